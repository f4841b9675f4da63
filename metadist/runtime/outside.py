"""``model(x)`` between compiled steps: the module runs on full copies of its sharded state.

After a step is compiled the model holds DTensor shards (:mod:`.model_state`).
Evaluation or sampling with the model itself (``model.eval(); model(x)``) must
still give the trained model's output, as with FSDP2. Hooks on every module do
what FSDP2's pre-forward unshard does: when a module is called and no enclosing
call has done it yet, every DTensor parameter and buffer of its subtree is
all-gathered into a plain full tensor for the duration of the call, and the
shards are put back when it returns (or raises). So the call is collective: run
it on every rank, as every rank runs the step.

The gathered tensors do not require gradients: training goes through the
compiled step, and a ``backward()`` through such a call fails loudly instead
of training a copy that is thrown away. Memory: the whole model is gathered for
the call; for large models compile an evaluation function
(``metadist.compile`` on ``eval_step(model, batch)``), which keeps the state
sharded where it lies.

Inside MetaDist's own capture the module holds fake tensors, not DTensors, so
the hooks find nothing to gather and stay out of the way.
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["enable_outside_forward"]

_HOOKED_ATTR = "_metadist_outside_forward"
_active = threading.local()


def enable_outside_forward(model: nn.Module) -> None:
    """Install the gather-on-call hooks on every module of ``model`` (once)."""
    for module in model.modules():
        if getattr(module, _HOOKED_ATTR, False):
            continue
        module.register_forward_pre_hook(_before)
        module.register_forward_hook(_after, always_call=True)
        object.__setattr__(module, _HOOKED_ATTR, True)


def _before(module: nn.Module, args) -> None:
    stack = getattr(_active, "stack", None)
    if stack is None:
        stack = _active.stack = []
    if stack:  # an enclosing call has gathered this subtree already
        stack.append(None)
        return
    stack.append(_gather_subtree(module))


def _after(module: nn.Module, args, output) -> None:
    stack = _active.stack
    swapped = stack.pop()
    if swapped:
        for table, attr, sharded in swapped:
            table[attr] = sharded


def _gather_subtree(module: nn.Module) -> list[tuple[dict, str, DTensor]]:
    """Swap every DTensor parameter and buffer under ``module`` for its full value; return what to put back."""
    swapped: list[tuple[dict, str, DTensor]] = []
    full_of: dict[int, torch.Tensor] = {}  # tied tensors are gathered once
    with torch.no_grad():
        for sub in module.modules():
            for table in (sub._parameters, sub._buffers):
                for attr, tensor in list(table.items()):
                    if not isinstance(tensor, DTensor):
                        continue
                    full = full_of.get(id(tensor))
                    if full is None:
                        full = full_of[id(tensor)] = tensor.full_tensor()
                    swapped.append((table, attr, tensor))
                    table[attr] = full
    return swapped
