"""Batch a rank program's small elementwise ops into ``torch._foreach_*`` calls.

A captured step runs its optimizer the way the single-tensor optimizers do: one
chain of some twenty elementwise ops per parameter (AdamW's moments, its bias
corrections on each parameter's 0-d step, the update). Eager PyTorch runs those
chains through its multi-tensor (``foreach``) kernels on GPUs; run op by op, a
small model's step is mostly dispatch: on gpt2-tiny the update is 728 of the
rank program's 1,146 ops.

This pass finds ops of the same kind that are independent of one another and
replaces each such group by one ``_foreach`` op over the list of its members'
inputs. Each ``_foreach`` op computes, per list element, what the member's own
op computes (off the GPU's fast path it calls that very op), so the values are
unchanged.

Which ops form a group: same operator, same non-tensor arguments, and the same
*height*, the length of the longest path from the op to the program's output.
Every edge runs from a greater height to a smaller one, so merging each group
into one node cannot create a cycle; ops of the same height are independent.
Parallel per-parameter chains line up by height because they end at the
program's outputs in the same number of steps.

Collectives, their waits and random draws are chained in their program order
for the height computation and for the new order, so every rank still issues
the same collectives in the same order and random draws consume the generator
as before. The new order is a topological order that keeps the original order
wherever it can (a group stands where its earliest member stood, or later if
its inputs are not ready there).

Only small tensors are batched (at most ``max_numel`` elements each, at most
``max_group_numel`` per group): the ops whose cost is dispatch. A group keeps
its members' outputs alive together, so the cap also bounds what the new order
can add to the program's peak memory.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx

from ..frontends.torch.aliasing import may_alias_argument
from .random_ops import draw_random

__all__ = ["BatchStats", "batch_elementwise", "merge_duplicates", "MAX_NUMEL", "MAX_GROUP_NUMEL"]

MAX_NUMEL = 1 << 14
"""Largest output (elements) of an op that is batched: above it an op's compute outweighs its dispatch."""
MAX_GROUP_NUMEL = 1 << 18
"""Largest total output (elements) of one batched group."""

aten = torch.ops.aten
_PREVIOUS = object()
"""In a form's second call: the output list of its first call."""

_UNARY = ("abs", "exp", "log", "neg", "reciprocal", "rsqrt", "sigmoid", "sign", "sqrt", "tanh", "sin", "cos",
          "expm1", "log1p", "erf")
_BINARY = ("add", "sub", "mul", "div", "maximum", "minimum")


