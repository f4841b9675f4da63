"""ShardCombine's executor for PyTorch: run one ATen op on numpy arrays.

:class:`TorchExecutor` implements :class:`metadist.shardcombine.OpExecutor`.
Arrays cross as numpy; dtypes numpy lacks (bfloat16) travel as float32 and are
rounded to the real dtype on the way in (float16 too, for one code path).

Shape-carrying arguments are rewritten when an op runs on other shapes than the
node was written for (:meth:`TorchExecutor.adapt`): reshape sizes by dim groups,
expand sizes, slice and split bounds, the input sizes of slice/select backward,
layer norm's ``normalized_shape`` and convolution backward's ``bias_sizes``.
Where no rewrite keeps the op's meaning, it raises ``ExecutionRefused``.

Before a kernel runs, cheap checks refuse pieces it cannot take: index-valued inputs out of range,
shapes the meta kernel rejects, and, for the attention (SDPA) family, shapes the fused kernels take on
trust (:func:`metadist.shardcombine.attention.shape_error`). Then kernels known to check their inputs
(:mod:`.safe_ops`) run in this process; every other op runs in a forked worker
(:class:`metadist.shardcombine.isolation.KernelWorker`), so a kernel that crashes or hangs on some
pieces refuses that execution instead of killing the caller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from ...ir import Literal, Node, TensorSpec, ValueRef
from ...shardcombine import attention
from ...shardcombine.executor import ExecutionRefused, OpCall
from ...shardcombine.isolation import KernelWorker
from ...shardcombine.shapes import reshape_for, resolve_reshape
from ...shardcombine.signature import op_name
from .execute import materialize, resolve_op
from .safe_ops import runs_in_process

__all__ = ["TorchExecutor"]

Shapes = tuple[tuple[int, ...], ...]

#: dtypes that cross to numpy as float32.
_VIA_FLOAT32 = {"bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"}


class TorchExecutor:
    """Runs ATen ops (MetaIR targets ``aten.*``, and custom ops) on numpy arrays, on the CPU.

    ``isolate`` (default True) runs ops not known to check their inputs in a forked worker, each
    execution bounded by ``timeout_s``; ``isolate=False`` runs everything in this process.
    ``device="cuda"`` runs the kernels on the GPU, in this process (a forked child cannot use
    CUDA): it is for tests that re-check rules on GPU-only kernels, not for discovery.
    """

    framework = "torch"
    framework_version = torch.__version__

    def __init__(self, *, isolate: bool = True, timeout_s: float = 60.0, device: str = "cpu") -> None:
        self._meta_checked: dict[tuple, str] = {}
        self.device = torch.device(device)
        self.isolate = isolate and self.device.type == "cpu"
        self.worker = KernelWorker(_execute, timeout_s=timeout_s, setup=_single_thread)
        """The isolated worker; its ``crashes`` count the executions each op lost to a crash or hang."""

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Single-threaded kernels while discovery runs (tiny ops; threads only add overhead), restored after.

        The isolated worker, if one was started, stops when the session ends; ops whose executions
        crashed or hung in it during the session are logged as one warning each.
        """
        threads = torch.get_num_threads()
        if threads != 1:
            torch.set_num_threads(1)
        crashes = dict(self.worker.crashes)
        try:
            yield
        finally:
            self.worker.close()
            self.worker.report_crashes(crashes)
            if threads != 1:
                torch.set_num_threads(threads)

    def close(self) -> None:
        """Stop the isolated worker, if one runs."""
        self.worker.close()

    # ------------------------------------------------------------- running
    def run(self, call: OpCall, inputs: Sequence[np.ndarray]) -> list[np.ndarray | None]:
        shapes = tuple(tuple(x.shape) for x in inputs)
        call = self.adapt(call, shapes)
        _check_indices(call.node, shapes, inputs)
        self._check_on_meta(call)
        if attention.is_attention(call.target):
            error = attention.shape_error(call)
            if error:
                raise ExecutionRefused(error)
        if self.isolate and not runs_in_process(call.target):
            if not call.target.startswith("aten."):
                _import_dynamo()
            return self.worker.run(call, list(inputs))
        return _execute(call, inputs, self.device)

    def _check_on_meta(self, call: OpCall) -> None:
        """Run the op on meta tensors first: CPU kernels do not all check shapes, meta kernels do.

        An op given inconsistent shapes (a candidate split of one input but not
        another) must fail with an error, never corrupt memory.
        """
        key = (call.node.op.target, call.node.args, call.node.kwargs, call.input_specs)
        error = self._meta_checked.get(key)
        if error is None:
            tensors = [torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device="meta") for spec in call.input_specs]
            try:
                _call(_on_meta(call.node), tensors)
                error = ""
            except Exception as err:  # the meta kernel rejects these shapes: so must we
                error = f"{call.target} rejects input shapes {call.input_shapes}: {str(err).splitlines()[0][:200]}"
            if len(self._meta_checked) > 100_000:
                self._meta_checked.clear()
            self._meta_checked[key] = error
        if error:
            raise ExecutionRefused(error)

    def example_inputs(self, call: OpCall, rng: np.random.Generator, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
        ranges = _index_ranges(call.node, tuple(tuple(s) for s in shapes))
        arrays = []
        for index, (spec, shape) in enumerate(zip(call.input_specs, shapes)):
            arrays.append(_draw(spec.dtype, tuple(shape), rng, ranges.get(index)))
        return arrays

    # ------------------------------------------------------------- shapes
    def kept_dims(self, call: OpCall) -> tuple[tuple[int, ...], ...]:
        """Per input, the dims whose real sizes the op's arguments refer to (see :func:`~metadist.shardcombine.executor.kept_dims`).

        A slice that is not the whole dim (RoPE's halves of the head dim) and ``slice_backward`` along
        its sliced dim: no rewrite of their bounds keeps their meaning on another size (:meth:`adapt`
        refuses it), so stand-in shapes keep that dim's size.
        """
        kept = _KEPT.get(op_name(call.target))
        dims = kept(list(call.node.args), call.input_shapes) if kept is not None else None
        return tuple(() for _ in call.input_specs) if dims is None else tuple(dims)

    def adapt(self, call: OpCall, shapes: Sequence[tuple[int, ...]]) -> OpCall:
        shapes = tuple(tuple(s) for s in shapes)
        if shapes == call.input_shapes:
            return call
        if len(shapes) != len(call.input_specs) or any(len(a) != len(b) for a, b in zip(shapes, call.input_shapes)):
            raise ExecutionRefused(f"{call.target}: inputs of shapes {shapes} do not have the ranks of {call.input_shapes}")
        rewrite = _REWRITES.get(op_name(call.target))
        args = list(call.node.args)
        if rewrite is not None:
            rewrite(args, call.input_shapes, shapes)
        specs = tuple(TensorSpec(shape, spec.dtype) for shape, spec in zip(shapes, call.input_specs))
        return OpCall(dataclasses.replace(call.node, args=tuple(args)), specs)


# ----------------------------------------------------------------- numpy <-> torch


def _execute(call: OpCall, inputs: Sequence[np.ndarray], device: torch.device = torch.device("cpu")) -> list[np.ndarray | None]:
    """Run the kernel: numpy in, numpy out (one entry per node output). The worker runs this too."""
    tensors = [_to_torch(x, spec.dtype).to(device) for x, spec in zip(inputs, call.input_specs)]
    results = _call(call.node, tensors)
    return [
        None if value is None or not isinstance(out, torch.Tensor) else _to_numpy(out)
        for value, out in zip(call.node.outputs, results)
    ]


@functools.lru_cache(maxsize=None)
def _import_dynamo() -> None:
    """Import ``torch._dynamo`` here, once: a Python custom op imports it on its first call (seconds),
    and a worker forked afterwards inherits it instead of importing it again after every crash."""
    importlib.import_module("torch._dynamo")


def _single_thread() -> None:
    """The worker's setup: one intra-op thread (a forked child must not enter the parent's OpenMP pool)."""
    torch.set_num_threads(1)


def _call(node: Node, tensors: Sequence[torch.Tensor]) -> tuple:
    env = {f"#{index}": tensor for index, tensor in enumerate(tensors)}
    numbered = iter(range(len(tensors)))
    args = [materialize(_number(arg, numbered), env) for arg in node.args]
    kwargs = {key: materialize(_number(arg, numbered), env) for key, arg in node.kwargs}
    with torch.no_grad():
        result = resolve_op(node.op.target)(*args, **kwargs)
    return (result,) if len(node.outputs) == 1 and not isinstance(result, (tuple, list)) else tuple(result)


def _on_meta(node: Node) -> Node:
    """The node with its device arguments moved to the meta device."""

    def move(arg: Any) -> Any:
        if isinstance(arg, Literal) and arg.kind == "device":
            return Literal("device", "meta")
        return tuple(move(item) for item in arg) if isinstance(arg, tuple) else arg

    args = tuple(move(arg) for arg in node.args)
    kwargs = tuple((key, move(arg)) for key, arg in node.kwargs)
    return dataclasses.replace(node, args=args, kwargs=kwargs)


def _check_indices(node: Node, shapes: Shapes, inputs: Sequence[np.ndarray]) -> None:
    """Refuse index-valued inputs out of their range on these shapes (CPU kernels may not check)."""
    for index, (low, high) in _index_ranges(node, shapes).items():
        values = inputs[index]
        if values.size and (values.min() < low or values.max() >= high):
            raise ExecutionRefused(f"{node.op.target}: input {index} holds indices outside [{low}, {high}) on these shapes")


def _to_torch(array: np.ndarray, dtype: str) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array).reshape(array.shape))  # ascontiguousarray makes 0-d arrays 1-d
    return tensor.to(getattr(torch, dtype))


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    if str(tensor.dtype).removeprefix("torch.") in _VIA_FLOAT32:
        tensor = tensor.float()
    return np.array(tensor.contiguous().numpy(), copy=True)


