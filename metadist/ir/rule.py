"""SPMD rules in factor notation (see docs/design.md, "Rules: factor notation").

A :class:`Rule` is the set of ways an op's iteration space can be split. Each
:class:`Factor` names, for every tensor input (in the node's flattened input
order, repeats kept), the dim that carries the factor or ``None`` (that input is
replicated), and, for every output, how the per-shard outputs recombine:
:class:`Concat` (the output is ``Shard(dim)``), :class:`Reduce` (``Partial(op)``)
or :class:`Identity` (``Replicate()``). ``None`` stands for an output that the
op does not produce as a tensor.

Text form: one letter per factor, written into each tensor's dims (``_`` where
no factor sits), then the non-concat outputs and options after ``|``::

    ab,bc->ac | b:sum                  # aten.mm
    a_,_,_->a_,a_,a_                   # layer norm over the last dim (mean, rstd too)
    ab,bc->ac | b:sum | pass 0:sum 1:sum   # mm: a Partial(sum) operand passes through

``pass`` lists the :class:`PartialPass` entries: a ``Partial(op)`` input that
may pass through to ``Partial(op)`` outputs with every other input replicated. A
**joint pass** names several inputs that are ``Partial(sum)`` together (each shard
holds a part of each, the other inputs replicated): the op is linear in them jointly,
as ``add`` and ``sub`` are in both operands and ``where`` in its two branches, so the
shards' outputs add up to the whole. It is written with ``+``::

    ab,ab->ab | pass 0:max 0:min 0+1:sum 1:max 1:min   # aten.add: two Partial(sum) gradients add up

Without it a sum of two partial gradients (a tied embedding's, read by the embedding and
the output layer) has both reduced before the add; with it the sum is reduced once.

An **affine factor** is a reducing factor some of whose inputs that do not carry
the factor's dim take part as ``Partial(op)`` (``op`` the factor's reduce op, only
``sum`` is discovered) instead of replicated: each shard adds in its part of them.
It is written ``letter:op+input`` (one ``+input`` per such input)::

    a,bc,ca->ba | c:sum+0 | pass 0:max 0:min   # aten.addmm(bias, x, w): the k split, bias Partial(sum)

Splitting ``k`` with the bias replicated would add the bias once per shard; with
the bias as ``Partial(sum)`` (its value on one shard, zeros on the others, or any
parts that add up to it) the shards' outputs add up to ``bias + x @ w``.

A **halo factor** (``Concat(dim, halo=h)``, ``h > 0``; written ``letter:halo=h``) splits
windowed ops (convolution, pooling, padding) along a spatial dim whose output pieces
need their neighbours' input. Exactly what it means, for a factor of size ``n`` (the
extent of the dims it occupies) cut into contiguous pieces ``[a_r, b_r)``:

1. every input that carries the factor is *extended* along its dim by ``h`` elements on
   each side: ``[a_r - h, b_r + h)`` of the global input, where positions outside
   ``[0, n)`` (beyond the global borders) hold **zeros**; every piece is at least ``h``
   long, so a halo comes from the adjacent piece only;
2. the op runs on the extended pieces with its arguments **unchanged** (its own padding
   included);
3. each output piece is *trimmed* by ``t = h * m / n`` elements at each end of its concat
   dim (``m`` the output's global size there; ``t`` must be a whole number) and the trimmed
   pieces concatenate into the whole output.

Pieces must map to whole output elements (``(b_r - a_r) * m / n`` integral): stride-2
ops split on even boundaries. Every present output of a halo factor is ``Concat`` with
the same ``h`` (extended inputs would count overlapping rows twice in a reduction).
Example, ``aten.convolution`` (3x3 kernel, padding 1, stride 1) on ``[N, C, H, W]``::

    abcd,ebfg->aecd | b:sum c:halo=1 d:halo=1

The width depends on the kernel's size, so ops that can carry halo factors have
signatures with concrete sizes (:data:`metadist.shardcombine.signature.HALO_OPS`).

A **proportional factor** occupies dims of different sizes, each a multiple of the smallest:
grouped-query attention's heads factor splits the query's ``H = g * Hk`` heads and the key's and
value's ``Hk`` heads into the same number of contiguous pieces, ``g : 1`` in size, so each query
head stays with its key/value head (see :meth:`Factor.size`). Plans split it evenly only.

A **block-cyclic** ``Concat(dim, chunk=k)`` (piece ``r`` made of ``k`` blocks, block ``j``
of every piece side by side forming block ``j`` of the output) is representable, parsed
and printed (``letter:chunk=k``), but ShardCombine does not discover it and plans do not
express it (see ``docs`` in :mod:`metadist.shardcombine.halo`).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Any, Union

from .placement import REDUCE_OPS

RULE_FORMAT_VERSION = 4
"""Version of the stored form (:meth:`Rule.to_dict`); 2 added ``Factor.partial_inputs`` (affine factors);
3 gives ``Concat.halo`` its meaning (module docstring) and checks it (:attr:`Factor.halo`); 4 adds joint
partial passes (:attr:`PartialPass.joint`), so rules found before are found again with them."""


class RuleError(ValueError):
    """A rule is malformed or does not fit the op it is applied to."""


def halo_trim(halo: int, factor_size: int, output_size: int) -> int | None:
    """Elements trimmed at each end of an output piece of a halo factor: ``halo * m / n``; None if not whole."""
    trim, rest = divmod(halo * output_size, factor_size)
    return None if rest else trim


@dataclass(frozen=True)
class Concat:
    """Outputs are pieces along ``dim``; ``chunk`` > 1 for block-cyclic pieces, ``halo`` for overlap."""

    dim: int
    chunk: int = 1
    halo: int = 0

    def __post_init__(self) -> None:
        if self.dim < 0 or self.chunk < 1 or self.halo < 0:
            raise RuleError(f"invalid Concat(dim={self.dim}, chunk={self.chunk}, halo={self.halo})")


@dataclass(frozen=True)
class Reduce:
    """Outputs are partial results that reduce with ``op``."""

    op: str

    def __post_init__(self) -> None:
        if self.op not in REDUCE_OPS:
            raise RuleError(f"Reduce.op must be one of {REDUCE_OPS}, got {self.op!r}")


@dataclass(frozen=True)
class Identity:
    """Every shard computes the whole output."""


Combine = Union[Concat, Reduce, Identity]


_NO_DIM = 1 << 30


@dataclass(frozen=True)
class Factor:
    """One way to split the op: the dim per input (or None) and the recombination per output.

    ``partial_inputs`` makes the factor affine: those inputs (which carry no dim of the
    factor) are ``Partial(op)`` rather than replicated, ``op`` being the one reduce op of
    every output (:attr:`partial_op`).
    """

    inputs: tuple[int | None, ...]
    outputs: tuple[Combine | None, ...]
    partial_inputs: tuple[int, ...] = ()
    """Inputs that enter as ``Partial(op)`` (each shard holds a part, the parts reduce to the value)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "partial_inputs", tuple(sorted(set(self.partial_inputs))))
        if all(dim is None for dim in self.inputs):
            raise RuleError("a factor must split at least one input")
        halos = {out.halo for out in self.outputs if isinstance(out, Concat) and out.halo}
        if halos:
            present = [out for out in self.outputs if out is not None]
            if len(halos) > 1 or any(not isinstance(out, Concat) or out.halo != next(iter(halos)) for out in present):
                raise RuleError(f"factor {self}: a halo factor's outputs must all be Concat with one halo width")
            if self.partial_inputs or any(out.chunk != 1 for out in present):  # type: ignore[union-attr]
                raise RuleError(f"factor {self}: a halo factor cannot also be affine or block-cyclic")
        if self.partial_inputs:
            for index in self.partial_inputs:
                if not 0 <= index < len(self.inputs) or self.inputs[index] is not None:
                    raise RuleError(
                        f"factor {self}: partial input {index} must be an input that does not carry the factor's dim"
                    )
            ops = {out.op if isinstance(out, Reduce) else None for out in self.outputs if out is not None}
            if len(ops) != 1 or None in ops:
                raise RuleError(
                    f"factor {self} has Partial inputs {list(self.partial_inputs)}, so every output must reduce "
                    "with one op (Reduce(sum), ...)"
                )

    @property
    def halo(self) -> int:
        """The halo width ``h`` of a halo factor (0 for any other factor); see the module docstring."""
        return next((out.halo for out in self.outputs if isinstance(out, Concat) and out.halo), 0)

    @property
    def partial_op(self) -> str | None:
        """The reduce op of the ``partial_inputs`` (None when the factor has none)."""
        if not self.partial_inputs:
            return None
        return next(out.op for out in self.outputs if isinstance(out, Reduce))

    def size(self, input_shapes: tuple[tuple[int, ...], ...]) -> int:
        """The extent of the split: the size of the dims this factor occupies.

        The dims usually agree. A *proportional* factor occupies dims of different sizes, each a
        multiple of the smallest (grouped-query attention: query heads ``g * Hk``, key/value heads
        ``Hk``); its extent is the smallest, and piece ``r`` of a dim ``m`` times larger is
        ``m`` times piece ``r``'s bounds. Even splits (``torch.chunk`` of every dim by a count that
        divides the smallest) are exactly such pieces; uneven ``torch.chunk`` splits are not, so a
        plan splits a proportional factor only where the count divides every dim it occupies.
        """
        sizes = {input_shapes[index][dim] for index, dim in enumerate(self.inputs) if dim is not None}
        smallest = min(sizes)
        if smallest < 1 and len(sizes) > 1 or any(size % smallest for size in sizes if smallest):
            raise RuleError(f"factor {self} occupies dims of sizes {sorted(sizes)} in shapes {input_shapes}: "
                            "neither equal nor multiples of the smallest")
        return smallest

    def is_proportional(self, input_shapes: tuple[tuple[int, ...], ...]) -> bool:
        """Whether the dims this factor occupies differ in size (see :meth:`size`): such a factor splits evenly only."""
        return len({input_shapes[index][dim] for index, dim in enumerate(self.inputs) if dim is not None}) > 1

    def sort_key(self) -> tuple:
        # Factors print in the order of the first input dim they occupy (mm: m, k, n).
        return (
            tuple(_NO_DIM if dim is None else dim for dim in self.inputs),
            tuple(_combine_key(out) for out in self.outputs),
            self.partial_inputs,
        )


