"""Op signatures: the key under which one op's rule is discovered and stored.

A rule depends on the op, the ranks and dtypes of its inputs, its non-tensor
arguments, which dims have size 1 (broadcasting) and which dims have equal sizes
(mm's shared ``k``), but not on the sizes themselves. So the key spells each
input as ``f32[a,1,b]``: a letter per distinct size > 1, in order of first
appearance. GPT-2 XL then has no more signatures than GPT-2 small.

Only ops whose arguments carry shapes (reshapes, expand, slice, split, their
backward ops) and windowed ops that may have halo factors (:data:`HALO_OPS`: a
halo's width depends on the kernel's size) put concrete sizes into the key: their
rule depends on them.

Arguments are normalized where the spelling differs but the meaning does not:
negative dims count from the end (``-1`` of a rank-3 input is ``2``), and the
``normalized_shape`` of layer norm and the ``bias_sizes`` of convolution backward
enter by length only. Ops this table does not know keep their arguments verbatim,
which is safe (more signatures, never a shared wrong rule).
"""

from __future__ import annotations

import hashlib
import string
from dataclasses import dataclass
from typing import Any

from ..ir.graph import Literal, ValueRef, format_arg
from .executor import OpCall

__all__ = ["OpSignature", "signature_of", "SHAPE_OPS", "HALO_OPS", "op_name"]

#: Ops (``namespace.name``, any overload) whose rule depends on concrete sizes.
SHAPE_OPS = frozenset(
    {
        "aten.view", "aten._unsafe_view", "aten.reshape", "aten.expand", "aten.slice", "aten.split",
        "aten.split_with_sizes", "aten.slice_backward", "aten.select_backward", "aten.narrow",
        "aten.select", "aten.unfold", "aten.as_strided",
        # JAX primitives whose parameters carry sizes
        "jax.lax.reshape", "jax.lax.broadcast_in_dim", "jax.lax.slice", "jax.lax.split", "jax.lax.dynamic_slice",
        "jax.lax.dynamic_update_slice", "jax.lax.pad",
    }
)

#: Windowed ops whose rule may have halo factors (``Concat(dim, halo=h)``): the halo width depends
#: on concrete sizes (the kernel's, the spatial dims' against the stride), so their key holds
#: concrete sizes and discovery searches halo widths on their real shapes
#: (:mod:`metadist.shardcombine.halo`).
HALO_OPS = frozenset(
    {
        "aten.convolution", "aten.max_pool1d", "aten.max_pool2d", "aten.max_pool2d_with_indices",
        "aten.max_pool3d_with_indices", "aten.avg_pool1d", "aten.avg_pool2d", "aten.avg_pool3d", "aten.constant_pad_nd",
    }
)

#: Argument positions that hold dims, normalized by the rank of the first tensor input.
_DIM_ARGS: dict[str, tuple[int, ...]] = {
    "aten._softmax": (1,), "aten._log_softmax": (1,), "aten._softmax_backward_data": (2,),
    "aten._log_softmax_backward_data": (2,), "aten.sum": (1,), "aten.mean": (1,), "aten.amax": (1,),
    "aten.amin": (1,), "aten.cumsum": (1,), "aten.cumprod": (1,), "aten.transpose": (1, 2), "aten.split": (2,),
    "aten.split_with_sizes": (2,), "aten.slice": (1,), "aten.squeeze": (1,), "aten.gather": (1,),
    "aten.select": (1,), "aten.sort": (1,), "aten.max": (1,), "aten.min": (1,), "aten.argmax": (1,),
    "aten.argmin": (1,), "aten.var": (1,), "aten.std": (1,), "aten.prod": (1,), "aten.index_select": (1,),
    "aten.scatter": (1,), "aten.scatter_add": (1,), "aten.narrow": (1,), "aten.logsumexp": (1,),
    "aten.var_mean": (1,), "aten.topk": (2,), "aten.cat": (1,),
}

#: Dim arguments normalized by rank + 1 (they name a dim of the output).
_DIM_ARGS_OUT: dict[str, tuple[int, ...]] = {"aten.unsqueeze": (1,), "aten.stack": (1,)}