def _number(arg: Any, numbered) -> Any:
    """Replace each tensor reference by its position, so repeated inputs can differ."""
    if isinstance(arg, ValueRef):
        return ValueRef(f"#{next(numbered)}")
    if isinstance(arg, tuple):
        return tuple(_number(item, numbered) for item in arg)
    return arg


def _draw(dtype: str, shape: tuple[int, ...], rng: np.random.Generator, index_range: tuple[int, int] | None) -> np.ndarray:
    if index_range is not None:
        low, high = index_range
        return rng.integers(low, max(high, low + 1), size=shape).astype(dtype)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype.startswith(("int", "uint")):
        low = 0 if dtype.startswith("uint") else -4
        return rng.integers(low, 5, size=shape).astype(dtype)
    values = np.asarray(rng.choice([-1.0, 1.0], size=shape) * rng.uniform(0.5, 1.5, size=shape))  # 0-d: an array too
    if dtype in _VIA_FLOAT32:
        return _to_numpy(torch.from_numpy(values).to(getattr(torch, dtype)))
    return values.astype(dtype)


# ----------------------------------------------------------------- index-valued inputs


def _input_positions(node: Node) -> list[tuple[int | str, int | None]]:
    """For each tensor input: its argument position (or kwarg name) and index inside a list argument."""
    positions: list[tuple[int | str, int | None]] = []
    items = list(enumerate(node.args)) + list(node.kwargs)
    for key, arg in items:
        if isinstance(arg, ValueRef):
            positions.append((key, None))
        elif isinstance(arg, tuple):
            positions += [(key, sub) for sub, item in enumerate(arg) if isinstance(item, ValueRef)]
    return positions


