"""Which ATen ops discovery may run in its own process: kernels known to check their inputs.

Discovery runs an op on pieces of candidate splits, so it hands kernels inputs whose shapes may
disagree (one input split, another whole). A kernel that checks its inputs raises an error, which
refuses the candidate; one that trusts them may corrupt memory and take the process down
(``_scaled_dot_product_flash_attention_for_cpu_backward`` did). The torch executor therefore runs
in its own process only the ops listed here, and every other op (other ATen ops, custom ops of any
namespace) in a forked worker (:mod:`metadist.shardcombine.isolation`), at the price of a pipe
round trip per execution.

An op runs in process when

* it is tagged ``pointwise``: TensorIterator broadcasts its inputs and rejects shapes that do not
  broadcast;
* it is a view (metadata only: sizes and strides are checked against the storage);
* or it is listed in :data:`CHECKED_OPS`: structured kernels (whose meta function, which discovery
  also runs first, is the CPU kernel's own shape check), reductions and copies of one tensor, and
  the other ops of the built-in workloads, whose discovery has run every candidate split of them.
"""

from __future__ import annotations

import functools

import torch

from ...ir import IRError
from ...shardcombine.signature import op_name
from .execute import resolve_op

__all__ = ["CHECKED_OPS", "runs_in_process"]

CHECKED_OPS = frozenset({
    # matrix products and convolutions (structured, or checked before the kernel runs)
    "aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.addbmm", "aten.mv", "aten.dot", "aten.matmul",
    "aten.convolution", "aten.convolution_backward",
    # softmax and normalisation
    "aten._softmax", "aten._log_softmax", "aten._softmax_backward_data", "aten._log_softmax_backward_data",
    "aten._safe_softmax", "aten.native_layer_norm", "aten.native_layer_norm_backward",
    "aten._native_batch_norm_legit_functional", "aten._native_batch_norm_legit", "aten.native_batch_norm",
    "aten.native_batch_norm_backward", "aten.native_group_norm", "aten.native_group_norm_backward",
    # reductions and scans of one tensor
    "aten.sum", "aten.mean", "aten.amax", "aten.amin", "aten.max", "aten.min", "aten.argmax", "aten.argmin",
    "aten.var", "aten.var_mean", "aten.std", "aten.prod", "aten.logsumexp", "aten.any", "aten.all",
    "aten.cumsum", "aten.cumprod", "aten.norm", "aten.linalg_vector_norm", "aten.sort", "aten.topk",
    # indexing (index ranges are also checked by the executor before the kernel runs)
    "aten.embedding", "aten.embedding_dense_backward", "aten.gather", "aten.scatter", "aten.scatter_add",
    "aten.index_select", "aten.index_add", "aten.index", "aten.index_put", "aten.nll_loss_forward",
    "aten.nll_loss_backward", "aten.nll_loss2d_forward", "aten.nll_loss2d_backward",
    # copies, joins, padding, pooling
    "aten._to_copy", "aten.copy", "aten.clone", "aten._unsafe_view", "aten.reshape", "aten.cat", "aten.stack",
    "aten.constant_pad_nd", "aten.slice_backward", "aten.select_backward", "aten.repeat", "aten.ones_like",
    "aten.zeros_like", "aten.full_like", "aten.new_ones", "aten.new_zeros", "aten.new_full",
    "aten.max_pool2d_with_indices", "aten.max_pool2d_with_indices_backward", "aten.avg_pool2d",
    "aten.avg_pool2d_backward", "aten._adaptive_avg_pool2d", "aten._adaptive_avg_pool2d_backward",
})
"""ATen ops (any overload) run in process besides pointwise ops and views."""


@functools.lru_cache(maxsize=None)
def runs_in_process(target: str) -> bool:
    """Whether discovery runs ``target`` in its own process (else in the isolated worker)."""
    if not target.startswith("aten."):
        return False
    if op_name(target) in CHECKED_OPS:
        return True
    try:
        op = resolve_op(target)
    except IRError:  # an op this torch lacks runs nowhere; the worker reports its error
        return False
    return torch.Tag.pointwise in op.tags or op.is_view
