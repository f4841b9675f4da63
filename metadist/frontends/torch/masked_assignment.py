"""``x[mask] = value`` in a captured step, traced with static shapes.

Assigning through a boolean mask is ``index_put_`` with a boolean index. Its forward has static
shapes, but its backward takes ``grad[mask]`` for the value's gradient, whose size is the number
of true elements: a data-dependent shape (``nonzero``) that capture cannot trace. HuggingFace
models write it (Wav2Vec2 masks its padded frames and its SpecAugment positions this way;
``labels[labels == pad] = -100`` is common in user code).

While the step is traced, :class:`MaskedAssignmentAsWhere` replaces such an assignment, when the
mask covers the leading dims of ``x`` and ``value`` broadcasts to one masked element, by
``x.copy_(torch.where(mask, value, x))``: the same values forward, the same gradients backward
(the value's gradient sums the masked positions' gradients, now over a mask instead of a
gathered list), every shape static. Other indexing is left to torch.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["MaskedAssignmentAsWhere", "as_where"]


class MaskedAssignmentAsWhere(TorchFunctionMode):
    """A torch-function mode for the trace: boolean-mask assignments become ``copy_(where(...))``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__setitem__ and not kwargs and len(args) == 3:
            if as_where(*args):
                return None
        return func(*args, **(kwargs or {}))


def as_where(target: Any, index: Any, value: Any) -> bool:
    """Carry out ``target[index] = value`` as a ``where`` if ``index`` is a boolean mask over ``target``'s
    leading dims and ``value`` broadcasts to what one masked position holds; False (nothing done) otherwise."""
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    if not (isinstance(target, torch.Tensor) and isinstance(index, torch.Tensor)):
        return False
    if index.dtype != torch.bool or index.ndim == 0 or tuple(index.shape) != tuple(target.shape[:index.ndim]):
        return False
    element_shape = tuple(target.shape[index.ndim:])  # what one masked position holds
    if isinstance(value, torch.Tensor):
        if value.ndim > len(element_shape) or not _broadcasts(tuple(value.shape), element_shape):
            return False
        value = value.to(dtype=target.dtype, device=target.device)
    elif isinstance(value, numbers.Number):
        value = torch.tensor(value, dtype=target.dtype, device=target.device)
    else:
        return False
    mask = index.to(target.device).reshape(tuple(index.shape) + (1,) * len(element_shape))  # (*lead, 1, ...)
    target.copy_(torch.where(mask, value, target))
    return True


def _broadcasts(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    try:
        return tuple(torch.broadcast_shapes(shape, to)) == to
    except RuntimeError:
        return False
