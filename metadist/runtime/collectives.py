"""Resharding on torch.distributed: functional collectives on one mesh axis, with a byte counter.

:class:`Collectives` is an ``nn.Module`` so that a rank's ``GraphModule``
holds it as the submodule ``comm`` and calls its methods from generated code.
Each method runs one functional collective on the process group of one mesh
axis (``DeviceMesh.get_group(axis)``, passed by name) and records the bytes
this rank sends, by the ring convention of :mod:`metadist.lowering.reshard`,
so that measured bytes can be compared with the plan's prediction.

Pieces cut unevenly (``torch.chunk``, :mod:`metadist.lowering.shapes`) reach the collectives
already padded to equal pieces: the lowering puts ``pad``/``unpad`` steps around them
(:func:`pad_to`, :func:`unpad_to`), so every collective here moves equal pieces, and counts
the padding it sends. :func:`local_slice` cuts as ``torch.chunk`` does, so a rank's piece may
be shorter than the others' or empty.

The ``coalesced_*`` methods run one collective for several tensors (a bucket of
:mod:`metadist.lowering.coalesce`) through one flat buffer in a per-rank layout:
segment ``r`` of the buffer holds, member after member, what rank ``r`` sends
(all-gather) or receives (reduce-scatter), so that one ``all_gather_tensor`` /
``reduce_scatter_tensor`` on dim 0 gives every member its own result along its own
dim. They count one call, and each member's bytes by its own buffer, so that the
bytes measured equal the sum the lowering predicts.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from ..lowering import CoalescedReshard, ReshardStep, chunk_bounds, comm_bytes

__all__ = ["Collectives", "CommRecord", "gathers_by_all_to_all", "start_all_gather", "local_slice", "take_bounds",
           "pad_to", "unpad_to", "zero_partial", "run_steps", "run_coalesced", "all_to_all_pieces", "unpack_all_reduce",
           "unpack_all_gather", "unpack_reduce_scatter", "unpack_all_to_all",
           "apply_halo_step", "halo_trim"]


@dataclass(frozen=True)
class CommRecord:
    """Collectives executed so far of one (phase, kind, axis): how many, and the bytes this rank sent."""

    count: int
    bytes: int


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG,
               "product": dist.ReduceOp.PRODUCT}


class _Pending:
    """A collective started by ``torch.distributed`` (``async_op=True``): its work handle and its output."""

    __slots__ = ("work", "result")

    def __init__(self, work: Any, result: torch.Tensor) -> None:
        self.work, self.result = work, result


def gathers_by_all_to_all(group: Any, tensor: torch.Tensor) -> bool:
    """Whether :func:`start_all_gather` carries out an all-gather of ``tensor`` on ``group`` as an all-to-all: a CPU
    tensor on a gloo process group.

    gloo's all-gather gathers into a flat buffer it allocates in its worker thread on every call and copies the
    pieces out of it afterwards; its all-to-all sends each piece straight into the caller's output. On this project's
    2-core machine (4 gloo processes, two pairs at once, 5 MiB from each rank) an all-gather took 28-30 ms a call and
    1,000-4,900 page faults in gloo's threads, the all-to-all of the input repeated 10 ms; among all 4 processes
    (1.25 MiB each) 8.5 ms against 5.5. The calibration times the all-gather through the same function, so the cost
    model prices the one the runtime runs."""
    return tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group))


def start_all_gather(out: torch.Tensor, tensor: torch.Tensor, group: Any, k: int, async_op: bool = True) -> Any:
    """All-gather the contiguous ``tensor`` along dim 0 over the ``k`` ranks of ``group`` into ``out`` (``k`` times
    its rows): row block r of ``out`` is rank r's ``tensor``.

    Where :func:`gathers_by_all_to_all`, an all-to-all of ``tensor`` repeated ``k`` times, which sends every rank the
    same bytes as a ring all-gather, ``(k - 1)`` pieces (a profiler sees an all-to-all whose input is as large as the
    gathered output); elsewhere the backend's own all-gather. Returns the work (``async_op``) or None."""
    if gathers_by_all_to_all(group, tensor):
        repeated = tensor.repeat(k, *(1,) * (tensor.dim() - 1))
        return dist.all_to_all_single(out, repeated, group=group, async_op=async_op)
    return dist.all_gather_single(out, tensor, group=group, async_op=async_op)


