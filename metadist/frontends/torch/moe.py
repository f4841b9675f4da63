"""Mixture-of-experts layers as static shapes: capacity-bounded dispatch, stated and checked.

A routed experts layer sends each token to the ``k`` experts its router picked: how many tokens
an expert gets depends on the data. ``transformers``' own implementations follow the data (a
loop over the experts that were hit, ``nonzero``, or ``_grouped_mm`` with data-dependent
offsets), which a shape-only trace cannot capture. While a step is captured, MetaDist runs every
``transformers`` experts module (a class decorated ``@use_experts_implementation``: weights
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, ``forward(hidden_states, top_k_index,
top_k_weights)``) with :func:`static_experts_forward` instead: the same mathematics with static
shapes.

The formulation (GShard-style dispatch, one-hot matrices):

- the ``T`` tokens are cut into ``G`` groups of ``S`` consecutive tokens (:func:`group_size`);
- within a group, each expert has ``C`` slots; a token routed to expert ``e`` takes the next
  free slot of ``e`` in token order (``position = cumsum of the routing mask - 1``);
- ``dispatch[g, s, e, c]`` is 1 where token ``s`` of group ``g`` sits in slot ``c`` of expert
  ``e``; the expert inputs are ``bmm(dispatch^T, tokens)`` laid out ``[E, G*C, H]``; every expert
  runs as one ``bmm`` over the experts dim; ``combine`` (the dispatch scaled by the routing
  weights) sums the expert outputs back to the tokens.

**Equivalence**: with ``C = S`` (dropless, the default) no token can overflow (a token picks an
expert at most once, a group has ``S`` tokens), so the result equals the library's up to the
order of the final sum over the ``k`` picks (fp32 rounding); ``tests/test_moe.py`` checks it,
output and gradients, against the library's own ``grouped_mm`` path. With a capacity ``C < S``
(``capacity_factor``: ``C = ceil(capacity_factor * k * S / E)``), a token whose position at an
expert is ``C`` or more is dropped **for that expert only**: its other picks still count, and
its output lacks that expert's share (as GShard and Switch do). That changes the model's
mathematics; MetaIR states it: the captured graph carries one
:class:`~metadist.ir.routing.ExpertRouting` per experts call (``Graph.routing``), with its groups,
slots and whether it is dropless.

The experts dim ``E`` is an explicit batch dim of the expert ``bmm``s, so ShardCombine finds
that it can be split: sharding it across a mesh axis is expert parallelism, and moving the
dispatched tokens between ``Shard(G*C)`` (data parallel) and ``Shard(E)`` is an all-to-all.

Anything else that routes with data-dependent shapes fails to capture with an error naming the
module (:func:`uncovered_routing_hint`).
"""

from __future__ import annotations

import contextlib
import math
import types
from typing import Iterator

import torch

from ...ir.routing import ExpertRouting
from .errors import CaptureError

__all__ = [
    "ExpertRouting",
    "MIN_GROUP_TOKENS",
    "capacity_for",
    "group_size",
    "is_experts_module",
    "static_experts",
    "static_experts_forward",
    "uncovered_routing_hint",
]

MIN_GROUP_TOKENS = 16
"""Tokens per dispatch group are the smallest divisor of the token count that is at least this
(or all tokens): many groups keep the dispatch matrices small (``T * E * C`` elements) and let
the group dim split across the mesh, as the token dim does."""


def group_size(tokens: int) -> int:
    """``S``, the tokens per dispatch group: the smallest divisor of ``tokens`` that is at least
    :data:`MIN_GROUP_TOKENS` (``tokens`` itself when it is smaller)."""
    for size in range(min(MIN_GROUP_TOKENS, tokens), tokens + 1):
        if tokens % size == 0:
            return size
    return tokens


