"""Capture a deep model's step on four of its layers, then expand the graph to all of them.

A model whose bulk is a ``ModuleList`` of identical layers (every transformer) traces the same
ops once per layer; capturing LLaMA-7B's 32 layers takes 15-20 s, most of planning it. The recipe:

1. find the repeated layers (:func:`find_repeated_layers`): the ``ModuleList`` holding the most
   parameters whose members have one class and the same parameters and buffers (names, shapes,
   dtypes), none shared;
2. capture the step with the list cut to its first 4 layers, the optimizer cut to those layers'
   parameters (same class, groups and hyperparameters);
3. expand the capture's template (layers 0, 1 and 3) to 4 layers (:func:`metadist.ir.expand.expand_layers`)
   and require it to equal the capture, name for name: layer 2, written from layer 1, is what was
   captured, so the layers repeat as the expansion assumes;
4. expand the capture to all layers.

Where a step does not repeat its layers so (layers of different kinds, a loop over all parameters
such as gradient clipping, shared parameters, a parameter group of later layers only) the step is
captured whole, and the reason is logged. The model is changed only for the two captures and
restored after it. On LLaMA-7B (32 layers) this takes 3-4 s of CPU where the whole capture takes 15-20 s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ...gc_pause import gc_paused
from ...ir import Graph, Role
from ...ir.expand import CAPTURED_LAYERS, LAST, ExpansionError, LayerNames, expand_layers_traced
from .capture import TorchStep, capture_step, loss_divisor_of
from .optim import optimizer_spec, optimizer_structure

__all__ = ["MIN_LAYERS_TO_EXPAND", "RepeatedLayers", "capture_repeated", "capture_repeated_step", "find_repeated_layers"]

log = logging.getLogger(__name__)

MIN_LAYERS_TO_EXPAND = 8
"""Fewer layers than this are captured whole (the two small captures would cost as much)."""


@dataclass(frozen=True)
class RepeatedLayers:
    """A ``ModuleList`` of identical layers inside a model."""

    path: str
    """Its module path (``model.layers``)."""
    count: int

    @property
    def prefix(self) -> str:
        """What the names of its parameters start with (``model.layers.``)."""
        return f"{self.path}." if self.path else ""


_PLAIN = (bool, int, float, str, type(None))


def _settings(module: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """Every submodule's class and plain attributes (numbers, strings, flags; other objects by their type)."""
    found: dict[tuple[str, str], Any] = {}
    for path, sub in module.named_modules():
        found[(path, "<class>")] = type(sub)
        for key, value in vars(sub).items():
            if key.startswith("_") or key == "training" or isinstance(value, torch.Tensor | torch.nn.Module):
                continue
            plain = isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value))
            found[(path, key)] = value if plain else type(value)
    return found


def _same_settings(layers: torch.nn.ModuleList) -> bool:
    """Whether the layers agree on every setting but their own index (``layer_idx`` = 0, 1, 2...).

    Layers that differ here may compute differently (a global-attention layer every sixth, say) though
    they hold the same parameters; the four captured layers could not show it.
    """
    settings = [_settings(layer) for layer in layers]
    if any(found.keys() != settings[0].keys() for found in settings):
        return False
    for key in settings[0]:
        values = [found[key] for found in settings]
        if values == list(range(len(layers))) and all(type(value) is int for value in values):
            continue
        if any(value != values[0] for value in values):
            return False
    return True


def _layout(module: torch.nn.Module) -> tuple:
    params = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in module.named_parameters())
    buffers = tuple((name, tuple(b.shape), b.dtype) for name, b in module.named_buffers())
    return type(module), params, buffers


def find_repeated_layers(model: torch.nn.Module) -> RepeatedLayers | None:
    """The ``ModuleList`` of identical, unshared layers holding the most parameters (None if there is none).

    Identical: one class, the same parameters and buffers (names, shapes, dtypes) and the same plain
    settings in every submodule but their own index (:func:`_same_settings`).
    """
    owners: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        owners[id(param)] = owners.get(id(param), 0) + 1
    best, best_size = None, 0
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        layouts = {_layout(layer) for layer in module}
        params = [param for layer in module for param in layer.parameters()]
        if len(layouts) != 1 or not params or any(owners.get(id(param), 0) != 1 for param in params):
            continue
        if not _same_settings(module):
            log.info("the layers under %r hold the same parameters but differ in a setting: not expanded", path)
            continue
        size = sum(param.numel() for param in params)
        if size > best_size:
            best, best_size = RepeatedLayers(path, len(module)), size
    return best


