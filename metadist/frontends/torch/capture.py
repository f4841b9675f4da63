"""Capture a whole PyTorch training step (forward, backward, optimizer) as one MetaIR graph.

The recipe:

1. Every parameter, buffer, optimizer state and batch tensor becomes a fake
   tensor (no memory), and the module is re-parametrised with them
   (tied weights stay one parameter).
2. Pass 1 traces the user's step with ``make_fx``: autograd runs for real, so
   ``loss.backward()`` records the backward ops. ``optimizer.step()`` is
   replaced, for the trace only, by the functional update of :mod:`.optim`,
   written back into the traced tensors in place; ``zero_grad()`` runs as is.
   A boolean-mask assignment ``x[mask] = value`` is traced as a ``where``
   (:mod:`.masked_assignment`: its backward has no static shape otherwise).
3. Pass 2 re-traces that graph under functionalization: in-place ops become
   out-of-place ones, and every mutated input (updated parameters, optimizer
   states, batch-norm running statistics) ends in one ``copy_`` into it.
4. :mod:`.to_ir` turns the result into MetaIR: each ``copy_`` into an input
   becomes a state output that names the input it replaces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils import stateless

from ...gc_pause import gc_paused
from ...ir import Graph, PrecisionPolicy, Role
from ...ir.expand import canonical_names
from .aliasing import may_alias_argument
from .errors import CaptureError
from .masked_assignment import MaskedAssignmentAsWhere
from .moe import static_experts, uncovered_routing_hint
from .optim import (
    HYPERPARAMETER_DTYPE, OptimizerSpec, functional_update, hyperparameter_values, initial_state, optimizer_spec,
    optimizer_structure,
)
from .precision import PolicyTrace, policy_of
from .rng_restore import RngRestoreWatch, check_no_replayed_draws
from .scaler import SCALER_STATE_KEYS, ScalerDiscovered, ScalerTrace, scaler_settings, scaler_state, write_scaler_state
from .to_ir import InputSlot, fx_to_ir

__all__ = ["TorchStep", "capture", "capture_step"]

log = logging.getLogger(__name__)

aten = torch.ops.aten


@dataclass
class TorchStep:
    """A captured step and what the PyTorch frontend needs to run it again.

    ``graph`` is the framework-free MetaIR. The rest stays in the frontend:
    the functional fx graph, where each graph input comes from, the tensor
    constants the step created, and the structure of the step's return value.
    """

    graph: Graph
    graph_module: torch.fx.GraphModule | None
    """The functional fx graph the trace made; None for a step expanded from a capture of fewer layers
    (:func:`.repeat.capture_repeated_step`), which runs from ``graph`` like every step."""
    slots: tuple[InputSlot, ...]
    constants: dict[str, torch.Tensor]
    output_tree: Any
    """pytree spec of the step's return value (its tensor leaves are the LOSS/ACTIVATION outputs)."""
    capture_seconds: float
    optimizer_structure: tuple = ()
    """What of the optimizer shaped the graph (see :func:`.optim.optimizer_structure`); its numbers are inputs."""
    left_grads: tuple[str, ...] = ()
    """Parameters whose gradient the step leaves behind (not zeroed, or not in the optimizer): eagerly, the next
    step would accumulate into it."""
    contiguous_values: frozenset[str] = frozenset()
    """Values the trace saw as contiguous. Executors make the real tensors contiguous too: fake
    tensors do not always predict a kernel's output strides (``softplus_backward`` of a transposed
    gradient is one case), and the trace's layout decisions (a ``.contiguous()`` it skipped
    because the value looked contiguous) hold only if the real layouts follow the traced ones.
    ``native_group_norm_backward`` on CPU gives wrong results for a non-contiguous gradient."""
    stats: dict = field(default_factory=dict)
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    """The mixed precision policy the step was captured under."""
    scaler: Any = None
    """The ``torch.amp.GradScaler`` the step uses (its scale and growth tracker are inputs and state outputs)."""
    scaler_settings: tuple = ()
    """The scaler's growth factor, backoff factor and growth interval at capture (constants of the graph)."""
    watched_grad_elements: int = 0
    """How many float16 gradient elements the ``metric`` output counts among (float16 without loss scaling)."""
    last_metrics: dict = field(default_factory=dict)
    """The metric outputs of the last :meth:`run`, by source."""
    loss_divisor: str | None = None
    """The value a mean-reduced loss is divided by when MetaDist can see it: the count (total weight) of the
    targets a mean cross-entropy counts, which no gradient flows through. A pipeline weights each microbatch's
    gradients by it, so that microbatches with different counts (masked-LM labels) add up to the whole batch's mean."""

    def gather_inputs(self, model: torch.nn.Module, optimizer: Any, batch: Any) -> list[torch.Tensor]:
        """The real tensors for the graph's inputs, in graph order.

        Optimizer state that torch has not created yet is created here the way
        torch would (zeros, step 0); it is not stored in ``optimizer.state`` (the
        step's updated state is, by :meth:`run` or the runtime's write-back).
        """
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        batch_leaves = _flatten_batch(batch)[0]
        param_of_name = {name: param for name, param in params.items()}
        group_of = _group_of_param(optimizer) if optimizer is not None else {}
        spec = optimizer_spec(optimizer) if optimizer is not None else None
        hyper = hyperparameter_values(spec, optimizer) if optimizer is not None else []
        fresh_states: dict[str, dict[str, torch.Tensor]] = {}
        tensors: list[torch.Tensor] = []
        for slot in self.slots:
            if slot.kind == "param":
                tensor = params[slot.key].detach()
            elif slot.kind == "buffer":
                tensor = buffers[slot.key]
            elif slot.kind == "state":
                param = param_of_name[slot.key]
                existing = optimizer.state.get(param, {})
                if slot.state_key in existing:
                    tensor = existing[slot.state_key]
                else:  # fresh state, not stored: the step's outputs become the optimizer's state
                    fresh = fresh_states.get(slot.key)
                    if fresh is None:
                        fresh = fresh_states[slot.key] = initial_state(spec, param.detach(), group_of[id(param)], dict(existing))
                    tensor = fresh[slot.state_key]
            elif slot.kind == "batch":
                tensor = batch_leaves[slot.index]
            elif slot.kind == "hyper":
                tensor = hyperparameter_tensor(hyper, slot)
            elif slot.kind == "scaler":
                tensor = scaler_state(self.scaler, slot.state_key)
            else:
                tensor = self.constants[slot.key]
            if tensor.device.type == "meta":
                raise CaptureError(
                    f"input {slot.name!r} is on the meta device: this model can be captured and planned, "
                    "but running it needs real tensors (materialise it, or run it distributed)"
                )
            tensors.append(tensor)
        return tensors

    def run(self, model: torch.nn.Module, optimizer: Any, batch: Any, *, execute: Callable | None = None) -> Any:
        """Run one step on one device by executing the graph, and write the updated state back.

        ``execute(graph, inputs, constants)`` defaults to the MetaIR interpreter
        of this frontend. Returns what the user's step returns.
        """
        from .execute import execute_graph

        inputs = self.gather_inputs(model, optimizer, batch)
        if execute is None:
            results = execute_graph(self.graph, inputs, self.constants, contiguous_values=self.contiguous_values)
        else:
            results = execute(self.graph, inputs, self.constants)
        by_input = {slot.name: (slot, tensor) for slot, tensor in zip(self.slots, inputs)}
        user_leaves = []
        params = dict(model.named_parameters())
        with torch.no_grad():
            for graph_output, value in zip(self.graph.outputs, results):
                if graph_output.replaces is not None:
                    slot, tensor = by_input[graph_output.replaces]
                    if slot.kind == "state":
                        optimizer.state[params[slot.key]][slot.state_key] = value
                    elif slot.kind == "scaler":
                        write_scaler_state(self.scaler, slot.state_key, value)
                    else:
                        tensor.copy_(value)
                elif graph_output.role is Role.GRAD:
                    params[graph_output.source.removeprefix("grad:")].grad = value
                elif graph_output.role is Role.METRIC:
                    self.last_metrics[graph_output.source] = value
                else:
                    user_leaves.append(value)
        return pytree.tree_unflatten(user_leaves, self.output_tree)


