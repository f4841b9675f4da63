"""Uneven shards in the lowering: torch.chunk pieces, DTensor's local shapes and offsets, padded reshards.

The pieces are checked against torch.chunk and DTensor's own local shape and offset
computation; every resharding between shardings of uneven tensors is simulated on all ranks
with collectives that, like gloo's and NCCL's, only accept equal pieces.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from metadist.ir import Mesh, Partial, Shard, TensorSpec, parse_sharding
from metadist.lowering import (
    LoweringError, chunk_bounds, is_even, local_bounds, local_shape, max_local_shape, plan_resharding, shard_offset,
)
from metadist.lowering.coalesce import split_stages
from metadist.lowering.program import Reshard, buffer_bytes

S = parse_sharding


def _coords(mesh):
    return list(itertools.product(*(range(size) for size in mesh.shape)))


# ---------------------------------------------------------------- pieces


@pytest.mark.parametrize("size", [0, 1, 2, 5, 6, 7, 9, 10, 50257 % 97])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_chunk_bounds_are_torch_chunk_pieces(size, parts):
    pieces = list(torch.arange(size).chunk(parts)) if size else []
    pieces += [torch.arange(0)] * (parts - len(pieces))  # torch.chunk returns fewer pieces: the rest are empty
    for index, piece in enumerate(pieces):
        start, length = chunk_bounds(size, parts, index)
        assert length == piece.numel()
        if length:
            assert start == int(piece[0])
    assert [chunk_bounds(6, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 0)]
    assert [chunk_bounds(1001, 2, r) for r in range(2)] == [(0, 501), (501, 500)]


SHARDINGS_2D = ["(S(0), S(0))", "(S(0), S(1))", "(S(1), S(0))", "(R, S(0))", "(S(1), R)", "(S(1), S(1))", "(P(sum), S(1))"]


@pytest.mark.parametrize("mesh_shape", [(2, 4), (3, 2), (4, 4)])
@pytest.mark.parametrize("global_shape", [(9, 5), (6, 12), (1, 3), (13, 7)])
def test_local_shapes_and_offsets_are_dtensors(mesh_shape, global_shape):
    mesh = Mesh(mesh_shape)
    for text in SHARDINGS_2D:
        sharding = S(text)
        placements = [TorchShard(p.dim) if isinstance(p, Shard) else TorchReplicate() for p in sharding]
        for coords in _coords(mesh):
            want_shape, want_offset = _compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coords), placements)
            bounds = local_bounds(global_shape, sharding, mesh, coords)
            assert tuple(length for _, length in bounds) == tuple(want_shape), (text, coords)
            for dim, (offset, length) in enumerate(bounds):
                if length:  # DTensor reports the dim's size as the offset of an empty piece
                    assert offset == want_offset[dim] == shard_offset(global_shape, sharding, mesh, coords, dim)
        assert max_local_shape(global_shape, sharding, mesh) == local_shape(global_shape, sharding, mesh, (0, 0))


def test_the_largest_piece_is_at_coordinate_zero_and_pieces_tile_the_tensor():
    mesh, shape = Mesh((2, 4)), (9, 7)
    for text in SHARDINGS_2D:
        sharding = S(text)
        largest = max_local_shape(shape, sharding, mesh)
        cover = np.zeros(shape, dtype=int)
        for coords in _coords(mesh):
            bounds = local_bounds(shape, sharding, mesh, coords)
            assert all(length <= big for (_, length), big in zip(bounds, largest))
            cover[tuple(slice(o, o + n) for o, n in bounds)] += 1
        copies = np.prod([size for p, size in zip(sharding, mesh.shape) if not isinstance(p, Shard)])
        assert (cover == copies).all(), text


def test_local_shape_without_coordinates_needs_an_even_split():
    mesh = Mesh((2, 3), ("dp", "tp"))
    assert local_shape((4, 9), S("(S(0), S(1))"), mesh) == (2, 3)
    assert is_even((4, 9), S("(S(0), S(1))"), mesh) and not is_even((4, 10), S("(S(0), S(1))"), mesh)
    with pytest.raises(LoweringError, match=r"batch input %x.*dim 1.*mesh axis 'tp' of size 3.*coords"):
        local_shape((4, 10), S("(S(0), S(1))"), mesh, what="batch input %x")
    assert [local_shape((4, 10), S("(S(0), S(1))"), mesh, (0, c)) for c in range(3)] == [(2, 4), (2, 4), (2, 2)]


# ---------------------------------------------------------------- resharding, simulated on all ranks


def _torch_piece(whole: np.ndarray, sharding, mesh, coords) -> np.ndarray:
    """Rank ``coords``'s piece by torch.chunk (nested, axis order) and partial shares, independent of the lowering."""
    piece = whole
    for axis, placement in enumerate(sharding):
        c, k = coords[axis], mesh.shape[axis]
        if isinstance(placement, Shard):
            chunks = torch.from_numpy(np.ascontiguousarray(piece)).chunk(k, dim=placement.dim)
            if c < len(chunks):
                piece = chunks[c].numpy()
            else:
                shape = list(piece.shape)
                shape[placement.dim] = 0
                piece = np.zeros(shape, piece.dtype)
        elif isinstance(placement, Partial) and placement.op == "sum":
            piece = piece * ([0.25] * (k - 1) + [1 - 0.25 * (k - 1)])[c]
        elif isinstance(placement, Partial):
            piece = piece if c == 0 else piece - 7.0
    return piece


