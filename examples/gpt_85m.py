"""A 12-layer, 768-wide GPT (85M parameters): the model of the whole-run compile figure and the benchmarks.

    metadist run examples/gpt_85m.py --nproc 2 --steps 2 --check

HuggingFace's GPT-2 block (12 heads, SDPA attention, the library's default dropout) with a byte vocabulary (256) and
128 positions; a global batch of 4 sequences of 128 tokens; plain SGD. Random weights from a seeded
generator: nothing is downloaded.
"""

from __future__ import annotations

import torch

import metadist

LAYERS, WIDTH, HEADS, VOCAB, SEQUENCE, BATCH = 12, 768, 12, 256, 128, 4


def workload() -> metadist.Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS)
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    return metadist.Workload(
        model=model,
        batch={"input_ids": tokens, "labels": tokens},
        loss_fn=lambda model, batch: model(**batch).loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=1e-3),
        name="gpt-85m",
        description=f"GPT-2 blocks: {LAYERS} layers, {WIDTH} wide, {HEADS} heads, vocabulary {VOCAB}; batch {BATCH}x{SEQUENCE}; SGD",
    )