def capture(train_step: Callable, model: torch.nn.Module, optimizer: Any, batch: Any, **options: Any) -> Graph:
    """Capture ``train_step(model, optimizer, batch)`` as one functional MetaIR graph.

    See :func:`capture_step` for the options; this returns just the graph.
    """
    return capture_step(train_step, model, optimizer, batch, **options).graph


@gc_paused()
def capture_step(
    train_step: Callable,
    model: torch.nn.Module,
    optimizer: Any,
    batch: Any,
    *,
    name: str = "step",
    keep_grads: bool = False,
    expert_capacity_factor: float | None = None,
    precision: PrecisionPolicy | str | None = None,
    raw_grads: bool = False,
) -> TorchStep:
    """Capture ``train_step(model, optimizer, batch)``.

    ``keep_grads=True`` adds each parameter's gradient (as the optimizer saw
    it) to the outputs with role ``grad``, for checking runs against each other.
    ``expert_capacity_factor`` bounds the slots of each ``transformers`` experts layer (see
    :mod:`.moe`; None: dropless, the library's result); ``graph.routing`` states what was captured.
    ``precision``: a mixed precision policy (``"bf16"``, ``"fp16"``, a :class:`PrecisionPolicy`; see
    :mod:`.precision`). A ``torch.amp.GradScaler`` the step uses is captured (:mod:`.scaler`).
    ``raw_grads=True`` adds instead each gradient as autograd accumulated it at the end of the
    backward pass (before clipping or the optimizer): a pipeline accumulates these over microbatches
    and runs the rest of the step (the update) once.
    Nothing of the user's model, optimizer, scaler or batch is changed.
    """
    policy = policy_of(precision)
    scaler = None
    try:
        return _capture(train_step, model, optimizer, batch, name, keep_grads, policy, scaler, expert_capacity_factor, raw_grads)
    except ScalerDiscovered as found:  # the step scales its loss: capture again with the scaler's state as inputs
        scaler = found.scaler
    return _capture(train_step, model, optimizer, batch, name, keep_grads, policy, scaler, expert_capacity_factor, raw_grads)


_ALWAYS_RETRACE = False
"""Tests set it to compare :func:`_functional_as_is` with the re-trace it stands for."""


