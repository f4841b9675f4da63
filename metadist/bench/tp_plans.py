"""Megatron-style tensor-parallel plans for the built-in models (``parallelize_module`` styles).

Each transformer block gets the Megatron split: the projections that fan out (attention
q/k/v, MLP up/gate) are ``ColwiseParallel``, the ones that fan back in (attention output,
MLP down) are ``RowwiseParallel``, so each block costs one all-reduce forward and one
backward per sub-layer. Embeddings, norms and the LM head stay replicated (no vocabulary
parallelism), which is what "Megatron-style TP" means in these tables.

GPT-2 stores its projections as ``transformers`` ``Conv1D`` (``y = x @ W + b``, ``W`` of shape
``(in, out)``), which the parallel styles do not know. :func:`convert_gpt2_for_tp` replaces each
with the equivalent ``nn.Linear`` (weight ``W.T``), and permutes the fused q/k/v projection so that
a column shard holds ``[q_r, k_r, v_r]`` for its heads, then sets the attention's ``split_size`` to
the local width. The converted model computes the same function as the original.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TensorParallelUnavailable(ValueError):
    """A model cannot take the Megatron-style plan at this degree; the message says why."""


def megatron_plan(model: nn.Module, family: str, tp_degree: int) -> dict[str, Any]:
    """The ``parallelize_module`` plan of ``model`` (module path -> ParallelStyle)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel(), RowwiseParallel()
    if family == "mlp":
        _check_divisible("hidden features", model.fc1.out_features, tp_degree)
        return {"fc1": col, "fc2": row}
    if family == "llama":
        config = model.config
        _check_heads(config.num_attention_heads, config.num_key_value_heads, tp_degree)
        return _per_layer("model.layers", len(model.model.layers), {
            "self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col, "self_attn.o_proj": row,
            "mlp.gate_proj": col, "mlp.up_proj": col, "mlp.down_proj": row,
        })
    if family in ("mixtral", "qwen3_moe"):
        # Attention as Llama's; the experts are stacked 3-D parameters the parallel styles do not split, so
        # they stay replicated (every rank runs every expert on all tokens): the experts' TP is MetaDist's to find.
        config = model.config
        _check_heads(config.num_attention_heads, config.num_key_value_heads, tp_degree)
        return _per_layer("model.layers", len(model.model.layers), {
            "self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col, "self_attn.o_proj": row,
        })
    if family == "bert":
        config = model.config
        _check_heads(config.num_attention_heads, config.num_attention_heads, tp_degree)
        return _per_layer("bert.encoder.layer", len(model.bert.encoder.layer), {
            "attention.self.query": col, "attention.self.key": col, "attention.self.value": col,
            "attention.output.dense": row, "intermediate.dense": col, "output.dense": row,
        })
    if family == "gpt2":
        config = model.config
        _check_heads(config.n_head, config.n_head, tp_degree)
        return _per_layer("transformer.h", len(model.transformer.h), {
            "attn.c_attn": col, "attn.c_proj": row, "mlp.c_fc": col, "mlp.c_proj": row,
        })
    raise TensorParallelUnavailable(
        f"no Megatron-style plan for the {family!r} family (it has no transformer blocks to split); "
        "use a transformer or mlp workload for the tp rows"
    )


def convert_gpt2_for_tp(model: nn.Module, tp_degree: int) -> None:
    """Replace GPT-2's ``Conv1D`` projections by equivalent ``nn.Linear`` ones, in place (see module doc)."""
    for block in model.transformer.h:
        attn = block.attn
        embed = attn.embed_dim
        order = _qkv_order(embed, tp_degree)  # (3E,) output feature permutation
        attn.c_attn = _linear_from_conv1d(attn.c_attn, order)
        attn.c_proj = _linear_from_conv1d(attn.c_proj)
        attn.split_size = embed // tp_degree  # q, k, v of the local heads
        block.mlp.c_fc = _linear_from_conv1d(block.mlp.c_fc)
        block.mlp.c_proj = _linear_from_conv1d(block.mlp.c_proj)


def _qkv_order(embed: int, tp_degree: int) -> torch.Tensor:
    """Output features of the fused q/k/v projection regrouped as [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]."""
    width = embed // tp_degree
    pieces = []
    for shard in range(tp_degree):
        for block in range(3):  # q, k, v
            start = block * embed + shard * width
            pieces.append(torch.arange(start, start + width))
    return torch.cat(pieces)


def _linear_from_conv1d(conv: nn.Module, order: torch.Tensor | None = None) -> nn.Linear:
    weight = conv.weight.detach().t()  # Conv1D (in, out) -> Linear (out, in)
    bias = conv.bias.detach()
    if order is not None:
        weight, bias = weight[order], bias[order]
    linear = nn.Linear(weight.shape[1], weight.shape[0], device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    return linear


def _per_layer(prefix: str, count: int, styles: dict[str, Any]) -> dict[str, Any]:
    return {f"{prefix}.{index}.{path}": style for index in range(count) for path, style in styles.items()}


def _check_heads(heads: int, kv_heads: int, tp_degree: int) -> None:
    if heads % tp_degree or kv_heads % tp_degree:
        raise TensorParallelUnavailable(
            f"{heads} attention heads ({kv_heads} key/value heads) do not split over {tp_degree} tensor-parallel "
            f"ranks; use a TP degree that divides both"
        )


def _check_divisible(what: str, size: int, tp_degree: int) -> None:
    if size % tp_degree:
        raise TensorParallelUnavailable(f"{what} ({size}) do not split over {tp_degree} tensor-parallel ranks")
