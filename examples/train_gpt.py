"""Train a small character-level GPT on the Python standard library's own source code, with MetaDist.

An ordinary training loop, as one writes it for one GPU, run on any number of processes::

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py            # 2 local CPU processes (gloo)
    torchrun --standalone --nproc-per-node 1 examples/train_gpt.py            # the same run on one process

It has what real loops have: a HuggingFace GPT-2 built from a config (library defaults: SDPA
attention, dropout), AdamW with a linear warmup then cosine decay (``torch.optim.lr_scheduler``),
gradient clipping, accumulation over micro-batches, an evaluation loss every ``--eval-every``
steps (a compiled ``eval_step`` on the model in eval mode), checkpoints every
``--checkpoint-every`` steps with automatic resume (run it again: it continues where it stopped),
a progress bar, and a loss curve written to ``--out``.

The text is every ``.py`` file of the running Python's standard library, read in a fixed order,
as bytes (a vocabulary of 256): every machine has it, and nothing is downloaded. Batches are drawn
from a generator seeded by the step number, so a resumed run sees the batches it would have seen.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

import metadist


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128, help="embedding width")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64, help="characters per sequence")
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences per optimizer step)")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=30, help="warmup steps")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--text-mb", type=float, default=4.0, help="MB of standard library source to read")
    parser.add_argument("--out", type=Path, default=Path("train_gpt_out"), help="checkpoints, losses.json, loss.png")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="stop after this many steps, as a preempted job would (run again to resume)")
    parser.add_argument("--mesh", default=None, help="mesh shape, e.g. 2x2 (default: all processes in 1-D)")
    return parser.parse_args()


# -- data --------------------------------------------------------------------------


def read_text(megabytes: float) -> torch.Tensor:
    """The standard library's source as bytes: the first ``megabytes`` of its .py files in sorted order."""
    budget = int(megabytes * 1e6)
    chunks, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= budget:
            break
    text = b"".join(chunks)[:budget]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batch_at(data: torch.Tensor, step: int, batch: int, context: int, salt: int = 0) -> dict[str, torch.Tensor]:
    """The batch of ``step``: ``batch`` windows at offsets drawn from a generator seeded by the step."""
    generator = torch.Generator().manual_seed(step * 1009 + salt)
    starts = torch.randint(0, len(data) - context - 1, (batch,), generator=generator)
    ids = torch.stack([data[start:start + context] for start in starts.tolist()])  # (B, T)
    return {"input_ids": ids, "labels": ids}


# -- the model and the steps -----------------------------------------------------------


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=args.context, n_embd=args.width, n_layer=args.layers,
                        n_head=args.heads, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def make_train_step(args: argparse.Namespace):
    def train_step(model, optimizer, batch):
        total = 0.0
        for input_ids in batch["input_ids"].chunk(args.accumulate):  # micro-batches: (B / accumulate, T)
            loss = model(input_ids=input_ids, labels=input_ids).loss / args.accumulate
            loss.backward()
            total = total + loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad()
        return total, norm

    return train_step


def eval_step(model, batch):
    with torch.no_grad():
        return model(**batch).loss


def schedule(args: argparse.Namespace):
    """Linear warmup to the peak, then cosine decay to a tenth of it."""
    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# -- the loop ------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    rank = int(os.environ.get("RANK", "0"))
    data = read_text(args.text_mb)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]

    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(args))
    mesh = tuple(int(n) for n in args.mesh.split("x")) if args.mesh else None
    train_step = metadist.compile(make_train_step(args), mesh=mesh)
    evaluate = metadist.compile(eval_step, mesh=mesh)
    checkpointer = metadist.Checkpointer(args.out / "checkpoints", every=args.checkpoint_every, keep=2)

    train_step.prepare(model, optimizer, batch_at(train_data, 0, args.batch, args.context))
    history = {"train": [], "eval": []}
    start = checkpointer.restore(model, optimizer, scheduler=scheduler, extra=history)
    if rank == 0:
        print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(data):,} characters, "
              f"{dist.get_world_size()} process(es), plan mesh {train_step.plan.mesh}"
              + (f", resumed at step {start}" if start else ""), flush=True)

    started = time.perf_counter()
    with progress_bar(rank == 0, args.steps, start) as advance:
        for step in range(start, min(args.steps, args.stop_after or args.steps)):
            loss, norm = train_step(model, optimizer, batch_at(train_data, step, args.batch, args.context))
            scheduler.step()
            history["train"].append((step, float(loss), float(norm), optimizer.param_groups[0]["lr"]))
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:  # evaluate, then back to training
                model.eval()
                val = float(evaluate(model, batch_at(val_data, step, args.batch, args.context, salt=1)))
                model.train()
                history["eval"].append((step, val))
            checkpointer.maybe_save(step + 1, model, optimizer, scheduler=scheduler, extra=history)
            advance(step, float(loss), history["eval"][-1][1] if history["eval"] else None)
    checkpointer.wait()
    if rank == 0:
        seconds = time.perf_counter() - started
        write_results(args.out, history, dist.get_world_size(), seconds)
        first, last = history["train"][0][1], history["train"][-1][1]
        print(f"train loss {first:.3f} -> {last:.3f}; eval loss {history['eval'][-1][1]:.3f}; "
              f"{len(history['train'])} steps in {seconds:.1f} s; results in {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


class progress_bar:
    """A rich progress bar on rank 0 (plain lines when the output is not a terminal); nothing elsewhere."""

    def __init__(self, enabled: bool, total: int, start: int) -> None:
        self.enabled, self.total, self.start = enabled, total, start
        self.progress = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                     TimeRemainingColumn())
            self.progress.start()
            self.task = self.progress.add_task("train", total=self.total, completed=self.start, info="")
        return self.advance

    def advance(self, step: int, loss: float, val: float | None) -> None:
        if self.progress is not None:
            info = f"loss {loss:.3f}" + (f"  eval {val:.3f}" if val is not None else "")
            self.progress.update(self.task, completed=step + 1, info=info)

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()


def write_results(out: Path, history: dict, world_size: int, seconds: float) -> None:
    """``losses.json`` (every step's loss, gradient norm and learning rate, the eval losses) and ``loss.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "losses.json").write_text(json.dumps({"processes": world_size, "seconds": seconds, **history}, indent=1))
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot([s for s, *_ in history["train"]], [loss for _, loss, *_ in history["train"]], label="train", lw=1)
    axes.plot([s for s, _ in history["eval"]], [loss for _, loss in history["eval"]], "o-", label="eval")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats/char)")
    axes.set_title(f"char-level GPT on the Python stdlib, {world_size} process(es)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(out / "loss.png", dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
