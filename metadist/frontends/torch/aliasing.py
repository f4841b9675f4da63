"""Whether an fx node's result may share memory with one of its arguments.

One answer for the two places that ask: the capture, which rewrites a traced step's mutations to their functional
forms only where no view is involved (:mod:`.capture`), and the runtime, which merges repeated small ops only where no
program output is their result or a view of it (:func:`metadist.runtime.batching.merge_duplicates`). Both must err
towards "may share": taking a fresh tensor for a view could make two outputs one tensor, or move a write.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

__all__ = ["UNANNOTATED_VIEWS", "may_alias_argument"]

UNANNOTATED_VIEWS = frozenset({torch.ops.aten._unsafe_view.default})
"""Ops whose result shares its input's memory though their schema does not say so: functionalization takes them for
views (Falcon's attention adds its residual in place into an ``_unsafe_view`` of a matmul), and so does this module."""


def may_alias_argument(node: torch.fx.Node) -> bool:
    """Whether ``node``'s result may share memory with an argument: a ``getitem`` of a multi-output op (taken for a
    view, as a split's are), an op whose schema marks a return as an alias or that is one of
    :data:`UNANNOTATED_VIEWS`, a ``contiguous`` method call (which returns its input when it is already contiguous),
    and any callable without a schema (a runtime helper: slicing, unpacking). Placeholders, outputs and other method
    calls do not."""
    if node.op == "call_method":
        return node.target == "contiguous"
    if node.op != "call_function":
        return False
    if node.target is operator.getitem or node.target in UNANNOTATED_VIEWS:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is None or any(ret.alias_info is not None for ret in schema.returns)
