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
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ...gc_pause import gc_paused
from ...ir import Graph
from ...ir.expand import CAPTURED_LAYERS, ExpansionError, expand_layers
from .capture import capture_step

__all__ = ["MIN_LAYERS_TO_EXPAND", "RepeatedLayers", "capture_repeated", "find_repeated_layers"]

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
    accepted = inspect.signature(type(optimizer)).parameters
    cut = type(optimizer)(groups, **{key: value for key, value in optimizer.defaults.items() if key in accepted})
    for param, state in optimizer.state.items():
        if id(param) in kept:
            cut.state[param] = state
    return cut


def _capture_cut(train_step: Callable, model, optimizer, batch, layers: RepeatedLayers, count: int, **options) -> Graph:
    with _cut(model, layers, count):
        cut_optimizer = None if optimizer is None else _cut_optimizer(optimizer, model)
        return capture_step(train_step, model, cut_optimizer, batch, **options).graph


@gc_paused()
def capture_repeated(train_step: Callable, model: torch.nn.Module, optimizer: Any, batch: Any, *, name: str = "step",
                     keep_grads: bool = False, min_layers: int = MIN_LAYERS_TO_EXPAND,
                     expert_capacity_factor: float | None = None, precision: Any = None, raw_grads: bool = False) -> Graph:
    """The step's graph: expanded from 4 captured layers where the model repeats ``min_layers`` or more, else captured whole.

    The graph equals the whole capture's (same names, same fingerprint), so a plan made from it runs the
    whole capture; see the module docstring for the checks.
    """
    options = dict(name=name, keep_grads=keep_grads, expert_capacity_factor=expert_capacity_factor, precision=precision,
                   raw_grads=raw_grads)
    layers = find_repeated_layers(model)
    if layers is None or layers.count < max(min_layers, CAPTURED_LAYERS + 1):
        return capture_step(train_step, model, optimizer, batch, **options).graph
    started = time.perf_counter()
    try:
        captured = _capture_cut(train_step, model, optimizer, batch, layers, CAPTURED_LAYERS, **options)
        if captured.routing:
            raise ExpansionError("its experts layers' routing records are not expanded yet")
        if expand_layers(captured, layers.prefix, CAPTURED_LAYERS) != captured:
            raise ExpansionError(f"layer 2 written from layer 1 differs from its capture: the {CAPTURED_LAYERS} captured layers do not repeat")
        graph = expand_layers(captured, layers.prefix, layers.count)
    except ExpansionError as err:
        log.info("capturing %s whole: its %d layers under %r do not expand (%s)", name, layers.count, layers.path, err)
        return capture_step(train_step, model, optimizer, batch, **options).graph
    log.info("captured %s on %d of its %d layers and expanded it to %d nodes in %.2f s", name, CAPTURED_LAYERS,
             layers.count, len(graph.nodes), time.perf_counter() - started)
    return graph
