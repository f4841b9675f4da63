"""The model zoo: HuggingFace architectures as users bring them, from tiny configs.

Each :class:`ZooModel` is data: the ``transformers`` config class and the sizes it is given,
the model class, and the batch it trains on. Everything else is the library's default: its
default attention (``scaled_dot_product_attention``), its default dropout and its default loss
(the model computes it from the labels in the batch). Only sizes are set (layers, widths, heads,
vocabulary, positions, image and audio sizes), plus the special token ids a smaller vocabulary
needs to contain. Weights are random (seeded), batches are drawn from a seeded generator, and
nothing is downloaded.

``load_workload("zoo:qwen2")`` (and so ``metadist run zoo:qwen2 --nproc 2 --check``) builds one;
``python -m metadist.bench.zoo`` runs them all and writes ``docs/models.md``.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..workload import Workload, WorkloadError
from .builtin import SEED, hf_loss, optimizer_factory

logger = logging.getLogger(__name__)

PREFIX = "zoo:"
"""Built-in names of zoo models start with this."""

BATCH_SIZE = 4
"""Global batch of every zoo model: divisible by 2 and 4, so the batch dim splits evenly on either mesh."""

SEQ_LEN = 16
"""Tokens per sequence (decoder input and labels)."""

VOCAB = 1000
"""Vocabulary of the text models; the special token ids are set inside it."""

IMAGE_SIZE = 32
"""Side of the square images of the vision models."""

NUM_LABELS = 10
"""Classes of the classification heads."""

KINDS = ("decoder", "encoder", "encoder-decoder", "vision", "multimodal", "audio")


@dataclass(frozen=True, kw_only=True)
class ZooModel:
    """One architecture of the zoo, as data."""

    name: str
    """Short name; the built-in name is ``zoo:<name>``."""
    kind: str
    """One of :data:`KINDS`."""
    config_class: str
    """The ``transformers`` config class."""
    model_class: str
    """The ``transformers`` model class (its head computes the default loss)."""
    config: dict
    """Keyword arguments of the config class: sizes only (and token ids that fit the smaller vocabulary)."""
    batch: str
    """The batch builder, a key of :data:`BATCH_BUILDERS`."""
    default_tier: tuple[int, ...] | None = None
    """The mesh the test suite's default tier trains it on (two models: the tier stays near a minute); every other
    (model, mesh) runs under the ``zoo`` marker (``pytest --zoo tests/test_zoo.py``)."""
    known_failure: str | None = None
    """Why MetaDist cannot train it yet, in one line, and a fragment of the error it stops with
    (:attr:`failure_fragment`); None: it passes ``--check``. The tests hold both to the truth."""
    failure_fragment: str | None = None
    """Text the failing run's one-line error contains."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"zoo model {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if self.batch not in BATCH_BUILDERS:
            raise ValueError(f"zoo model {self.name!r}: batch {self.batch!r} is not one of {tuple(BATCH_BUILDERS)}")
        if (self.known_failure is None) != (self.failure_fragment is None):
            raise ValueError(f"zoo model {self.name!r}: known_failure and failure_fragment go together")

    @property
    def builtin_name(self) -> str:
        return PREFIX + self.name


# ---------------------------------------------------------------- batches


