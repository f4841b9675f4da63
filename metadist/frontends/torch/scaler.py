"""A ``torch.amp.GradScaler`` inside a captured step: dynamic loss scaling without Python control flow.

Eagerly, ``scaler.step(optimizer)`` reads ``found_inf.item()`` and skips ``optimizer.step()`` when a
gradient is inf or NaN: a Python decision on a tensor's value, which one captured graph cannot hold.
While pass 1 traces the step, the scaler's methods are replaced (on the class, for the trace only) by
functional equivalents with torch's numerics:

- ``scale(loss)``: ``loss * scale``, the scale being a graph input;
- ``unscale_(optimizer)``: every gradient times ``scale.double().reciprocal().float()``, and
  ``found_inf`` (1.0 when any gradient element is not finite) computed from them;
- ``step(optimizer)``: the optimizer's update is computed and then selected with
  ``torch.where(found_inf > 0, old, new)`` for every parameter and optimizer state (its step count
  too), which is exactly what skipping the step leaves;
- ``update()``: ``torch._amp_update_scale_``'s arithmetic with ``torch.where`` (back off on inf, grow
  after ``growth_interval`` clean steps, never to inf).

The scale and the growth tracker are state that lives in the user's scaler, as the optimizer's state
lives in the optimizer: graph inputs read from ``scaler._scale`` / ``scaler._growth_tracker`` (created
as torch creates them on first use) and outputs written back there after every step. The scaler's
factors and interval are read at capture (:func:`scaler_settings`; the runtime refuses a step whose
scaler changed them).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .errors import CaptureError

__all__ = ["SCALER_STATE_KEYS", "ScalerDiscovered", "ScalerTrace", "scaler_settings", "scaler_state", "write_scaler_state"]

SCALER_STATE_KEYS = ("scale", "growth_tracker")
"""The scaler's tensors a captured step reads and replaces, by slot key."""

_ATTRIBUTES = {"scale": "_scale", "growth_tracker": "_growth_tracker"}


class ScalerDiscovered(Exception):
    """Raised by the traced ``scale()`` the first time a step uses a scaler: capture restarts with its state as inputs."""

    def __init__(self, scaler: Any) -> None:
        super().__init__("a GradScaler is used by the step")
        self.scaler = scaler


def scaler_state(scaler: Any, key: str) -> torch.Tensor:
    """The scaler's current ``scale`` or ``growth_tracker``; before its first use, the value torch would create."""
    tensor = getattr(scaler, _ATTRIBUTES[key])
    if tensor is not None:
        return tensor
    if key == "scale":
        return torch.full((), scaler._init_scale, dtype=torch.float32)
    return torch.full((), scaler._init_growth_tracker, dtype=torch.int32)


def write_scaler_state(scaler: Any, key: str, tensor: torch.Tensor) -> None:
    """Store a step's new ``scale`` or ``growth_tracker`` in the scaler (as ``update()`` leaves them)."""
    setattr(scaler, _ATTRIBUTES[key], tensor)


def scaler_settings(scaler: Any) -> tuple[float, float, int]:
    """(growth factor, backoff factor, growth interval): constants of the captured step."""
    return (float(scaler._growth_factor), float(scaler._backoff_factor), int(scaler._growth_interval))


@dataclass
class _OptimizerState:
    stage: str = "ready"
    found_inf: torch.Tensor | None = None


