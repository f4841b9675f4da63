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
    """A shape tuple such as ``(2, 2)``, a :class:`metadist.Mesh`, a ``DeviceMesh``, or None for all ranks in 1-D
    (or, for a model that already holds sharded state, the mesh that state lies on)."""
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
    expert_capacity_factor: float | None = None
    """Mixture-of-experts layers (``transformers`` experts modules): each expert gets ``ceil(f * k * S / E)``
    slots per group of ``S`` tokens and a token past them loses that expert's share; None (the default) is
    dropless, the model's own result. The captured graph states it (``Graph.routing``)."""
    init_fn: Callable | None = None
    """A model on the meta device: ``init_fn(module)`` initialises a module's own tensors, instead of its
    ``reset_parameters()`` or HuggingFace's ``_init_weights`` (see ``metadist.materialize``)."""
    batch: str = "global"
    """``global``: every rank passes the whole batch, the same on every rank (checked); ``local``: each rank passes
    its own slice along dim 0, the global batch being the slices in rank order (as with a DistributedSampler)."""
    verify_batch: str = "first"
    """When a global batch is checked to be the same on every rank (a checksum per leaf, compared across ranks):
    ``first`` (the first call of each compiled shape), ``always`` (every call; for debugging) or ``never``."""
    max_cached: int = 8
    """Compiled variants kept (one per batch shape, training/eval mode and optimizer structure)."""
    precision: Any = None
    """Mixed precision policy: ``"bf16"`` or ``"fp16"`` (float32 master weights and optimizer state, computation in
    16 bits, gradients reduced in float32: FSDP2's MixedPrecisionPolicy), a ``metadist.PrecisionPolicy``, or None
    (as the step is written; a step under ``torch.autocast`` is captured as such). A float16 step should scale its
    loss with a ``torch.amp.GradScaler``, which is captured."""
    microbatches: int | None = None
    """A mesh with a ``pp`` axis (a pipeline): microbatches per step; None: the pp degree, or the most below it that
    divide the batch."""
    schedule: str | None = None
    """A mesh with a ``pp`` axis: ``1f1b`` (None: the default) or ``gpipe``."""

    def __post_init__(self) -> None:
        if self.batch not in ("global", "local"):
            raise ValueError(f"batch={self.batch!r}: choose 'global' (every rank passes the whole batch) or 'local'")
        if self.verify_batch not in ("first", "always", "never"):
            raise ValueError(f"verify_batch={self.verify_batch!r}: choose 'first', 'always' or 'never'")
        if self.max_cached < 1:
            raise ValueError(f"max_cached must be at least 1, got {self.max_cached}")
        if self.microbatches is not None and self.microbatches < 1:
            raise ValueError(f"microbatches={self.microbatches!r}: give 1 or more")
        if self.schedule not in (None, "1f1b", "gpipe"):
            raise ValueError(f"schedule={self.schedule!r}: choose '1f1b' or 'gpipe'")
        if self.expert_capacity_factor is not None and not self.expert_capacity_factor > 0:
            raise ValueError(f"expert_capacity_factor={self.expert_capacity_factor!r}: give a positive factor, "
                             "or None for dropless experts")
        from .ir import PrecisionPolicy

        if self.precision is not None and not isinstance(self.precision, PrecisionPolicy):
            object.__setattr__(self, "precision", PrecisionPolicy.named(str(self.precision)))


