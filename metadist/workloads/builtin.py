"""Built-in workloads: well-known model shapes, random-initialised, nothing downloaded.

Each built-in is a :class:`BuiltinSpec` (pure data: family, model config, default shapes). The
transformer families are built from ``transformers`` config classes with the library's defaults:
its default attention (``scaled_dot_product_attention``: the fused attention kernels, or, with
attention dropout in training, its matmul/softmax/dropout form) and its default dropout (so random
ops are captured). ``attn_implementation="eager"`` builds them with eager attention instead.

Tiny models default to the CPU with real weights, seeded so that the same name gives the same
weights every time. Everything else defaults to the ``meta`` device: parameters have shapes
and no storage, so ``llama-7b`` builds in well under a second and allocates nothing. Batches
are always real, small CPU tensors drawn from a seeded ``torch.Generator``.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..workload import Workload, WorkloadError
from .models import MLP, SmallCNN
from .moe import MOE_BUILTINS, MOE_FAMILIES, MOE_LARGE_BUILTINS, MOE_SEQ_LEN, MOE_SUMMARY_KEYS

logger = logging.getLogger(__name__)

SEED = 0
"""Seed of the weight initialisation (real devices) and of every batch."""

BERT_MASK_TOKEN_ID = 103
"""The ``[MASK]`` id of the BERT vocabulary; also valid in the tiny vocabularies."""

BERT_MASK_PROBABILITY = 0.15
"""Share of tokens a masked-LM batch masks and predicts."""


@dataclass(frozen=True, kw_only=True)
class BuiltinSpec:
    """One built-in workload, as data."""

    name: str
    """The name the CLI and :func:`builtin_workload` take."""
    description: str
    """What the model is, in a few words."""
    family: str
    """``mlp``, ``cnn``, ``gpt2``, ``llama``, ``bert`` or an MoE family of :mod:`.moe`: selects the model and batch builders."""
    tiny: bool
    """Tiny models default to real CPU weights; the others to the meta device."""
    batch_size: int
    """Default global batch size."""
    seq_len: int | None
    """Default sequence length; None for models without a sequence dim."""
    config: dict
    """Keyword arguments of the model (torch module) or of its ``transformers`` config class."""


def _gpt2(name: str, what: str, n_layer: int, n_embd: int, n_head: int, *, tiny: bool = False) -> BuiltinSpec:
    vocab_size = 1000 if tiny else 50257
    config = dict(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        vocab_size=vocab_size,
        n_positions=256 if tiny else 1024,
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
    )
    return BuiltinSpec(
        name=name, description=f"GPT-2 {what} causal LM", family="gpt2", tiny=tiny,
        batch_size=4 if tiny else 8, seq_len=16 if tiny else 1024, config=config,
    )


LLAMA_3_2_ROPE = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)
"""The rope scaling of Llama 3.2 (passed as the legacy ``rope_scaling``, which transformers 4 and 5 accept)."""

SPECS: tuple[BuiltinSpec, ...] = (
    BuiltinSpec(
        name="mlp", description="3-layer MLP classifier (64 -> 256 -> 256 -> 10, GELU)", family="mlp",
        tiny=True, batch_size=32, seq_len=None,
        config=dict(in_features=64, hidden_features=256, num_classes=10),
    ),
    BuiltinSpec(
        name="cnn", description="small CNN classifier on 3x16x16 images (Conv2d, BatchNorm2d, ReLU, MaxPool2d)",
        family="cnn", tiny=True, batch_size=8, seq_len=None,
        config=dict(in_channels=3, image_size=16, channels=16, num_classes=10),
    ),
    _gpt2("gpt2-tiny", "tiny (2 layers, 64 wide, vocab 1000)", 2, 64, 4, tiny=True),
    _gpt2("gpt2-small", "small (124M)", 12, 768, 12),
    _gpt2("gpt2-medium", "medium (355M)", 24, 1024, 16),
    _gpt2("gpt2-large", "large (774M)", 36, 1280, 20),
    _gpt2("gpt2-xl", "XL (1.5B)", 48, 1600, 25),
    BuiltinSpec(
        name="llama-tiny", description="Llama causal LM, tiny (2 layers, 64 wide, GQA 4/2 heads, vocab 1000)",
        family="llama", tiny=True, batch_size=4, seq_len=16,
        config=dict(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
    ),
    BuiltinSpec(
        name="llama-1b", description="Llama 3.2 1B shapes (1.24B, GQA 32/8 heads, tied embeddings)",
        family="llama", tiny=False, batch_size=8, seq_len=2048,
        config=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA_3_2_ROPE,
                    tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
    ),
    BuiltinSpec(
        name="llama-7b", description="Llama 2 7B shapes (6.7B)",
        family="llama", tiny=False, batch_size=8, seq_len=2048,
        config=dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    ),
    BuiltinSpec(
        name="llama-70b", description="Llama 2 70B shapes (69B, GQA 64/8 heads); a batch of 1024 x 4096 tokens (Llama 2's 4M)",
        family="llama", tiny=False, batch_size=1024, seq_len=4096,
        config=dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                    num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    ),
    BuiltinSpec(
        name="bert-tiny", description="BERT masked LM, tiny (2 layers, 128 wide, 2 heads, vocab 1000)",
        family="bert", tiny=True, batch_size=4, seq_len=16,
        config=dict(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=512, max_position_embeddings=256),
    ),
    BuiltinSpec(
        name="bert-base", description="BERT-base masked LM (110M)",
        family="bert", tiny=False, batch_size=8, seq_len=512,
        config=dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    intermediate_size=3072, max_position_embeddings=512),
    ),
) + tuple(
    BuiltinSpec(name=name, description=description, family=family, tiny=True, batch_size=4,
                seq_len=MOE_SEQ_LEN.get(name, 16), config=config)
    for name, description, family, config in MOE_BUILTINS
) + tuple(
    BuiltinSpec(name=name, description=description, family=family, tiny=False, batch_size=8, seq_len=2048, config=config)
    for name, description, family, config in MOE_LARGE_BUILTINS
)

BUILTINS: dict[str, BuiltinSpec] = {spec.name: spec for spec in SPECS}
BUILTIN_NAMES: tuple[str, ...] = tuple(BUILTINS)

# family -> (transformers config class, transformers model class, transformers loss type or None)
_HF_FAMILIES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "ForCausalLM"),
    "bert": ("BertConfig", "BertForMaskedLM", None),
    **MOE_FAMILIES,
}

CAUSAL_FAMILIES = ("gpt2", "llama", *MOE_FAMILIES)
"""Families whose batch is a causal-LM batch (the model shifts the labels itself)."""

# Config keys copied into ``Workload.extras["config"]``.
_SUMMARY_KEYS = (
    "model_type", "vocab_size", "n_layer", "n_embd", "n_head", "n_positions", "hidden_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "max_position_embeddings", "tie_word_embeddings", "_attn_implementation", *MOE_SUMMARY_KEYS,
)


# ---------------------------------------------------------------- loss and optimizers


def hf_loss(model: Any, batch: dict) -> torch.Tensor:
    """The loss of a ``transformers`` model given its labels in the batch."""
    return model(**batch).loss


def classification_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Cross-entropy of ``model(inputs)`` against integer ``targets``."""
    return F.cross_entropy(model(batch["inputs"]), batch["targets"])


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {"adamw": adamw, "adam": adam, "sgd": sgd}


