"""Shape arithmetic for discovery: reshape dim groups, stand-in shapes, shard sizes.

Framework-free. A reshape (``view``/``reshape``) maps groups of input dims onto
groups of output dims with equal products; :func:`reshape_groups` finds them and
:func:`reshape_for` rewrites a reshape's target shape when its input shape changes
(splitting a one-to-one dim, the leading dim of a merge, or the leading output dim
of a split is expressible; anything else is not).

Stand-in shapes (:func:`standin_shapes`) shrink every dim to a small size
divisible by 6 (so 2 and 3 shards split it evenly), keep size-1 dims (broadcast
patterns) and keep equal sizes equal and distinct sizes distinct and ordered, so
discovery costs the same for a tiny model and a large one.
"""

from __future__ import annotations

import math
from typing import Sequence

Shape = tuple[int, ...]

#: Stand-in sizes, smallest first; the i-th distinct real size (ascending) gets the i-th.
STANDIN_SIZES = (6, 12, 18, 24, 30, 36, 42, 48, 54, 60)


def reshape_groups(in_shape: Shape, out_shape: Shape) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Pair runs of input dims with runs of output dims of equal product.

    Size-1 dims form groups of their own with an empty other side, so
    ``(4, 1, 6) -> (4, 6)`` gives ``[((0,), (0,)), ((1,), ()), ((2,), (1,))]``.
    """
    if math.prod(in_shape) != math.prod(out_shape):
        raise ValueError(f"cannot reshape {in_shape} into {out_shape}: sizes differ")
    groups: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        if i < len(in_shape) and in_shape[i] == 1:
            groups.append(((i,), ()))
            i += 1
            continue
        if j < len(out_shape) and out_shape[j] == 1:
            groups.append(((), (j,)))
            j += 1
            continue
        ins, outs = [i], [j]
        in_prod, out_prod = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while in_prod != out_prod:
            if in_prod < out_prod:
                ins.append(i)
                in_prod *= in_shape[i]
                i += 1
            else:
                outs.append(j)
                out_prod *= out_shape[j]
                j += 1
        groups.append((tuple(ins), tuple(outs)))
    return groups


def resolve_reshape(in_shape: Shape, target: Sequence[int]) -> Shape:
    """The output shape of reshaping ``in_shape`` to ``target`` (which may hold one ``-1``)."""
    target = list(target)
    if -1 in target:
        known = math.prod(size for size in target if size != -1)
        target[target.index(-1)] = math.prod(in_shape) // known if known else 0
    return tuple(target)


def reshape_for(in_ref: Shape, out_ref: Shape, in_new: Shape) -> Shape | None:
    """The output shape of the same reshape applied to an input of shape ``in_new``.

    A merged output dim takes the product of its new input dims (whether the pieces
    of a non-leading dim recombine is for execution to tell); a split takes the
    change in its leading output dim. Returns None where the change cannot be
    expressed (a split's input no longer divides, a many-to-many group changed).
    """
    if len(in_new) != len(in_ref):
        return None
    out = list(out_ref)
    for ins, outs in reshape_groups(in_ref, out_ref):
        old = tuple(in_ref[d] for d in ins)
        new = tuple(in_new[d] for d in ins)
        if old == new:
            continue
        if not outs:
            return None  # a size-1 input dim changed size
        if len(outs) == 1:
            out[outs[0]] = math.prod(new)  # one-to-one or a merge: the product
            continue
        if len(ins) != 1:
            return None
        rest = math.prod(out_ref[d] for d in outs[1:])
        if new[0] % rest:
            return None
        out[outs[0]] = new[0] // rest
    return tuple(out)


def standin_size_map(shapes: Sequence[Shape]) -> dict[int, int]:
    """Map each distinct size > 1 to a stand-in size, ascending; size 1 (and 0) stay."""
    distinct = sorted({size for shape in shapes for size in shape if size > 1})
    if len(distinct) > len(STANDIN_SIZES):
        raise ValueError(f"{len(distinct)} distinct sizes; stand-in shapes support {len(STANDIN_SIZES)}")
    mapping = {size: standin for size, standin in zip(distinct, STANDIN_SIZES)}
    mapping.update({0: 0, 1: 1})
    return mapping


def standin_shapes(shapes: Sequence[Shape]) -> tuple[Shape, ...]:
    """Small shapes with the same size-1 dims and the same equalities and order of sizes."""
    mapping = standin_size_map(shapes)
    return tuple(tuple(mapping[size] for size in shape) for shape in shapes)


def standin_shapes_keeping(shapes: Sequence[Shape], kept: Sequence[Sequence[int]],
                           sizes: Sequence[int] = STANDIN_SIZES) -> tuple[Shape, ...]:
    """Small shapes as :func:`standin_shapes` gives, except that the sizes of the ``kept`` dims stay real.

    ``kept[i]`` lists the dims of input ``i`` whose real sizes the op's arguments refer to. Every
    dim of a kept size keeps it (equal sizes stay equal); the other sizes take ``sizes`` in order
    (then further multiples of 6), skipping the kept ones, so they stay distinct from each other
    and from the kept sizes, and in order among themselves. Their order relative to a kept size
    is not kept: LLaMA-70B's ``[1024, 64, 4096, 128]`` sliced on its head dim becomes
    ``[12, 6, 18, 128]`` (keeping 1024 and 4096 above 128 would take 14M elements, a minute and
    a half of discovery); the op refers to the kept size only, and the re-check
    (:mod:`.recheck`) runs the rule again on other sizes.
    """
    keep = {shape[dim] for shape, dims in zip(shapes, kept) for dim in dims if shape[dim] > 1}
    distinct = sorted({size for shape in shapes for size in shape if size > 1} - keep)
    if len(distinct) > len(sizes):
        raise ValueError(f"{len(distinct)} distinct sizes; stand-in shapes support {len(sizes)} besides the kept ones")
    mapping: dict[int, int] = {0: 0, 1: 1, **{size: size for size in keep}}
    pool = [size for size in sizes if size not in keep]
    extra = max(sizes)
    for size in distinct:
        if not pool:
            extra += 6
            while extra in keep:
                extra += 6
            pool.append(extra)
        mapping[size] = pool.pop(0)
    return tuple(tuple(mapping[size] for size in shape) for shape in shapes)


def standin_reshape(in_shape: Shape, out_shape: Shape) -> Shape:
    """A small input shape for a reshape that keeps its dim groups.

    Merged and one-to-one input dims become 6; a split input dim becomes 6 times
    the real sizes of the split's non-leading output dims (so that
    :func:`reshape_for` maps it); many-to-many groups keep their real sizes.
    Equal sizes are harmless here: a reshape's key holds its real sizes.
    """
    small = STANDIN_SIZES[0]
    new = list(in_shape)
    for ins, outs in reshape_groups(in_shape, out_shape):
        if not outs or not ins:
            continue
        if len(outs) == 1:
            for d in ins:
                new[d] = small
        elif len(ins) == 1:
            new[ins[0]] = small * math.prod(out_shape[d] for d in outs[1:])
    return tuple(new)


def piece_sizes(size: int, shards: int, uneven: bool) -> list[int] | None:
    """Sizes of ``shards`` non-empty pieces of a dim of ``size``; None if it is too small.

    Uneven pieces grow 1:2:3..., so a rule that only holds for equal pieces is caught.
    """
    if size < shards:
        return None
    if not uneven:
        base, extra = divmod(size, shards)
        return [base + (1 if k < extra else 0) for k in range(shards)]
    weights = list(range(1, shards + 1))
    sizes = [max(1, size * w // sum(weights)) for w in weights]
    sizes[-1] = size - sum(sizes[:-1])
    if sizes[-1] < 1 or len(set(sizes)) == 1:
        return piece_sizes(size, shards, uneven=False)
    return sizes


def reshape_factors(in_shape: Shape, out_shape: Shape) -> list[tuple[int, int]]:
    """The factors of a reshape by shape arithmetic alone: ``(input dim, output dim)`` pairs.

    A dim that maps one-to-one carries a factor, so does the leading input dim of
    a merge (its pieces are contiguous blocks of the merged dim) and the input dim
    of a split onto the split's leading output dim (pieces in whole multiples of
    the trailing output dims). Discovery finds these by execution; this is the
    independent derivation the tests compare it with.
    """
    pairs = []
    for ins, outs in reshape_groups(in_shape, out_shape):
        if ins and outs and (len(ins) == 1 or len(outs) == 1):
            pairs.append((ins[0], outs[0]))
    return pairs
