"""Support for the multi-process runtime tests (no tests here).

:func:`run_distributed` runs a function on N local processes (spawned, gloo,
a free port) and returns each rank's result, or raises with the failing
rank's traceback; a hung run is killed after ``timeout_s``.
:func:`greedy_plan` builds test plans from hand-written rules: given the
input shardings, each node takes, per mesh axis, the factor of its rule that
its inputs already fit (else the best-fitting factor, else replicate), so
data-parallel and column/row tensor-parallel plans follow from how the
batch and the parameters start.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from typing import Any, Callable, Mapping

import torch.multiprocessing as mp

from metadist.ir import Graph, Mesh, Partial, Replicate, Shard, parse_rule, parse_sharding
from metadist.ir.plan import REPLICATE, AxisChoice, NodeStrategy, Plan, graph_fingerprint, strategy_from_choices


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        results.put((rank, "ok", fn(*args)))
    except BaseException:  # the parent re-raises it with the traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 150.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` processes; the results by rank."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_child, args=(rank, world_size, port, fn, args, results)) for rank in range(world_size)]
    for process in processes:
        process.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout_s)
            outcomes[rank] = (status, value)
            if status == "error":
                break
    except queue.Empty:
        raise TimeoutError(f"distributed test on {world_size} ranks did not finish in {timeout_s} s") from None
    finally:
        for process in processes:
            process.join(timeout=5 if outcomes and len(outcomes) == world_size else 1)
            if process.is_alive():
                process.kill()
    errors = {rank: value for rank, (status, value) in outcomes.items() if status == "error"}
    if errors:
        rank, text = next(iter(errors.items()))
        raise AssertionError(f"rank {rank} failed:\n{text}")
    return [outcomes[rank][1] for rank in range(world_size)]


# ---------------------------------------------------------------- hand-written rules and greedy plans

_FIXED_RULES = {
    "aten.addmm.default": "c,a_,_c->ac",
    "aten.mm.default": "ab,bc->ac | b:sum",
    "aten._log_softmax.default": "a_->a_",
    "aten._log_softmax_backward_data.default": "a_,a_->a_",
    "aten.nll_loss_backward.default": ",a_,a,->a_",
    "aten.sum.dim_IntList": "ab->_b | a:sum",
}


def hand_rule(graph: Graph, node):
    """The rule of one MLP op, written by hand (None: no rule, the node replicates)."""
    target = node.op.target
    if target in _FIXED_RULES:
        return parse_rule(_FIXED_RULES[target])
    ranks = [graph.value(name).spec.rank for name in node.input_names]
    letters = "abcd"[: ranks[0]] if ranks else ""
    if target == "aten.t.default":
        return parse_rule("ab->ba | pass 0:sum")
    if target == "aten.view.default" and ranks == [2] and node.outputs[0].spec.rank == 1:
        return parse_rule("_a->a | pass 0:sum")
    if target in ("aten.gelu.default", "aten.clone.default") or (target == "aten.mul.Tensor" and len(ranks) == 1):
        passes = "" if target == "aten.gelu.default" else " | pass 0:sum"
        return parse_rule(f"{letters}->{letters}{passes}")
    if target in ("aten.gelu_backward.default", "aten.add.Tensor") and len(set(ranks)) == 1 and len(ranks) == 2:
        return parse_rule(f"{letters},{letters}->{letters}")
    if target == "aten.mul.Tensor" and len(ranks) == 2 and ranks[1] == 0:  # by a live hyperparameter
        return parse_rule(f"{letters},->{letters} | pass 0:sum")
    if target == "aten.addcmul.default" and len(ranks) == 3 and ranks[0] == ranks[1] and ranks[2] == 0:
        return parse_rule(f"{letters},{letters},->{letters}")  # a.add(b, alpha=hyperparameter)
    return None


def greedy_plan(graph: Graph, mesh: Mesh, input_shardings: Mapping[str, str]) -> Plan:
    """A plan from hand rules and the given input shardings (text, by input name; default replicated)."""
    replicated = tuple(Replicate() for _ in mesh.shape)
    start = {i.value.name: parse_sharding(input_shardings[i.value.name]) if i.value.name in input_shardings else replicated
             for i in graph.inputs}
    current = dict(start)
    strategies = {}
    for node in graph.nodes:
        rule = hand_rule(graph, node)
        placements = [current[name] for name in node.input_names]
        if rule is None:
            strategy = _replicated_strategy(node, mesh)
        else:
            choices = tuple(_choose(rule, [p[axis] for p in placements]) for axis in range(mesh.ndim))
            strategy = strategy_from_choices(rule, choices)
        strategies[node.name] = strategy
        for value, sharding in zip(node.outputs, strategy.outputs):
            if value is not None:
                current[value.name] = sharding
    outputs = tuple(start[o.replaces] if o.replaces else replicated for o in graph.outputs)
    return Plan(graph.name, graph_fingerprint(graph), "test", mesh, strategies, start, outputs, solver={"kind": "greedy"})


def _replicated_strategy(node, mesh: Mesh) -> NodeStrategy:
    replicated = tuple(Replicate() for _ in mesh.shape)
    return NodeStrategy(tuple(REPLICATE for _ in mesh.shape), tuple(replicated for _ in node.input_names),
                        tuple(None if v is None else replicated for v in node.outputs))


def _choose(rule, placements) -> AxisChoice:
    """The factor that fits the inputs' placements on one axis best; a partial pass; or replicate."""
    for index, placement in enumerate(placements):
        if isinstance(placement, Partial) and any(p.input == index for p in rule.partial_passes):
            if all(isinstance(other, Replicate) for i, other in enumerate(placements) if i != index):
                return AxisChoice("partial", index, placement.op)
    best, best_score = REPLICATE, 0
    for index, factor in enumerate(rule.factors):
        wanted = [Replicate() if dim is None else Shard(dim) for dim in factor.inputs]
        score = sum(1 for want, have in zip(wanted, placements) if want == have and isinstance(have, Shard))
        if score > best_score:
            best, best_score = AxisChoice("factor", index), score
    return best