@dataclass(frozen=True)
class _Form:
    """How a group of one aten overload becomes a foreach call.

    ``tensor_args``: positions of the arguments that become lists; ``build`` maps
    (lists, the shared non-list arguments, kwargs) to the foreach call's
    (target, args, kwargs).
    """

    tensor_args: tuple[int, ...]
    build: Callable[[list[list[Any]], tuple, dict], list[tuple[Any, tuple, dict]]]
    kwargs: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments a member may pass: (name, the only value accepted, or ``_ANY`` for any)."""

    def accepts(self, kwargs: dict) -> bool:
        accepted = dict(self.kwargs)
        return all(key in accepted and (accepted[key] is _ANY or accepted[key] == value) for key, value in kwargs.items())


_ANY = object()


def _forms() -> dict[Any, _Form]:
    forms: dict[Any, _Form] = {}
    for name in _UNARY:
        foreach = getattr(aten, f"_foreach_{name}").default
        forms[getattr(aten, name).default] = _Form((0,), lambda lists, rest, kw, f=foreach: [(f, (lists[0],), {})])
    for name in _BINARY:
        overloads = getattr(aten, f"_foreach_{name}")
        tensor_overload = getattr(aten, name).Tensor if name in ("add", "sub", "mul", "div") else getattr(aten, name).default
        forms[(tensor_overload, "tensor")] = _Form(
            (0, 1), lambda lists, rest, kw, f=overloads.List: [(f, (lists[0], lists[1]), kw)])
        if name in ("add", "sub", "mul", "div"):  # the second argument a Python number
            forms[(tensor_overload, "scalar")] = _Form(
                (0,), lambda lists, rest, kw, f=overloads.Scalar: [(f, (lists[0], rest[0]), {})])
    forms[(aten.pow.Tensor_Tensor, "tensor")] = _Form(
        (0, 1), lambda lists, rest, kw: [(aten._foreach_pow.List, (lists[0], lists[1]), {})])
    forms[aten.pow.Tensor_Scalar] = _Form((0,), lambda lists, rest, kw: [(aten._foreach_pow.Scalar, (lists[0], rest[0]), {})])
    forms[aten.pow.Scalar] = _Form((1,), lambda lists, rest, kw: [(aten._foreach_pow.ScalarAndTensor, (rest[0], lists[0]), {})])
    for name in ("addcmul", "addcdiv"):
        foreach = getattr(aten, f"_foreach_{name}").Scalar
        forms[getattr(aten, name).default] = _Form(
            (0, 1, 2), lambda lists, rest, kw, f=foreach: [(f, (*lists, kw.get("value", rest[0] if rest else 1)), {})],
            kwargs=(("value", _ANY),))
    forms[aten.lerp.Tensor] = _Form((0, 1, 2), lambda lists, rest, kw: [(aten._foreach_lerp.List, tuple(lists), {})])
    forms[aten.lerp.Scalar] = _Form((0, 1), lambda lists, rest, kw: [(aten._foreach_lerp.Scalar, (lists[0], lists[1], rest[0]), {})])
    # s - x is exactly (-x) + s (negation is exact; one rounding either way)
    forms[aten.rsub.Scalar] = _Form((0,), lambda lists, rest, kw: [
        (aten._foreach_neg.default, (lists[0],), {}), (aten._foreach_add.Scalar, (_PREVIOUS, rest[0]), {})],
        kwargs=(("alpha", 1),))
    return forms


_FORMS = _forms()


@dataclass(frozen=True)
class BatchStats:
    """What one pass did: ops before and after, and the groups formed."""

    ops_before: int
    ops_after: int
    groups: int
    batched: int

    def __str__(self) -> str:
        return (f"{self.batched} small elementwise ops in {self.groups} foreach calls "
                f"({self.ops_before} -> {self.ops_after} ops)")


def _form_of(node: torch.fx.Node) -> tuple[Any, _Form] | None:
    """The batching form of ``node`` and its key part, or None when it is not batchable."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    target = node.target
    if target in _FORMS:
        return (target, _FORMS[target]) if _FORMS[target].accepts(dict(node.kwargs)) else None
    if len(node.args) != 2 or set(node.kwargs) - {"alpha"}:
        return None
    kind = "tensor" if isinstance(node.args[1], torch.fx.Node) else "scalar"
    if kind == "scalar" and (node.kwargs.get("alpha", 1) != 1 or not isinstance(node.args[1], (int, float))
                             or isinstance(node.args[1], bool)):
        return None
    form = _FORMS.get((target, kind))
    return ((target, kind), form) if form is not None else None


def _numel(node: torch.fx.Node) -> int | None:
    shapes = node.meta.get("metadist_local_shapes")
    if not shapes or len(shapes) != 1 or shapes[0] is None:
        return None
    return math.prod(shapes[0])


def _is_barrier(node: torch.fx.Node) -> bool:
    """Nodes whose relative order must not change: collectives, their waits, random draws, anything impure."""
    if node.op == "call_method":
        return node.target != "contiguous"
    if node.op != "call_function":
        return False
    if node.target is draw_random:
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in node.target.tags or node.target._schema.is_mutable
    return False


