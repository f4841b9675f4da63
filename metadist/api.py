"""The public API: ``metadist.compile`` and ``metadist.plan``.

A thin facade over the stages; it adds no logic of its own beyond the recipe::

    @metadist.compile(mesh=(2, 2))
    def train_step(model, optimizer, batch):
        loss = model(**batch).loss
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        return loss

launched with ``torchrun``: the first call captures the step, discovers the
rules (rank 0), plans (rank 0; every rank receives the plan and all ranks
verify they hold the same one) and lowers; later calls run the compiled step.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

from .ir import Mesh
from .ir.plan import Plan

__all__ = ["CompileOptions", "CompiledTrainStep", "capture_and_discover", "compile", "plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """How ``metadist.compile`` plans and runs a step."""

    mesh: Any = None
    """A shape tuple such as ``(2, 2)``, a :class:`metadist.Mesh`, a ``DeviceMesh``, or None for all ranks in 1-D."""
    memory_gb: float | None = None
    """Per-device memory budget for the solver, in GB (1e9 bytes, as the CLI's --memory-gb); None for no budget."""
    cluster: str | None = None
    """Cost-model cluster preset or JSON file; None picks ``cpu-gloo`` on CPU and the solver's default on GPUs."""
    plan: str = "solver"
    """``solver``, a baseline (``dp``, ``zero2``, ``zero3``, ``megatron``), ``replicate``, or a plan JSON file."""
    timeout_s: float = 300.0
    """Bound on the rendezvous and every collective, so a failed rank never hangs the others."""
    compile_backend: str | None = None
    """Run each rank's program through ``torch.compile`` with this backend (e.g. ``inductor`` on GPUs)."""
    overlap: bool = True
    """Issue each collective as early as its inputs allow and wait for it right before its first reader, so that
    communication overlaps computation (gradients reduce during the backward pass); False waits at once."""
    bucket_cap_mb: float | None = None
    """Cap of one coalesced collective in MiB (gradients bucket like DDP's); None: 25 MiB, 0: no coalescing.
    The solver prices the same buckets."""
    init_seed: int = 0
    """A model on the meta device: the seed of its initialisation (each rank materialises only its shards)."""
    init_fn: Callable | None = None
    """A model on the meta device: ``init_fn(module)`` initialises a module's own tensors, instead of its
    ``reset_parameters()`` or HuggingFace's ``_init_weights`` (see ``metadist.materialize``)."""


class CompiledTrainStep:
    """A user's ``train_step(model, optimizer, batch)``, compiled on first call and run distributed after.

    State (parameters, buffers, optimizer states) stays sharded between calls;
    :meth:`state_dict` gathers full tensors on request, :meth:`sync_to_model`
    writes them back into the user's model and optimizer, :meth:`sharded_state_dict`
    gives the shards as DTensors, and :meth:`save`/:meth:`load` checkpoint them
    with torch.distributed.checkpoint (a checkpoint loads under another plan).

    A model built on the meta device is initialised shard by shard: each rank
    materialises only its shards, with the values ``metadist.materialize``
    gives the whole model on one device.
    """

    def __init__(self, fn: Callable, options: CompileOptions) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = options
        self.compiled = None
        self.torch_step = None
        self._bound: tuple[int, int, tuple] | None = None

    def __call__(self, model: Any, optimizer: Any, batch: Any) -> Any:
        key = (id(model), id(optimizer), _batch_signature(batch))
        if self.compiled is not None and key != self._bound:
            if key[:2] != self._bound[:2]:
                from .runtime.errors import RunInputError

                raise RunInputError(
                    "this compiled step was compiled for another model or optimizer object; "
                    "compile one step per model (apply metadist.compile to a new function)"
                )
            log.warning("batch shapes changed from %s to %s: compiling the step again", self._bound[2], key[2])
            self.sync_to_model(model, optimizer)
            self.compiled = None
        self.prepare(model, optimizer, batch)
        return self.compiled(model, optimizer, batch)

    def prepare(self, model: Any, optimizer: Any, batch: Any) -> None:
        """Compile for this model, optimizer and batch shapes and shard the state, without running a step
        (e.g. before :meth:`load`)."""
        if self.compiled is None:
            self._compile(model, optimizer, batch)
            self._bound = (id(model), id(optimizer), _batch_signature(batch))
        self.compiled.prepare(model, optimizer, batch)

    @property
    def plan(self) -> Plan:
        self._require_compiled()
        return self.compiled.plan

    def state_dict(self) -> dict:
        """Full (unsharded) parameters, buffers and optimizer states, by graph input name."""
        self._require_compiled()
        return self.compiled.state_dict()

    def sync_to_model(self, model: Any, optimizer: Any) -> None:
        """Write the full updated state back into the user's model and optimizer."""
        self._require_compiled()
        self.compiled.write_back(model, optimizer)

    def sharded_state_dict(self) -> dict:
        """Parameters, buffers and optimizer states as DTensors over this rank's shards, by graph input name."""
        self._require_compiled()
        return self.compiled.sharded_state_dict()

    def save(self, path: Any) -> None:
        """Save the sharded state as a torch.distributed.checkpoint directory (collective)."""
        self._require_compiled()
        self.compiled.save_checkpoint(path)

    def load(self, path: Any) -> None:
        """Load the state from a torch.distributed.checkpoint directory (collective); call after :meth:`prepare`
        or a step. The checkpoint may come from another plan or mesh."""
        self._require_compiled()
        self.compiled.load_checkpoint(path)

    def _compile(self, model: Any, optimizer: Any, batch: Any) -> None:
        from .frontends.torch import capture_step
        from .runtime import read_torchrun_env, setup_device_mesh
        from .runtime.build import StepOptions, bytes_from_mib, compile_captured, read_plan_source

        mesh, device_mesh = self._mesh()
        if device_mesh is None:
            device_mesh = setup_device_mesh(mesh, read_torchrun_env(), timeout_s=self.options.timeout_s)
        self.torch_step = capture_step(self.fn, model, optimizer, batch, name=getattr(self.fn, "__name__", "step"))
        memory = None if self.options.memory_gb is None else int(self.options.memory_gb * 1e9)
        options = StepOptions(plan=read_plan_source(self.options.plan), memory_budget_bytes=memory, cluster=self.options.cluster,
                              compile_backend=self.options.compile_backend, init_seed=self.options.init_seed,
                              init_fn=self.options.init_fn, bucket_cap_bytes=bytes_from_mib(self.options.bucket_cap_mb),
                              overlap=self.options.overlap)
        self.compiled, _ = compile_captured(self.torch_step, mesh, device_mesh, options)

    def _mesh(self) -> tuple[Mesh, Any]:
        """The logical mesh, and the DeviceMesh if the user gave one."""
        mesh = self.options.mesh
        if mesh is not None and type(mesh).__name__ == "DeviceMesh":
            names = tuple(mesh.mesh_dim_names or ())
            return Mesh(tuple(mesh.shape), names), mesh
        if isinstance(mesh, Mesh):
            return mesh, None
        if mesh is None:
            from .runtime import read_torchrun_env

            return Mesh((read_torchrun_env().world_size,)), None
        if isinstance(mesh, str):
            return Mesh.parse(mesh), None
        return Mesh(tuple(mesh)), None

    def _require_compiled(self) -> None:
        if self.compiled is None:
            from .runtime.errors import RunInputError

            raise RunInputError("the step has not run yet: call it once (it compiles on the first call)")


def compile(fn: Callable | None = None, **options: Any) -> Any:  # noqa: A001 - the public name is the point
    """Compile a plain ``train_step(model, optimizer, batch)`` for distributed training.

    Use as ``@metadist.compile`` or ``@metadist.compile(mesh=(2, 2), memory_gb=16)``;
    the options are :class:`CompileOptions`' fields.
    """
    settings = CompileOptions(**options)
    if fn is None:
        return lambda inner: CompiledTrainStep(inner, settings)
    return CompiledTrainStep(fn, settings)


def capture_and_discover(workload: Any, rules_db: str | None = None) -> tuple[Any, Any]:
    """A workload's graph and its rules (the rule database at ``rules_db``, default the user cache, caches discovery).

    ``workload``: a :class:`metadist.Workload`, a JAX workload, a built-in name or a model file.
    PyTorch workloads are captured by the torch frontend; JAX workloads (``jax-*`` built-ins, or a
    model file returning a ``JaxWorkload``) from their jaxpr, with rules discovered by executing
    the JAX primitives, into the same database.
    """
    from .frontends.jax.workload import JaxWorkload
    from .shardcombine.api import rules_from_database
    from .workloads import load_workload

    name = workload if isinstance(workload, str) else None
    if isinstance(workload, str):
        workload = load_workload(workload)
    if isinstance(workload, JaxWorkload):
        from .frontends.jax import capture_jax
        from .frontends.jax.discovery import JaxOpExecutor

        step = capture_jax(workload)
        graph, executor = step.graph, JaxOpExecutor(raw_params=step.raw_params)
    else:
        from .frontends.torch import capture_step
        from .frontends.torch.discovery import TorchExecutor

        optimizer = workload.optimizer(workload.model.parameters())
        graph = capture_step(workload.train_step(), workload.model, optimizer, workload.batch,
                             name=workload.name or name or "step").graph
        executor = TorchExecutor()
    return graph, rules_from_database(graph, executor, rules_db)


def plan(
    workload: Any,
    mesh: Mesh | str | tuple,
    *,
    cluster: str | None = None,
    memory_gb: float | None = None,
    solver: str = "ilp",
    rules_db: str | None = None,
) -> Plan:
    """Plan a workload (a :class:`metadist.Workload`, a built-in name or a model file) for ``mesh``; no processes needed."""
    from .cost.cluster import resolve_cluster
    from .solver import plan_graph

    mesh = Mesh.parse(mesh) if isinstance(mesh, str) else (mesh if isinstance(mesh, Mesh) else Mesh(tuple(mesh)))
    graph, rules = capture_and_discover(workload, rules_db)
    memory = None if memory_gb is None else int(memory_gb * 1e9)
    return plan_graph(graph, rules, resolve_cluster(cluster, mesh), memory_budget_bytes=memory, solver=solver)


def _batch_signature(batch: Any) -> tuple:
    import torch.utils._pytree as pytree

    leaves, spec = pytree.tree_flatten(batch)
    return (str(spec), tuple(tuple(getattr(leaf, "shape", ())) for leaf in leaves))
