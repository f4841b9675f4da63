"""Lowering: from a plan to one program per rank (framework-free; imports neither torch nor jax).

- :mod:`.shapes`: local shapes and offsets of sharded values (even shards only)
- :mod:`.reshard`: the collectives between two shardings on an N-D mesh, with bytes per rank
- :mod:`.rewrite`: shape-carrying arguments of ops, rewritten for local shards
- :mod:`.program`: :func:`lower` a graph and a plan to a :class:`RankProgram`
- :mod:`.coalesce`: reshards run in buckets, one collective for several values
"""

from .errors import LoweringError
from .plans import replicate_plan
from .coalesce import COALESCIBLE_KINDS, DEFAULT_BUCKET_CAP_BYTES, coalesce, coalescible_step, split_stages
from .program import (
    BucketMember, CoalescedReshard, LocalOp, ProgramInput, ProgramOutput, RandomDraw, RankProgram, Reshard, lower,
    lower_for_rank,
)
from .reshard import COLLECTIVE_KINDS, ReshardStep, comm_bytes, plan_resharding
from .shapes import contiguous_strides, local_shape, mesh_coordinates, shard_offset

__all__ = [name for name in dir() if not name.startswith("_")]