def _functional_as_is(pass1: torch.fx.GraphModule, fake_mode: FakeTensorMode) -> torch.fx.GraphModule | None:
    """Pass 1's graph as pass 2 would make it, without re-tracing it, where it mutates only inputs it writes whole and
    tensors nothing else sees; None for any other graph (pass 2 then re-traces it under functionalization).

    Two kinds of mutation qualify:

    - a whole write into an input, ``copy_(input, value)`` with its result unread, each input written at most once,
      nothing reading the input or any view of it after the write: the write becomes a functional
      ``copy(input, value)`` where it stood, and the input takes that copy by one ``copy_`` at the end of the graph,
      the inputs in their order;
    - an in-place op (``x.bernoulli_(p)``, ``x.div_(k)``: it writes its first argument only and returns it) on a
      tensor the step made that is not a view and has none, whose result no view is taken of: it becomes the op's
      functional variant (the overload of the name without ``_`` with the same arguments), and every later reader of
      ``x`` reads its result.

    That is what functionalization does to such a graph, and all it does. Any other mutation (of a view, of a tensor
    with views, of an input in place, an op without one functional variant) keeps the re-trace. Re-tracing is more
    than half of a capture (torch's per-op dispatch through functional tensors: most of a second on 4 LLaMA-7B
    layers); the test suite requires both to give the same MetaIR graph on the built-in models and the zoo.
    """
    graph = pass1.graph
    position = {node: index for index, node in enumerate(graph.nodes)}
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    writes: dict[torch.fx.Node, torch.fx.Node] = {}
    in_place: dict[torch.fx.Node, Any] = {}  # node -> its functional variant
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if not node.target._schema.is_mutable:
            continue
        target = node.args[0] if node.args else None
        if not isinstance(target, torch.fx.Node):
            return None
        if target.op == "placeholder":
            if node.target is not torch.ops.aten.copy_.default or node.kwargs or len(node.args) != 2:
                return None
            if target in writes or node.users:
                return None
            writes[target] = node
            continue
        functional = _functional_variant(node.target)
        # the tensor written: made by an op that is no view (or by an in-place op made functional), with no views, and
        # no view taken of the result (functionalization would make such a view again where it is read, not where it
        # was taken: the same values in another order); in-place ops on either are the chain, checked in their turn
        if (functional is None or target.op != "call_function"
                or (target not in in_place and may_alias_argument(target))
                or any(_may_view(user, target) and not _writes_in_place(user, target) for user in target.users)
                or any(_may_view(user, node) and not _writes_in_place(user, node) for user in node.users)):
            return None
        args, kwargs = _functional_arguments(node.target, functional, node.args, node.kwargs)
        try:  # everything that may fail before the graph changes: a refusal leaves pass 1 to re-trace
            with fake_mode, torch.no_grad():
                val = functional(*_vals(args), **_vals(kwargs))
        except Exception as err:  # an op the fake tensors cannot run so: the re-trace decides
            log.debug("re-tracing: %s as %s failed on fake tensors (%s)", node.target, functional, err)
            return None
        in_place[node] = (functional, args, kwargs, val)
    for dst, write in writes.items():
        aliases, frontier = {dst}, [dst]
        while frontier:  # the input and every view of it, transitively
            viewed = frontier.pop()
            for user in viewed.users:
                if user not in aliases and _may_view(user, viewed):
                    aliases.add(user)
                    frontier.append(user)
        if any(position[user] > position[write] for alias in aliases for user in alias.users if user is not write):
            return None
    made: dict[torch.fx.Node, torch.fx.Node] = {}  # in-place node -> its functional result
    for node, (functional, args, kwargs, val) in in_place.items():  # in graph order: a chain reads the last result
        written = node.args[0]
        later = [user for user in written.users if user is not node and position[user] > position[node]]
        args, kwargs = pytree.tree_map(lambda arg: made.get(arg, arg) if isinstance(arg, torch.fx.Node) else arg,
                                       (args, kwargs))
        with graph.inserting_before(node):
            result = graph.call_function(functional, args, kwargs)
        result.meta["val"] = val
        made[node] = result
        node.replace_all_uses_with(result)
        for user in later:
            user.replace_input_with(written, result)
        position[result] = position[node]
        graph.erase_node(node)
    output = next(node for node in graph.nodes if node.op == "output")
    copies = {}
    for dst, write in writes.items():
        src = write.args[1]
        with graph.inserting_before(write):
            copy = graph.call_function(torch.ops.aten.copy.default, (dst, src))
        with fake_mode, torch.no_grad():
            copy.meta["val"] = torch.ops.aten.copy.default(dst.meta["val"], src.meta["val"])
        copies[dst] = copy
        graph.erase_node(write)
    for dst in placeholders:
        if dst in copies:
            with graph.inserting_before(output):
                graph.call_function(torch.ops.aten.copy_.default, (dst, copies[dst]))
    graph.eliminate_dead_code()
    pass1.recompile()
    return pass1


def _vals(args: Any) -> Any:
    """``args`` with each fx node replaced by the value the trace recorded for it."""
    return pytree.tree_map(lambda arg: arg.meta["val"] if isinstance(arg, torch.fx.Node) else arg, args)