def _groups(mesh, axis):
    others = [range(size) if a != axis else [None] for a, size in enumerate(mesh.shape)]
    for fixed in itertools.product(*others):
        yield [tuple(c if a == axis else fixed[a] for a in range(mesh.ndim)) for c in range(mesh.shape[axis])]


def _simulate(pieces, steps_by_rank, mesh):
    """Run every step on every rank; collectives demand equal pieces in their group, as gloo and NCCL do."""
    count = {len(steps) for steps in steps_by_rank.values()}
    assert len(count) == 1, "every rank takes the same steps"
    for index in range(count.pop()):
        kinds = {(steps[index].kind, steps[index].axis) for steps in steps_by_rank.values()}
        assert len(kinds) == 1, f"step {index} differs between ranks: {kinds}"
        step = next(iter(steps_by_rank.values()))[index]
        new = {}
        for group in _groups(mesh, step.axis):
            inputs = [pieces[c] for c in group]
            for position, coords in enumerate(group):
                own = steps_by_rank[coords][index]
                assert inputs[position].shape == own.local_shape_in, (own, inputs[position].shape)
                new[coords] = _run(own, inputs, position)
                assert new[coords].shape == own.local_shape_out, own
        pieces = new
    return pieces


def _run(step, inputs, position):
    k = len(inputs)
    reduce = {"sum": np.add.reduce, "max": np.maximum.reduce}.get(step.op or "")
    if step.kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all"):
        assert len({x.shape for x in inputs}) == 1, f"{step.kind} on unequal pieces {[x.shape for x in inputs]}"
    if step.kind == "all_gather":
        return np.concatenate(inputs, axis=step.dim)
    if step.kind == "all_reduce":
        return reduce(np.stack(inputs))
    if step.kind == "reduce_scatter":
        return np.split(reduce(np.stack(inputs)), k, axis=step.dim)[position]
    if step.kind == "all_to_all":
        return np.concatenate([np.split(x, k, axis=step.split_dim)[position] for x in inputs], axis=step.dim)
    if step.kind == "local_slice":
        start, length = chunk_bounds(inputs[position].shape[step.dim], k, step.coordinate)
        return np.take(inputs[position], np.arange(start, start + length), axis=step.dim)
    if step.kind == "zero_partial":
        return inputs[position] if position == 0 else np.zeros_like(inputs[position])
    if step.kind == "pad":
        x = inputs[position]
        return np.pad(x, [(0, want - have) for have, want in zip(x.shape, step.local_shape_out)])
    if step.kind == "unpad":
        return inputs[position][tuple(slice(0, size) for size in step.local_shape_out)]
    raise AssertionError(step.kind)


def _check_all_pairs(mesh, shape, placements):
    whole = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) - 20.0
    shardings = [S("(" + ", ".join(combo) + ")") for combo in itertools.product(placements, repeat=mesh.ndim)]
    for source, target in itertools.product(shardings, repeat=2):
        pieces = {c: _torch_piece(whole, source, mesh, c) for c in _coords(mesh)}
        steps = {c: plan_resharding(shape, 8, source, target, mesh, c) for c in pieces}
        result = _simulate(pieces, steps, mesh)
        for coords, piece in result.items():
            want = _torch_piece(whole, target, mesh, coords)
            if any(isinstance(p, Partial) for p in target):
                piece, want = _reduced(result, target, mesh, coords), _torch_piece(whole, _no_partial(target), mesh, coords)
            assert piece.shape == want.shape and np.allclose(piece, want), (source, target, coords)


