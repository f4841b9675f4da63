"""Functional optimizer updates with the numerics of torch's eager optimizers.

Capture cannot trace ``torch.optim.Adam/AdamW.step()`` as-is on CPU: with
``capturable=False`` the step count is read with ``.item()`` (a data-dependent
value), and ``capturable=True`` refuses CPU tensors. So capture replaces
``optimizer.step()`` with the update below: the same arithmetic, op for op, as
torch's single-tensor implementation, written out of place, with the step count
kept as a tensor (bias corrections computed in float64 exactly as Python does).
``tests/test_torch_optim.py`` checks it bit for bit against torch's eager step.

Each supported optimizer is described by a :class:`OptimizerSpec`: which state
tensors it keeps per parameter and how to initialise them (as torch does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import CaptureError

__all__ = ["SUPPORTED_OPTIMIZERS", "OptimizerSpec", "optimizer_spec", "initial_state", "functional_update"]


@dataclass(frozen=True)
class OptimizerSpec:
    """What MetaDist knows about one optimizer class."""

    name: str
    state_keys: Callable[[dict], tuple[str, ...]]
    """The per-parameter state keys for a param group's hyperparameters."""
    update: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    """``update(param, grad, state, group) -> (new_param, new_state)``, all out of place."""


_UNSUPPORTED_FLAGS = {
    "fused": "the fused kernel has its own numerics; build the optimizer with fused=False (the default on CPU)",
    "differentiable": "differentiable optimizers are not supported; build it with differentiable=False",
}


def _check_group(name: str, group: dict) -> None:
    for flag, why in _UNSUPPORTED_FLAGS.items():
        if group.get(flag):
            raise CaptureError(f"{name}({flag}=True) cannot be captured: {why}")
    for key in ("lr", "weight_decay", "momentum", "betas", "eps"):
        value = group.get(key)
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(item, torch.Tensor) for item in values):
            raise CaptureError(
                f"{name} has a tensor-valued hyperparameter {key}; MetaDist captures hyperparameters as constants. "
                f"Pass {key} as a Python float"
            )


# -- SGD ---------------------------------------------------------------------


def _sgd_state_keys(group: dict) -> tuple[str, ...]:
    return ("momentum_buffer",) if group["momentum"] != 0 else ()


def _sgd_update(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict):
    # Mirrors torch.optim.sgd._single_tensor_sgd.
    lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
    weight_decay, nesterov = group["weight_decay"], group["nesterov"]
    if group["maximize"]:
        grad = -grad
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    new_state = {}
    if momentum != 0:
        buf = state["momentum_buffer"].mul(momentum).add(grad, alpha=1 - dampening)
        new_state["momentum_buffer"] = buf
        grad = grad.add(buf, alpha=momentum) if nesterov else buf
    return param.add(grad, alpha=-lr), new_state


# -- Adam / AdamW ----------------------------------------------------------------


def _adam_state_keys(group: dict) -> tuple[str, ...]:
    keys = ("step", "exp_avg", "exp_avg_sq")
    return keys + ("max_exp_avg_sq",) if group["amsgrad"] else keys


def _adam_update(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, decoupled: bool):
    # Mirrors torch.optim.adam._single_tensor_adam with capturable=False.
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if group["maximize"]:
        grad = -grad
    step = state["step"] + 1  # float32 scalar tensor, as torch keeps it
    if weight_decay != 0:
        if decoupled:
            param = param.mul(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg = torch.lerp(state["exp_avg"], grad, 1 - beta1)
    exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul(grad, grad, value=1 - beta2)
    # Bias corrections in float64, as Python computes them from step.item().
    step_f64 = step.to(torch.float64)
    bias_correction1 = 1 - torch.pow(beta1, step_f64)
    bias_correction2 = 1 - torch.pow(beta2, step_f64)
    step_size = torch.div(torch.full((), lr, dtype=torch.float64, device=step.device), bias_correction1)
    bias_correction2_sqrt = torch.pow(bias_correction2, torch.full((), 0.5, dtype=torch.float64, device=step.device))
    new_state = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    second_moment = exp_avg_sq
    if group["amsgrad"]:
        second_moment = torch.maximum(state["max_exp_avg_sq"], exp_avg_sq)
        new_state["max_exp_avg_sq"] = second_moment
    denom = (second_moment.sqrt() / bias_correction2_sqrt).add(eps)
    # param.addcdiv_(exp_avg, denom, value=-step_size) computes param + ((-step_size) * exp_avg) / denom.
    new_param = param + torch.mul(exp_avg, step_size.neg()) / denom
    return new_param, new_state


def _optimizer_specs() -> dict[type, OptimizerSpec]:
    return {
        torch.optim.SGD: OptimizerSpec("SGD", _sgd_state_keys, _sgd_update),
        torch.optim.Adam: OptimizerSpec(
            "Adam", _adam_state_keys, lambda p, g, s, group: _adam_update(p, g, s, group, group.get("decoupled_weight_decay", False))
        ),
        torch.optim.AdamW: OptimizerSpec("AdamW", _adam_state_keys, lambda p, g, s, group: _adam_update(p, g, s, group, True)),
    }


SUPPORTED_OPTIMIZERS = ("torch.optim.SGD", "torch.optim.Adam", "torch.optim.AdamW")


def optimizer_spec(optimizer: Any) -> OptimizerSpec:
    """The spec for the user's optimizer, or a clear error if it cannot be captured."""
    specs = _optimizer_specs()
    spec = specs.get(type(optimizer))
    if spec is None:
        raise CaptureError(
            f"optimizer {type(optimizer).__module__}.{type(optimizer).__qualname__} cannot be captured: MetaDist "
            f"knows the update rules of {', '.join(SUPPORTED_OPTIMIZERS)} (subclasses are not assumed to behave alike). "
            "Use one of these, or pass optimizer=None and update the parameters inside the step yourself"
        )
    for group in optimizer.param_groups:
        _check_group(spec.name, group)
    return spec


def initial_state(spec: OptimizerSpec, param: torch.Tensor, group: dict, existing: dict) -> dict[str, torch.Tensor]:
    """The state torch would hold for ``param`` before the next step.

    Existing state is kept; missing state is created the way torch creates it
    lazily (zeros, and a float32 CPU step count of 0 for Adam/AdamW).
    """
    keys = spec.state_keys(group)
    state: dict[str, torch.Tensor] = {}
    for key in keys:
        if key in existing and existing[key] is not None:
            state[key] = existing[key]
            continue
        if key == "step":
            state[key] = torch.tensor(0.0, dtype=torch.float32, device="cpu" if param.device.type != "meta" else "meta")
        elif key == "momentum_buffer":
            if group["dampening"] != 0:
                raise CaptureError(
                    "SGD with momentum and dampening != 0 copies the first gradient into a fresh momentum buffer, "
                    "which a fixed graph cannot reproduce. Take one eager optimizer step before capturing, "
                    "or use dampening=0"
                )
            # torch copies the first gradient; with dampening == 0, 0 * momentum + grad is that copy.
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
        else:
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
    unknown = set(existing) - set(keys)
    if unknown:
        raise CaptureError(
            f"{spec.name} state of a parameter has keys {sorted(unknown)} that MetaDist does not know; "
            "was the optimizer's state loaded from another optimizer?"
        )
    return state


def functional_update(spec: OptimizerSpec, param, grad, state, group):
    return spec.update(param, grad, state, group)