def capacity_for(group_tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int:
    """``C``: ``S`` when dropless (``capacity_factor`` None), else ``ceil(capacity_factor * k * S / E)``, at most ``S``."""
    if capacity_factor is None:
        return group_tokens
    if not capacity_factor > 0:
        raise CaptureError(f"capacity_factor must be positive (or None for dropless dispatch), got {capacity_factor!r}")
    return max(1, min(group_tokens, math.ceil(capacity_factor * top_k * group_tokens / num_experts)))


def is_experts_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` experts module (``@use_experts_implementation``)."""
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "has_gate") and hasattr(module, "down_proj")


def _check_covered(name: str, module: torch.nn.Module) -> None:
    """One line naming what of an experts module the static dispatch does not cover, and what to change."""
    where = f"experts module {name!r} ({type(module).__name__})"
    if getattr(module, "_is_expert_parallel", False):
        raise CaptureError(
            f"{where} is already expert-parallel (transformers' own distributed experts); MetaDist places the "
            "experts itself: build the model without a tensor/expert-parallel plan and let MetaDist shard it"
        )
    if getattr(module, "has_post_expert_norm", False):
        raise CaptureError(
            f"{where} applies a norm after each expert, which MetaDist's static expert dispatch does not cover "
            "yet; use a model whose experts have no post-expert norm"
        )
    for weight in ("gate_up_proj" if module.has_gate else "up_proj", "down_proj"):
        tensor = getattr(module, weight, None)
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
            raise CaptureError(
                f"{where}: {weight} is not a 3-D [experts, out, in] tensor (got "
                f"{type(tensor).__name__}{'' if tensor is None else tuple(getattr(tensor, 'shape', ()))}); "
                "MetaDist's static expert dispatch needs transformers' stacked expert weights"
            )


def static_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    capacity_factor: float | None = None,
    record: list[ExpertRouting] | None = None,
    name: str = "",
) -> torch.Tensor:
    """The experts' output for ``hidden_states [T, H]`` routed by ``top_k_index``/``top_k_weights [T, k]``,
    with static shapes (see the module docstring). Dropless unless ``capacity_factor`` is given."""
    tokens, hidden = hidden_states.shape  # (T, H)
    top_k = top_k_index.shape[-1]
    num_experts = module.num_experts
    group_tokens = group_size(tokens)
    groups = tokens // group_tokens
    capacity = capacity_for(group_tokens, top_k, num_experts, capacity_factor)
    if record is not None:
        record.append(ExpertRouting(module=name, num_experts=num_experts, top_k=top_k, tokens=tokens,
                                    groups=groups, group_tokens=group_tokens, capacity=capacity))
    device = hidden_states.device
    index = top_k_index.reshape(groups, group_tokens, top_k)  # (G, S, k)
    weights = top_k_weights.reshape(groups, group_tokens, top_k)  # (G, S, k)
    experts = torch.arange(num_experts, device=device)  # (E,)
    picked = index.unsqueeze(-1) == experts  # (G, S, k, E)
    routed = picked.any(dim=2)  # (G, S, E)
    token_weight = (weights.unsqueeze(-1) * picked).sum(dim=2)  # (G, S, E)
    position = torch.cumsum(routed.to(torch.int64), dim=1) - 1  # (G, S, E): slot of the token at each expert
    slots = torch.arange(capacity, device=device)  # (C,)
    in_slot = (position.unsqueeze(-1) == slots) & routed.unsqueeze(-1)  # (G, S, E, C); position >= C: dropped
    dispatch = in_slot.to(hidden_states.dtype).reshape(groups, group_tokens, num_experts * capacity)  # (G, S, E*C)
    tokens_in = hidden_states.reshape(groups, group_tokens, hidden)  # (G, S, H)
    expert_in = torch.bmm(dispatch.transpose(1, 2), tokens_in)  # (G, E*C, H)
    expert_in = expert_in.reshape(groups, num_experts, capacity, hidden).transpose(0, 1)  # (E, G, C, H)
    expert_in = expert_in.reshape(num_experts, groups * capacity, hidden)  # (E, G*C, H)
    expert_out = _run_experts(module, expert_in)  # (E, G*C, H)
    expert_out = expert_out.reshape(num_experts, groups, capacity, hidden).transpose(0, 1)  # (G, E, C, H)
    expert_out = expert_out.reshape(groups, num_experts * capacity, hidden)  # (G, E*C, H)
    combine = (in_slot * token_weight.unsqueeze(-1)).reshape(groups, group_tokens, num_experts * capacity)
    dtype = torch.promote_types(expert_out.dtype, combine.dtype)  # as the library: weighted in the weights' dtype
    output = torch.bmm(combine.to(dtype), expert_out.to(dtype))  # (G, S, H)
    return output.reshape(tokens, hidden).to(hidden_states.dtype)


def _run_experts(module: torch.nn.Module, expert_in: torch.Tensor) -> torch.Tensor:
    """Every expert on its slots: ``[E, N, H] -> [E, N, H]``, one ``bmm`` per projection."""
    if module.has_gate:
        projected = _batched_linear(module, expert_in, module.gate_up_proj, "gate_up_proj_bias")  # (E, N, 2I)
        projected = module._apply_gate(projected)  # (E, N, I)
    else:
        projected = module.act_fn(_batched_linear(module, expert_in, module.up_proj, "up_proj_bias"))  # (E, N, I)
    return _batched_linear(module, projected, module.down_proj, "down_proj_bias")  # (E, N, H)


def _batched_linear(module: torch.nn.Module, inputs: torch.Tensor, weight: torch.Tensor, bias_name: str) -> torch.Tensor:
    """``inputs [E, N, in]`` through each expert's weight (``[E, out, in]``, or ``[E, in, out]`` when transposed)."""
    inputs = inputs.to(weight.dtype)
    out = torch.bmm(inputs, weight if module.is_transposed else weight.transpose(1, 2))  # (E, N, out)
    if module.has_bias:
        out = out + getattr(module, bias_name).unsqueeze(1)  # (E, 1, out)
    return out


@contextlib.contextmanager
def static_experts(model: torch.nn.Module, *, capacity_factor: float | None = None,
                   record: list[ExpertRouting] | None = None) -> Iterator[list[ExpertRouting]]:
    """While inside, every ``transformers`` experts module of ``model`` runs :func:`static_experts_forward`.

    Yields the list of :class:`ExpertRouting` records, one per experts call traced. The modules'
    own ``forward`` is restored on exit; nothing else of the model changes.
    """
    record = [] if record is None else record
    patched: list[torch.nn.Module] = []
    try:
        for name, module in model.named_modules():
            if not is_experts_module(module):
                continue
            _check_covered(name, module)
            if "forward" in module.__dict__:
                raise CaptureError(
                    f"experts module {name!r} ({type(module).__name__}) has a forward set on the instance; "
                    "MetaDist replaces the experts' forward while capturing: set it on the class instead"
                )

            def forward(self, hidden_states, top_k_index, top_k_weights, _name=name):
                return static_experts_forward(self, hidden_states, top_k_index, top_k_weights,
                                              capacity_factor=capacity_factor, record=record, name=_name)

            module.forward = types.MethodType(forward, module)
            patched.append(module)
        yield record
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)


def uncovered_routing_hint(module: torch.nn.Module | None) -> str:
    """For a data-dependent failure inside ``module``: what MetaDist covers of mixture-of-experts
    routing and what to change, or "" when ``module`` does not look like part of an MoE layer."""
    if module is None:
        return ""
    names = {type(module).__name__.lower()}
    names.update(type(child).__name__.lower() for child in module.children())
    if not any("expert" in name or "moe" in name or "router" in name for name in names):
        return ""
    return (
        ". This looks like a mixture-of-experts layer that routes with data-dependent shapes, which MetaDist "
        "does not cover: MetaDist captures experts written as transformers' experts modules "
        "(@use_experts_implementation: gate_up_proj [E, 2I, H], down_proj [E, H, I], forward(hidden_states, "
        "top_k_index, top_k_weights)) with a static, capacity-bounded dispatch; write the experts that way, "
        "and route with fixed-shape ops (softmax/sigmoid, topk, gather)"
    )