def causal_lm_batch(model: ZooModel, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Token ids and the same ids as labels (the model shifts them)."""
    input_ids = torch.randint(0, VOCAB, (BATCH_SIZE, SEQ_LEN), generator=generator)  # (B, T)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def masked_lm_batch(model: ZooModel, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """About 15 % of the tokens (at least one per row) replaced by a mask id and predicted."""
    tokens = torch.randint(5, VOCAB, (BATCH_SIZE, SEQ_LEN), generator=generator)  # (B, T); 0-4: special ids
    masked = torch.rand(BATCH_SIZE, SEQ_LEN, generator=generator) < 0.15  # (B, T)
    masked[torch.arange(BATCH_SIZE), torch.randint(0, SEQ_LEN, (BATCH_SIZE,), generator=generator)] = True
    mask_id = 4
    return {
        "input_ids": torch.where(masked, torch.full_like(tokens, mask_id), tokens),  # (B, T)
        "attention_mask": torch.ones(BATCH_SIZE, SEQ_LEN, dtype=torch.long),  # (B, T)
        "labels": torch.where(masked, tokens, torch.full_like(tokens, -100)),  # (B, T); -100: ignored
    }


def seq2seq_batch(model: ZooModel, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Source ids and target labels; the model builds its decoder inputs from the labels."""
    return {
        "input_ids": torch.randint(5, VOCAB, (BATCH_SIZE, SEQ_LEN), generator=generator),  # (B, S)
        "labels": torch.randint(5, VOCAB, (BATCH_SIZE, SEQ_LEN // 2), generator=generator),  # (B, T)
    }


def image_classification_batch(model: ZooModel, generator: torch.Generator) -> dict[str, torch.Tensor]:
    channels = model.config.get("num_channels", 3)
    return {
        "pixel_values": torch.randn(BATCH_SIZE, channels, IMAGE_SIZE, IMAGE_SIZE, generator=generator),  # (B, C, H, W)
        "labels": torch.randint(0, NUM_LABELS, (BATCH_SIZE,), generator=generator),  # (B,)
    }


def contrastive_batch(model: ZooModel, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Captions and images; the loss pairs each caption with its image (see :func:`contrastive_loss`)."""
    input_ids = torch.randint(5, VOCAB - 1, (BATCH_SIZE, SEQ_LEN), generator=generator)  # (B, T)
    input_ids[:, -1] = model.config["text_config"]["eos_token_id"]  # the pooled token
    return {
        "input_ids": input_ids,
        "pixel_values": torch.randn(BATCH_SIZE, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator),  # (B, C, H, W)
    }


def speech_to_text_batch(model: ZooModel, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Log-mel features (two frames per encoder position) and target labels."""
    frames = 2 * model.config["max_source_positions"]
    return {
        "input_features": torch.randn(BATCH_SIZE, model.config["num_mel_bins"], frames, generator=generator),  # (B, M, F)
        "labels": torch.randint(5, VOCAB, (BATCH_SIZE, SEQ_LEN // 2), generator=generator),  # (B, T)
    }


def audio_classification_batch(model: ZooModel, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Raw waveforms long enough for ``AUDIO_FRAMES`` frames after the convolutional feature encoder."""
    return {
        "input_values": torch.randn(BATCH_SIZE, AUDIO_SAMPLES, generator=generator),  # (B, samples)
        "labels": torch.randint(0, NUM_LABELS, (BATCH_SIZE,), generator=generator),  # (B,)
    }


AUDIO_SAMPLES = 400 * 16
"""Samples per waveform: 20 frames of Wav2Vec2's default feature encoder (stride 320, receptive field 400)."""

BATCH_BUILDERS: dict[str, Callable[[ZooModel, torch.Generator], dict]] = {
    "causal_lm": causal_lm_batch,
    "masked_lm": masked_lm_batch,
    "seq2seq": seq2seq_batch,
    "image_classification": image_classification_batch,
    "contrastive": contrastive_batch,
    "speech_to_text": speech_to_text_batch,
    "audio_classification": audio_classification_batch,
}


# ---------------------------------------------------------------- the models


def contrastive_loss(model: Any, batch: dict) -> torch.Tensor:
    """CLIP's own contrastive loss, which it computes when asked (``return_loss=True``)."""
    return model(**batch, return_loss=True).loss


LOSSES: dict[str, Callable[[Any, dict], torch.Tensor]] = {"contrastive": contrastive_loss}
"""Batch kinds whose model needs to be asked for its loss; the others compute it from the labels."""


def _decoder(name: str, config_class: str, model_class: str, default_tier: tuple[int, ...] | None = None,
             **config: Any) -> ZooModel:
    return ZooModel(name=name, kind="decoder", config_class=config_class, model_class=model_class,
                    config=dict(vocab_size=VOCAB, **config), batch="causal_lm", default_tier=default_tier)


_LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64)
"""Sizes shared by the Llama-style decoders (grouped-query attention: 4 query heads, 2 key/value heads)."""

_BERT_LIKE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=64, pad_token_id=0)
"""Sizes shared by the BERT-style encoders."""

MODELS: tuple[ZooModel, ...] = (
    # decoder LMs
    _decoder("gpt2", "GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=64, n_head=4, n_positions=64,
             bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1),
    _decoder("gpt-neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=0),
    _decoder("opt", "OPTConfig", "OPTForCausalLM", hidden_size=64, ffn_dim=128, word_embed_proj_dim=64,
             num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64),
    _decoder("bloom", "BloomConfig", "BloomForCausalLM", hidden_size=64, n_layer=2, n_head=4),
    _decoder("falcon", "FalconConfig", "FalconForCausalLM", hidden_size=64, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1),
    _decoder("llama", "LlamaConfig", "LlamaForCausalLM", **_LLAMA_LIKE),
    _decoder("mistral", "MistralConfig", "MistralForCausalLM", **_LLAMA_LIKE),
    _decoder("qwen2", "Qwen2Config", "Qwen2ForCausalLM", default_tier=(2, 2), **_LLAMA_LIKE),
    _decoder("qwen3", "Qwen3Config", "Qwen3ForCausalLM", head_dim=16, **_LLAMA_LIKE),
    _decoder("gemma", "GemmaConfig", "GemmaForCausalLM", head_dim=16, **_LLAMA_LIKE),
    _decoder("gemma2", "Gemma2Config", "Gemma2ForCausalLM", head_dim=16, sliding_window=8, **_LLAMA_LIKE),
    _decoder("phi", "PhiConfig", "PhiForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64),
    _decoder("phi3", "Phi3Config", "Phi3ForCausalLM", **_LLAMA_LIKE,
             bos_token_id=1, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1),
    _decoder("stablelm", "StableLmConfig", "StableLmForCausalLM", **_LLAMA_LIKE),
    # encoders (masked LM)
    ZooModel(name="bert", kind="encoder", config_class="BertConfig", model_class="BertForMaskedLM",
             config=dict(_BERT_LIKE), batch="masked_lm"),
    ZooModel(name="roberta", kind="encoder", config_class="RobertaConfig", model_class="RobertaForMaskedLM",
             config=dict(_BERT_LIKE, pad_token_id=1, bos_token_id=0, eos_token_id=2), batch="masked_lm"),
    ZooModel(name="deberta-v2", kind="encoder", config_class="DebertaV2Config", model_class="DebertaV2ForMaskedLM",
             config=dict(_BERT_LIKE), batch="masked_lm"),
    ZooModel(name="albert", kind="encoder", config_class="AlbertConfig", model_class="AlbertForMaskedLM",
             config=dict(_BERT_LIKE, embedding_size=32, pad_token_id=0, bos_token_id=2, eos_token_id=3),
             batch="masked_lm"),
    ZooModel(name="electra", kind="encoder", config_class="ElectraConfig", model_class="ElectraForMaskedLM",
             config=dict(_BERT_LIKE, embedding_size=32), batch="masked_lm"),
    # encoder-decoders
    ZooModel(name="t5", kind="encoder-decoder", config_class="T5Config", model_class="T5ForConditionalGeneration",
             config=dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                         num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                         decoder_start_token_id=0),
             batch="seq2seq", default_tier=(2,)),
    ZooModel(name="bart", kind="encoder-decoder", config_class="BartConfig", model_class="BartForConditionalGeneration",
             config=dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                         max_position_embeddings=64),
             batch="seq2seq"),
    # vision
    ZooModel(name="vit", kind="vision", config_class="ViTConfig", model_class="ViTForImageClassification",
             config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                         image_size=IMAGE_SIZE, patch_size=8, num_labels=NUM_LABELS),
             batch="image_classification"),
    ZooModel(name="swin", kind="vision", config_class="SwinConfig", model_class="SwinForImageClassification",
             config=dict(image_size=IMAGE_SIZE, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                         window_size=4, num_labels=NUM_LABELS),
             batch="image_classification"),
    ZooModel(name="convnext", kind="vision", config_class="ConvNextConfig", model_class="ConvNextForImageClassification",
             config=dict(image_size=IMAGE_SIZE, patch_size=4, hidden_sizes=[16, 32], depths=[1, 1],
                         num_stages=2, num_labels=NUM_LABELS),
             batch="image_classification"),
    ZooModel(name="resnet", kind="vision", config_class="ResNetConfig", model_class="ResNetForImageClassification",
             config=dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=NUM_LABELS),
             batch="image_classification"),
    # multimodal and audio
    ZooModel(name="clip", kind="multimodal", config_class="CLIPConfig", model_class="CLIPModel",
             config=dict(projection_dim=32,
                         text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                                          bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1, pad_token_id=1),
                         vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=8)),
             batch="contrastive"),
    ZooModel(name="whisper", kind="audio", config_class="WhisperConfig", model_class="WhisperForConditionalGeneration",
             config=dict(vocab_size=VOCAB, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2,
                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                         decoder_ffn_dim=128, max_source_positions=16, max_target_positions=32,
                         pad_token_id=VOCAB - 1, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
                         decoder_start_token_id=VOCAB - 2),
             batch="speech_to_text"),
    ZooModel(name="wav2vec2", kind="audio", config_class="Wav2Vec2Config",
             model_class="Wav2Vec2ForSequenceClassification",
             config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                         conv_dim=[32] * 7, num_conv_pos_embeddings=16, classifier_proj_size=32,
                         num_labels=NUM_LABELS),
             batch="audio_classification",
             known_failure="LayerDrop (layerdrop=0.1 by default) decides in Python, on a random draw, whether each "
                           "layer runs, and SpecAugment (mask_time_prob=0.05) draws its masks with numpy: a captured "
                           "step runs the same ops on the same numbers at every step, so capture refuses both",
             failure_fragment="if not skip_the_layer"),
)

