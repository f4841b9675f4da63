"""The cost model: compute (roofline), communication (alpha-beta collectives), memory (liveness).

Framework-free: imports neither torch nor jax (the calibration worker, run by torchrun, and the
op counter it shares with the bench, ``op_counts``, are the exceptions and are never imported from here).
"""

from .cluster import (
    DEFAULT_PRESET,
    PRESETS,
    Cluster,
    ClusterError,
    Device,
    Link,
    Machine,
    cluster_for,
    load_cluster,
    resolve_cluster,
)
from .bucketing import DEFAULT_BUCKET_CAP_BYTES, NO_BUCKETING, OUTPUT_CONSUMER, Bucketing, bucketing_for
from .comm import Collective, Resharding, collective_seconds, halo_exchange_bytes, halo_exchange_seconds, reshard
from .compute import Work, compute_seconds, node_work, split_degree
from .memory import Liveness, ValueLife, liveness
from .sharding import is_divisible, largest_local_shape, local_nbytes, padded_nbytes, shard_divisor

__all__ = [name for name in dir() if not name.startswith("_")]
