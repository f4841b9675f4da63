"""``metadist.compile(mesh=...)`` with a ``pp`` axis: the user's step run as a pipeline.

The step is captured on one microbatch (``microbatches=`` of :class:`metadist.api.CompileOptions`,
default the pp degree or the most below it dividing the batch), rank 0 plans the pipeline and
every rank runs its stage (:class:`~metadist.runtime.pipeline.PipelineStep`). The user's model and
optimizer stay the source of truth, as ``metadist.compile`` promises: every call places the state
from them and writes the updated state back, **whole, on every rank** (gathered from every stage).
That keeps ``model(x)``, ``optimizer.state_dict()``, in-place edits between steps and checkpoints
exact, at the price of every rank holding the whole state (no memory saving yet; ``metadist run
--mesh pp=...`` keeps each stage's shards only).
"""

from __future__ import annotations

from typing import Any, Callable

from ..ir import Mesh
from .errors import RunInputError

__all__ = ["CompiledPipeline", "compile_pipeline"]


class CompiledPipeline:
    """One compiled variant of a pipelined step (the interface :class:`metadist.api.CompiledTrainStep` uses)."""

    def __init__(self, step: Any, torch_step: Any) -> None:
        self.step, self.torch_step, self.plan = step, torch_step, step.plan
        self._bound: tuple[Any, Any, Any] | None = None

    def prepare(self, model: Any, optimizer: Any, batch: Any = None) -> None:
        self._bound = (model, optimizer, batch if batch is not None else (self._bound or (None, None, None))[2])

    def __call__(self, model: Any, optimizer: Any, batch: Any) -> Any:
        self._bound = (model, optimizer, batch)
        self.step.local_state = None  # the model and optimizer hold the state: placed from them at every call
        loss = self.step(model, optimizer, batch)
        self.step.write_back(model, optimizer, batch)
        return loss

    def state_dict(self) -> dict:
        model, optimizer, batch = self._require_bound()
        return self.step.state_dict(model, optimizer, batch)

    def grads(self) -> dict:
        return self.step.grads()

    def sharded_state_dict(self) -> dict:
        raise RunInputError("a pipelined step keeps the whole state in the model (no shards to give): use state_dict()")

    def save_checkpoint(self, path: Any) -> None:
        from .checkpoint import save_state_atomically, training_state_dict

        model, optimizer, _ = self._require_bound()
        save_state_atomically(training_state_dict(model, optimizer), path)

    def load_checkpoint(self, path: Any) -> None:
        import os

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        from .checkpoint import _staged, require_complete, training_state_dict

        model, optimizer, _ = self._require_bound()
        require_complete(path)
        staged = {key: _staged(value) for key, value in training_state_dict(model, optimizer).items()}
        dcp.load(staged, checkpoint_id=os.fspath(path))
        set_model_state_dict(model, staged["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, staged["optim"])

    def _require_bound(self) -> tuple[Any, Any, Any]:
        if self._bound is None or self._bound[2] is None:
            raise RunInputError("the pipelined step has not run yet: call it once (it compiles on the first call)")
        return self._bound


def compile_pipeline(step_fn: Callable, model: Any, optimizer: Any, batch: Any, mesh: Mesh, device_mesh: Any,
                     options: Any, name: str) -> CompiledPipeline:
    """Capture ``step_fn`` on one microbatch, plan the pipeline (rank 0) and lower this rank's stage."""
    from ..frontends.torch.repeat import capture_repeated, capture_repeated_step
    from ..frontends.torch.microbatch import batch_size_of, first_microbatch
    from ..ir.pipeline import PP_AXIS
    from .pipeline import PipelineStep
    from .pipeline_worker import default_microbatches, pipeline_plan
    from .setup import check_same_everywhere
    from .start_state import broadcast_start_state, check_same_structure
    from .step import _device_of

    unsupported = [flag for flag, on in (
        ("precision", options.precision is not None), ("expert_capacity_factor", options.expert_capacity_factor is not None),
        ("compile_backend", options.compile_backend is not None), ("batch='local'", options.batch == "local"),
        (f"plan={options.plan!r}", options.plan != "solver"),
    ) if on]
    if unsupported:
        raise RunInputError(f"a pipelined step (a mesh with a pp axis) does not support {', '.join(unsupported)} yet; "
                            "leave them out, or use a mesh without a pp axis")
    if optimizer is None:
        raise RunInputError("an evaluation step (model, batch) cannot run as a pipeline: compile it on a mesh without a "
                            "pp axis")
    pp = mesh.shape[mesh.axis_index(PP_AXIS)]
    microbatches = options.microbatches or default_microbatches(pp, batch_size_of(batch))
    check_same_structure(model, optimizer)
    broadcast_start_state(model, optimizer, _device_of(device_mesh))  # one starting state: rank 0's
    torch_step = capture_repeated_step(step_fn, model, optimizer, first_microbatch(batch, microbatches), name=name, raw_grads=True)
    whole = None
    if any(node.op.is_random for node in torch_step.graph.nodes):
        whole = capture_repeated(step_fn, model, optimizer, batch, name=name)
    memory = None if options.memory_gb is None else options.memory_gb * 1e9
    plan = pipeline_plan(torch_step, mesh, microbatches, cluster=options.cluster, schedule=options.schedule,
                         memory_budget_bytes=memory)
    check_same_everywhere(plan.decisions_hash(), "pipeline plan")
    from ..config import settings_from_env
    from .build import bytes_from_mib

    step = PipelineStep(torch_step, plan, device_mesh, whole_graph=whole, overlap=options.overlap,
                        bucket_cap_bytes=bytes_from_mib(options.bucket_cap_mb), schedule=options.schedule,
                        keep_host_memory=settings_from_env().keeps_host_memory)
    return CompiledPipeline(step, torch_step)
