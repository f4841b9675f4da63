"""Lowering: from a plan to one program per rank (framework-free; imports neither torch nor jax).

- :mod:`.shapes`: local shapes and offsets of sharded values (``torch.chunk`` pieces, as DTensor cuts them)
- :mod:`.reshard`: the collectives between two shardings on an N-D mesh, with bytes per rank
- :mod:`.rewrite`: shape-carrying arguments of ops, rewritten for local shards
- :mod:`.program`: :func:`lower` a graph and a plan to a :class:`RankProgram`
- :mod:`.coalesce`: reshards run in buckets, one collective for several values
- :mod:`.overlap`: collectives issued early and waited for late, overlapping computation
"""

from .errors import LoweringError
from .plans import replicate_plan
from .coalesce import COALESCIBLE_KINDS, DEFAULT_BUCKET_CAP_BYTES, coalesce, coalescible_step, share_collectives, split_stages
from .program import (
    BucketMember, CoalescedReshard, LocalOp, ProgramInput, ProgramOutput, RandomDraw, RankProgram, Reshard, Wait, lower,
    lower_for_rank,
)
from .overlap import DEFAULT_IN_FLIGHT_CAP_BYTES, is_async, schedule_overlap
from .reshard import COLLECTIVE_KINDS, PAD_KINDS, ReshardStep, comm_bytes, plan_resharding
from .shapes import (
    chunk_bounds, contiguous_strides, is_even, local_bounds, local_shape, max_local_shape, mesh_coordinates, shard_offset,
)

__all__ = [name for name in dir() if not name.startswith("_")]
