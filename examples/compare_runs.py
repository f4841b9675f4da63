"""Draw the loss curves of several ``examples/train_gpt.py`` runs on one plot.

    python examples/compare_runs.py runs/gpt-1proc runs/gpt-2proc --to docs/img/train_gpt_loss.png

Each folder is a run's ``--out``: its ``losses.json`` gives the curve and the number of processes.
The largest difference between the curves' train losses, step by step, is printed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="output folders of train_gpt.py runs")
    parser.add_argument("--to", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    histories = [json.loads((run / "losses.json").read_text()) for run in args.runs]
    figure, axes = plt.subplots(figsize=(6.5, 3.8))
    for run, history, style in zip(args.runs, histories, ("-", "--", ":", "-.")):
        label = f"{history['processes']} process(es)"
        axes.plot([s for s, *_ in history["train"]], [loss for _, loss, *_ in history["train"]], style, lw=1.2,
                  label=f"train, {label}")
        axes.plot([s for s, _ in history["eval"]], [loss for _, loss in history["eval"]], "o" + style, ms=4,
                  label=f"eval, {label}")
        print(f"{run}: {history['processes']} process(es), {len(history['train'])} steps in {history['seconds']:.1f} s, "
              f"train loss {history['train'][0][1]:.3f} -> {history['train'][-1][1]:.3f}, "
              f"eval loss {history['eval'][-1][1]:.3f}")
    if len(histories) > 1:
        first = {step: loss for step, loss, *_ in histories[0]["train"]}
        worst = max(abs(loss - first[step]) / first[step] for h in histories[1:] for step, loss, *_ in h["train"] if step in first)
        print(f"largest relative difference of a step's train loss between the runs: {worst:.2e}")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats per character)")
    axes.set_title("examples/train_gpt.py: char-level GPT on the Python standard library")
    axes.legend(fontsize=8)
    figure.tight_layout()
    args.to.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.to, dpi=110)
    print(f"wrote {args.to}")


if __name__ == "__main__":
    main()
