"""Process group and DeviceMesh setup from the torchrun environment."""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..ir import Mesh
from .env import TorchrunEnv
from .errors import RuntimeSetupError

__all__ = ["setup_device_mesh", "check_mesh_size", "check_same_everywhere", "teardown", "exit_process"]

log = logging.getLogger(__name__)


def check_mesh_size(mesh: Mesh, world_size: int) -> None:
    """The mesh must hold exactly one device per process."""
    if mesh.size != world_size:
        raise RuntimeSetupError(
            f"the mesh {mesh} has {mesh.size} devices but the job has {world_size} processes (world size); "
            f"launch {mesh.size} processes (--nproc {mesh.size}) or pick a mesh of {world_size} devices"
        )


def setup_device_mesh(mesh: Mesh, env: TorchrunEnv, *, timeout_s: float = 120.0) -> DeviceMesh:
    """Initialise the default process group (NCCL with CUDA, else gloo) and the DeviceMesh.

    ``timeout_s`` bounds the rendezvous and every collective: if one rank fails,
    the others raise instead of hanging.
    """
    check_mesh_size(mesh, env.world_size)
    use_cuda = torch.cuda.is_available()
    backend, device_type = ("nccl", "cuda") if use_cuda else ("gloo", "cpu")
    if use_cuda:
        torch.cuda.set_device(env.local_rank)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if env.agent_store and env.restart_count:
            dist.init_process_group(backend, timeout=timeout, store=_attempt_store(env, timeout), rank=env.rank,
                                    world_size=env.world_size)
        else:
            dist.init_process_group(backend, timeout=timeout)
    log.info("rank %d/%d: %s process group up, mesh %s", env.rank, env.world_size, backend, mesh)
    return init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.axis_names)


def _attempt_store(env: TorchrunEnv, timeout: datetime.timedelta) -> dist.Store:
    """The launcher's store, with keys of this attempt only.

    Torchelastic's launcher keeps one store for every attempt of a group and hands it to the ranks without an
    attempt prefix; a restarted group could then read the previous attempt's process-group addresses (its
    keys are the same) and fail to connect. A prefix per attempt keeps the attempts apart.
    """
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"metadist/attempt_{env.restart_count}", store)


def check_same_everywhere(text: str, what: str) -> str:
    """All-gather a hash of ``text`` and fail unless every rank holds the same one. Returns the hash."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, digest)
    differing = {rank: value for rank, value in enumerate(gathered) if value != digest}
    if differing:
        raise RuntimeSetupError(
            f"the ranks hold different {what}s: this rank ({dist.get_rank()}) has {digest}, ranks "
            f"{sorted(differing)} have {sorted(set(differing.values()))}. Planning must be deterministic; "
            "pass the same --plan FILE to every rank"
        )
    return digest


def teardown() -> None:
    """Destroy the default process group if one is up."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """Flush, then leave the process without running C++ static destructors.

    With torch 2.13 on gloo, a process that ran all-gathers after ``init_device_mesh``
    aborts at exit in roughly one run in three ("terminate called without an active
    exception", exit status -6), after its work is done and its process group destroyed;
    a plain script with five all-gathers on a 1-D DeviceMesh reproduces it without
    MetaDist. Leaving through ``os._exit`` keeps the exit status the run earned.

    A failing status leaves through ``sys.exit`` as usual: the failure is already
    reported, and the slower teardown gives the other ranks time to report theirs
    before torchrun stops them.
    """
    if code != 0:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
