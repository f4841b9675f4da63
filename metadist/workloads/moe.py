"""Built-in mixture-of-experts workloads: tiny ``transformers`` MoE causal LMs, as data.

Each is a ``transformers`` model built from a tiny config; every option not listed here keeps
the library's default (its default experts implementation, ``grouped_mm``, included: MetaDist
captures the experts with a static dispatch, :mod:`metadist.frontends.torch.moe`). The sizes
keep them small enough to check on CPUs in seconds while every MoE feature of the family is
present: routed experts with top-k routing, shared experts (Qwen2-MoE, DeepSeek-V3), grouped
routing with a score-correction bias and a dense first layer (DeepSeek-V3).

:mod:`.builtin` turns these rows into its ``BuiltinSpec``\\ s; the batch is a causal-LM batch.
"""

from __future__ import annotations

MOE_FAMILIES: dict[str, tuple[str, str, str]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "ForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", "ForCausalLM"),
}
"""family -> (transformers config class, model class, loss type)."""

_ATTENTION = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
"""What every tiny MoE shares: 2 layers, 64 wide, GQA 4/2 heads, vocab 1000."""

MOE_BUILTINS: tuple[tuple[str, str, str, dict], ...] = (
    ("mixtral-tiny", "Mixtral causal LM, tiny (2 layers, 64 wide, 4 experts, top-2)", "mixtral",
     dict(_ATTENTION, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)),
    ("mixtral-mini",
     "Mixtral causal LM, CPU-sized (2 layers, 128 wide, 8 experts of 512, top-2; expert weights dominate)",
     "mixtral",
     dict(_ATTENTION, hidden_size=128, intermediate_size=512, num_local_experts=8, num_experts_per_tok=2)),
    ("qwen2-moe-tiny", "Qwen2-MoE causal LM, tiny (2 layers, 64 wide, 4 experts, top-2, gated shared expert)",
     "qwen2_moe",
     dict(_ATTENTION, intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=128,
          num_experts=4, num_experts_per_tok=2)),
    ("qwen3-moe-tiny", "Qwen3-MoE causal LM, tiny (2 layers, 64 wide, 4 experts, top-2, QK norm)", "qwen3_moe",
     dict(_ATTENTION, head_dim=16, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
          num_experts_per_tok=2)),
    ("deepseek-v3-tiny",
     "DeepSeek-V3 causal LM, tiny (2 layers: dense then MoE; MLA; 4 routed experts in 2 groups, top-2, 1 shared)",
     "deepseek_v3",
     dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
          max_position_embeddings=256, intermediate_size=128, moe_intermediate_size=32, first_k_dense_replace=1,
          n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
          q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
)
"""(name, description, family, config) of each tiny built-in MoE (real CPU weights); batch 4 x 16
tokens, 4 x 32 for ``mixtral-mini`` (:data:`MOE_SEQ_LEN`)."""

MOE_LARGE_BUILTINS: tuple[tuple[str, str, str, dict], ...] = (
    ("mixtral-8x7b", "Mixtral 8x7B shapes (46.7B, 8 experts of 14336, top-2, GQA 32/8 heads)", "mixtral",
     dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
          num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
          rms_norm_eps=1e-5, tie_word_embeddings=False)),
)
"""Published MoE shapes, built on the meta device (planning only); batch 8 x 2048 tokens."""

MOE_SEQ_LEN: dict[str, int] = {"mixtral-mini": 32}
"""Sequence lengths other than 16."""

MOE_SUMMARY_KEYS: tuple[str, ...] = (
    "num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "first_k_dense_replace",
)
"""Config keys of the MoE families worth showing in a workload's summary."""
