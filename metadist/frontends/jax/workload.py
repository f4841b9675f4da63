"""The JAX workload contract: params, batch, a loss and an optax optimizer, as pytrees.

A JAX training step is a pure function, so the workload names its pieces and
the frontend writes the step itself (:meth:`JaxWorkload.train_step`)::

    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return loss, params, opt_state
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import JaxCaptureError

__all__ = ["JaxWorkload"]


@dataclass(frozen=True, kw_only=True)
class JaxWorkload:
    """One JAX training workload. Every array is global (the whole batch, unsharded)."""

    params: Any
    """The parameters: a pytree of arrays (e.g. a nested dict)."""
    batch: Any
    """The global batch: a pytree of arrays."""
    loss_fn: Callable[[Any, Any], Any]
    """``loss_fn(params, batch)`` returns the scalar loss."""
    optimizer: Any
    """An optax ``GradientTransformation`` (``init``/``update``), e.g. ``optax.adamw(1e-3)``."""
    opt_state: Any = None
    """The optimizer state; ``optimizer.init(params)`` when None."""
    name: str = ""
    """A short name for summaries."""
    description: str = ""
    """One line on what the workload is."""
    extras: dict = field(default_factory=dict)
    """Free-form facts about the workload (config, sizes) shown in summaries."""

    def __post_init__(self) -> None:
        if not callable(self.loss_fn):
            raise JaxCaptureError(
                f"JaxWorkload.loss_fn must be callable as loss_fn(params, batch), got {type(self.loss_fn).__name__}"
            )
        if not (hasattr(self.optimizer, "init") and hasattr(self.optimizer, "update")):
            raise JaxCaptureError(
                "JaxWorkload.optimizer must be an optax GradientTransformation (with init and update), "
                f"e.g. optax.adamw(1e-3); got {type(self.optimizer).__name__}"
            )
        if self.opt_state is None:
            object.__setattr__(self, "opt_state", self.optimizer.init(self.params))

    def train_step(self) -> Callable[[Any, Any, Any], tuple[Any, Any, Any]]:
        """The pure step ``(params, opt_state, batch) -> (loss, new_params, new_opt_state)``."""
        import jax
        import optax

        loss_fn, optimizer = self.loss_fn, self.optimizer

        def train_step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Any]:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, new_opt_state = optimizer.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            return loss, new_params, new_opt_state

        return train_step