# ---------------------------------------------------------------- public entry point


def builtin_workload(
    name: str,
    *,
    device: str | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    optimizer: str = "adamw",
    attn_implementation: str | None = None,
) -> Workload:
    """Build the built-in workload ``name`` (one of :data:`BUILTIN_NAMES`).

    ``device`` defaults to ``"cpu"`` for tiny models and ``"meta"`` for the others; on ``meta``
    the parameters have no storage. ``batch_size`` and ``seq_len`` override the defaults;
    ``optimizer`` is ``"adamw"``, ``"adam"`` or ``"sgd"``. The batch is always on the CPU.
    ``attn_implementation`` is passed to the ``transformers`` config (``"eager"``, ``"sdpa"``...);
    None keeps the library's default (SDPA).
    """
    spec = lookup_builtin(name)
    make_optimizer = optimizer_factory(optimizer)
    target = _resolve_device(spec, device)
    batch_size, seq_len = _resolve_shapes(spec, batch_size, seq_len)
    model, config_summary = _build_model(spec, target, seq_len, attn_implementation)
    batch = _make_batch(spec, batch_size, seq_len)
    loss_fn = classification_loss if spec.family in ("mlp", "cnn") else hf_loss
    shape = f"{batch_size} x {seq_len} tokens" if seq_len is not None else f"{batch_size} samples"
    params = sum(p.numel() for p in model.parameters())
    logger.debug("built %s on %s: %d parameters", spec.name, target, params)
    return Workload(
        model=model,
        batch=batch,
        loss_fn=loss_fn,
        optimizer=make_optimizer,
        name=spec.name,
        description=f"{spec.description}; random init; batch {shape}; {optimizer}",
        extras={
            "family": spec.family,
            "config": config_summary,
            "params": params,
            "device": str(target),
            "batch_size": batch_size,
            "seq_len": seq_len,
            "batch_shapes": {key: tuple(value.shape) for key, value in batch.items()},
            "optimizer": optimizer,
        },
    )