#: Shape arguments of ops that are NOT shape ops: they enter the key by length only.
_LENGTH_ARGS: dict[str, tuple[int, ...]] = {
    "aten.native_layer_norm": (1,), "aten.native_layer_norm_backward": (2,), "aten.convolution_backward": (3,),
}


@dataclass(frozen=True)
class OpSignature:
    """What a rule depends on; ``key`` is its stable string form (the database key)."""

    target: str
    inputs: tuple[str, ...]
    """Each tensor input as ``dtype[dims]``: letters for sizes (or sizes, for shape ops)."""
    args: str
    """The normalized non-tensor arguments, tensors written ``T0, T1...``."""
    outputs: tuple[str, ...]
    """Each output as ``dtype/rank``, ``-`` where absent."""

    @property
    def key(self) -> str:
        return f"{self.target}({self.args}) :: {' '.join(self.inputs)} -> {' '.join(self.outputs)}"

    @property
    def digest(self) -> str:
        """A short hash of ``key``, for file names and logs."""
        return hashlib.sha256(self.key.encode()).hexdigest()[:16]

    def __str__(self) -> str:
        return self.key


def op_name(target: str) -> str:
    """``aten.mm.default`` -> ``aten.mm``: the op without its overload. JAX targets
    (``jax.lax.dot_general``) have no overload and stay whole."""
    if target.startswith("jax."):
        return target
    return target.rsplit(".", 1)[0] if target.count(".") >= 2 else target


def signature_of(call: OpCall) -> OpSignature:
    """The signature of one op call."""
    target = call.target
    name = op_name(target)
    shapes = [spec.shape for spec in call.input_specs]
    if name in SHAPE_OPS or name in HALO_OPS:
        inputs = tuple(f"{spec.dtype}[{','.join(map(str, spec.shape))}]" for spec in call.input_specs)
    else:
        letters = _size_letters(shapes)
        inputs = tuple(
            f"{spec.dtype}[{','.join(letters[size] for size in spec.shape)}]" for spec in call.input_specs
        )
    rank = len(shapes[0]) if shapes else 0
    counter = iter(range(len(shapes)))
    args = [_normalize(name, position, arg, rank, counter) for position, arg in enumerate(call.node.args)]
    kwargs = [f"{key}={_normalize(name, key, arg, rank, counter)}" for key, arg in call.node.kwargs]
    outputs = tuple("-" if value is None else f"{value.spec.dtype}/{value.spec.rank}" for value in call.node.outputs)
    return OpSignature(target, inputs, ", ".join(args + kwargs), outputs)


def _size_letters(shapes: list[tuple[int, ...]]) -> dict[int, str]:
    letters: dict[int, str] = {0: "0", 1: "1"}
    alphabet = iter(string.ascii_lowercase + string.ascii_uppercase)
    for shape in shapes:
        for size in shape:
            if size not in letters:
                letters[size] = next(alphabet)
    return letters


def _normalize(name: str, position: int | str, arg: Any, rank: int, counter) -> str:
    if position == "dim" or position in _DIM_ARGS.get(name, ()):
        return _dims(arg, rank, counter)
    if position in _DIM_ARGS_OUT.get(name, ()):
        return _dims(arg, rank + 1, counter)
    if position in _LENGTH_ARGS.get(name, ()) and isinstance(arg, tuple):
        return f"<{len(arg)} sizes>"
    return _text(arg, counter)


def _dims(arg: Any, rank: int, counter) -> str:
    if isinstance(arg, bool) or not isinstance(arg, (int, tuple)):
        return _text(arg, counter)
    if isinstance(arg, tuple):
        return "[" + ", ".join(_dims(item, rank, counter) for item in arg) + "]"
    return str(arg % rank if rank and arg < 0 else arg)


def _text(arg: Any, counter) -> str:
    if isinstance(arg, ValueRef):
        return f"T{next(counter)}"
    if isinstance(arg, tuple):
        return "[" + ", ".join(_text(item, counter) for item in arg) + "]"
    if isinstance(arg, Literal):
        return str(arg)
    return format_arg(arg)
