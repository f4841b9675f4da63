"""The user's workload contract (docs/design.md, "The user's contracts").

A model file for the CLI defines a function (default name ``workload``) that
returns a :class:`Workload`. This module imports no framework.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


class WorkloadError(ValueError):
    """A workload is malformed; the message says what to change."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One training workload: a model, a global batch, a loss and an optimizer factory."""

    model: Any
    """The model (a ``torch.nn.Module`` for PyTorch workloads)."""
    batch: Any
    """The global batch: a tensor, or a dict/tuple/list of tensors."""
    loss_fn: Callable[[Any, Any], Any]
    """``loss_fn(model, batch)`` returns the scalar loss."""
    optimizer: Callable[[Any], Any]
    """``optimizer(params)`` builds the optimizer, e.g. ``lambda p: torch.optim.AdamW(p, lr=1e-3)``."""
    name: str = ""
    """A short name for summaries."""
    description: str = ""
    """One line on what the workload is."""
    extras: dict = field(default_factory=dict)
    """Free-form facts about the workload (config, sizes) shown in summaries."""

    def __post_init__(self) -> None:
        if self.model is None:
            raise WorkloadError("Workload.model is None; pass the model to train")
        if not callable(self.loss_fn):
            raise WorkloadError(
                f"Workload.loss_fn must be callable as loss_fn(model, batch), got {type(self.loss_fn).__name__}"
            )
        if not callable(self.optimizer):
            raise WorkloadError(
                "Workload.optimizer must be a factory called with the parameters, e.g. "
                "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3); "
                f"got {type(self.optimizer).__name__}"
            )

    def train_step(self, scaler: Any = None) -> Callable[[Any, Any, Any], Any]:
        """The plain training step this workload stands for; with ``scaler`` (a ``torch.amp.GradScaler``) the loss is
        scaled and steps with inf/NaN gradients are skipped, as float16 training needs."""
        loss_fn = self.loss_fn

        def train_step(model: Any, optimizer: Any, batch: Any) -> Any:
            loss = loss_fn(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        def scaled_train_step(model: Any, optimizer: Any, batch: Any) -> Any:
            loss = loss_fn(model, batch)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            return loss

        return train_step if scaler is None else scaled_train_step