def lookup_builtin(name: str) -> BuiltinSpec:
    """The spec of ``name``, or a WorkloadError listing the valid names and the closest one."""
    spec = BUILTINS.get(name)
    if spec is not None:
        return spec
    raise WorkloadError(unknown_builtin_message(name))


def unknown_builtin_message(name: str) -> str:
    close = difflib.get_close_matches(name, BUILTIN_NAMES, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"unknown built-in workload {name!r}.{hint} Valid built-ins: {', '.join(BUILTIN_NAMES)}. "
        "To train your own model, pass a model file as path/to/file.py[:function]."
    )


# ---------------------------------------------------------------- validation


def optimizer_factory(optimizer: str) -> Callable[[Any], torch.optim.Optimizer]:
    factory = OPTIMIZERS.get(optimizer)
    if factory is None:
        raise WorkloadError(
            f"unknown optimizer {optimizer!r} for a built-in workload; choose one of {', '.join(OPTIMIZERS)}, "
            "or write a model file whose Workload passes its own optimizer factory"
        )
    return factory


def _resolve_device(spec: BuiltinSpec, device: str | None) -> torch.device:
    if device is None:
        device = "cpu" if spec.tiny else "meta"
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise WorkloadError(
            f"device {device!r} for built-in {spec.name!r} is not a torch device ({err}); "
            "use 'cpu', 'meta' (shapes only, no memory) or 'cuda'"
        ) from err
    if target.type == "cuda" and not torch.cuda.is_available():
        raise WorkloadError(
            f"device {device!r} asked for built-in {spec.name!r}, but this machine has no CUDA device; "
            "use 'cpu' or 'meta'"
        )
    return target


def _resolve_shapes(spec: BuiltinSpec, batch_size: int | None, seq_len: int | None) -> tuple[int, int | None]:
    batch_size = spec.batch_size if batch_size is None else batch_size
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise WorkloadError(f"batch_size must be a positive integer, got {batch_size!r}")
    if spec.seq_len is None:
        if seq_len is not None:
            raise WorkloadError(
                f"built-in {spec.name!r} has no sequence dim, so seq_len={seq_len!r} means nothing; "
                "drop seq_len, or pick a transformer built-in"
            )
        return batch_size, None
    seq_len = spec.seq_len if seq_len is None else seq_len
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise WorkloadError(f"seq_len must be a positive integer, got {seq_len!r}")
    max_positions = spec.config.get("n_positions", spec.config.get("max_position_embeddings"))
    if max_positions is not None and seq_len > max_positions:
        raise WorkloadError(
            f"seq_len={seq_len} is longer than built-in {spec.name!r} supports ({max_positions} positions); "
            f"pass seq_len <= {max_positions}"
        )
    return batch_size, seq_len