def _no_partial(sharding):
    return tuple(p if not isinstance(p, Partial) else parse_sharding("(R)")[0] for p in sharding)


def _reduced(pieces, sharding, mesh, coords):
    """The value of ``coords``'s piece once the Partial axes are reduced (over every rank that differs only on them)."""
    partial = [axis for axis, p in enumerate(sharding) if isinstance(p, Partial)]
    group = [c for c in pieces if all(c[a] == coords[a] for a in range(mesh.ndim) if a not in partial)]
    stack = np.stack([pieces[c] for c in group])
    return stack.sum(axis=0) if sharding[partial[0]].op == "sum" else stack.max(axis=0)


@pytest.mark.parametrize("mesh_shape,shape", [((4,), (6, 5)), ((3,), (7, 2)), ((4,), (3, 9)), ((2,), (1001, 3))])
def test_every_resharding_of_uneven_pieces_moves_the_right_values_1d(mesh_shape, shape):
    _check_all_pairs(Mesh(mesh_shape), shape, ["R", "S(0)", "S(1)", "P(sum)", "P(max)"])


@pytest.mark.parametrize("mesh_shape,shape", [((2, 4), (9, 6)), ((2, 2), (3, 5)), ((3, 2), (7, 4))])
def test_every_resharding_of_uneven_pieces_moves_the_right_values_2d(mesh_shape, shape):
    _check_all_pairs(Mesh(mesh_shape), shape, ["R", "S(0)", "S(1)", "P(sum)"])


def test_uneven_collectives_are_padded_and_count_their_padding():
    mesh = Mesh((4,))
    steps = plan_resharding((6, 5), 4, S("(S(0))"), S("(R)"), mesh, (3,))  # rank 3 holds 0 of the 6 rows
    assert [s.kind for s in steps] == ["pad", "all_gather", "unpad"]
    pad, gather, unpad = steps
    assert (pad.local_shape_in, pad.local_shape_out) == ((0, 5), (2, 5))
    assert (gather.local_shape_in, gather.local_shape_out) == ((2, 5), (8, 5))
    assert unpad.local_shape_out == (6, 5)
    assert gather.comm_bytes == 8 * 5 * 4 * 3 // 4  # (k-1)/k of the padded gathered buffer
    scatter = plan_resharding((6, 5), 4, S("(P(sum))"), S("(S(0))"), mesh, (2,))
    assert [(s.kind, s.local_shape_out) for s in scatter] == [("pad", (8, 5)), ("reduce_scatter", (2, 5)), ("unpad", (2, 5))]
    even = plan_resharding((8, 5), 4, S("(S(0))"), S("(R)"), mesh, (3,))
    assert [s.kind for s in even] == ["all_gather"]  # even pieces take no padding


def test_bound_shapes_are_the_same_on_every_rank():
    mesh = Mesh((2, 4))
    spec = TensorSpec((9, 6), "float32")
    for source, target in [("(S(0), S(0))", "(R, R)"), ("(P(sum), P(sum))", "(S(0), S(0))"), ("(S(0), S(1))", "(S(1), S(0))")]:
        by_rank = [plan_resharding(spec.shape, 4, S(source), S(target), mesh, c) for c in _coords(mesh)]
        for index in range(len(by_rank[0])):
            bounds = {(steps[index].bound_in, steps[index].bound_out) for steps in by_rank}
            assert len(bounds) == 1, (source, target, index)
            sizes = {buffer_bytes(steps[index], 4) for steps in by_rank}
            assert len(sizes) == 1


def test_stages_keep_a_collectives_pad_step_with_it():
    mesh = Mesh((2, 4))
    steps = plan_resharding((9, 6), 4, S("(S(0), S(0))"), S("(R, R)"), mesh, (1, 3))
    assert [s.kind for s in steps] == ["pad", "all_gather", "unpad", "pad", "all_gather", "unpad"]
    stages = split_stages(Reshard("x", "x~0", TensorSpec((9, 6), "float32"), S("(S(0), S(0))"), S("(R, R)"), steps))
    assert [[s.kind for s in stage.steps] for stage in stages] == [["pad", "all_gather", "unpad"]] * 2
    assert stages[0].steps[-1].local_shape_out == (4, 6)  # the stage's value is this rank's real (unpadded) piece