def _functional_arguments(op: Any, functional: Any, args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
    """The arguments of ``functional`` for a call of the in-place ``op`` with ``args`` and ``kwargs``, written as a
    call from C++ is recorded: positional arguments the call left at ``op``'s defaults given, then trailing ones at
    ``functional``'s defaults left out, as are keyword arguments at its defaults (``bernoulli_.float(x)`` is
    ``bernoulli.p(x, 0.5)``; ``add_.Tensor(x, y, alpha=1)`` is ``add.Tensor(x, y)``)."""
    kwargs = dict(kwargs)
    positional = [arg for arg in functional._schema.arguments if not arg.kwarg_only]
    own = {arg.name: arg for arg in op._schema.arguments}
    args = list(args)
    for arg in positional[len(args):]:
        if arg.name in kwargs:
            args.append(kwargs.pop(arg.name))
        elif own[arg.name].has_default_value():
            args.append(own[arg.name].default_value)
        else:
            break
    while args and len(args) <= len(positional) and _at_default(positional[len(args) - 1], args[-1]):
        args.pop()
    defaults = {arg.name: arg for arg in functional._schema.arguments if arg.kwarg_only}
    kwargs = {key: value for key, value in kwargs.items() if not (key in defaults and _at_default(defaults[key], value))}
    return tuple(args), kwargs


def _at_default(argument: Any, value: Any) -> bool:
    """Whether ``value`` is ``argument``'s default (a scalar or None of the same type)."""
    if not argument.has_default_value():
        return False
    default = argument.default_value
    return type(value) is type(default) and not isinstance(value, (torch.Tensor, torch.fx.Node)) and value == default


@functools.lru_cache(maxsize=None)
def _functional_variant(op: Any) -> Any:
    """The functional overload of the in-place ATen op ``op`` (``bernoulli_.float`` -> ``bernoulli.p``): the op of its
    name without the trailing ``_`` whose arguments have the same names, types and kinds, returning a new tensor;
    None unless ``op`` writes its first argument only and returns it, and exactly one such overload exists."""
    schema = op._schema
    arguments = schema.arguments
    writes = [bool(arg.alias_info is not None and arg.alias_info.is_write) for arg in arguments]
    if not writes or not writes[0] or any(writes[1:]) or len(schema.returns) != 1 or schema.returns[0].alias_info is None:
        return None
    namespace, _, name = schema.name.partition("::")
    if not name.endswith("_"):
        return None
    try:
        packet = getattr(getattr(torch.ops, namespace), name[:-1])
    except AttributeError:
        return None
    shape = [(arg.name, str(arg.type), arg.kwarg_only) for arg in arguments]
    found = []
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        other = candidate._schema
        if (not other.is_mutable and len(other.returns) == 1 and other.returns[0].alias_info is None
                and [(arg.name, str(arg.type), arg.kwarg_only) for arg in other.arguments] == shape):
            found.append(candidate)
    return found[0] if len(found) == 1 else None


def _writes_in_place(node: torch.fx.Node, tensor: torch.fx.Node) -> bool:
    """Whether ``node`` is an in-place op writing ``tensor`` (its first argument)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and schema.is_mutable and bool(node.args) and node.args[0] is tensor


def _may_view(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    """Whether ``node``'s result may share memory with ``source``, one of its arguments: a view of it, or an in-place
    op writing it (an in-place op returns the tensor it writes, its first argument, not its other arguments)."""
    if not may_alias_argument(node):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable and node.args:
        return node.args[0] is source
    return True


def _capture(train_step, model, optimizer, batch, name, keep_grads, policy: PrecisionPolicy, scaler,
             expert_capacity_factor: float | None, raw_grads: bool) -> TorchStep:
    started = time.perf_counter()
    _check_arguments(train_step, model, optimizer, batch)
    if keep_grads and raw_grads:
        raise CaptureError("keep_grads and raw_grads both add gradient outputs; ask for one of them")
    spec = optimizer_spec(optimizer) if optimizer is not None else None
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    param_names = {id(param): name for name, param in params.items()}
    group_of = _group_of_param(optimizer) if optimizer is not None else {}
    _check_optimizer_params(group_of, param_names, optimizer)
    for pname, param in params.items():
        if param.grad is not None:
            raise CaptureError(
                f"parameter {pname!r} already holds a gradient: the captured step starts from no gradients. "
                "Call optimizer.zero_grad() (set_to_none=True, the default) before capturing"
            )
    batch_leaves, batch_paths, batch_tree = _flatten_batch(batch)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    slots: list[InputSlot] = []
    fakes: list[torch.Tensor] = []

    def add(slot: InputSlot, tensor: torch.Tensor, requires_grad: bool = False) -> None:
        slots.append(slot)
        fakes.append(_to_fake(fake_mode, tensor, requires_grad))

    for pname, param in params.items():
        add(InputSlot(pname, Role.PARAM, "param", pname), param, param.requires_grad)
    for bname, buffer in buffers.items():
        add(InputSlot(bname, Role.BUFFER, "buffer", bname), buffer)
    for pname, param in params.items():
        if id(param) not in group_of:
            continue
        state = initial_state(spec, param.detach(), group_of[id(param)], dict(optimizer.state.get(param, {})))
        for key, tensor in state.items():
            add(InputSlot(f"{pname}:{key}", Role.OPTIM_STATE, "state", pname, state_key=key), tensor)
    for key in SCALER_STATE_KEYS if scaler is not None else ():
        add(InputSlot(f"scaler:{key}", Role.BUFFER, "scaler", f"scaler.{key}", state_key=key), scaler_state(scaler, key))
    for index, (path, leaf) in enumerate(zip(batch_paths, batch_leaves)):
        add(InputSlot(f"batch{path}", Role.BATCH, "batch", path, index=index), leaf)
    for group_index, values in enumerate(hyperparameter_values(spec, optimizer) if optimizer is not None else []):
        for key, value in values.items():
            slot = InputSlot(f"hyper:{group_index}.{key}", Role.HYPERPARAMETER, "hyper", f"{group_index}.{key}",
                             state_key=key, index=group_index)
            add(slot, torch.tensor(value, dtype=HYPERPARAMETER_DTYPE))

    traced = _Pass1(train_step, model, optimizer, spec, slots, batch_tree, "raw" if raw_grads else keep_grads, policy, scaler)
    decompositions = {
        aten.native_batch_norm.default: _native_batch_norm_as_legit,
        aten.nll_loss_forward.default: _nll_loss_mean_as_sum,
    }
    modules = _ModuleTracker(model)
    experts = static_experts(model, capacity_factor=expert_capacity_factor)  # MoE layers with static shapes (.moe)
    rng_watch = RngRestoreWatch()
    with _user_errors(modules), _quiet_fake_tensor_log(), fake_mode, modules, _host_random_unused(), experts as routing, \
            rng_watch.active():
        pass1 = make_fx(traced, tracing_mode="real", decomposition_table=decompositions)(*fakes)
    pass2 = _functional_as_is(pass1, fake_mode) if not _ALWAYS_RETRACE else None
    if pass2 is None:  # mutations _functional_as_is does not take: functionalization re-traces the graph
        inputs_pass2 = [fake.detach() for fake in fakes]
        with _user_errors(), fake_mode, torch.no_grad():
            pass2 = make_fx(torch.func.functionalize(pass1, remove="mutations"), tracing_mode="real")(*inputs_pass2)
        pass2.graph.eliminate_dead_code()
        pass2.recompile()

    output_roles = traced.output_roles()
    graph, constants, slots_all, contiguous_values = fx_to_ir(pass2, slots, output_roles, name=name)
    check_no_replayed_draws(rng_watch, graph)  # torch.utils.checkpoint replaying dropout: refused, never silently wrong
    if raw_grads:
        # the dropped copies would leave gaps in the numbering: renamed from the op sequence again, so that a capture
        # on a few layers expanded (frontends.torch.repeat) gets the same names as this one
        graph, renamed = canonical_names(_grads_without_copies(graph))
        # a dropped copy's old name may now name another value: only values still in the graph keep their flag
        contiguous_values = frozenset(renamed[value] for value in contiguous_values if value in renamed)
    if routing:
        graph = dataclasses.replace(graph, routing=tuple(routing))  # MetaIR states the experts' static dispatch
    elapsed = time.perf_counter() - started
    log.info("captured %s: %d nodes in %.2f s", name, len(graph.nodes), elapsed)
    return TorchStep(
        graph=graph,
        graph_module=pass2,
        slots=tuple(slots_all),
        constants=constants,
        output_tree=traced.output_tree,
        capture_seconds=elapsed,
        optimizer_structure=optimizer_structure(optimizer),
        left_grads=tuple(traced.left_grads),
        contiguous_values=contiguous_values,
        precision=policy,
        scaler=scaler,
        scaler_settings=scaler_settings(scaler) if scaler is not None else (),
        watched_grad_elements=traced.watched_grad_elements,
        loss_divisor=loss_divisor_of(graph),
    )


def loss_divisor_of(graph: Graph) -> str | None:
    """The total weight a mean cross-entropy loss output is divided by (see :attr:`TorchStep.loss_divisor`), or None."""
    losses = graph.outputs_by_role(Role.LOSS)
    if len(losses) != 1:
        return None
    division = graph.producer(losses[0].name)
    if division is None or division.op.target != "aten.div.Tensor" or len(division.input_names) != 2:
        return None
    total, divisor = division.input_names
    loss_node = graph.producer(total)
    if loss_node is None or loss_node.op.target != "aten.nll_loss_forward.default":
        return None
    weighted = len(loss_node.args) > 2 and loss_node.args[2] is not None
    if weighted or loss_node.outputs[0] is None or loss_node.outputs[0].name != total:
        return None
    if loss_node.outputs[1] is not None and loss_node.outputs[1].name == divisor:
        return divisor
    return divisor if _counts_targets(graph, divisor, loss_node) else None


def _counts_targets(graph: Graph, divisor: str, loss_node) -> bool:
    """Whether ``divisor`` is the count of ``loss_node``'s targets not ignored, as :func:`_nll_loss_mean_as_sum`
    writes it: ``(target != ignore_index).sum()``, cast to the loss's dtype."""
    node = graph.producer(divisor)
    while node is not None and node.op.target == "aten._to_copy.default":
        node = graph.producer(node.input_names[0])
    if node is None or node.op.target != "aten.sum.default":
        return False
    compare = graph.producer(node.input_names[0])
    return (compare is not None and compare.op.target == "aten.ne.Scalar" and len(compare.args) == 2
            and len(loss_node.args) > 4 and compare.input_names[0] == loss_node.input_names[1]
            and compare.args[1] == loss_node.args[4])


class _Pass1:
    """The function pass 1 traces: the user's step over re-parametrised tensors."""

    def __init__(self, train_step, model, optimizer, spec, slots, batch_tree, keep_grads, policy, scaler) -> None:
        """``keep_grads``: False, True (the gradients the optimizer saw) or ``"raw"`` (as autograd accumulated them)."""
        self.train_step, self.model, self.optimizer, self.spec = train_step, model, optimizer, spec
        self.slots, self.batch_tree, self.keep_grads = slots, batch_tree, keep_grads
        self.policy, self.scaler = policy, scaler
        self.metric_sources: list[str] = []
        self.watched_grad_elements = 0
        self.output_tree = None
        self.user_roles: list[tuple[Role, str]] = []
        self.grad_names: list[str] = []
        self.left_grads: list[str] = []
        """Parameters still holding a gradient when the step returns (the next step would accumulate into it)."""
        self.name_of = {id(param): name for name, param in model.named_parameters()}

    def __call__(self, *tensors: torch.Tensor):
        by_kind: dict[str, dict[str, torch.Tensor]] = {"param": {}, "buffer": {}, "batch": {}}
        states: dict[str, dict[str, torch.Tensor]] = {}
        hypers: dict[int, dict[str, torch.Tensor]] = {}
        batch_leaves: list[torch.Tensor] = []
        scaler_tensors: dict[str, torch.Tensor] = {}
        for slot, tensor in zip(self.slots, tensors):
            if slot.kind == "state":
                states.setdefault(slot.key, {})[slot.state_key] = tensor
            elif slot.kind == "scaler":
                scaler_tensors[slot.state_key] = tensor
            elif slot.kind == "hyper":
                hypers.setdefault(slot.index, {})[slot.state_key] = tensor
            elif slot.kind == "batch":
                batch_leaves.append(tensor)
            else:
                by_kind[slot.kind][slot.key] = tensor
        policy = PolicyTrace(self.policy, watch_underflow=self.scaler is None)
        batch = pytree.tree_unflatten(policy.batch(batch_leaves), self.batch_tree)
        traced_params = by_kind["param"]
        kept_grads: dict[str, torch.Tensor] = {}
        raw_grads: dict[str, torch.Tensor] = {}
        guard: dict = {"found_inf": None}
        scaler = ScalerTrace(self.scaler, scaler_tensors, lambda optimizer: self._with_grads(optimizer, traced_params), guard)
        mapping = {**policy.compute_params(traced_params), **by_kind["buffer"]}
        with stateless._reparametrize_module(self.model, mapping, tie_weights=True), self._optimizer_hooks(
            traced_params, states, hypers, kept_grads, guard
        ), MaskedAssignmentAsWhere(), scaler.patched(), _accumulated_grads(traced_params, raw_grads, self.keep_grads == "raw"):
            result = self.train_step(self.model, self.optimizer, batch)
        if self.keep_grads == "raw":
            kept_grads = raw_grads
        leaves, self.output_tree = pytree.tree_flatten(result)
        outputs = []
        self.user_roles = []
        for position, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                raise CaptureError(
                    f"the training step returned a {type(leaf).__name__} ({leaf!r}) at position {position} of its "
                    "result; a captured step may return tensors only (e.g. the loss). Return the tensor, "
                    "or convert after the step"
                )
            is_loss = leaf.dim() == 0 and leaf.is_floating_point()
            self.user_roles.append((Role.LOSS if is_loss else Role.ACTIVATION, f"result{position}"))
            outputs.append(leaf.detach())
        self.grad_names = []
        self.left_grads = [pname for pname, tensor in traced_params.items() if tensor.grad is not None]
        for pname, tensor in traced_params.items():
            grad = kept_grads.get(pname) if self.keep_grads else None
            if grad is None and tensor.grad is not None:
                grad = tensor.grad  # the step left a gradient behind: it is part of the result
            if grad is not None:
                self.grad_names.append(pname)
                outputs.append(grad.detach())
        metrics = policy.metrics()
        self.metric_sources = [source for source, _ in metrics]
        self.watched_grad_elements = policy.watched_numel
        outputs.extend(tensor.detach() for _, tensor in metrics)
        return outputs

    def output_roles(self) -> list[tuple[Role, str]]:
        return (self.user_roles + [(Role.GRAD, f"grad:{name}") for name in self.grad_names]
                + [(Role.METRIC, source) for source in self.metric_sources])

    def _with_grads(self, optimizer: Any, traced_params: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The traced parameters of ``optimizer`` that hold a gradient (what a GradScaler unscales)."""
        if optimizer is not self.optimizer:
            raise CaptureError("the GradScaler steps an optimizer that is not the step's optimizer argument")
        names = [self.name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]
        return [traced_params[name] for name in names if traced_params[name].grad is not None]


    @contextlib.contextmanager
    def _optimizer_hooks(self, traced_params, states, hypers, kept_grads, guard):
        optimizer = self.optimizer
        if optimizer is None:
            yield
            return
        name_of = self.name_of  # the real parameters' names (the module is re-parametrised now)
        spec: OptimizerSpec = self.spec

        def step(closure=None):
            if closure is not None:
                raise CaptureError(
                    "optimizer.step(closure) cannot be captured: the closure re-evaluates the model inside the "
                    "optimizer. Call loss.backward() in the step and optimizer.step() without a closure"
                )
            with torch.no_grad():
                for group_index, group in enumerate(optimizer.param_groups):
                    for param in group["params"]:
                        pname = name_of[id(param)]
                        traced = traced_params[pname]
                        if traced.grad is None:
                            continue  # torch skips parameters without a gradient
                        kept_grads[pname] = traced.grad.clone()
                        param_state = states.setdefault(pname, {})
                        new_param, new_state = functional_update(spec, traced, traced.grad, param_state,
                                                                 hypers[group_index], group)
                        if guard["found_inf"] is not None:  # a GradScaler's step: skipped when a gradient is inf/NaN
                            skip = guard["found_inf"] != 0
                            new_param = torch.where(skip, traced, new_param)
                            new_state = {key: torch.where(skip, param_state[key], value) for key, value in new_state.items()}
                        traced.copy_(new_param)
                        for key, value in new_state.items():
                            param_state[key].copy_(value)

        in_groups = [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]

        def zero_grad(set_to_none: bool = True):
            for traced in (traced_params[name] for name in in_groups):  # as torch: the optimizer's parameters only
                if traced.grad is None:
                    continue
                if set_to_none:
                    traced.grad = None
                else:
                    traced.grad = torch.zeros_like(traced.grad)

        saved = {name: optimizer.__dict__.get(name) for name in ("step", "zero_grad")}
        optimizer.step, optimizer.zero_grad = step, zero_grad
        try:
            yield
        finally:
            for attr, value in saved.items():
                if value is None:
                    optimizer.__dict__.pop(attr, None)
                else:
                    optimizer.__dict__[attr] = value


# -- helpers ---------------------------------------------------------------------


@contextlib.contextmanager
def _accumulated_grads(traced_params: dict[str, torch.Tensor], found: dict[str, torch.Tensor], enabled: bool):
    """Record into ``found`` each parameter's ``.grad`` right after autograd accumulates into it (the last time)."""
    if not enabled:
        yield
        return

    def hook(name: str):
        def record(tensor: torch.Tensor) -> None:
            found[name] = tensor.grad.clone()  # a copy: the step may change .grad in place later (clipping)
        return record

    handles = [tensor.register_post_accumulate_grad_hook(hook(name))
               for name, tensor in traced_params.items() if tensor.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()



def _grads_without_copies(graph: Graph) -> Graph:
    """Each ``grad`` output that is a copy (``clone``) of a value names the value itself (equal in a functional graph),
    and copies nothing else reads are dropped: the update then reads the very values marked as gradients."""
    from ...ir import GraphOutput

    replaced: dict[str, str] = {}
    for output in graph.outputs:
        node = graph.producer(output.name)
        if output.role is Role.GRAD and node is not None and node.op.target == "aten.clone.default" and node.input_names \
                and node.memory_format != "contiguous_format":  # such a clone lays the gradient out as its parameter
            replaced[output.name] = node.input_names[0]
    if not replaced:
        return graph
    outputs = tuple(GraphOutput(replaced.get(o.name, o.name), o.role, o.replaces, o.source) for o in graph.outputs)
    kept_outputs = {o.name for o in outputs}
    dropped = {graph.producer(name).name for name in replaced
               if not graph.users(name) and name not in kept_outputs}
    nodes = tuple(node for node in graph.nodes if node.name not in dropped)
    return Graph(inputs=graph.inputs, nodes=nodes, outputs=outputs, name=graph.name)


_MEAN_REDUCTION = 1


def _nll_loss_mean_as_sum(input, target, weight, reduction, ignore_index):
    """A mean-reduced ``nll_loss`` as its sum over the total weight, which is what the kernel computes
    (bit for bit). The sum splits over the batch (``Partial(sum)``); a mean of per-shard means would
    not, so the split form lets the loss be computed sharded.

    Without class weights the total weight is the count of targets not ignored, the kernel's
    ``static_cast<scalar_t>(count)``: it is computed here from the targets alone, so that a plan can
    count them where the whole batch is at hand. Taken from the op's own output, it would be a partial
    sum of the sharded op, all-reduced in the middle of the step (the backward divides by it) where
    every rank waits for the others; now only the loss itself is reduced, for the step's output."""
    if reduction != _MEAN_REDUCTION:
        return NotImplemented
    total, total_weight = aten.nll_loss_forward.default(input, target, weight, 2, ignore_index)
    if weight is None:
        total_weight = aten.sum.default(aten.ne.Scalar(target, ignore_index)).to(total_weight.dtype)
    return total / total_weight, total_weight


def _native_batch_norm_as_legit(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """``native_batch_norm`` updates its running statistics without saying so in its schema, which
    functionalization cannot see; ``_native_batch_norm_legit`` declares the mutation and runs the
    same CPU/CUDA kernel, so functionalization turns it into an explicit update."""
    if running_mean is None and running_var is None:
        return aten._native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)
    if not training:
        return aten._native_batch_norm_legit_no_training.default(input, weight, bias, running_mean, running_var, momentum, eps)
    return aten._native_batch_norm_legit.default(input, weight, bias, running_mean, running_var, training, momentum, eps)



def _to_fake(fake_mode: FakeTensorMode, tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A fake CPU tensor of the same shape and dtype (meta tensors too), a leaf."""
    with fake_mode:
        fake = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device="cpu")
    if requires_grad:
        fake.requires_grad_(True)
    return fake


def _flatten_batch(batch: Any) -> tuple[list[torch.Tensor], list[str], Any]:
    with_paths, tree = pytree.tree_flatten_with_path(batch)
    leaves, paths = [], []
    for path, leaf in with_paths:
        text = pytree.keystr(path)
        if not isinstance(leaf, torch.Tensor):
            raise CaptureError(
                f"the batch holds a {type(leaf).__name__} at batch{text}; MetaDist shards tensors, so every leaf "
                "of the batch (a tensor, or a dict/list/tuple of tensors) must be a torch.Tensor. "
                "Make it a tensor, or pass it to the step another way (a closure or the model's config)"
            )
        leaves.append(leaf)
        paths.append(_clean_path(text))
    return leaves, paths, tree


def _clean_path(text: str) -> str:
    return text.replace("['", ".").replace("']", "").replace("[", ".").replace("]", "")


def hyperparameter_tensor(values: list[dict[str, float]], slot: InputSlot) -> torch.Tensor:
    """The live value of a hyperparameter slot (its group's ``values``) as the 0-dim double the graph reads."""
    return torch.tensor(values[slot.index][slot.state_key], dtype=HYPERPARAMETER_DTYPE)


def _group_of_param(optimizer: Any) -> dict[int, dict]:
    return {id(param): group for group in optimizer.param_groups for param in group["params"]}


def _check_arguments(train_step, model, optimizer, batch) -> None:
    if not callable(train_step):
        raise CaptureError(f"train_step must be callable as train_step(model, optimizer, batch), got {type(train_step).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise CaptureError(
            f"optimizer must be a torch.optim.Optimizer (or None), got {type(optimizer).__name__}"
        )


def _check_optimizer_params(group_of: dict[int, dict], param_names: dict[int, str], optimizer: Any) -> None:
    missing = [key for key in group_of if key not in param_names]
    if missing:
        raise CaptureError(
            f"the optimizer updates {len(missing)} tensor(s) that are not parameters of the model; "
            "build the optimizer from model.parameters()"
        )


_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """Fake tensors log a kernel's failure at ERROR level before raising it; the CaptureError says it once."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fake_log.setLevel(level)


class _ModuleTracker:
    """While pass 1 traces, which module of the model is running (for errors: "in module 'h.0.attn' (GPT2Attention)")."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.stack, self.handles = model, [], []
        self.failed_in: str | None = None

    def __enter__(self) -> "_ModuleTracker":
        for name, module in self.model.named_modules():
            self.handles.append(module.register_forward_pre_hook(lambda module, args, name=name: self.stack.append(name)))
            self.handles.append(module.register_forward_hook(self._leave, always_call=True))
        return self

    def _leave(self, module, args, output) -> None:
        if self.stack:
            name = self.stack.pop()
            if output is None and self.failed_in is None:  # always_call passes no output when the module raised
                self.failed_in = name

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def where(self) -> str:
        name = self.failed_in if self.failed_in is not None else (self.stack[-1] if self.stack else None)
        if name is None:
            return ""
        module = self.model.get_submodule(name) if name else self.model
        return f" in module {name or '(the root)'!r} ({type(module).__name__})"

    def routing_hint(self) -> str:
        """What to change when the failing module is a mixture-of-experts layer MetaDist does not cover."""
        name = self.failed_in if self.failed_in is not None else (self.stack[-1] if self.stack else None)
        return "" if name is None else uncovered_routing_hint(self.model.get_submodule(name))


@contextlib.contextmanager
def _user_errors(modules: "_ModuleTracker | None" = None):
    """Turn failures while tracing the user's step into CaptureErrors that point at the user's code and module."""
    try:
        yield
    except (CaptureError, ScalerDiscovered):
        raise
    except _DATA_DEPENDENT as err:
        raise CaptureError(
            f"the training step has data-dependent Python control flow or output shapes at {_user_frame(err)}"
            f"{_where(modules)}: a Python decision on a tensor's value ({type(err).__name__}: {err}). A captured step "
            "must run the same ops whatever the data: use torch.where instead of `if tensor:`, and keep "
            ".item()/.tolist()/nonzero() out of the step" + (modules.routing_hint() if modules is not None else "")
        ) from err
    except UnsupportedFakeTensorException as err:
        raise CaptureError(f"the training step uses a tensor MetaDist cannot trace at {_user_frame(err)}"
                           f"{_where(modules)}: {err}") from err
    except UnsupportedOperatorException as err:
        raise CaptureError(
            f"the training step calls {err.func}, which has no fake (meta) kernel, at {_user_frame(err)}{_where(modules)}: "
            "MetaDist traces the step on shapes without running it. Register one (torch.library.register_fake for a "
            "custom op) or keep the op out of the step"
        ) from err
    except Exception as err:  # a user's exception while tracing: say where, keep the cause chained
        if type(err).__name__ == "GuardOnDataDependentSymNode":
            raise CaptureError(
                f"the training step has data-dependent Python control flow at {_user_frame(err)}{_where(modules)}: "
                f"{err}. Use torch.where instead of `if tensor:`" + (modules.routing_hint() if modules is not None else "")
            ) from err
        raise CaptureError(
            f"the training step failed while being traced, at {_user_frame(err)}{_where(modules)}: "
            f"{type(err).__name__}: {err}"
        ) from err


@contextlib.contextmanager
def _host_random_unused():
    """Refuse a step that draws from Python's or numpy's global random generator while being traced.

    Their numbers are plain values to the tracer: captured, they would be constants, the same at
    every step (a SpecAugment-style mask drawn with ``np.random`` would mask the same positions
    forever). Torch's random ops are captured as ops and draw anew at every step.
    """
    import random

    import numpy as np

    python_state, numpy_state = random.getstate(), np.random.get_state()
    yield
    used = [name for name, changed in (
        ("Python's `random`", random.getstate() != python_state),
        ("numpy's `np.random`", not _same_numpy_state(np.random.get_state(), numpy_state)),
    ) if changed]
    if used:
        raise CaptureError(
            f"the training step draws random numbers from {' and '.join(used)} while it is traced: captured, they "
            "would be constants, the same at every step. Draw them with torch (torch.rand, torch.randint, "
            "torch.bernoulli: captured as random ops, drawn anew each step), or draw them outside the step and pass "
            "them in the batch"
        )


def _same_numpy_state(one: tuple, other: tuple) -> bool:
    import numpy as np

    return all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(one, other))


def _where(modules: "_ModuleTracker | None") -> str:
    return modules.where() if modules is not None else ""


def _user_frame(err: BaseException) -> str:
    frames = [frame for frame in traceback.extract_tb(err.__traceback__) if not frame.filename.startswith("<")]
    internal = ("/torch/", "/metadist/", "/contextlib.py", "/functools.py")
    for frame in reversed(frames):
        if not any(part in frame.filename for part in internal) and "site-packages" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    for frame in reversed(frames):
        if not any(part in frame.filename for part in internal):
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "an unknown place"