class CompiledTrainStep:
    """A user's step, compiled on first call and run distributed after.

    ``train_step(model, optimizer, batch)`` trains; ``eval_step(model, batch)`` (no optimizer, e.g. a forward
    under ``torch.no_grad()``) evaluates. Either way the state lives in the user's model and optimizer, as
    DTensors over each rank's shards (the FSDP2 convention): ``model.state_dict()``, ``optimizer.state_dict()``
    and ``model(x)`` are current after every step. Hyperparameters are read from ``optimizer.param_groups`` at
    every call, so LR schedulers work as they do eagerly.

    A call whose batch shapes, training/eval mode (``model.train()``/``model.eval()``) or optimizer structure
    (groups, flags) differ from every compiled variant compiles one more (cached, up to ``max_cached``). A model
    that already holds sharded state keeps it where it lies: the new plan takes those placements as given.
    :meth:`save`/:meth:`load` checkpoint the state with torch.distributed.checkpoint (loadable under another plan).
    """

    def __init__(self, fn: Callable, options: CompileOptions) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.options = options
        self.takes_optimizer = _takes_optimizer(fn)
        self._variants: dict[tuple, Any] = {}
        self._device_mesh = None
        self.compiled = None
        """The compiled step (a ``CompiledStep``) of the last call."""

    @property
    def torch_step(self) -> Any:
        return None if self.compiled is None else self.compiled.torch_step

    def __call__(self, model: Any, *args: Any) -> Any:
        optimizer, batch = self._arguments(args)
        self.prepare(model, optimizer, batch)
        return self.compiled(model, optimizer, batch)

    def _arguments(self, args: tuple) -> tuple[Any, Any]:
        expected = 2 if self.takes_optimizer else 1
        if len(args) != expected:
            from .runtime.errors import RunInputError

            form = "(model, optimizer, batch)" if self.takes_optimizer else "(model, batch)"
            raise RunInputError(f"{getattr(self.fn, '__name__', 'the step')} was written as {form}; call it so")
        return (args[0], args[1]) if self.takes_optimizer else (None, args[0])

    def prepare(self, model: Any, optimizer: Any, batch: Any) -> None:
        """Compile for this model, optimizer, batch shapes and mode, and place the state, without running a step
        (e.g. before :meth:`load`)."""
        key = self._key(model, optimizer, batch)
        compiled = self._variants.get(key)
        if compiled is None:
            if self._variants:
                log.warning("compiling %s again: %s", getattr(self.fn, "__name__", "the step"), self._why_new(key))
            compiled = self._compile(model, optimizer, batch)
            if len(self._variants) >= self.options.max_cached:
                self._variants.pop(next(iter(self._variants)))
            self._variants[key] = compiled
        else:  # most recently used last
            self._variants[key] = self._variants.pop(key)
        compiled.prepare(model, optimizer, batch)
        self.compiled = compiled

    def _key(self, model: Any, optimizer: Any, batch: Any) -> tuple:
        from .frontends.torch.optim import optimizer_structure

        return (id(model), id(optimizer), _batch_signature(batch), _modes_and_trainable(model),
                optimizer_structure(optimizer))

    def _why_new(self, key: tuple) -> str:
        last = next(reversed(self._variants))
        parts = ["model or optimizer object", "batch shapes", "train/eval mode or trainable parameters", "optimizer structure"]
        changed = [part for part, new, old in zip(parts, (key[:2],) + key[2:], (last[:2],) + last[2:]) if new != old]
        return f"{', '.join(changed) or 'inputs'} changed since the last compiled variant"

    def batch_layout(self) -> dict[str, str]:
        """How the current variant's plan splits each batch leaf (by path), and, with ``batch='local'``, whether a
        rank's slice is its piece as it is or the slices are all-gathered each step."""
        from .runtime.step import batch_layout

        self._require_compiled()
        return batch_layout(self.compiled)

    @property
    def plan(self) -> Plan:
        self._require_compiled()
        return self.compiled.plan

    def state_dict(self) -> dict:
        """Full (unsharded) parameters, buffers and optimizer states, by graph input name (collective)."""
        self._require_compiled()
        return self.compiled.state_dict()

    def sync_to_model(self, model: Any = None, optimizer: Any = None) -> None:
        """Deprecated, and a no-op: the model and the optimizer hold the current state after every step."""
        import warnings

        warnings.warn("sync_to_model is no longer needed: the model and optimizer hold the current (sharded) state "
                      "after every step", DeprecationWarning, stacklevel=2)

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

    def _compile(self, model: Any, optimizer: Any, batch: Any) -> Any:
        from .frontends.torch.repeat import capture_repeated_step
        from .runtime.build import StepOptions, bytes_from_mib, compile_captured, read_plan_source

        from .runtime.start_state import check_same_structure

        mesh, device_mesh = self._mesh(model)
        if "pp" in mesh.axis_names:
            from .runtime.pipeline_compile import compile_pipeline

            step = self.fn if self.takes_optimizer else _without_optimizer(self.fn)
            return compile_pipeline(step, model, optimizer if self.takes_optimizer else None, batch, mesh, device_mesh,
                                    self.options, getattr(self.fn, "__name__", "step"))
        if self.options.microbatches is not None or self.options.schedule is not None:
            from .runtime.errors import RunInputError

            raise RunInputError("microbatches= and schedule= go with a mesh with a pp axis (e.g. mesh='pp=2,dp=2')")
        check_same_structure(model, optimizer)  # before planning: rank 0's plan must fit every rank's graph
        capture_batch = _global_batch_for_capture(batch) if self.options.batch == "local" else batch
        step = self.fn if self.takes_optimizer else _without_optimizer(self.fn)
        torch_step = capture_repeated_step(step, model, optimizer, capture_batch, name=getattr(self.fn, "__name__", "step"),
                                           expert_capacity_factor=self.options.expert_capacity_factor,
                                           precision=self.options.precision)
        memory = None if self.options.memory_gb is None else int(self.options.memory_gb * 1e9)
        options = StepOptions(plan=read_plan_source(self.options.plan), memory_budget_bytes=memory, cluster=self.options.cluster,
                              compile_backend=self.options.compile_backend, init_seed=self.options.init_seed,
                              init_fn=self.options.init_fn, bucket_cap_bytes=bytes_from_mib(self.options.bucket_cap_mb),
                              overlap=self.options.overlap, batch_mode=self.options.batch,
                              verify_batch=self.options.verify_batch,
                              pinned=_placed_shardings(torch_step, model, optimizer, device_mesh))
        compiled, _ = compile_captured(torch_step, mesh, device_mesh, options)
        return compiled

    def _mesh(self, model: Any) -> tuple[Mesh, Any]:
        """The logical mesh and its DeviceMesh: the user's, the one the model's state lies on, or a new one."""
        from .runtime import read_torchrun_env, setup_device_mesh

        mesh = self.options.mesh
        if mesh is not None and type(mesh).__name__ == "DeviceMesh":
            return Mesh(tuple(mesh.shape), tuple(mesh.mesh_dim_names or ())), mesh
        if self._device_mesh is None:
            self._device_mesh = _mesh_of_model(model)
        if mesh is None:
            logical = (Mesh(tuple(self._device_mesh.shape), tuple(self._device_mesh.mesh_dim_names or ()))
                       if self._device_mesh is not None else Mesh((read_torchrun_env().world_size,)))
        elif isinstance(mesh, Mesh):
            logical = mesh
        else:
            logical = Mesh.parse(mesh) if isinstance(mesh, str) else Mesh(tuple(mesh))
        if "pp" in logical.axis_names:  # a pipeline: with only pp, its stages get a 1-device sub-mesh axis
            from .runtime.pipeline_worker import pipeline_device_mesh

            shape = pipeline_device_mesh(logical)
            if self._device_mesh is None or tuple(self._device_mesh.shape) != shape.shape:
                self._device_mesh = setup_device_mesh(shape, read_torchrun_env(), timeout_s=self.options.timeout_s)
            return logical, self._device_mesh
        if self._device_mesh is None or tuple(self._device_mesh.shape) != logical.shape:
            self._device_mesh = setup_device_mesh(logical, read_torchrun_env(), timeout_s=self.options.timeout_s)
        return logical, self._device_mesh

    def _require_compiled(self) -> None:
        if self.compiled is None:
            from .runtime.errors import RunInputError

            raise RunInputError("the step has not run yet: call it once (it compiles on the first call)")