# ---------------------------------------------------------------- models


def _build_model(spec: BuiltinSpec, target: torch.device, seq_len: int | None,
                 attn_implementation: str | None = None) -> tuple[nn.Module, dict]:
    """Construct the model: on meta without storage, otherwise seeded on the CPU, then moved."""
    if target.type == "meta":
        with torch.device("meta"):
            model, summary = _construct(spec, attn_implementation)
    else:
        # Seed a forked RNG, so the weights are reproducible and the caller's RNG is untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model, summary = _construct(spec, attn_implementation)
        if target.type != "cpu":
            model = model.to(target)
    model.train()
    return model, summary


def _construct(spec: BuiltinSpec, attn_implementation: str | None = None) -> tuple[nn.Module, dict]:
    if spec.family == "mlp":
        return MLP(**spec.config), dict(spec.config)
    if spec.family == "cnn":
        return SmallCNN(**spec.config), dict(spec.config)
    import transformers  # deferred: importing transformers takes seconds

    config_class, model_class, loss_type = _HF_FAMILIES[spec.family]
    # The library's default attention unless asked otherwise. No KV cache: this is training.
    attention = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    config = getattr(transformers, config_class)(**spec.config, **attention, use_cache=False)
    model = getattr(transformers, model_class)(config)
    if loss_type is not None:
        # transformers guesses the loss from the class name; GPT2LMHeadModel's name does not say it.
        model.loss_type = loss_type
    config_dict = config.to_dict()
    config_dict.setdefault("_attn_implementation", config._attn_implementation)
    summary = {key: config_dict[key] for key in _SUMMARY_KEYS if config_dict.get(key) is not None}
    return model, summary


# ---------------------------------------------------------------- batches


def _make_batch(spec: BuiltinSpec, batch_size: int, seq_len: int | None) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED)
    config = spec.config
    if spec.family == "mlp":
        return {
            "inputs": torch.randn(batch_size, config["in_features"], generator=generator),  # (B, F)
            "targets": torch.randint(0, config["num_classes"], (batch_size,), generator=generator),  # (B,)
        }
    if spec.family == "cnn":
        side = config["image_size"]
        return {
            "inputs": torch.randn(batch_size, config["in_channels"], side, side, generator=generator),  # (B, C, H, W)
            "targets": torch.randint(0, config["num_classes"], (batch_size,), generator=generator),  # (B,)
        }
    input_ids = torch.randint(0, config["vocab_size"], (batch_size, seq_len), generator=generator)  # (B, T)
    if spec.family in CAUSAL_FAMILIES:
        # Causal LM: the model shifts the labels itself.
        return {"input_ids": input_ids, "labels": input_ids.clone()}
    return _masked_lm_batch(input_ids, generator)


def _masked_lm_batch(tokens: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Mask ~15% of the tokens (at least one per row) and predict only those."""
    batch_size, seq_len = tokens.shape
    masked = torch.rand(batch_size, seq_len, generator=generator) < BERT_MASK_PROBABILITY  # (B, T)
    masked[torch.arange(batch_size), torch.randint(0, seq_len, (batch_size,), generator=generator)] = True
    labels = torch.where(masked, tokens, torch.full_like(tokens, -100))  # -100: ignored by the loss
    input_ids = torch.where(masked, torch.full_like(tokens, BERT_MASK_TOKEN_ID), tokens)
    return {
        "input_ids": input_ids,  # (B, T)
        "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),  # (B, T)
        "labels": labels,  # (B, T)
    }
