"""The copies the cost model counts around a reshard (``metadist.lowering.copies``) are the ones the runtime makes.

Each reshard runs through the runtime's own code (``run_steps``, ``run_coalesced``: the ``Collectives`` methods and
the local steps the rank module calls) on collectives that stand in for the transfer, under a dispatch mode that
records every copy and fill the runtime's code issues. The stand-in's own transfer (what gloo writes) is not
recorded; an all-reduce's functional clone, which the direct path makes before handing the buffer to gloo, is.
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from metadist.ir import Mesh, Partial, Replicate, Shard, TensorSpec  # noqa: E402
from metadist.lowering.copies import coalesced_copies, program_copies, step_copies  # noqa: E402
from metadist.lowering.program import BucketMember, CoalescedReshard, Reshard, RankProgram  # noqa: E402
from metadist.lowering.reshard import COLLECTIVE_KINDS, plan_resharding  # noqa: E402
from metadist.runtime.collectives import Collectives, _Pending, run_coalesced, run_steps  # noqa: E402

_COPIES = {"cat", "clone", "stack", "copy_", "_to_copy"}
_FILLS = {"zeros_like", "new_zeros", "zeros", "zero_", "fill_"}


class CopyCounter(TorchDispatchMode):
    """Elements written by each copy or fill, in call order (a ``copy_`` counts its destination's elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[int] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.paused and (name in _COPIES or name in _FILLS):
            self.copies.append((args[0] if name == "copy_" else out).numel())
        return out

    @contextlib.contextmanager
    def pause(self):
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


class StandIn(Collectives):
    """Collectives that move nothing between ranks: each output has the real call's shape. The transfer itself is
    not counted; the all-reduce's clone of its input is, as the direct path makes it (``Collectives._start``)."""

    def __init__(self, axis_sizes, counter: CopyCounter) -> None:
        super().__init__(("stand-in",) * len(axis_sizes), axis_sizes)
        self.counter = counter

    def _start(self, kind, tensor, axis, op=None):
        k = self.axis_sizes[axis]
        if kind == "all_reduce":
            return _Pending(None, tensor.clone())
        with self.counter.pause():
            if kind == "all_gather":
                out = tensor.repeat(k, *([1] * (tensor.dim() - 1)))
            elif kind == "reduce_scatter":
                out = tensor[: tensor.shape[0] // k].clone()
            else:
                out = tensor.clone()
        return _Pending(None, out)


def _steps(shape, source, target, mesh, coords=None):
    coords = coords if coords is not None else (0,) * mesh.ndim
    steps = plan_resharding(shape, 4, source, target, mesh, coords)
    assert steps, "the case must reshard"
    return steps


CASES = [  # (global shape, source, target, mesh shape): every step kind the lowering emits
    ((8, 12), (Shard(0),), (Replicate(),), (4,)),  # all-gather along dim 0: a view
    ((8, 12), (Shard(1),), (Replicate(),), (4,)),  # along dim 1: the pieces joined
    ((8, 12), (Partial(),), (Replicate(),), (4,)),  # all-reduce: its clone
    ((8, 12), (Partial(),), (Shard(0),), (4,)),  # reduce-scatter of dim 0
    ((8, 12), (Partial(),), (Shard(1),), (4,)),  # of dim 1: rows laid out first
    ((8, 12), (Shard(0),), (Shard(1),), (4,)),  # all-to-all
    ((8, 12), (Shard(1),), (Shard(0),), (4,)),
    ((8, 12), (Replicate(),), (Shard(1),), (4,)),  # local slice
    ((8, 12), (Replicate(),), (Partial(),), (4,)),  # zero_partial (nothing on coordinate 0)
    ((10, 12), (Shard(0),), (Replicate(),), (4,)),  # uneven pieces: pad and unpad around the gather
    ((8, 12), (Shard(0), Shard(1)), (Replicate(), Replicate()), (2, 2)),
    ((8, 12), (Partial(), Shard(0)), (Shard(1), Replicate()), (2, 2)),
]


def _rank_copies(shape, source, target, mesh, coords):
    steps = _steps(shape, source, target, mesh, coords)
    counter = CopyCounter()
    comm = StandIn(mesh.shape, counter)
    with counter:
        run_steps(comm, torch.randn(steps[0].local_shape_in), steps)
    return steps, counter.copies


@pytest.mark.parametrize("shape,source,target,mesh_shape", CASES)
def test_each_reshard_step_copies_what_the_model_counts(shape, source, target, mesh_shape):
    import itertools

    mesh = Mesh(mesh_shape)
    by_rank = {coords: _rank_copies(shape, source, target, mesh, coords)
               for coords in itertools.product(*(range(size) for size in mesh_shape))}
    for coords, (steps, copies) in by_rank.items():
        expected = [elements for step in steps for elements in step_copies(step)]
        if not any(step.kind in ("pad", "unpad") for step in steps):  # even pieces: exactly the runtime's copies
            assert copies == expected, (coords, [str(step) for step in steps])
        else:  # uneven: the model reads the largest piece and prices a pad on every rank, as the slowest makes it
            assert sum(copies) <= sum(expected), (coords, [str(step) for step in steps])


def _member(shape, source, target, mesh):
    steps = _steps(shape, source, target, mesh)
    (position,) = [index for index, step in enumerate(steps) if step.kind in COLLECTIVE_KINDS]
    spec = TensorSpec(tuple(shape), "float32")
    return BucketMember(f"v{shape}{source}", f"t{shape}{source}", spec, tuple(source), tuple(target),
                        steps[:position], steps[position], steps[position + 1:])


@pytest.mark.parametrize("kind,members", [
    ("all_gather", [((8, 12), (Shard(0),), (Replicate(),)), ((4, 8), (Shard(1),), (Replicate(),)),
                    ((16,), (Shard(0),), (Replicate(),))]),
    ("all_reduce", [((8, 12), (Partial(),), (Replicate(),)), ((4, 6), (Partial(),), (Replicate(),))]),
    ("reduce_scatter", [((8, 12), (Partial(),), (Shard(0),)), ((4, 8), (Partial(),), (Shard(1),))]),
    ("all_gather", [((8, 12), (Shard(1),), (Replicate(),))]),  # one member: packed and unpacked as views
])
def test_a_coalesced_call_copies_what_the_model_counts(kind, members):
    mesh = Mesh((4,))
    bucket = CoalescedReshard(kind, 0, "sum" if kind != "all_gather" else None, "float32",
                              tuple(_member(shape, source, target, mesh) for shape, source, target in members))
    counter = CopyCounter()
    comm = StandIn((4,), counter)
    tensors = [torch.randn(member.steps[0].local_shape_in) for member in bucket.members]
    with counter:
        run_coalesced(comm, tensors, bucket)
    assert counter.copies == coalesced_copies(bucket)
    if len(members) > 1:  # packing the members is a copy of all of them, and a gather unpacks each
        packed = sum(t.numel() for t in tensors)
        assert packed in counter.copies
        if kind == "all_gather":
            start = counter.copies.index(packed) + 1
            assert counter.copies[start:start + len(tensors)] == [4 * t.numel() for t in tensors]


def test_a_program_lists_the_copies_of_its_reshards_with_their_dtypes():
    mesh = Mesh((4,))
    gather = Reshard("a", "a.r", TensorSpec((8, 12), "bfloat16"), (Shard(1),), (Replicate(),),
                     _steps((8, 12), (Shard(1),), (Replicate(),), mesh))
    bucket = CoalescedReshard("all_reduce", 0, "sum", "float32",
                              tuple(_member(shape, (Partial(),), (Replicate(),), mesh) for shape in ((8, 12), (4, 6))))
    program = RankProgram("g", mesh, (0,), (), (gather, bucket), ())
    assert list(program_copies(program)) == [("bfloat16", 96), ("float32", 120), ("float32", 120)]


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("coordinate", [0, 1, 3])
def test_a_halo_exchange_and_its_trim_copy_what_the_model_counts(dim, coordinate):
    from metadist.lowering.halo import halo_exchange_step, halo_trim_step

    mesh = Mesh((4,))
    spec = TensorSpec((16, 12) if dim == 0 else (6, 16), "float32")
    local_in = tuple(size // 4 if d == dim else size for d, size in enumerate(spec.shape))
    exchange = halo_exchange_step(spec, (Shard(dim),), local_in, 0, 2, mesh, (coordinate,), "x")
    trim = halo_trim_step(local_in, dim, 0, 2, 16, 16, mesh, (coordinate,), "x")
    counter = CopyCounter()
    comm = StandIn((4,), counter)
    with counter:
        extended = run_steps(comm, torch.randn(local_in), (exchange,))
        run_steps(comm, extended, (trim,))
    assert counter.copies == step_copies(exchange) + step_copies(trim)