class Collectives(torch.nn.Module):
    """The collectives of one rank, one process group per mesh axis, counting what they move.

    ``direct`` (the default) calls ``torch.distributed`` itself (``all_reduce``, ``all_gather_single``,
    ``reduce_scatter_single``, ``all_to_all_single``, each ``async_op=True``, waited for by :meth:`wait_tensor`);
    False calls the functional collectives (``torch.distributed._functional_collectives``), which
    ``torch.compile`` traces. The values are the same; on gloo between CPU processes a functional
    collective costs about 0.3 ms more per call (dispatch through its op registry and work map).
    """

    def __init__(self, group_names: Sequence[str], axis_sizes: Sequence[int], direct: bool = True) -> None:
        super().__init__()
        self.group_names = tuple(group_names)
        self.axis_sizes = tuple(axis_sizes)
        self.direct = direct
        self.records: dict[tuple[str, str, int], CommRecord] = {}
        self.phase = "step"
        self._groups: dict[int, Any] = {}

    @staticmethod
    def from_device_mesh(device_mesh: DeviceMesh, direct: bool = True) -> "Collectives":
        groups = [device_mesh.get_group(axis) for axis in range(device_mesh.ndim)]
        comm = Collectives([group.group_name for group in groups], tuple(device_mesh.shape), direct)
        comm._groups = dict(enumerate(groups))
        return comm

    def _group(self, axis: int) -> Any:
        group = self._groups.get(axis)
        if group is None:
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = self._groups[axis] = _resolve_process_group(self.group_names[axis])
        return group

    def _start(self, kind: str, tensor: torch.Tensor, axis: int, op: str | None = None) -> Any:
        """Start ``kind`` on the contiguous ``tensor`` along dim 0; returns what :meth:`wait_tensor` takes."""
        if not self.direct:
            name = self.group_names[axis]
            if kind == "all_reduce":
                return funcol.all_reduce(tensor, op, name)
            if kind == "all_gather":
                return funcol.all_gather_single(tensor, 0, name)
            if kind == "reduce_scatter":
                return funcol.reduce_scatter_single(tensor, op, 0, name)
            return funcol.all_to_all_single(tensor, None, None, name)
        k = self.axis_sizes[axis]
        if kind == "all_reduce":
            out = tensor.clone()  # functional, as the functional collective is: the input stays as it was
        elif kind == "all_gather":
            out = tensor.new_empty((k * tensor.shape[0], *tensor.shape[1:]))
        elif kind == "reduce_scatter":
            if tensor.shape[0] % k:
                raise ValueError(f"reduce-scatter of a dim of {tensor.shape[0]} over {k} ranks: it must divide")
            out = tensor.new_empty((tensor.shape[0] // k, *tensor.shape[1:]))
        else:
            out = torch.empty_like(tensor)
        if tensor.numel() == 0:  # the same on every rank (pieces are padded to equal shapes): nothing to move
            return _Pending(None, out)
        group = self._group(axis)
        if kind == "all_reduce":
            work = dist.all_reduce(out, _REDUCE_OPS[op], group=group, async_op=True)
        elif kind == "all_gather":
            work = start_all_gather(out, tensor, group, k)
        elif kind == "reduce_scatter":
            work = dist.reduce_scatter_single(out, tensor, _REDUCE_OPS[op], group=group, async_op=True)
        else:
            work = dist.all_to_all_single(out, tensor, group=group, async_op=True)
        return _Pending(work, out)

    def wait_tensor(self, raw: Any) -> torch.Tensor:
        """The output of a collective started by an ``issue_*`` method, once it has completed."""
        if isinstance(raw, _Pending):
            if raw.work is not None:
                raw.work.wait()
            return raw.result
        return funcol.wait_tensor(raw)

    @contextlib.contextmanager
    def counting_as(self, phase: str) -> Iterator[None]:
        """Count the collectives inside under ``phase`` (e.g. ``"boundary"`` for gathers outside the step)."""
        saved, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = saved

    def reset(self) -> None:
        self.records.clear()

    def _record(self, kind: str, axis: int, bytes_in: int, bytes_out: int) -> None:
        self._record_call(kind, axis, [(bytes_in, bytes_out)])

    def _record_call(self, kind: str, axis: int, member_bytes: Sequence[tuple[int, int]]) -> None:
        """One collective call; its bytes are the members', each by the ring convention of its own buffer."""
        key = (self.phase, kind, axis)
        old = self.records.get(key, CommRecord(0, 0))
        sent = sum(comm_bytes(kind, self.axis_sizes[axis], bytes_in, bytes_out) for bytes_in, bytes_out in member_bytes)
        self.records[key] = CommRecord(old.count + 1, old.bytes + sent)

    def all_gather(self, tensor: torch.Tensor, axis: int, dim: int) -> torch.Tensor:
        gathered = self.wait_tensor(self._start("all_gather", tensor.contiguous(), axis))  # (k * n0, ...)
        out = gathered if dim == 0 else torch.cat(gathered.chunk(self.axis_sizes[axis], 0), dim=dim)
        self._record("all_gather", axis, _nbytes(tensor), _nbytes(out))
        return out

    def all_reduce(self, tensor: torch.Tensor, axis: int, op: str) -> torch.Tensor:
        out = self.wait_tensor(self._start("all_reduce", tensor.contiguous(), axis, op))
        self._record("all_reduce", axis, _nbytes(tensor), _nbytes(out))
        return out

    def reduce_scatter(self, tensor: torch.Tensor, axis: int, op: str, dim: int) -> torch.Tensor:
        k = self.axis_sizes[axis]
        if tensor.shape[dim] % k:
            raise ValueError(f"reduce-scatter of dim {dim} ({tensor.shape[dim]}) over {k} ranks: it must divide")
        rows = tensor.contiguous() if dim == 0 else torch.cat(tensor.chunk(k, dim), dim=0)  # piece r in row block r
        out = self.wait_tensor(self._start("reduce_scatter", rows, axis, op))
        self._record("reduce_scatter", axis, _nbytes(tensor), _nbytes(out))
        return out

    def all_to_all(self, tensor: torch.Tensor, axis: int, gather_dim: int, split_dim: int) -> torch.Tensor:
        """``Shard(gather_dim) -> Shard(split_dim)`` on one axis: send piece r of ``split_dim`` to rank r."""
        pieces = all_to_all_pieces(tensor, self.axis_sizes[axis], split_dim)
        received = self.wait_tensor(self._start("all_to_all", pieces, axis))
        out = unpack_all_to_all(received, gather_dim)
        self._record("all_to_all", axis, _nbytes(tensor), _nbytes(out))
        return out

    def halo_exchange(self, tensor: torch.Tensor, axis: int, dim: int, halo: int, coordinate: int) -> torch.Tensor:
        """``tensor`` extended by ``halo`` elements of ``dim`` on each side from its neighbours on ``axis`` (zeros at the ends).

        One all-gather of every rank's first and last ``halo`` elements (``2 halo`` slices); rank ``c``
        keeps the last ``halo`` of rank ``c - 1`` and the first ``halo`` of rank ``c + 1``
        (:mod:`metadist.lowering.halo`).
        """
        k = self.axis_sizes[axis]
        moved = tensor.movedim(dim, 0)  # (n, ...)
        border = torch.cat([moved[:halo], moved[moved.shape[0] - halo:]]).contiguous()  # (2h, ...)
        gathered = self.wait_tensor(self._start("all_gather", border, axis))  # (k * 2h, ...)
        gathered = gathered.view(k, 2 * halo, *border.shape[1:])  # (k, 2h, ...)
        zeros = torch.zeros_like(border[:halo])
        left = gathered[coordinate - 1, halo:] if coordinate > 0 else zeros  # (h, ...)
        right = gathered[coordinate + 1, :halo] if coordinate < k - 1 else zeros  # (h, ...)
        self._record("halo_exchange", axis, _nbytes(border), _nbytes(gathered))
        return torch.cat([left, moved, right]).movedim(0, dim).contiguous()  # (..., n + 2h, ...)

    # -- coalesced: one collective for several tensors ------------------------------------------
    def coalesced_all_reduce(self, tensors: Sequence[torch.Tensor], axis: int, op: str) -> list[torch.Tensor]:
        """All-reduce every tensor with one collective on one flat buffer (the members' elements, in order)."""
        shapes = [tuple(tensor.shape) for tensor in tensors]
        raw = self.issue_all_reduce(pack_flat(tensors), axis, op, [math.prod(shape) for shape in shapes])
        return unpack_all_reduce(self.wait_tensor(raw), shapes)

    def coalesced_all_gather(self, tensors: Sequence[torch.Tensor], axis: int, dims: Sequence[int]) -> list[torch.Tensor]:
        """All-gather every tensor along its own dim with one collective (layout: :meth:`issue_all_gather`)."""
        shapes = [tuple(tensor.shape) for tensor in tensors]
        raw = self.issue_all_gather(pack_flat(tensors), axis, [math.prod(shape) for shape in shapes])
        return unpack_all_gather(self.wait_tensor(raw), self.axis_sizes[axis], shapes, dims)

    def coalesced_reduce_scatter(self, tensors: Sequence[torch.Tensor], axis: int, op: str, dims: Sequence[int]) -> list[torch.Tensor]:
        """Reduce-scatter every tensor along its own dim with one collective (layout: :func:`pack_for_reduce_scatter`)."""
        k = self.axis_sizes[axis]
        shapes = [_piece_shape(tuple(tensor.shape), dim, k) for tensor, dim in zip(tensors, dims)]
        raw = self.issue_reduce_scatter(pack_for_reduce_scatter(tensors, k, dims), axis, op, [t.numel() for t in tensors])
        return unpack_reduce_scatter(self.wait_tensor(raw), shapes)

    # -- asynchronous: pack, issue now, wait (wait_tensor) and unpack later ---------------------
    # Each ``issue_*`` starts one collective on a packed flat buffer (``pack_*``), counts
    # the call and each member's bytes (``numels``: the members' input elements, which must add up
    # to the buffer), and returns the collective's raw output without waiting. The caller waits
    # with :meth:`wait_tensor` where the results are first needed (metadist.lowering.overlap)
    # and unpacks them with the matching ``unpack_*`` function. Packing is its own step so that
    # the members' tensors can be freed before the collective runs.
    def issue_all_reduce(self, flat: torch.Tensor, axis: int, op: str, numels: Sequence[int]) -> torch.Tensor:
        """Start one all-reduce of a (N,) buffer of members' elements (:func:`pack_flat`)."""
        item = _check_packed(flat, numels)
        self._record_call("all_reduce", axis, [(n * item, n * item) for n in numels])
        return self._start("all_reduce", flat, axis, op)

    def issue_all_gather(self, flat: torch.Tensor, axis: int, numels: Sequence[int]) -> torch.Tensor:
        """Start one all-gather of a (N,) buffer of members' elements (:func:`pack_flat`).

        The gathered (k * N,) buffer holds rank r's N elements at row r of its (k, N) view
        (:func:`unpack_all_gather` puts each member's pieces in place).
        """
        k = self.axis_sizes[axis]
        item = _check_packed(flat, numels)
        self._record_call("all_gather", axis, [(n * item, k * n * item) for n in numels])
        return self._start("all_gather", flat, axis)  # (k * N,)

    def issue_reduce_scatter(self, buffer: torch.Tensor, axis: int, op: str, numels: Sequence[int]) -> torch.Tensor:
        """Start one reduce-scatter of a (k * N,) buffer in per-rank layout (:func:`pack_for_reduce_scatter`);
        each rank keeps its reduced (N,) row."""
        k = self.axis_sizes[axis]
        item = _check_packed(buffer, numels)
        self._record_call("reduce_scatter", axis, [(n * item, n * item // k) for n in numels])
        return self._start("reduce_scatter", buffer, axis, op)  # (N,)

    def issue_all_to_all(self, tensor: torch.Tensor, axis: int, split_dim: int) -> torch.Tensor:
        """Start ``Shard(gather_dim) -> Shard(split_dim)`` on one axis: piece r of ``split_dim`` goes to rank r.

        Returns the received (k, ...) pieces, row r from rank r (:func:`unpack_all_to_all` joins them).
        """
        pieces = all_to_all_pieces(tensor, self.axis_sizes[axis], split_dim)
        self._record("all_to_all", axis, _nbytes(tensor), _nbytes(tensor))
        return self._start("all_to_all", pieces, axis)


def pack_flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements one after another, in one contiguous (N,) buffer (no copy for one contiguous tensor)."""
    if len(tensors) == 1:
        return tensors[0].contiguous().reshape(-1)
    return torch.cat([tensor.reshape(-1) for tensor in tensors])


def pack_for_reduce_scatter(tensors: Sequence[torch.Tensor], k: int, dims: Sequence[int]) -> torch.Tensor:
    """A (k * N,) buffer in per-rank layout for reducing and scattering every tensor along its own dim.

    Member m is split along ``dims[m]`` into k pieces, each flattened: a (k, n_m) block whose row r
    is what rank r keeps. The blocks side by side make a (k, N) buffer; its row r is rank r's
    segment, so one reduce-scatter on dim 0 leaves each rank its reduced (N,) row, which
    :func:`unpack_reduce_scatter` splits back into the members' pieces.
    """
    blocks = []
    for tensor, dim in zip(tensors, dims):
        shape = tuple(tensor.shape)
        split = tensor.reshape(shape[:dim] + (k, shape[dim] // k) + shape[dim + 1:])  # (..., k, n_dim/k, ...)
        blocks.append(split.movedim(dim, 0).reshape(k, -1))  # (k, n_m)
    if len(blocks) == 1:
        return blocks[0].contiguous().reshape(-1)
    return torch.cat(blocks, dim=1).reshape(-1)  # (k * N,)


def unpack_all_reduce(reduced: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """The members of a waited all-reduce buffer, as views of it."""
    sizes = [math.prod(shape) for shape in shapes]
    return [piece.view(shape) for piece, shape in zip(reduced.split(sizes), shapes)]


def unpack_all_gather(gathered: torch.Tensor, k: int, shapes: Sequence[tuple[int, ...]], dims: Sequence[int]) -> list[torch.Tensor]:
    """The members of a waited all-gather buffer, each gathered along its own dim.

    Member m's columns of the (k, N) buffer, viewed as (k, *shape_m), hold the k pieces along a new
    leading dim; moving that dim next to ``dims[m]`` and merging the two concatenates the pieces in
    rank order.
    """
    rows = gathered.view(k, -1)  # (k, N)
    out, offset = [], 0
    for shape, dim in zip(shapes, dims):
        numel = math.prod(shape)
        pieces = rows[:, offset:offset + numel].reshape(k, *shape)  # (k, ..., n_dim, ...)
        whole = tuple(shape[:dim]) + (k * shape[dim],) + tuple(shape[dim + 1:])
        out.append(pieces.movedim(0, dim).reshape(whole))  # (..., k * n_dim, ...)
        offset += numel
    return out


def unpack_reduce_scatter(reduced: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """The members' pieces of a waited reduce-scatter row (``shapes``: the pieces' shapes)."""
    return unpack_all_reduce(reduced, shapes)


def all_to_all_pieces(tensor: torch.Tensor, k: int, split_dim: int) -> torch.Tensor:
    """The contiguous (k, ...) buffer an all-to-all sends: row r is piece r of ``tensor`` along ``split_dim`` (the
    pieces ``torch.chunk`` cuts; ``split_dim``'s size is a multiple of ``k``, as the lowering pads it).

    Along dim 0 of a contiguous tensor the rows are the tensor's own memory, viewed (k, n/k, ...): no copy."""
    if tensor.shape[split_dim] % k:
        raise ValueError(f"all-to-all of dim {split_dim} of size {tensor.shape[split_dim]} over {k} ranks: it must divide")
    if split_dim == 0:
        return tensor.contiguous().view(k, tensor.shape[0] // k, *tensor.shape[1:])
    return torch.stack(tensor.chunk(k, dim=split_dim), dim=0)  # (k, ..., n_split/k, ...), a new contiguous tensor


def unpack_all_to_all(received: torch.Tensor, gather_dim: int) -> torch.Tensor:
    """The received (k, ...) pieces of a waited all-to-all, joined along ``gather_dim`` (row r is rank r's piece).

    Along dim 0 the joined tensor is the received buffer itself, viewed (k * n, ...): no copy."""
    if gather_dim == 0:
        return received.flatten(0, 1)  # (k * n_gather, ...): a view of the contiguous buffer
    return torch.cat(received.unbind(0), dim=gather_dim)  # (..., k * n_gather, ..., n_split/k, ...)


def local_slice(tensor: torch.Tensor, dim: int, coordinate: int, parts: int) -> torch.Tensor:
    """This rank's piece ``coordinate`` of ``parts`` along ``dim``, cut as ``torch.chunk`` cuts (a copy, so the whole can be freed)."""
    start, length = chunk_bounds(tensor.shape[dim], parts, coordinate)
    return tensor.narrow(dim, start, length).clone()


def bounds_view(tensor: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The view of ``tensor`` at ``(offset, length)`` per dim (:func:`metadist.lowering.local_bounds`)."""
    if len(bounds) != tensor.dim():
        raise ValueError(f"bounds for {len(bounds)} dims given for a tensor of shape {tuple(tensor.shape)}")
    for dim, (offset, length) in enumerate(bounds):
        if (offset, length) != (0, tensor.shape[dim]):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def take_bounds(tensor: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """:func:`bounds_view`'s block as its own contiguous copy."""
    return bounds_view(tensor, bounds).clone()


def pad_to(tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``tensor`` with zeros appended at the end of every dim that is shorter than ``shape`` (itself when none is)."""
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    if any(have > want for have, want in zip(tensor.shape, shape)) or tensor.dim() != len(shape):
        raise ValueError(f"cannot pad a tensor of shape {tuple(tensor.shape)} to {tuple(shape)}")
    out = tensor.new_zeros(tuple(shape))
    out[tuple(slice(0, size) for size in tensor.shape)] = tensor
    return out


def unpad_to(tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The leading ``shape`` elements of ``tensor`` in every dim (itself when it has that shape)."""
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    if any(have < want for have, want in zip(tensor.shape, shape)) or tensor.dim() != len(shape):
        raise ValueError(f"cannot cut a tensor of shape {tuple(tensor.shape)} to {tuple(shape)}")
    return tensor[tuple(slice(0, size) for size in shape)].contiguous()


def zero_partial(tensor: torch.Tensor, coordinate: int) -> torch.Tensor:
    """``Replicate -> Partial(sum)``: coordinate 0 keeps the value, the others hold zeros."""
    return tensor if coordinate == 0 else torch.zeros_like(tensor)


def run_steps(comm: Collectives, tensor: torch.Tensor, steps: Sequence[ReshardStep]) -> torch.Tensor:
    """Apply resharding steps eagerly (outside a GraphModule)."""
    for step in steps:
        tensor = apply_step(comm, tensor, step)
    return tensor


def run_coalesced(comm: Collectives, tensors: Sequence[torch.Tensor], coalesced: CoalescedReshard) -> list[torch.Tensor]:
    """Apply a coalesced reshard eagerly (outside a GraphModule): each member's local steps around one collective."""
    before = [run_steps(comm, tensor, member.pre) for tensor, member in zip(tensors, coalesced.members)]
    after = coalesced_collective(comm, before, coalesced)
    return [run_steps(comm, tensor, member.post) for tensor, member in zip(after, coalesced.members)]


def coalesced_collective(comm: Collectives, tensors: Sequence[torch.Tensor], coalesced: CoalescedReshard) -> list[torch.Tensor]:
    """The shared collective of a coalesced reshard on the members' tensors (after their ``pre`` steps)."""
    dims = [member.collective.dim for member in coalesced.members]
    if coalesced.kind == "all_reduce":
        return comm.coalesced_all_reduce(tensors, coalesced.axis, coalesced.op)
    if coalesced.kind == "all_gather":
        return comm.coalesced_all_gather(tensors, coalesced.axis, dims)
    if coalesced.kind == "reduce_scatter":
        return comm.coalesced_reduce_scatter(tensors, coalesced.axis, coalesced.op, dims)
    raise ValueError(f"collective kind {coalesced.kind!r} does not coalesce")


def apply_step(comm: Collectives, tensor: torch.Tensor, step: ReshardStep) -> torch.Tensor:
    """One resharding step on a concrete tensor."""
    if step.kind == "all_gather":
        return comm.all_gather(tensor, step.axis, step.dim)
    if step.kind == "all_reduce":
        return comm.all_reduce(tensor, step.axis, step.op)
    if step.kind == "reduce_scatter":
        return comm.reduce_scatter(tensor, step.axis, step.op, step.dim)
    if step.kind == "all_to_all":
        return comm.all_to_all(tensor, step.axis, step.dim, step.split_dim)
    if step.kind == "local_slice":
        return local_slice(tensor, step.dim, step.coordinate, step.axis_size)
    if step.kind == "zero_partial":
        return zero_partial(tensor, step.coordinate)
    if step.kind == "pad":
        return pad_to(tensor, step.local_shape_out)
    if step.kind == "unpad":
        return unpad_to(tensor, step.local_shape_out)
    if step.kind in ("halo_exchange", "halo_trim"):
        return apply_halo_step(comm, tensor, step)
    raise ValueError(f"unknown resharding step kind {step.kind!r}")


def apply_halo_step(comm: Collectives, tensor: torch.Tensor, step: ReshardStep) -> torch.Tensor:
    """A ``halo_exchange`` or ``halo_trim`` step (:mod:`metadist.lowering.halo`); widths from the step's local shapes."""
    if step.kind == "halo_exchange":
        halo = (step.local_shape_out[step.dim] - step.local_shape_in[step.dim]) // 2
        return comm.halo_exchange(tensor, step.axis, step.dim, halo, step.coordinate)
    trim = (step.local_shape_in[step.dim] - step.local_shape_out[step.dim]) // 2
    return halo_trim(tensor, step.dim, trim)


def halo_trim(tensor: torch.Tensor, dim: int, trim: int) -> torch.Tensor:
    """``tensor`` without ``trim`` elements at each end of ``dim`` (a copy, so the extended output can be freed)."""
    return tensor.narrow(dim, trim, tensor.shape[dim] - 2 * trim).clone()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _check_packed(buffer: torch.Tensor, numels: Sequence[int]) -> int:
    """The buffer's element size, after checking that it holds exactly the members' elements."""
    if buffer.dim() != 1 or buffer.numel() != sum(numels):
        raise ValueError(f"a packed collective buffer of shape {tuple(buffer.shape)} does not hold its members' "
                         f"{sum(numels)} elements ({list(numels)}); pack it with pack_flat or pack_for_reduce_scatter")
    return buffer.element_size()


def _piece_shape(shape: tuple[int, ...], dim: int, k: int) -> tuple[int, ...]:
    return shape[:dim] + (shape[dim] // k,) + shape[dim + 1:]
