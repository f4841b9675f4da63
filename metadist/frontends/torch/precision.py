"""A :class:`~metadist.ir.precision.PrecisionPolicy` applied while pass 1 traces the step.

The module is re-parametrised with each floating parameter cast to ``param_dtype`` (one ``_to_copy``
per parameter, shared by tied weights); autograd's backward of that cast brings the gradient back to
the parameter's own dtype, so the optimizer updates the float32 master copy with a float32 gradient.
Floating batch leaves are cast the same way. Everything else (buffers, integer inputs, the loss the
model computes) is the user's code, traced as it runs.

A float16 step without a GradScaler also reports, as a ``metric`` output, how many elements of its
float16 parameter gradients are subnormal (below 2**-14, where float16 loses precision; smaller ones
are already flushed to zero): the runtime warns when they are common (:func:`underflow_warning`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch

from ...ir import PrecisionPolicy

__all__ = ["autocast_off", "FLOAT16_SMALLEST_NORMAL", "SUBNORMAL_METRIC", "UNDERFLOW_WARN_FRACTION", "PolicyTrace", "underflow_warning"]

SUBNORMAL_METRIC = "fp16_subnormal_grad_elements"
"""Source name of the metric output: float16 parameter-gradient elements in (0, 2**-14)."""

FLOAT16_SMALLEST_NORMAL = 2.0 ** -14

UNDERFLOW_WARN_FRACTION = 1e-2
"""Warn when at least this share of the float16 gradient elements is subnormal: gradients spread over many orders
of magnitude, so about as many again lie below 2**-24 and are zero (a small model's well-scaled gradients, with
float16's full range in use, have a fraction of a percent there)."""


class PolicyTrace:
    """The casts of one trace, and (float16 without loss scaling) the hooks counting subnormal gradients."""

    def __init__(self, policy: PrecisionPolicy, watch_underflow: bool) -> None:
        self.policy = policy
        self.watch_underflow = watch_underflow and policy.needs_loss_scaling
        self.dtype = getattr(torch, policy.param_dtype) if policy.param_dtype else None
        self.counts: list[torch.Tensor] = []
        self.watched_numel = 0

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.dtype is None or not tensor.is_floating_point() or tensor.dtype == self.dtype:
            return tensor
        return tensor.to(self.dtype)

    def compute_params(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors the module computes with: each floating parameter cast once (its gradient watched)."""
        result = {}
        for name, tensor in params.items():
            cast = self._cast(tensor)
            if self.watch_underflow and cast is not tensor and cast.requires_grad:
                cast.register_hook(self._count_subnormal)
            result[name] = cast
        return result

    def batch(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Floating batch leaves cast to the compute dtype (``cast_forward_inputs``)."""
        if not self.policy.cast_forward_inputs:
            return leaves
        return [self._cast(leaf) for leaf in leaves]

    def _count_subnormal(self, grad: torch.Tensor) -> None:
        magnitude = grad.abs()
        self.counts.append(torch.logical_and(magnitude > 0, magnitude < FLOAT16_SMALLEST_NORMAL).sum())
        self.watched_numel += grad.numel()

    def metrics(self) -> list[tuple[str, torch.Tensor]]:
        """(source, 0-dim tensor) of each metric output of the step."""
        if not self.counts:
            return []
        total = self.counts[0]
        for count in self.counts[1:]:
            total = total + count
        return [(SUBNORMAL_METRIC, total)]


def underflow_warning(subnormal: int, watched_numel: int) -> str | None:
    """The warning for a float16 step without loss scaling whose gradients underflow, or None."""
    if watched_numel <= 0 or subnormal < UNDERFLOW_WARN_FRACTION * watched_numel:
        return None
    return (
        f"float16 gradients underflow: {subnormal} of {watched_numel} gradient elements ({subnormal / watched_numel:.1%}) "
        "are below 2**-14, where float16 loses precision, and smaller ones are already zero. Scale the loss: create "
        "scaler = torch.amp.GradScaler() and write the step as scaler.scale(loss).backward(); scaler.step(optimizer); "
        "scaler.update() (MetaDist captures it, skipped steps included), or train in bf16 (precision='bf16'), which "
        "has float32's range"
    )


def policy_of(value: Any) -> PrecisionPolicy:
    """A policy from a name (``fp32``, ``bf16``, ``fp16``), a policy, or None (float32 as stored)."""
    if value is None:
        return PrecisionPolicy()
    if isinstance(value, PrecisionPolicy):
        return value
    return PrecisionPolicy.named(str(value))


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Every ``torch.autocast`` region entered inside is a no-op (capturing a step written under autocast as its
    float32 twin, which ``--check`` measures the step's rounding against). Class-level, for the capture only."""
    cls = torch.amp.autocast_mode.autocast
    saved = cls.__dict__["__enter__"], cls.__dict__["__exit__"]

    def enter(self: Any) -> Any:
        return self

    def exit_(self: Any, *exc: Any) -> bool:
        return False

    cls.__enter__, cls.__exit__ = enter, exit_
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = saved
