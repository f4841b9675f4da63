"""Built-in JAX workloads: MLPs (plain, scanned layers, dropout) and a tiny GPT-2 in ``jax.numpy``, trained with optax.

Each built-in is random-initialised from a fixed ``PRNGKey`` (nothing is
downloaded), so the same name gives the same weights and batch every time.
``jax_builtin_workload(name)`` returns a :class:`~metadist.frontends.jax.JaxWorkload`.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from typing import Any

from ..frontends.jax.workload import JaxWorkload
from ..workload import WorkloadError

__all__ = ["JAX_BUILTIN_NAMES", "DropoutMLPConfig", "GPT2Config", "MLPConfig", "ScanMLPConfig", "jax_builtin_workload"]

log = logging.getLogger(__name__)

SEED = 0
"""Seed of the weight initialisation and of every batch."""


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """A GELU MLP classifier."""

    in_features: int = 64
    """Width of the input."""
    hidden_features: int = 256
    """Width of the two hidden layers."""
    num_classes: int = 10
    """Number of classes of the softmax cross-entropy."""
    batch_size: int = 32
    """Global batch size."""
    learning_rate: float = 1e-3
    """AdamW learning rate."""


@dataclass(frozen=True, kw_only=True)
class GPT2Config:
    """A GPT-2-style causal LM (pre-norm blocks, GELU MLP, tied LM head)."""

    vocab_size: int = 1000
    """Tokens in the vocabulary."""
    n_positions: int = 64
    """Learned positions (the longest sequence)."""
    n_embd: int = 64
    """Model width."""
    n_head: int = 4
    """Attention heads (``n_embd`` must divide by it)."""
    n_layer: int = 2
    """Transformer blocks."""
    batch_size: int = 8
    """Global batch size."""
    seq_len: int = 16
    """Sequence length of the batch."""
    learning_rate: float = 1e-3
    """AdamW learning rate."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise WorkloadError(f"GPT2Config: n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if self.seq_len > self.n_positions:
            raise WorkloadError(f"GPT2Config: seq_len={self.seq_len} exceeds n_positions={self.n_positions}")


# ---------------------------------------------------------------- MLP


def _dense(key: Any, fan_in: int, fan_out: int) -> dict:
    import jax
    import jax.numpy as jnp

    weight = jax.random.normal(key, (fan_in, fan_out), jnp.float32) / jnp.sqrt(float(fan_in))
    return {"w": weight, "b": jnp.zeros((fan_out,), jnp.float32)}


def _mlp_params(config: MLPConfig, keys: Any) -> tuple[tuple[int, ...], dict]:
    """The widths and the ``fc0``..``fc2`` layers of the 3-layer MLP (layer ``i`` from ``keys[i]``)."""
    widths = (config.in_features, config.hidden_features, config.hidden_features, config.num_classes)
    return widths, {f"fc{index}": _dense(keys[index], widths[index], widths[index + 1]) for index in range(3)}


def mlp_workload(config: MLPConfig = MLPConfig()) -> JaxWorkload:
    """A 3-layer GELU MLP classifier on random data."""
    import jax
    import jax.numpy as jnp
    import optax

    keys = jax.random.split(jax.random.PRNGKey(SEED), 5)
    widths, params = _mlp_params(config, keys)
    batch = {
        "inputs": jax.random.normal(keys[3], (config.batch_size, config.in_features), jnp.float32),  # (B, F)
        "targets": jax.random.randint(keys[4], (config.batch_size,), 0, config.num_classes),  # (B,)
    }

    def loss_fn(params: dict, batch: dict) -> Any:
        hidden = batch["inputs"]  # (B, F)
        for index in range(3):
            layer = params[f"fc{index}"]
            hidden = hidden @ layer["w"] + layer["b"]
            if index < 2:
                hidden = jax.nn.gelu(hidden)
        return _cross_entropy(hidden, batch["targets"], config.num_classes)

    return JaxWorkload(
        params=params, batch=batch, loss_fn=loss_fn, optimizer=optax.adamw(config.learning_rate),
        name="jax-mlp", description=f"3-layer GELU MLP {widths} in jax.numpy; optax.adamw",
        extras={"config": config, "params": _count(params)},
    )