def _takes_optimizer(fn: Callable) -> bool:
    """``fn(model, optimizer, batch)`` trains; ``fn(model, batch)`` evaluates."""
    import inspect

    try:
        parameters = [p for p in inspect.signature(fn).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):  # no signature to read (a builtin): the training form
        return True
    if len(parameters) not in (2, 3):
        raise TypeError(f"metadist.compile takes train_step(model, optimizer, batch) or eval_step(model, batch); "
                        f"{getattr(fn, '__name__', fn)!r} has {len(parameters)} required positional parameters")
    return len(parameters) == 3


def _without_optimizer(fn: Callable) -> Callable:
    def step(model, optimizer, batch):
        return fn(model, batch)

    step.__name__ = getattr(fn, "__name__", "eval_step")
    return step


def _mesh_of_model(model: Any) -> Any:
    """The DeviceMesh the model's sharded state lies on, or None."""
    for param in model.parameters():
        if hasattr(param, "device_mesh"):
            return param.device_mesh
    return None


def _placed_shardings(torch_step: Any, model: Any, optimizer: Any, device_mesh: Any) -> dict:
    """Graph input name -> the sharding the model's or optimizer's state already has on ``device_mesh``
    (kept by the new plan)."""
    from .runtime.checkpoint import metadist_sharding
    from .runtime.model_state import holders_of, is_sharded_here

    holders = holders_of(model)
    placed = {}
    for slot in torch_step.slots:
        if slot.kind in ("param", "buffer"):
            tensor = holders[(slot.kind, slot.key)][0].get()
        elif slot.kind == "state" and optimizer is not None:
            tensor = optimizer.state.get(holders[("param", slot.key)][0].get(), {}).get(slot.state_key)
        else:
            continue
        if is_sharded_here(tensor, device_mesh):
            placed[slot.name] = metadist_sharding(tensor.placements)
    return placed


def _global_batch_for_capture(batch: Any) -> Any:
    """With ``batch='local'``: meta tensors of the global shapes (every rank's slice along dim 0), for capture."""
    import torch
    import torch.utils._pytree as pytree

    from .runtime.start_state import local_batch_shapes

    with_paths, tree = pytree.tree_flatten_with_path(batch)
    leaves = [leaf for _, leaf in with_paths]
    shapes = local_batch_shapes(leaves, [pytree.keystr(path) for path, _ in with_paths])
    fakes = [torch.empty(shape, dtype=leaf.dtype, device="meta") for shape, leaf in zip(shapes, leaves)]
    return pytree.tree_unflatten(fakes, tree)


