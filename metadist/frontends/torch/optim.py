"""Functional optimizer updates with the numerics of torch's eager optimizers, hyperparameters live.

Capture cannot trace ``torch.optim.Adam/AdamW.step()`` as-is on CPU: with
``capturable=False`` the step count is read with ``.item()`` (a data-dependent
value), and ``capturable=True`` refuses CPU tensors. So capture replaces
``optimizer.step()`` with the update below: the same arithmetic, op for op, as
torch's single-tensor implementation, written out of place, with the step count
kept as a tensor (bias corrections computed in float64 exactly as Python does).
``tests/test_torch_capture.py`` checks it bit for bit against torch's eager step.

Hyperparameters are inputs, not constants. Every numeric hyperparameter of a
param group (learning rate, betas, eps, weight decay, momentum, dampening)
enters the captured step as a 0-dim float64 tensor (a Python float is a double),
read from ``optimizer.param_groups`` at every call, so a learning-rate schedule
(or any hand-written change) is followed without recompiling. Where torch's
kernel takes the value as a Scalar argument, the update uses an op that takes a
tensor and rounds the same way: ``a.add(b, alpha=s)`` becomes
``torch.addcmul(a, b, s)`` (measured equal, element for element, on CPU: both
compute ``a + s * b`` with one rounding), ``x.addcmul(g, g, value=v)`` becomes
``x.addcmul(g * v, g)`` (the kernel computes ``(v * g) * g`` too), and
``lerp``'s weight is rounded to the tensor's dtype as its Scalar overload does.

What a value cannot change without changing the graph is the group's
*structure*: the flags (``amsgrad``, ``maximize``, ``nesterov``...), whether
weight decay is on, whether SGD keeps a momentum buffer. :func:`optimizer_structure`
returns it; a change recompiles the step.

Each supported optimizer is described by a :class:`OptimizerSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from .errors import CaptureError

__all__ = [
    "SUPPORTED_OPTIMIZERS", "OptimizerSpec", "optimizer_spec", "initial_state", "functional_update",
    "hyperparameter_values", "optimizer_structure",
]

HYPERPARAMETER_DTYPE = torch.float64
"""Hyperparameters travel as doubles: Python computes with them as doubles in the eager optimizers."""


@dataclass(frozen=True)
class OptimizerSpec:
    """What MetaDist knows about one optimizer class."""

    name: str
    state_keys: Callable[[dict], tuple[str, ...]]
    """The per-parameter state keys for a param group."""
    hyperparameters: Callable[[dict], dict[str, float]]
    """The live numeric hyperparameters of a param group, by name (``betas`` as ``beta1``/``beta2``)."""
    structure: Callable[[dict], tuple]
    """What of a param group shapes the graph (flags, which terms exist); a change recompiles."""
    update: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    """``update(param, grad, state, hyper, group) -> (new_param, new_state)``, all out of place;
    ``hyper`` maps the names of :attr:`hyperparameters` to 0-dim float64 tensors, ``group`` gives the flags."""


_UNSUPPORTED_FLAGS = {
    "fused": "the fused kernel has its own numerics; build the optimizer with fused=False (the default on CPU)",
    "differentiable": "differentiable optimizers are not supported; build it with differentiable=False",
}


def _check_group(name: str, group: dict) -> None:
    for flag, why in _UNSUPPORTED_FLAGS.items():
        if group.get(flag):
            raise CaptureError(f"{name}({flag}=True) cannot be captured: {why}")


def _number(group: dict, key: str, index: int | None = None) -> float:
    """A hyperparameter as a Python float (tensor-valued ones, e.g. ``lr=torch.tensor(1e-3)``, included)."""
    value = group[key] if index is None else group[key][index]
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise CaptureError(f"hyperparameter {key} is a tensor of {value.numel()} elements; it must hold one number")
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise CaptureError(f"hyperparameter {key} is {value!r}; MetaDist follows numeric hyperparameters only")
    return float(value)


# -- SGD ---------------------------------------------------------------------


def _sgd_state_keys(group: dict) -> tuple[str, ...]:
    return ("momentum_buffer",) if _number(group, "momentum") != 0 else ()


def _sgd_hyperparameters(group: dict) -> dict[str, float]:
    return {key: _number(group, key) for key in ("lr", "momentum", "dampening", "weight_decay")}


def _sgd_structure(group: dict) -> tuple:
    return ("SGD", bool(group["maximize"]), bool(group["nesterov"]), _number(group, "momentum") != 0,
            _number(group, "weight_decay") != 0)


def _sgd_update(param: torch.Tensor, grad: torch.Tensor, state: dict, hyper: Mapping[str, torch.Tensor], group: dict):
    # Mirrors torch.optim.sgd._single_tensor_sgd; a.add(b, alpha=s) is written torch.addcmul(a, b, s).
    if group["maximize"]:
        grad = -grad
    if _number(group, "weight_decay") != 0:
        grad = torch.addcmul(grad, param, hyper["weight_decay"])
    new_state = {}
    if _number(group, "momentum") != 0:
        buf = torch.addcmul(state["momentum_buffer"].mul(hyper["momentum"]), grad, 1 - hyper["dampening"])
        new_state["momentum_buffer"] = buf
        grad = torch.addcmul(grad, buf, hyper["momentum"]) if group["nesterov"] else buf
    return torch.addcmul(param, grad, hyper["lr"].neg()), new_state


# -- Adam / AdamW ----------------------------------------------------------------


def _adam_state_keys(group: dict) -> tuple[str, ...]:
    keys = ("step", "exp_avg", "exp_avg_sq")
    return keys + ("max_exp_avg_sq",) if group["amsgrad"] else keys


def _adam_hyperparameters(group: dict) -> dict[str, float]:
    return {"lr": _number(group, "lr"), "beta1": _number(group, "betas", 0), "beta2": _number(group, "betas", 1),
            "eps": _number(group, "eps"), "weight_decay": _number(group, "weight_decay")}


def _adam_structure(name: str, decoupled: bool) -> Callable[[dict], tuple]:
    def structure(group: dict) -> tuple:
        return (name, decoupled, bool(group["amsgrad"]), bool(group["maximize"]), _number(group, "weight_decay") != 0)

    return structure


def _adam_update(param: torch.Tensor, grad: torch.Tensor, state: dict, hyper: Mapping[str, torch.Tensor], group: dict,
                 decoupled: bool):
    # Mirrors torch.optim.adam._single_tensor_adam with capturable=False.
    lr, beta1, beta2, eps = hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["eps"]
    if group["maximize"]:
        grad = -grad
    step = state["step"] + 1  # float32 scalar tensor, as torch keeps it
    if _number(group, "weight_decay") != 0:
        if decoupled:
            param = param.mul(1 - lr * hyper["weight_decay"])
        else:
            grad = torch.addcmul(grad, param, hyper["weight_decay"])
    exp_avg = torch.lerp(state["exp_avg"], grad, (1 - beta1).to(grad.dtype))
    exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul(grad.mul(1 - beta2), grad)
    # Bias corrections in float64, as Python computes them from step.item().
    step_f64 = step.to(torch.float64)
    bias_correction1 = 1 - torch.pow(beta1, step_f64)
    bias_correction2 = 1 - torch.pow(beta2, step_f64)
    step_size = torch.div(lr, bias_correction1)
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
        torch.optim.SGD: OptimizerSpec("SGD", _sgd_state_keys, _sgd_hyperparameters, _sgd_structure, _sgd_update),
        torch.optim.Adam: OptimizerSpec(
            "Adam", _adam_state_keys, _adam_hyperparameters, _adam_structure_of_adam,
            lambda p, g, s, h, group: _adam_update(p, g, s, h, group, bool(group.get("decoupled_weight_decay", False))),
        ),
        torch.optim.AdamW: OptimizerSpec(
            "AdamW", _adam_state_keys, _adam_hyperparameters, _adam_structure("AdamW", True),
            lambda p, g, s, h, group: _adam_update(p, g, s, h, group, True),
        ),
    }


def _adam_structure_of_adam(group: dict) -> tuple:
    return _adam_structure("Adam", bool(group.get("decoupled_weight_decay", False)))(group)


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
        spec.hyperparameters(group)  # every value must be a number
    _check_no_step_hooks(optimizer)
    return spec


def _check_no_step_hooks(optimizer: Any) -> None:
    """Step hooks run code inside ``optimizer.step()``, which the compiled step replaces: refuse them."""
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    hooks = (len(getattr(optimizer, "_optimizer_step_pre_hooks", {})) + len(getattr(optimizer, "_optimizer_step_post_hooks", {}))
             + len(_global_optimizer_pre_hooks) + len(_global_optimizer_post_hooks))
    if hooks:
        raise CaptureError(
            f"the optimizer has {hooks} step hook(s) (register_step_pre_hook/register_step_post_hook); the compiled step "
            "replaces optimizer.step(), so they would never run. Remove the hooks, or do their work in the training step"
        )


def hyperparameter_values(spec: OptimizerSpec, optimizer: Any) -> list[dict[str, float]]:
    """Per param group, the live hyperparameters (read at every call of a compiled step)."""
    return [spec.hyperparameters(group) for group in optimizer.param_groups]


def optimizer_structure(optimizer: Any) -> tuple:
    """What of the optimizer shapes the captured graph: its class, each group's size and structure flags.

    Parameters are counted, not identified: placing the state replaces them by their DTensors.
    """
    if optimizer is None:
        return ()
    spec = optimizer_spec(optimizer)
    return (type(optimizer).__qualname__,) + tuple(
        (len(group["params"]), spec.structure(group)) for group in optimizer.param_groups
    )


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
            if _number(group, "dampening") != 0:
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


def functional_update(spec: OptimizerSpec, param, grad, state, hyper, group):
    return spec.update(param, grad, state, hyper, group)