@contextlib.contextmanager
def _cut(model: torch.nn.Module, layers: RepeatedLayers, count: int) -> Iterator[None]:
    """The model with its repeated layers cut to the first ``count``, for the block's duration."""
    parent_path, _, attribute = layers.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    original = getattr(parent, attribute)
    setattr(parent, attribute, torch.nn.ModuleList(list(original)[:count]))
    try:
        yield
    finally:
        setattr(parent, attribute, original)


def _cut_optimizer(optimizer: Any, model: torch.nn.Module) -> Any:
    """The optimizer's class, groups and hyperparameters over the parameters ``model`` holds now."""
    kept = {id(param) for param in model.parameters()}
    groups = []
    for group in optimizer.param_groups:
        params = [param for param in group["params"] if id(param) in kept]
        if not params:
            raise ExpansionError("a parameter group of the optimizer holds only parameters of later layers")
        groups.append({**{key: value for key, value in group.items() if key != "params"}, "params": params})
    # the whole optimizer passes the capture's checks first (its step hooks, say, which a cut copy would not carry
    # over): a step the whole capture refuses is refused with the same error, never captured without them
    optimizer_spec(optimizer)
    accepted = inspect.signature(type(optimizer)).parameters
    try:
        cut = type(optimizer)(groups, **{key: value for key, value in optimizer.defaults.items() if key in accepted})
    except Exception as err:  # a class whose constructor wants more than its groups and defaults
        raise ExpansionError(f"{type(optimizer).__name__} cannot be rebuilt from its groups and defaults ({err})") from err
    for param, state in optimizer.state.items():
        if id(param) in kept:
            cut.state[param] = state
    return cut


def _capture_cut(train_step: Callable, model, optimizer, batch, layers: RepeatedLayers, count: int, **options) -> TorchStep:
    with _cut(model, layers, count):
        cut_optimizer = None if optimizer is None else _cut_optimizer(optimizer, model)
        return capture_step(train_step, model, cut_optimizer, batch, **options)


@gc_paused()
def capture_repeated(train_step: Callable, model: torch.nn.Module, optimizer: Any, batch: Any, *, name: str = "step",
                     keep_grads: bool = False, min_layers: int = MIN_LAYERS_TO_EXPAND,
                     expert_capacity_factor: float | None = None, precision: Any = None, raw_grads: bool = False) -> Graph:
    """The step's graph: expanded from 4 captured layers where the model repeats ``min_layers`` or more, else captured whole.

    The graph equals the whole capture's (same names, same fingerprint), so a plan made from it runs the
    whole capture; see the module docstring for the checks.
    """
    return capture_repeated_step(train_step, model, optimizer, batch, name=name, keep_grads=keep_grads, min_layers=min_layers,
                                 expert_capacity_factor=expert_capacity_factor, precision=precision, raw_grads=raw_grads).graph


@gc_paused()
def capture_repeated_step(train_step: Callable, model: torch.nn.Module, optimizer: Any, batch: Any, *, name: str = "step",
                          keep_grads: bool = False, min_layers: int = MIN_LAYERS_TO_EXPAND,
                          expert_capacity_factor: float | None = None, precision: Any = None,
                          raw_grads: bool = False) -> TorchStep:
    """:func:`.capture.capture_step`'s result, expanded from 4 captured layers where the model repeats ``min_layers``
    or more (else captured whole): what a run needs of the step, not just its graph.

    Beside the graph, the expansion carries over what the capture knows of each value: where each graph input
    comes from (its slot), the tensor constants the trace created, the values whose layout the trace saw as
    contiguous, the parameters whose gradient the step leaves behind. The same checks as the graph's apply to
    these: expanding the 4 captured layers to 4 must give back the capture's own (layer 2's constants equal
    layer 1's, tensor for tensor). The step has no fx module (``graph_module`` is None); it runs from its graph.
    """
    options = dict(name=name, keep_grads=keep_grads, expert_capacity_factor=expert_capacity_factor, precision=precision,
                   raw_grads=raw_grads)
    layers = find_repeated_layers(model)
    if layers is None or layers.count < max(min_layers, CAPTURED_LAYERS + 1):
        return capture_step(train_step, model, optimizer, batch, **options)
    started = time.perf_counter()
    try:
        captured = _capture_cut(train_step, model, optimizer, batch, layers, CAPTURED_LAYERS, **options)
        if captured.graph.routing:
            raise ExpansionError("its experts layers' routing records are not expanded yet")
        if captured.watched_grad_elements:
            raise ExpansionError("it counts its float16 gradients' underflow, a count not expanded yet")
        if _expand_step(captured, layers, CAPTURED_LAYERS, model, optimizer, check=True) != captured.graph:
            raise ExpansionError(f"layer 2 written from layer 1 differs from its capture: the {CAPTURED_LAYERS} captured layers do not repeat")
        step = _expand_step(captured, layers, layers.count, model, optimizer)
    except ExpansionError as err:
        log.info("capturing %s whole: its %d layers under %r do not expand (%s)", name, layers.count, layers.path, err)
        return capture_step(train_step, model, optimizer, batch, **options)
    elapsed = time.perf_counter() - started
    log.info("captured %s on %d of its %d layers and expanded it to %d nodes in %.2f s", name, CAPTURED_LAYERS,
             layers.count, len(step.graph.nodes), elapsed)
    return dataclasses.replace(step, capture_seconds=elapsed)