def batch_elementwise(graph: torch.fx.Graph, *, max_numel: int = MAX_NUMEL,
                      max_group_numel: int = MAX_GROUP_NUMEL) -> tuple[torch.fx.Graph, BatchStats]:
    """A new graph computing what ``graph`` computes, with small independent elementwise ops batched."""
    nodes = list(graph.nodes)
    index = {node: position for position, node in enumerate(nodes)}
    barriers = [node for node in nodes if _is_barrier(node)]
    after_barrier = {barrier: barriers[position + 1] for position, barrier in enumerate(barriers[:-1])}
    height: dict[torch.fx.Node, int] = {}
    for node in reversed(nodes):
        successors = list(node.users)
        if node in after_barrier:
            successors.append(after_barrier[node])
        height[node] = 1 + max((height[user] for user in successors), default=-1)

    buckets: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    forms: dict[tuple, _Form] = {}
    for node in nodes:
        found = _form_of(node)
        numel = _numel(node)
        if found is None or numel is None or numel > max_numel:
            continue
        key_part, form = found
        shared = tuple(arg for position, arg in enumerate(node.args) if position not in form.tensor_args)
        if any(isinstance(arg, torch.fx.Node) for arg in shared) or not all(
                isinstance(node.args[position], torch.fx.Node) for position in form.tensor_args if position < len(node.args)):
            continue
        if any(isinstance(value, torch.fx.Node) for value in node.kwargs.values()):
            continue
        key = (height[node], key_part, _hashable(shared), _hashable(dict(node.kwargs)))
        buckets[key].append(node)
        forms[key] = form

    groups: list[tuple[_Form, list[torch.fx.Node]]] = []
    for key, members in buckets.items():
        chunk: list[torch.fx.Node] = []
        total = 0
        for member in members:
            numel = _numel(member) or 0
            if chunk and total + numel > max_group_numel:
                groups.append((forms[key], chunk))
                chunk, total = [], 0
            chunk.append(member)
            total += numel
        groups.append((forms[key], chunk))
    groups = [(form, group) for form, group in groups if len(group) > 1]
    ops_before = _count_ops(nodes)
    if not groups:
        return graph, BatchStats(ops_before, ops_before, 0, 0)
    return _rebuild(graph, nodes, index, barriers, groups, ops_before)


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(item) for item in value)
    if isinstance(value, dict):
        return tuple(sorted((key, _hashable(item)) for key, item in value.items()))
    return value


def _rebuild(graph: torch.fx.Graph, nodes: list[torch.fx.Node], index: dict, barriers: list,
             groups: list[tuple[_Form, list[torch.fx.Node]]], ops_before: int) -> tuple[torch.fx.Graph, BatchStats]:
    """Emit the nodes in a topological order with each group as one unit (keys: original positions)."""
    group_of = {member: number for number, (_, group) in enumerate(groups) for member in group}
    # units: a node of its own, or a group (identified by ('group', number))
    def unit(node: torch.fx.Node) -> Any:
        number = group_of.get(node)
        return node if number is None else ("group", number)

    units: list[Any] = [node for node in nodes if node not in group_of] + [("group", number) for number in range(len(groups))]
    members_of = {u: ([u] if isinstance(u, torch.fx.Node) else groups[u[1]][1]) for u in units}
    key = {u: min(index[m] for m in members_of[u]) for u in units}
    successors: dict[Any, set] = {u: set() for u in units}
    waiting = {u: 0 for u in units}
    for u in units:
        for member in members_of[u]:
            for user in member.users:
                target = unit(user)
                if target != u and target not in successors[u]:
                    successors[u].add(target)
                    waiting[target] += 1
    for first, second in zip(barriers, barriers[1:]):
        a, b = unit(first), unit(second)
        if b not in successors[a]:
            successors[a].add(b)
            waiting[b] += 1
    ready = [(key[u], position, u) for position, u in enumerate(units) if waiting[u] == 0]
    heapq.heapify(ready)
    order = []
    tie = len(units)
    while ready:
        _, _, u = heapq.heappop(ready)
        order.append(u)
        for successor in successors[u]:
            waiting[successor] -= 1
            if waiting[successor] == 0:
                tie += 1
                heapq.heappush(ready, (key[successor], tie, successor))
    if len(order) != len(units):  # pragma: no cover - same-height groups cannot close a cycle
        raise RuntimeError("batching the rank program's elementwise ops would create a cycle")

    new_graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    batched = 0
    for u in order:
        if isinstance(u, torch.fx.Node):
            env[u] = new_graph.node_copy(u, lambda node: env[node])
            continue
        form, group = groups[u[1]]
        batched += len(group)
        first = group[0]
        lists = [[env[member.args[position]] for member in group] for position in form.tensor_args if position < len(first.args)]
        rest = tuple(arg for position, arg in enumerate(first.args) if position not in form.tensor_args)
        previous = None
        for target, args, kwargs in form.build(lists, rest, dict(first.kwargs)):
            args = tuple(previous if arg is _PREVIOUS else arg for arg in args)
            previous = new_graph.call_function(target, args, kwargs)
        for position, member in enumerate(group):
            item = new_graph.call_function(operator.getitem, (previous, position))
            item.meta.update(member.meta)
            env[member] = item
    new_graph.lint()
    return new_graph, BatchStats(ops_before, _count_ops(new_graph.nodes), len(groups), batched)


