"""Random ops in a rank program: every rank draws the whole tensor, then keeps its slice.

A module of its own so that the rank module builder and the batching pass (which must keep random draws in program
order) can both name :func:`draw_random`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..frontends.torch.execute import resolve_op
from .collectives import local_slice

__all__ = ["draw_random"]


def draw_random(target: str, shape_input: tuple | None, slices: tuple, n_outputs: int, *args: Any, **kwargs: Any) -> Any:
    """Run a random op on global shapes, then keep this rank's slice of each output.

    Every rank draws the whole tensor from the same generator state, so each
    shard holds exactly the values a single device would have drawn there.
    """
    if shape_input is not None:
        like = args[0]
        args = (torch.empty(shape_input, dtype=like.dtype, device=like.device), *args[1:])
    result = resolve_op(target)(*args, **kwargs)
    results = (result,) if n_outputs == 1 else tuple(result)
    local = []
    for tensor, output_slices in zip(results, slices):
        for dim, coordinate, parts in output_slices or ():
            tensor = local_slice(tensor, dim, coordinate, parts)
        local.append(tensor)
    return local[0] if n_outputs == 1 else tuple(local)