def _captured_name(name: str, layer_names: LayerNames, count: int) -> str:
    """The captured input or parameter that ``name`` of the ``count``-layer step is a copy of."""
    layer = layer_names.of(name)
    if layer is None:
        return name
    label = 0 if layer == 0 else LAST if layer == count - 1 else 1
    return layer_names.moved(name, label)


def _expand_step(captured: TorchStep, layers: RepeatedLayers, count: int, model: torch.nn.Module, optimizer: Any,
                 check: bool = False) -> TorchStep | Graph:
    """The step of ``count`` layers from ``captured`` (of :data:`CAPTURED_LAYERS`).

    ``check=True`` (``count`` being the captured layers): verifies that what the expansion carries over gives back
    the capture's own slots, constants and layouts, raising :class:`ExpansionError` where not, and returns the
    expanded graph for the caller to compare with the capture's. (The parameters whose gradient the step leaves
    behind are mapped by name, layer 1's standing for every middle layer's; a run refuses a step that leaves any.)
    """
    graph, origin = expand_layers_traced(captured.graph, layers.prefix, count)
    names = LayerNames(layers.prefix)
    slot_of = {slot.name: slot for slot in captured.slots}
    slots, constants = [], {}
    for graph_input in graph.inputs:
        name = graph_input.value.name
        if graph_input.role is Role.CONSTANT:
            source = slot_of[origin.get(name, name)]
            slots.append(dataclasses.replace(source, name=name, key=name))
            constants[name] = captured.constants[source.key]
            continue
        source = slot_of.get(_captured_name(name, names, count))
        if source is None:
            raise ExpansionError(f"input {name} of the expansion has no captured counterpart")
        layer = names.of(name)
        key = source.key if layer is None or names.of(source.key) is None else names.moved(source.key, layer)
        slots.append(dataclasses.replace(source, name=name, key=key))
    contiguous = frozenset(name for name, source in origin.items() if source in captured.contiguous_values)
    contiguous |= captured.contiguous_values & {gi.value.name for gi in graph.inputs}
    if check:
        _check_carried(captured, slots, constants, contiguous)
        return graph
    left = set(captured.left_grads)
    left_grads = tuple(name for name, _ in model.named_parameters() if _captured_name(name, names, count) in left)
    return dataclasses.replace(
        captured, graph=graph, graph_module=None, slots=tuple(slots), constants=constants, contiguous_values=contiguous,
        left_grads=left_grads, optimizer_structure=optimizer_structure(optimizer), loss_divisor=loss_divisor_of(graph),
    )


def _check_carried(captured: TorchStep, slots: list, constants: dict, contiguous: frozenset) -> None:
    """The capture's own slots, constants and layouts, written from layers 0, 1 and 3, equal what was captured."""
    if tuple(slots) != captured.slots:
        raise ExpansionError("the graph inputs' slots written from layer 1 differ from the captured ones")
    for name, tensor in constants.items():
        own = captured.constants.get(name)
        if own is None or own.dtype != tensor.dtype or own.shape != tensor.shape or not torch.equal(own, tensor):
            raise ExpansionError(f"tensor constant {name} of layer 2 differs from layer 1's: the layers create different constants")
    if contiguous != captured.contiguous_values:
        differ = sorted(contiguous ^ captured.contiguous_values)[:3]
        raise ExpansionError(f"the layouts of layer 2's values differ from layer 1's ({differ})")