ZOO: dict[str, ZooModel] = {model.name: model for model in MODELS}
ZOO_NAMES: tuple[str, ...] = tuple(model.builtin_name for model in MODELS)


# ---------------------------------------------------------------- building


def lookup_zoo(name: str) -> ZooModel:
    """The zoo model ``name`` (with or without the ``zoo:`` prefix), or a WorkloadError listing the names."""
    short = name[len(PREFIX):] if name.startswith(PREFIX) else name
    model = ZOO.get(short)
    if model is not None:
        return model
    close = difflib.get_close_matches(short, tuple(ZOO), n=1, cutoff=0.5)
    hint = f" Did you mean {PREFIX + close[0]!r}?" if close else ""
    raise WorkloadError(f"unknown zoo model {name!r}.{hint} Zoo models: {', '.join(ZOO_NAMES)}")


def zoo_workload(name: str, *, optimizer: str = "adamw", device: str | None = None) -> Workload:
    """Build the zoo model ``name`` (``zoo:qwen2`` or ``qwen2``): seeded random weights, a seeded batch.

    ``optimizer`` is ``adamw`` (the zoo's), ``adam`` or ``sgd``; ``device="meta"`` builds the model without
    storage (each rank of a run then materialises only its shards). The batch is always on the CPU.
    """
    spec = lookup_zoo(name)
    make_optimizer = optimizer_factory(optimizer)
    if device not in (None, "cpu", "meta"):
        raise WorkloadError(f"zoo models are built on 'cpu' (the default) or 'meta', not {device!r}")
    if device == "meta":
        with torch.device("meta"):
            model = build_model(spec)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = build_model(spec)
    model.train()
    batch = BATCH_BUILDERS[spec.batch](spec, torch.Generator().manual_seed(SEED))
    params = sum(p.numel() for p in model.parameters())
    logger.debug("built %s: %d parameters", spec.builtin_name, params)
    return Workload(
        model=model,
        batch=batch,
        loss_fn=LOSSES.get(spec.batch, hf_loss),
        optimizer=make_optimizer,
        name=spec.builtin_name,
        description=f"{spec.model_class} from a tiny {spec.config_class}; random init; library defaults; AdamW",
        extras={"kind": spec.kind, "architecture": spec.model_class, "params": params,
                "attention": model.config._attn_implementation,
                "batch_shapes": {key: tuple(value.shape) for key, value in batch.items()
                                 if isinstance(value, torch.Tensor)}},
    )


def build_model(spec: ZooModel) -> torch.nn.Module:
    """The model of ``spec``: its config class given the sizes, everything else the library's default."""
    import transformers  # deferred: importing transformers takes seconds

    config = getattr(transformers, spec.config_class)(**spec.config)
    return getattr(transformers, spec.model_class)(config)