def compile(fn: Callable | None = None, **options: Any) -> Any:  # noqa: A001 - the public name is the point
    """Compile a plain ``train_step(model, optimizer, batch)`` for distributed training.

    Use as ``@metadist.compile`` or ``@metadist.compile(mesh=(2, 2), memory_gb=16)``;
    the options are :class:`CompileOptions`' fields.
    """
    settings = CompileOptions(**options)
    if fn is None:
        return lambda inner: CompiledTrainStep(inner, settings)
    return CompiledTrainStep(fn, settings)


def capture_and_discover(workload: Any, rules_db: str | None = None, precision: Any = None, *,
                         expert_capacity_factor: float | None = None) -> tuple[Any, Any]:
    """A workload's graph and its rules (the rule database at ``rules_db``, default the user cache, caches discovery).

    ``workload``: a :class:`metadist.Workload`, a JAX workload, a built-in name or a model file.
    PyTorch workloads are captured by the torch frontend; JAX workloads (``jax-*`` built-ins, or a
    model file returning a ``JaxWorkload``) from their jaxpr, with rules discovered by executing
    the JAX primitives, into the same database. ``expert_capacity_factor``: see :class:`CompileOptions`.
    ``precision``: a mixed precision policy for PyTorch workloads (``"bf16"``, ``"fp16"``, a
    :class:`metadist.PrecisionPolicy`), applied at capture.
    A PyTorch model repeating one block of layers is captured on a few of them and expanded
    (:func:`metadist.frontends.torch.repeat.capture_repeated`; the graph equals the whole capture's).
    """
    from .frontends.jax.workload import JaxWorkload
    from .shardcombine.api import rules_from_database
    from .workloads import load_workload

    name = workload if isinstance(workload, str) else None
    if isinstance(workload, str):
        workload = load_workload(workload)
    if isinstance(workload, JaxWorkload):
        if precision is not None:
            raise ValueError("precision= applies to PyTorch workloads; a JAX step states its dtypes itself")
        from .frontends.jax import capture_jax
        from .frontends.jax.discovery import JaxOpExecutor

        step = capture_jax(workload)
        graph, executor = step.graph, JaxOpExecutor(raw_params=step.raw_params)
    else:
        from .frontends.torch.discovery import TorchExecutor
        from .frontends.torch.repeat import capture_repeated

        optimizer = workload.optimizer(workload.model.parameters())
        graph = capture_repeated(workload.train_step(), workload.model, optimizer, workload.batch,
                                 name=workload.name or name or "step", expert_capacity_factor=expert_capacity_factor,
                                 precision=precision)
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
    expert_capacity_factor: float | None = None,
    precision: Any = None,
) -> Plan:
    """Plan a workload (a :class:`metadist.Workload`, a built-in name or a model file) for ``mesh``; no processes needed.

    ``expert_capacity_factor``: see :class:`CompileOptions` (a plan is for the graph captured with it).
    ``precision``: a mixed precision policy (``"bf16"``, ``"fp16"``, a :class:`metadist.PrecisionPolicy`): the step is
    captured under it and its gradients are reduced in the policy's reduce dtype.
    When no plan fits ``memory_gb`` the solver lets repeated layers recompute their forward (``Plan.recompute``);
    ``metadist.compile`` and ``metadist run`` run such a plan on their capture rewritten the same way."""
    from .ir import PrecisionPolicy
    from .cost.cluster import resolve_cluster
    from .solver import plan_graph

    mesh = Mesh.parse(mesh) if isinstance(mesh, str) else (mesh if isinstance(mesh, Mesh) else Mesh(tuple(mesh)))
    policy = precision if precision is None or isinstance(precision, PrecisionPolicy) else PrecisionPolicy.named(str(precision))
    graph, rules = capture_and_discover(workload, rules_db, policy, expert_capacity_factor=expert_capacity_factor)
    memory = None if memory_gb is None else int(memory_gb * 1e9)
    return plan_graph(graph, rules, resolve_cluster(cluster, mesh), memory_budget_bytes=memory, solver=solver,
                      reduce_dtype=None if policy is None else policy.reduce_dtype)


def _modes_and_trainable(model: Any) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """Every module's train/eval mode and every parameter's ``requires_grad``, module by module (each module once).

    Read at every call: one walk over ``_modules`` (``model.modules()`` also builds every module's dotted name)."""
    modes, trainable = [], []
    seen: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        modes.append(module.training)
        trainable.extend(param.requires_grad for param in module._parameters.values() if param is not None)
        stack.extend(child for child in reversed(module._modules.values()) if child is not None)
    return tuple(modes), tuple(trainable)


def _batch_signature(batch: Any) -> tuple:
    import torch.utils._pytree as pytree

    leaves, spec = pytree.tree_flatten(batch)
    return (str(spec), tuple(tuple(getattr(leaf, "shape", ())) for leaf in leaves))