def _index_ranges(node: Node, shapes: Shapes) -> dict[int, tuple[int, int]]:
    """Valid ranges of the index-valued integer inputs of ``node`` on inputs of ``shapes``."""
    name = op_name(node.op.target)
    positions = _input_positions(node)
    where = {position: index for index, position in enumerate(positions)}
    ranges: dict[int, tuple[int, int]] = {}

    def at(position: int | str, sub: int | None = None) -> int | None:
        return where.get((position, sub))

    def classes(shape: tuple[int, ...]) -> int:
        return shape[1] if len(shape) >= 2 else (shape[0] if shape else 1)

    if name == "aten.embedding" and at(1) is not None:
        ranges[at(1)] = (0, shapes[0][0])
    elif name == "aten.embedding_dense_backward" and at(1) is not None:
        ranges[at(1)] = (0, int(node.args[2]))
    elif name in ("aten.gather", "aten.scatter", "aten.scatter_add", "aten.index_select", "aten.index_add") and at(2) is not None:
        dim = int(node.args[1]) % max(len(shapes[0]), 1)
        ranges[at(2)] = (0, shapes[0][dim] if shapes[0] else 1)
    elif name in ("aten.index", "aten.index_put") and isinstance(node.args[1], tuple):
        for dim, item in enumerate(node.args[1]):
            if isinstance(item, ValueRef):
                ranges[at(1, dim)] = (0, shapes[0][dim])
    elif name in ("aten.nll_loss_forward", "aten.nll_loss2d_forward") and at(1) is not None:
        ranges[at(1)] = (0, classes(shapes[0]))
    elif name in ("aten.nll_loss_backward", "aten.nll_loss2d_backward") and at(2) is not None:
        ranges[at(2)] = (0, classes(shapes[1]))
    elif name == "aten.max_pool2d_with_indices_backward" and at(7) is not None:
        ranges[at(7)] = (0, shapes[1][-2] * shapes[1][-1])
    return ranges


# ----------------------------------------------------------------- shape rewrites


def _refuse(what: str) -> None:
    raise ExecutionRefused(what)


def _rewrite_reshape(args: list, old: Shapes, new: Shapes) -> None:
    out_ref = resolve_reshape(old[0], args[1])
    out = reshape_for(old[0], out_ref, new[0])
    if out is None:
        _refuse(f"reshape {old[0]} -> {out_ref} has no counterpart for input {new[0]}")
    args[1] = tuple(out)  # type: ignore[arg-type]


