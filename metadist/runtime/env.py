"""The torchrun environment, read in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from .errors import RuntimeSetupError

__all__ = ["TorchrunEnv", "read_torchrun_env"]

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, kw_only=True)
class TorchrunEnv:
    """What torchrun tells each process about its place in the job."""

    rank: int
    """Global rank of this process."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank on this host (selects the GPU)."""
    master_addr: str
    """Host of the rendezvous store."""
    master_port: int
    """Port of the rendezvous store."""
    restart_count: int = 0
    """Torchelastic's attempt number (``TORCHELASTIC_RESTART_COUNT``): 0, then one more per restart of the group."""
    agent_store: bool = False
    """Whether the store at ``master_addr:master_port`` is the launcher's (``TORCHELASTIC_USE_AGENT_STORE``),
    shared by every attempt of the group."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise RuntimeSetupError(f"RANK={self.rank} is outside WORLD_SIZE={self.world_size}")


def read_torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv:
    """Read the variables torchrun sets; a clear error names the missing ones."""
    environ = os.environ if environ is None else environ
    missing = [name for name in _REQUIRED if name not in environ]
    if missing:
        raise RuntimeSetupError(
            f"the torchrun environment is missing ({', '.join(missing)} not set): this process was not started "
            "by torchrun. Launch it with `metadist run MODEL --nproc N`, or "
            "`python -m torch.distributed.run --standalone --nproc-per-node N -m metadist.runtime.worker ...`"
        )
    try:
        return TorchrunEnv(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ["LOCAL_RANK"]),
            master_addr=environ["MASTER_ADDR"],
            master_port=int(environ["MASTER_PORT"]),
            restart_count=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )
    except ValueError as err:
        raise RuntimeSetupError(f"the torchrun environment has a malformed number: {err}") from err