def _count_ops(nodes: Any) -> int:
    """Calls the program makes (``getitem`` reads of a result are not calls)."""
    return sum(1 for node in nodes if node.op in ("call_function", "call_method") and node.target is not operator.getitem)


def merge_duplicates(graph: torch.fx.Graph, *, max_numel: int = MAX_NUMEL) -> int:
    """Merge small pure ops that repeat an earlier op on the same arguments (in place); returns how many.

    The captured optimizer computes its shared hyperparameters' functions again
    for every parameter (``1 - beta1``, ``lr * weight_decay``, the constant
    ``0.5``). Only ops that are deterministic and mutate nothing are merged, and
    only when no program output is their result or a view of it, so no two
    outputs become one tensor; only small results, so no merge keeps a large
    tensor alive longer (a recomputed activation stays recomputed).
    """
    escapes = _output_origins(graph)
    seen: dict[tuple, torch.fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):  # a merged node's readers now read the earlier one: both must only be read
        if node in escapes or not _mergeable(node, max_numel):
            continue
        try:
            key = (node.op, node.target, _hashable(node.args), _hashable(dict(node.kwargs)))
            hash(key)
        except TypeError:  # an argument that cannot be compared by value
            continue
        earlier = seen.get(key)
        if earlier is None:
            seen[key] = node
            continue
        node.replace_all_uses_with(earlier)
        graph.erase_node(node)
        merged += 1
    return merged


def _output_origins(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes whose result is a program output or shares storage with one (through views)."""
    origins: set[torch.fx.Node] = set()
    stack = [arg for node in graph.nodes if node.op == "output" for arg in node.all_input_nodes]
    while stack:
        node = stack.pop()
        if node in origins:
            continue
        origins.add(node)
        if may_alias_argument(node):
            stack.extend(node.all_input_nodes)
    return origins


def _mergeable(node: torch.fx.Node, max_numel: int) -> bool:
    if node.op == "call_method":
        if node.target != "contiguous" or len(node.args) != 1 or not isinstance(node.args[0], torch.fx.Node):
            return False
        numel = _numel(node.args[0])
        return numel is not None and numel <= max_numel and all(_reads_only(user) for user in node.users)
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    schema = node.target._schema
    if (torch.Tag.nondeterministic_seeded in node.target.tags or schema.is_mutable or len(schema.returns) != 1
            or str(schema.returns[0].type) != "Tensor"):
        return False
    numel = _numel(node)
    return numel is not None and numel <= max_numel and all(_reads_only(user) for user in node.users)


def _reads_only(user: torch.fx.Node) -> bool:
    """Whether ``user`` only reads its inputs (a shared tensor stays as it was for its other readers)."""
    if user.op == "call_method":
        return user.target == "contiguous"
    if user.op != "call_function":
        return False
    if user.target is operator.getitem:
        return True
    return isinstance(user.target, torch._ops.OpOverload) and not user.target._schema.is_mutable