@dataclass(frozen=True, kw_only=True)
class ScanMLPConfig(MLPConfig):
    """A GELU MLP whose hidden layers are stacked and applied with ``jax.lax.scan``."""

    hidden_features: int = 128
    """Width of the hidden layers."""
    hidden_layers: int = 4
    """Stacked hidden layers (the scan's length)."""

    def __post_init__(self) -> None:
        if self.hidden_layers < 1:
            raise WorkloadError(f"ScanMLPConfig: hidden_layers must be at least 1, got {self.hidden_layers}")


@dataclass(frozen=True, kw_only=True)
class DropoutMLPConfig(MLPConfig):
    """The built-in MLP with dropout after each hidden layer, its key a raw uint32 ``PRNGKey`` in the batch."""

    dropout_rate: float = 0.1
    """Probability that dropout zeroes an activation."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.dropout_rate < 1.0:
            raise WorkloadError(f"DropoutMLPConfig: dropout_rate must be in [0, 1), got {self.dropout_rate}")


def _cross_entropy(logits: Any, targets: Any, num_classes: int) -> Any:
    import jax
    import jax.numpy as jnp

    log_probs = jax.nn.log_softmax(logits, axis=-1)  # (B, classes)
    one_hot = jax.nn.one_hot(targets, num_classes, dtype=log_probs.dtype)
    return -jnp.mean(jnp.sum(log_probs * one_hot, axis=-1))


def _classification_batch(key: Any, batch_size: int, in_features: int, num_classes: int) -> dict:
    import jax
    import jax.numpy as jnp

    input_key, target_key = jax.random.split(key)
    return {
        "inputs": jax.random.normal(input_key, (batch_size, in_features), jnp.float32),  # (B, F)
        "targets": jax.random.randint(target_key, (batch_size,), 0, num_classes),  # (B,)
    }


def scan_mlp_workload(config: ScanMLPConfig = ScanMLPConfig()) -> JaxWorkload:
    """An MLP whose ``hidden_layers`` identical layers are one stacked pytree, applied with ``lax.scan``."""
    import jax
    import optax

    keys = jax.random.split(jax.random.PRNGKey(SEED), 3 + config.hidden_layers)
    hidden = [_dense(keys[2 + index], config.hidden_features, config.hidden_features)
              for index in range(config.hidden_layers)]
    params = {
        "fc_in": _dense(keys[0], config.in_features, config.hidden_features),
        "hidden": jax.tree_util.tree_map(lambda *layers: jax.numpy.stack(layers), *hidden),  # w (L, H, H), b (L, H)
        "fc_out": _dense(keys[1], config.hidden_features, config.num_classes),
    }
    batch = _classification_batch(keys[-1], config.batch_size, config.in_features, config.num_classes)

    def layer(x: Any, weights: dict) -> tuple[Any, None]:
        return jax.nn.gelu(x @ weights["w"] + weights["b"]), None  # (B, H)

    def loss_fn(params: dict, batch: dict) -> Any:
        x = jax.nn.gelu(batch["inputs"] @ params["fc_in"]["w"] + params["fc_in"]["b"])  # (B, H)
        x, _ = jax.lax.scan(layer, x, params["hidden"])  # (B, H)
        logits = x @ params["fc_out"]["w"] + params["fc_out"]["b"]  # (B, classes)
        return _cross_entropy(logits, batch["targets"], config.num_classes)

    return JaxWorkload(
        params=params, batch=batch, loss_fn=loss_fn, optimizer=optax.adamw(config.learning_rate),
        name="jax-mlp-scan",
        description=(f"GELU MLP, {config.hidden_layers} stacked {config.hidden_features}-wide layers applied with "
                     "lax.scan; optax.adamw"),
        extras={"config": config, "params": _count(params)},
    )


def dropout_mlp_workload(config: DropoutMLPConfig = DropoutMLPConfig()) -> JaxWorkload:
    """The 3-layer MLP with dropout; the batch carries the dropout key as raw ``uint32`` data (``PRNGKey``)."""
    import jax
    import jax.numpy as jnp
    import optax

    keys = jax.random.split(jax.random.PRNGKey(SEED), 5)
    widths, params = _mlp_params(config, keys)
    batch = _classification_batch(keys[3], config.batch_size, config.in_features, config.num_classes)
    batch["dropout_key"] = jax.random.PRNGKey(SEED + 1)  # (2,) uint32
    keep_rate = 1.0 - config.dropout_rate

    def loss_fn(params: dict, batch: dict) -> Any:
        hidden = batch["inputs"]  # (B, F)
        for index in range(3):
            layer = params[f"fc{index}"]
            hidden = hidden @ layer["w"] + layer["b"]
            if index < 2:
                hidden = jax.nn.gelu(hidden)
                keep = jax.random.bernoulli(jax.random.fold_in(batch["dropout_key"], index), keep_rate, hidden.shape)
                hidden = jnp.where(keep, hidden / keep_rate, 0.0)  # (B, H)
        return _cross_entropy(hidden, batch["targets"], config.num_classes)

    return JaxWorkload(
        params=params, batch=batch, loss_fn=loss_fn, optimizer=optax.adamw(config.learning_rate),
        name="jax-mlp-dropout",
        description=f"3-layer GELU MLP {widths} with dropout {config.dropout_rate} (raw uint32 key in the batch); optax.adamw",
        extras={"config": config, "params": _count(params)},
    )


# ---------------------------------------------------------------- GPT-2


def _gpt2_params(config: GPT2Config, key: Any) -> dict:
    import jax
    import jax.numpy as jnp

    width = config.n_embd
    keys = iter(jax.random.split(key, 2 + 4 * config.n_layer))

    def normal(shape: tuple[int, ...], std: float = 0.02) -> Any:
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    def norm() -> dict:
        return {"g": jnp.ones((width,), jnp.float32), "b": jnp.zeros((width,), jnp.float32)}

    blocks = []
    for _ in range(config.n_layer):
        blocks.append({
            "ln1": norm(),
            "attn": {"w_qkv": normal((width, 3 * width)), "b_qkv": jnp.zeros((3 * width,), jnp.float32),
                     "w_out": normal((width, width)), "b_out": jnp.zeros((width,), jnp.float32)},
            "ln2": norm(),
            "mlp": {"w_in": normal((width, 4 * width)), "b_in": jnp.zeros((4 * width,), jnp.float32),
                    "w_out": normal((4 * width, width)), "b_out": jnp.zeros((width,), jnp.float32)},
        })
    return {"wte": normal((config.vocab_size, width)), "wpe": normal((config.n_positions, width), 0.01),
            "blocks": blocks, "ln_f": norm()}


def _layer_norm(x: Any, layer: dict, eps: float = 1e-5) -> Any:
    import jax.numpy as jnp

    mean = jnp.mean(x, axis=-1, keepdims=True)  # (B, T, 1)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)  # (B, T, 1)
    return (x - mean) / jnp.sqrt(var + eps) * layer["g"] + layer["b"]


def _attention(x: Any, layer: dict, n_head: int) -> Any:
    import jax
    import jax.numpy as jnp

    batch, seq, width = x.shape
    qkv = x @ layer["w_qkv"] + layer["b_qkv"]  # (B, T, 3C)
    q, k, v = jnp.split(qkv, 3, axis=-1)  # 3 x (B, T, C)
    heads = lambda t: t.reshape(batch, seq, n_head, width // n_head).transpose(0, 2, 1, 3)  # (B, H, T, D)
    q, k, v = heads(q), heads(k), heads(v)
    scores = (q @ k.transpose(0, 1, 3, 2)) / jnp.sqrt(float(width // n_head))  # (B, H, T, T)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    out = jax.nn.softmax(scores, axis=-1) @ v  # (B, H, T, D)
    out = out.transpose(0, 2, 1, 3).reshape(batch, seq, width)  # (B, T, C)
    return out @ layer["w_out"] + layer["b_out"]


def _gpt2_loss(params: dict, batch: dict, config: GPT2Config) -> Any:
    import jax
    import jax.numpy as jnp

    tokens = batch["input_ids"]  # (B, T)
    seq = tokens.shape[1]
    x = params["wte"][tokens] + params["wpe"][:seq]  # (B, T, C)
    for block in params["blocks"]:
        x = x + _attention(_layer_norm(x, block["ln1"]), block["attn"], config.n_head)
        hidden = jax.nn.gelu(_layer_norm(x, block["ln2"]) @ block["mlp"]["w_in"] + block["mlp"]["b_in"])
        x = x + hidden @ block["mlp"]["w_out"] + block["mlp"]["b_out"]  # (B, T, C)
    logits = _layer_norm(x, params["ln_f"]) @ params["wte"].T  # tied head: (B, T, V)
    log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)  # (B, T-1, V)
    targets = jax.nn.one_hot(batch["labels"][:, 1:], config.vocab_size, dtype=log_probs.dtype)
    return -jnp.mean(jnp.sum(log_probs * targets, axis=-1))


def gpt2_workload(config: GPT2Config = GPT2Config()) -> JaxWorkload:
    """A tiny GPT-2 on a random token batch (labels are the inputs; the loss shifts them)."""
    import jax
    import optax

    param_key, batch_key = jax.random.split(jax.random.PRNGKey(SEED))
    params = _gpt2_params(config, param_key)
    tokens = jax.random.randint(batch_key, (config.batch_size, config.seq_len), 0, config.vocab_size)  # (B, T)
    return JaxWorkload(
        params=params, batch={"input_ids": tokens, "labels": tokens},
        loss_fn=lambda params, batch: _gpt2_loss(params, batch, config),
        optimizer=optax.adamw(config.learning_rate),
        name="jax-gpt2-tiny",
        description=(f"GPT-2-style LM in jax.numpy ({config.n_layer} layers, {config.n_embd} wide, "
                     f"{config.n_head} heads, vocab {config.vocab_size}); batch ({config.batch_size}, "
                     f"{config.seq_len}); optax.adamw"),
        extras={"config": config, "params": _count(params)},
    )


# ---------------------------------------------------------------- catalogue

_BUILDERS = {"jax-mlp": mlp_workload, "jax-gpt2-tiny": gpt2_workload, "jax-mlp-scan": scan_mlp_workload,
             "jax-mlp-dropout": dropout_mlp_workload}

JAX_BUILTIN_NAMES: tuple[str, ...] = tuple(_BUILDERS)
"""The names :func:`jax_builtin_workload` takes."""


def jax_builtin_workload(name: str) -> JaxWorkload:
    """Build the built-in JAX workload ``name`` (see :data:`JAX_BUILTIN_NAMES`)."""
    builder = _BUILDERS.get(name)
    if builder is None:
        close = difflib.get_close_matches(name, JAX_BUILTIN_NAMES, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise WorkloadError(f"unknown built-in JAX workload {name!r}.{hint} Valid: {', '.join(JAX_BUILTIN_NAMES)}")
    workload = builder()
    log.info("built %s: %d parameters", name, workload.extras["params"])
    return workload


def _count(params: Any) -> int:
    import jax

    return int(sum(leaf.size for leaf in jax.tree_util.tree_leaves(params)))