@dataclass
class ScalerTrace:
    """The traced scaler: which scaler the step uses, its state tensors in the trace, per-optimizer stages.

    ``grads_of(optimizer)`` gives the traced parameters holding a gradient; ``guard`` is where
    ``step()`` leaves ``found_inf`` for the optimizer hook to select the update with.
    """

    scaler: Any
    tensors: dict[str, torch.Tensor]
    grads_of: Callable[[Any], list[torch.Tensor]]
    guard: dict
    optimizers: dict[int, _OptimizerState] = field(default_factory=dict)

    @contextlib.contextmanager
    def patched(self):
        """The scaler class's methods replaced by this trace's, restored afterwards."""
        cls = torch.amp.GradScaler
        names = ("scale", "unscale_", "step", "update", "get_scale", "_get_growth_tracker")
        saved = {name: cls.__dict__[name] for name in names}
        replacements = {"scale": self.scale, "unscale_": self.unscale_, "step": self.step, "update": self.update,
                        "get_scale": self.item_read, "_get_growth_tracker": self.item_read}
        for name, method in replacements.items():
            setattr(cls, name, _as_method(method))
        try:
            yield
        finally:
            for name, method in saved.items():
                setattr(cls, name, method)

    # -- the traced methods (first argument: the user's scaler) --------------------------------------
    def _own(self, scaler: Any) -> None:
        if self.scaler is None:
            raise ScalerDiscovered(scaler)
        if scaler is not self.scaler:
            raise CaptureError("the step uses two GradScalers; a captured step may use one (for all its optimizers)")

    def scale(self, scaler: Any, outputs: Any) -> Any:
        if not scaler._enabled:
            return outputs
        self._own(scaler)
        scale = self.tensors["scale"]

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value * scale.to(device=value.device)
            if isinstance(value, (list, tuple)):
                return type(value)(apply(item) for item in value)
            raise CaptureError(f"scaler.scale() got a {type(value).__name__}; pass a tensor, or a list or tuple of tensors")

        return apply(outputs)

    def unscale_(self, scaler: Any, optimizer: Any) -> None:
        if not scaler._enabled:
            return
        self._own(scaler)
        state = self.optimizers.setdefault(id(optimizer), _OptimizerState())
        if state.stage != "ready":
            raise CaptureError(f"scaler.unscale_() called after {state.stage} in the same step (torch refuses it too)")
        inv_scale = self.tensors["scale"].double().reciprocal().float()
        grads = self.grads_of(optimizer)
        nonfinite = None
        for traced in grads:
            if traced.grad.dtype == torch.float16:
                raise CaptureError("Attempting to unscale FP16 gradients: keep the parameters in float32 (master weights) "
                                   "and compute in float16 with precision='fp16'")
            count = torch.logical_not(torch.isfinite(traced.grad)).sum()
            nonfinite = count if nonfinite is None else nonfinite + count
            traced.grad = traced.grad * inv_scale
        found = torch.zeros((), dtype=torch.float32) if nonfinite is None else (nonfinite > 0).to(torch.float32)
        state.stage, state.found_inf = "unscaled", found

    def step(self, scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if not scaler._enabled:
            return optimizer.step(*args, **kwargs)
        self._own(scaler)
        state = self.optimizers.setdefault(id(optimizer), _OptimizerState())
        if state.stage == "stepped":
            raise CaptureError("scaler.step() called twice for one optimizer in the same step")
        if state.stage == "ready":
            self.unscale_(scaler, optimizer)
        self.guard["found_inf"] = state.found_inf
        try:
            result = optimizer.step(*args, **kwargs)
        finally:
            self.guard["found_inf"] = None
        state.stage = "stepped"
        return result

    def update(self, scaler: Any, new_scale: Any = None) -> None:
        if not scaler._enabled:
            return
        self._own(scaler)
        if new_scale is not None:
            raise CaptureError("scaler.update(new_scale) is not captured; call scaler.update() in the step and set a "
                               "scale outside it (scaler.update(new_scale) between steps)")
        found = [state.found_inf for state in self.optimizers.values() if state.stage == "stepped"]
        if not found:
            raise CaptureError("scaler.update() without scaler.step(optimizer) in the step: no inf checks were recorded")
        found_inf = found[0]
        for more in found[1:]:
            found_inf = found_inf + more
        scale, tracker = self.tensors["scale"], self.tensors["growth_tracker"]
        new_scale_value, new_tracker = updated_scale(scale, tracker, found_inf, *scaler_settings(scaler))
        scale.copy_(new_scale_value)
        tracker.copy_(new_tracker)
        self.optimizers.clear()

    def item_read(self, scaler: Any, *args: Any) -> Any:
        raise CaptureError("scaler.get_scale() reads a tensor's value (.item()), which a captured step cannot do; "
                           "read it outside the step (after the call)")


def _as_method(bound: Callable) -> Callable:
    """A plain function (so the class binds the user's scaler as its first argument) calling ``bound``."""

    def method(scaler: Any, *args: Any, **kwargs: Any) -> Any:
        return bound(scaler, *args, **kwargs)

    method.__name__ = bound.__name__
    return method


def updated_scale(scale: torch.Tensor, tracker: torch.Tensor, found_inf: torch.Tensor, growth_factor: float,
                  backoff_factor: float, growth_interval: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch._amp_update_scale_`` without control flow: the same float32/float64 arithmetic, selected with ``where``."""
    skipped = found_inf != 0
    backed_off = (scale.double() * backoff_factor).float()
    successful = tracker + 1
    grow = successful == growth_interval
    grown = (scale.double() * growth_factor).float()
    grown = torch.where(torch.isfinite(grown), grown, scale)
    zero = torch.zeros_like(tracker)
    new_scale = torch.where(skipped, backed_off, torch.where(grow, grown, scale))
    new_tracker = torch.where(skipped, zero, torch.where(grow, zero, successful))
    return new_scale, new_tracker
