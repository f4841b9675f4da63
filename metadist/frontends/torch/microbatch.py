"""One microbatch of a batch: what a pipeline captures its step on.

A pipeline runs the step on ``m`` microbatches, slices of the batch along dim 0 (every tensor
leaf's first dim is the batch dim). The step is captured on the first slice; every slice has
the same shapes, so one graph serves them all.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from ...solver.errors import PipelineError

__all__ = ["batch_size_of", "first_microbatch"]


def batch_size_of(batch: Any) -> int:
    """The batch's size: the first dim every tensor leaf shares (a clear error when they disagree or have none)."""
    sizes = {tuple(leaf.shape[:1]) for leaf in pytree.tree_leaves(batch) if isinstance(leaf, torch.Tensor)}
    if not sizes:
        raise PipelineError("the batch holds no tensors: a pipeline splits the batch's tensors along dim 0 into microbatches")
    if len(sizes) != 1 or () in sizes:
        shapes = sorted(str(size[0]) if size else "a 0-d tensor" for size in sizes)
        raise PipelineError(f"the batch's tensors disagree on dim 0 ({', '.join(shapes)}): a pipeline splits every tensor "
                            "of the batch along dim 0 into microbatches, so they must all have the same dim 0")
    return sizes.pop()[0]


def first_microbatch(batch: Any, microbatches: int) -> Any:
    """The first of ``microbatches`` equal slices of ``batch`` along dim 0."""
    size = batch_size_of(batch)
    if microbatches < 1 or size % microbatches:
        fits = [count for count in range(1, size + 1) if size % count == 0]
        raise PipelineError(f"{microbatches} microbatches do not divide the batch of {size}; microbatch counts that fit: "
                            f"{', '.join(map(str, fits))}")
    part = size // microbatches
    return pytree.tree_map(lambda leaf: leaf[:part] if isinstance(leaf, torch.Tensor) else leaf, batch)


class MicrobatchGraphs:
    """``graphs(m, raw_grads)``: a workload's step captured on one of ``m`` microbatches, with its rules and loss divisor.

    The callable :func:`metadist.solver.pipeline.search_pipeline` takes; each (m, raw_grads) is captured once.
    """

    def __init__(self, workload: Any, rules_db: str | None = None) -> None:
        self.workload, self.rules_db = workload, rules_db
        self.global_batch = batch_size_of(workload.batch)
        self._cache: dict[tuple[int, bool], tuple] = {}

    def __call__(self, microbatches: int, raw_grads: bool) -> tuple:
        key = (microbatches, raw_grads)
        if key not in self._cache:
            from ...shardcombine.api import rules_from_database
            from .capture import loss_divisor_of
            from .discovery import TorchExecutor
            from .repeat import capture_repeated

            workload = self.workload
            optimizer = workload.optimizer(workload.model.parameters())
            # a deep model is captured on a few of its layers and expanded: the graph equals the whole capture's
            graph = capture_repeated(workload.train_step(), workload.model, optimizer,
                                     first_microbatch(workload.batch, microbatches), name=workload.name or "step",
                                     raw_grads=raw_grads)
            rules = rules_from_database(graph, TorchExecutor(), self.rules_db)
            self._cache[key] = (graph, rules, loss_divisor_of(graph))
        return self._cache[key]
