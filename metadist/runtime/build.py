"""The recipe ``metadist.compile`` and ``metadist run``'s worker share: plan a captured step, agree, compile.

Given a captured :class:`TorchStep`: make the plan (rank 0 solves and
broadcasts, or a baseline, or a plan file), prove every rank holds the same
plan, and build this rank's :class:`CompiledStep`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..frontends.torch import TorchStep
from ..ir import Mesh
from ..ir.plan import Plan
from ..progress import phase
from .plan_source import PLAN_SOURCES, load_plan, plan_decisions
from .setup import check_same_everywhere
from .step import CompiledStep

__all__ = ["StepOptions", "bytes_from_mib", "compile_captured", "read_plan_source"]


@dataclass(frozen=True, kw_only=True)
class StepOptions:
    """How a captured step is planned and run."""

    plan: str | Plan = "solver"
    """``solver``, ``replicate``, a baseline (``dp``, ``zero2``, ``zero3``, ``megatron``), a plan file or a :class:`Plan`."""
    memory_budget_bytes: int | None = None
    """Per-device memory budget for the solver; None for no budget."""
    cluster: str | None = None
    """Cost-model cluster preset or file (None: ``cpu-gloo`` on CPU)."""
    check_shapes: bool = False
    """Run the rank program op by op, checking local shapes (slower)."""
    compile_backend: str | None = None
    """Run the rank program through ``torch.compile`` with this backend."""
    init_seed: int = 0
    """Seed of a meta-device model's initialisation (see ``iter_materialized``)."""
    init_fn: Callable[[torch.nn.Module], None] | None = None
    """Per-module init of a meta-device model, instead of ``reset_parameters``/HuggingFace's ``_init_weights``."""
    bucket_cap_bytes: int | None = None
    """Cap of a coalesced collective, in the runtime and in the solver's cost model (None: default, 0: off)."""
    overlap: bool = True
    """Issue each collective as early as its sources allow and wait right before its first reader (False: at once)."""
    batch_mode: str = "global"
    """``global`` (every rank passes the whole batch) or ``local`` (each rank its slice along dim 0)."""
    verify_batch: str = "first"
    """When a global batch is checked to be the same on every rank: ``first``, ``always`` or ``never``."""
    pinned: Mapping[str, tuple] = field(default_factory=dict)
    """Graph input name -> the sharding its state already lies in; the solver keeps it (baselines and plan files
    do not: the state is then resharded to them when the step binds)."""


def bytes_from_mib(mib: float | None) -> int | None:
    """A size given in MiB (``--bucket-cap-mb``, ``bucket_cap_mb=``) in bytes; None stays None."""
    return None if mib is None else int(mib * (1 << 20))


def read_plan_source(source: str | Plan) -> str | Plan:
    """A plan file read once into a :class:`Plan`; the names of other plan sources as they are."""
    if isinstance(source, Plan) or source in PLAN_SOURCES:
        return source
    path = Path(source)
    return Plan.from_json(path.read_text()) if path.is_file() else source


def with_recompute(torch_step: TorchStep, layers: tuple[int, ...]) -> TorchStep:
    """``torch_step`` with ``layers`` recomputing their forward before their backward (a plan's ``recompute``).

    The clones of values the trace saw contiguous are contiguous too (they are the same computation).
    """
    if not layers:
        return torch_step
    from dataclasses import replace

    from ..solver.recompute import CLONE_SUFFIX, apply_recompute

    graph = apply_recompute(torch_step.graph, layers)
    clones = {value.name for node in graph.nodes if node.name.endswith(CLONE_SUFFIX) for value in node.output_values}
    contiguous = torch_step.contiguous_values | {name for name in clones if name[: -len(CLONE_SUFFIX)] in torch_step.contiguous_values}
    return replace(torch_step, graph=graph, contiguous_values=frozenset(contiguous))


def compile_captured(torch_step: TorchStep, mesh: Mesh, device_mesh: DeviceMesh, options: StepOptions) -> tuple[CompiledStep, str]:
    """This rank's compiled step for ``torch_step`` on ``device_mesh``, and the hash of the plan all ranks agreed on."""
    from .. import __version__
    from ..config import settings_from_env

    plan = load_plan(options.plan, torch_step, mesh, __version__, options.memory_budget_bytes, options.cluster,
                     bucket_cap_bytes=options.bucket_cap_bytes, pinned=options.pinned)
    plan_hash = check_same_everywhere(plan_decisions(plan), "plan")
    torch_step = with_recompute(torch_step, plan.recompute)
    with phase("lowering"):
        compiled = CompiledStep(
            torch_step, plan, device_mesh, metadist_version=__version__, check_shapes=options.check_shapes,
            compile_backend=options.compile_backend, init_seed=options.init_seed, init_fn=options.init_fn,
            bucket_cap_bytes=options.bucket_cap_bytes, overlap=options.overlap, batch_mode=options.batch_mode,
            verify_batch=options.verify_batch, keep_host_memory=settings_from_env().keeps_host_memory,
        )
    return compiled, plan_hash