def _rewrite_expand(args: list, old: Shapes, new: Shapes) -> None:
    sizes = list(args[1])
    lead = len(sizes) - len(old[0])
    for dim, (was, now) in enumerate(zip(old[0], new[0])):
        if was == now:
            continue
        if was == 1 or sizes[lead + dim] not in (-1, was):
            _refuse(f"expand of a broadcast dim {dim} ({was} -> {now})")
        sizes[lead + dim] = -1 if sizes[lead + dim] == -1 else now
    args[1] = tuple(sizes)


def _rewrite_slice(args: list, old: Shapes, new: Shapes) -> None:
    while len(args) < 5:
        args.append((0, None, None, 1)[len(args) - 1])
    dim = args[1] % len(old[0])
    if old[0][dim] == new[0][dim]:
        return
    start, end, step = args[2] or 0, args[3], args[4]
    if start != 0 or step != 1 or (end is not None and end < old[0][dim]):
        _refuse(f"slice [{start}:{end}:{step}] of dim {dim} changes meaning when the dim resizes")
    args[3] = new[0][dim]


def _kept_slice(args: list, shapes: Shapes) -> tuple[tuple[int, ...], ...] | None:
    dim = (args[1] if len(args) > 1 else 0) % len(shapes[0])
    start, end, step = (list(args[2:5]) + [None, None, None])[:3]
    whole = (start or 0) == 0 and (step or 1) == 1 and (end is None or end >= shapes[0][dim])
    return None if whole else ((dim,),)


def _kept_slice_backward(args: list, shapes: Shapes) -> tuple[tuple[int, ...], ...] | None:
    return ((args[2] % len(shapes[0]),),)


def _rewrite_split(args: list, old: Shapes, new: Shapes) -> None:
    dim = (args[2] if len(args) > 2 else 0) % len(old[0])
    if old[0][dim] == new[0][dim]:
        return
    count = math.ceil(old[0][dim] / args[1])
    if old[0][dim] % args[1] or new[0][dim] % count:
        _refuse(f"split of dim {dim} into pieces of {args[1]} has no counterpart for size {new[0][dim]}")
    args[1] = new[0][dim] // count


def _rewrite_split_with_sizes(args: list, old: Shapes, new: Shapes) -> None:
    dim = (args[2] if len(args) > 2 else 0) % len(old[0])
    if old[0][dim] == new[0][dim]:
        return
    scaled = [size * new[0][dim] / old[0][dim] for size in args[1]]
    if any(value != int(value) for value in scaled):
        _refuse(f"split_with_sizes {args[1]} has no proportional counterpart for size {new[0][dim]}")
    args[1] = tuple(int(value) for value in scaled)


def _rewrite_slice_backward(args: list, old: Shapes, new: Shapes) -> None:
    dim = args[2] % len(old[0])
    if old[0][dim] != new[0][dim]:
        _refuse(f"slice_backward along its sliced dim {dim}")
    args[1] = tuple(size if d == dim else new[0][d] for d, size in enumerate(args[1]))


def _rewrite_select_backward(args: list, old: Shapes, new: Shapes) -> None:
    dim = args[2] % len(args[1])
    rest = iter(new[0])
    args[1] = tuple(size if d == dim else next(rest) for d, size in enumerate(args[1]))


def _normalized_shape(position: int, source: int) -> Callable[[list, Shapes, Shapes], None]:
    def rewrite(args: list, old: Shapes, new: Shapes) -> None:
        count = len(args[position])
        args[position] = tuple(new[source][len(new[source]) - count:])

    return rewrite


def _rewrite_conv_backward(args: list, old: Shapes, new: Shapes) -> None:
    if args[3] is not None:
        args[3] = (new[2][0],)


_REWRITES: dict[str, Callable[[list, Shapes, Shapes], None]] = {
    "aten.view": _rewrite_reshape,
    "aten._unsafe_view": _rewrite_reshape,
    "aten.reshape": _rewrite_reshape,
    "aten.expand": _rewrite_expand,
    "aten.slice": _rewrite_slice,
    "aten.split": _rewrite_split,
    "aten.split_with_sizes": _rewrite_split_with_sizes,
    "aten.slice_backward": _rewrite_slice_backward,
    "aten.select_backward": _rewrite_select_backward,
    "aten.native_layer_norm": _normalized_shape(1, 0),
    "aten.native_layer_norm_backward": _normalized_shape(2, 1),
    "aten.convolution_backward": _rewrite_conv_backward,
}

#: Ops whose arguments refer to the real size of some input dims: which dims (see :meth:`TorchExecutor.kept_dims`).
_KEPT: dict[str, Callable[[list, Shapes], tuple[tuple[int, ...], ...] | None]] = {
    "aten.slice": _kept_slice,
    "aten.slice_backward": _kept_slice_backward,
}