@dataclass(frozen=True)
class PartialPass:
    """A ``Partial(op)`` in input ``input`` passes through: outputs come out ``Partial(op)``.

    ``joint``: further inputs that are ``Partial(op)`` together with ``input`` (a joint pass, ``sum``
    only: the op is linear in all of them at once; see the module docstring).
    """

    input: int
    op: str
    joint: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "joint", tuple(sorted(set(self.joint))))
        if self.op not in REDUCE_OPS:
            raise RuleError(f"PartialPass.op must be one of {REDUCE_OPS}, got {self.op!r}")
        if self.joint and (self.op != "sum" or self.joint[0] <= self.input):
            raise RuleError(f"a joint partial pass is Partial(sum) of inputs in increasing order, got {self}")

    @property
    def inputs(self) -> tuple[int, ...]:
        """Every input that is ``Partial(op)`` under this pass."""
        return (self.input, *self.joint)

    def __str__(self) -> str:
        return "+".join(str(index) for index in self.inputs) + f":{self.op}"


@dataclass(frozen=True)
class Rule:
    """The SPMD rule of one op signature."""

    input_ranks: tuple[int, ...]
    output_ranks: tuple[int | None, ...]
    factors: tuple[Factor, ...]
    partial_passes: tuple[PartialPass, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ranks", tuple(self.input_ranks))
        object.__setattr__(self, "output_ranks", tuple(self.output_ranks))
        factors = tuple(sorted(set(self.factors), key=Factor.sort_key))
        object.__setattr__(self, "factors", factors)
        object.__setattr__(
            self, "partial_passes", tuple(sorted(set(self.partial_passes), key=lambda p: (p.input, p.op, p.joint)))
        )
        for factor in factors:
            if len(factor.inputs) != len(self.input_ranks) or len(factor.outputs) != len(self.output_ranks):
                raise RuleError(
                    f"factor {factor} has {len(factor.inputs)} inputs/{len(factor.outputs)} outputs, "
                    f"the rule has {len(self.input_ranks)}/{len(self.output_ranks)}"
                )
            for dim, rank in zip(factor.inputs, self.input_ranks):
                if dim is not None and not 0 <= dim < rank:
                    raise RuleError(f"factor {factor} splits dim {dim} of a rank-{rank} input")
            for out, rank in zip(factor.outputs, self.output_ranks):
                if (out is None) != (rank is None):
                    raise RuleError(f"factor {factor} does not match which outputs exist: {self.output_ranks}")
                if isinstance(out, Concat) and not out.dim < rank:  # type: ignore[operator]
                    raise RuleError(f"factor {factor} concatenates along dim {out.dim} of a rank-{rank} output")
        for partial in self.partial_passes:
            if not all(0 <= index < len(self.input_ranks) for index in partial.inputs):
                raise RuleError(f"partial pass {partial} names a missing input")

    # -- text form -----------------------------------------------------------
    def to_text(self) -> str:
        letters = _letters(len(self.factors))
        inputs = []
        for index, rank in enumerate(self.input_ranks):
            slots = ["_"] * rank
            for letter, factor in zip(letters, self.factors):
                dim = factor.inputs[index]
                if dim is not None:
                    if slots[dim] != "_":
                        return self._verbose()
                    slots[dim] = letter
            inputs.append("".join(slots))
        outputs = []
        extras: list[str] = []
        for index, rank in enumerate(self.output_ranks):
            if rank is None:
                outputs.append("-")
                continue
            slots = ["_"] * rank
            for letter, factor in zip(letters, self.factors):
                out = factor.outputs[index]
                if isinstance(out, Concat):
                    if slots[out.dim] != "_":
                        return self._verbose()
                    slots[out.dim] = letter
            outputs.append("".join(slots))
        for letter, factor in zip(letters, self.factors):
            kinds = {_combine_text(out) for out in factor.outputs if out is not None and not _plain_concat(out)}
            if len(kinds) > 1:
                return self._verbose()
            if kinds:
                extras.append(f"{letter}:{kinds.pop()}" + "".join(f"+{index}" for index in factor.partial_inputs))
        text = ",".join(inputs) + "->" + ",".join(outputs)
        if extras:
            text += " | " + " ".join(extras)
        if self.partial_passes:
            text += " | pass " + " ".join(str(p) for p in self.partial_passes)
        return text

    def _verbose(self) -> str:
        return repr(self)

    def __str__(self) -> str:
        return self.to_text()

    @staticmethod
    def parse(text: str) -> "Rule":
        return parse_rule(text)

    # -- JSON ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "input_ranks": list(self.input_ranks),
            "output_ranks": list(self.output_ranks),
            "factors": [_factor_to_json(factor) for factor in self.factors],
            "partial_passes": [{"input": p.input, "op": p.op, **({"joint": list(p.joint)} if p.joint else {})}
                               for p in self.partial_passes],
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "Rule":
        return Rule(
            input_ranks=tuple(data["input_ranks"]),
            output_ranks=tuple(data["output_ranks"]),
            factors=tuple(
                Factor(
                    tuple(item["inputs"]),
                    tuple(_combine_from_json(out) for out in item["outputs"]),
                    tuple(item.get("partial_inputs", ())),
                )
                for item in data["factors"]
            ),
            partial_passes=tuple(PartialPass(item["input"], item["op"], tuple(item.get("joint", ())))
                                 for item in data.get("partial_passes", ())),
        )


def _letters(count: int) -> list[str]:
    alphabet = string.ascii_lowercase + string.ascii_uppercase
    if count > len(alphabet):
        raise RuleError(f"a rule with {count} factors cannot be written in letters")
    return list(alphabet[:count])


def _plain_concat(out: Combine) -> bool:
    return isinstance(out, Concat) and out.chunk == 1 and out.halo == 0


def _combine_text(out: Combine) -> str:
    if isinstance(out, Reduce):
        return out.op
    if isinstance(out, Identity):
        return "id"
    parts = []
    if out.chunk != 1:
        parts.append(f"chunk={out.chunk}")
    if out.halo:
        parts.append(f"halo={out.halo}")
    return ",".join(parts)


def _combine_key(out: Combine | None) -> tuple:
    if out is None:
        return (0,)
    if isinstance(out, Concat):
        return (1, out.dim, out.chunk, out.halo)
    if isinstance(out, Reduce):
        return (2, REDUCE_OPS.index(out.op))
    return (3,)


def _factor_to_json(factor: Factor) -> dict[str, Any]:
    data: dict[str, Any] = {"inputs": list(factor.inputs), "outputs": [_combine_to_json(out) for out in factor.outputs]}
    if factor.partial_inputs:
        data["partial_inputs"] = list(factor.partial_inputs)
    return data


def _combine_to_json(out: Combine | None) -> Any:
    if out is None:
        return None
    if isinstance(out, Concat):
        return {"concat": out.dim, "chunk": out.chunk, "halo": out.halo}
    if isinstance(out, Reduce):
        return {"reduce": out.op}
    return {"identity": True}


def _combine_from_json(data: Any) -> Combine | None:
    if data is None:
        return None
    if "concat" in data:
        return Concat(data["concat"], data.get("chunk", 1), data.get("halo", 0))
    if "reduce" in data:
        return Reduce(data["reduce"])
    if data.get("identity"):
        return Identity()
    raise RuleError(f"unknown output combination {data!r}")


_OPTION_RE = re.compile(
    r"^([A-Za-z]):(sum|max|min|id|(?:chunk=\d+|halo=\d+)(?:,(?:chunk=\d+|halo=\d+))*)((?:\+\d+)*)$"
)


def parse_rule(text: str) -> Rule:
    """Parse the text form written by :meth:`Rule.to_text`."""
    sections = [section.strip() for section in text.split("|")]
    if "->" not in sections[0]:
        raise RuleError(f"cannot parse rule {text!r}: expected 'inputs->outputs'")
    lhs, rhs = sections[0].split("->")
    input_specs = lhs.split(",")  # "" is one rank-0 tensor
    output_specs = rhs.split(",")
    options: dict[str, str] = {}
    partial_inputs: dict[str, tuple[int, ...]] = {}
    passes: list[PartialPass] = []
    for section in sections[1:]:
        if section.startswith("pass"):
            for item in section[len("pass"):].split():
                indices, op = item.split(":")
                first, *joint = (int(index) for index in indices.split("+"))
                passes.append(PartialPass(first, op, tuple(joint)))
            continue
        for item in section.split():
            match = _OPTION_RE.match(item)
            if not match:
                raise RuleError(f"cannot parse rule option {item!r} in {text!r}")
            options[match.group(1)] = match.group(2)
            if match.group(3):
                if match.group(2) not in ("sum", "max", "min"):
                    raise RuleError(f"rule option {item!r} in {text!r}: only a reducing factor (:sum/:max/:min) has Partial inputs")
                partial_inputs[match.group(1)] = tuple(int(index) for index in match.group(3).split("+")[1:])
    letters = sorted(
        {ch for spec in input_specs for ch in spec if ch.isalpha()},
        key=lambda ch: (string.ascii_letters.index(ch)),
    )
    factors = []
    for letter in letters:
        inputs = tuple(spec.index(letter) if letter in spec else None for spec in input_specs)
        outputs: list[Combine | None] = []
        option = options.get(letter)
        for spec in output_specs:
            if spec == "-":
                outputs.append(None)
            elif letter in spec:
                chunk, halo = 1, 0
                if option and option not in ("sum", "max", "min", "id"):
                    for kv in option.split(","):
                        key, val = kv.split("=")
                        chunk, halo = (int(val), halo) if key == "chunk" else (chunk, int(val))
                outputs.append(Concat(spec.index(letter), chunk, halo))
            elif option in ("sum", "max", "min"):
                outputs.append(Reduce(option))
            elif option == "id":
                outputs.append(Identity())
            else:
                raise RuleError(f"factor {letter!r} of {text!r} is missing from an output and has no :sum/:max/:min/:id")
        factors.append(Factor(inputs, tuple(outputs), partial_inputs.pop(letter, ())))
    if partial_inputs:
        raise RuleError(f"rule {text!r} gives Partial inputs to factors it does not have: {sorted(partial_inputs)}")
    return Rule(
        input_ranks=tuple(len(spec) for spec in input_specs),
        output_ranks=tuple(None if spec == "-" else len(spec) for spec in output_specs),
        factors=tuple(factors),
        partial_passes=tuple(passes),
    )
