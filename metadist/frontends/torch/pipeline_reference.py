"""A pipeline plan's meaning, executed in one process: every stage's phases over every microbatch.

This is the reference a distributed pipeline must reproduce, and the check that a plan's stages
(:mod:`metadist.solver.pipeline`) compute the step: per microbatch, each stage's forward phase in
stage order and its backward phase in reverse order, the values the plan says they send handed
over; each accumulated value summed over the microbatches with the weight of its microbatch (its
loss divisor over the sum of all of them: a mean loss over a batch is the weighted mean of the
microbatches' means; ``1 / m`` without a divisor); then each stage's update once, on the
accumulated gradients and those other stages transfer to it. The schedule changes when phases run,
not what they compute, so one order serves both.

Random ops are refused: a pipeline draws them whole for the batch and slices them, which this
reference does not reproduce yet.
"""

from __future__ import annotations

from typing import Any

import torch

from ...ir import Role
from ...ir.pipeline import PipelinePlan
from ...ir.stage_graphs import phase_graphs
from ...solver.errors import PipelineError
from ...solver.pipeline.regions import ANYWHERE_ROLES
from .capture import TorchStep
from .execute import execute_graph
from .microbatch import batch_size_of

__all__ = ["run_pipeline_reference"]


def _slice(batch: Any, index: int, microbatches: int) -> Any:
    import torch.utils._pytree as pytree

    part = batch_size_of(batch) // microbatches
    return pytree.tree_map(lambda leaf: leaf[index * part:(index + 1) * part] if isinstance(leaf, torch.Tensor) else leaf,
                           batch)


def run_pipeline_reference(step: TorchStep, plan: PipelinePlan, model: torch.nn.Module, optimizer: Any,
                           batch: Any) -> dict[str, Any]:
    """Run ``plan`` (made for ``step``, captured on one microbatch with ``raw_grads=True``) on ``batch``.

    Returns ``{"loss": tensor, "state": {input name: updated tensor}, "grads": {parameter: accumulated gradient}}``;
    nothing of the model or the optimizer is changed.
    """
    graph = step.graph
    from ... import __version__

    plan.check_for(graph, __version__)
    if any(node.op.is_random for node in graph.nodes):
        raise PipelineError("the step draws random numbers (dropout): the one-process pipeline reference does not "
                            "reproduce a pipeline's whole-batch draws yet; use a model without dropout")
    m = plan.microbatches
    phases = [phase_graphs(graph, stage, plan.loss, plan.loss_divisor, plan.transfers) for stage in plan.stages]
    everywhere = {gi.value.name for gi in graph.inputs if gi.role in ANYWHERE_ROLES}
    inputs = []
    for index in range(m):
        tensors = step.gather_inputs(model, optimizer, _slice(batch, index, m))
        inputs.append({gi.value.name: tensor for gi, tensor in zip(graph.inputs, tensors)})

    def held(stage, index: int) -> dict[str, Any]:
        """What a stage's rank has before anything is sent to it: the anywhere inputs and the state it holds."""
        return {name: tensor for name, tensor in inputs[index].items() if name in everywhere or name in stage.state}

    outputs: list[list[dict[str, Any]]] = [[{} for _ in plan.stages] for _ in range(m)]  # [microbatch][stage]
    for index in range(m):  # forward, stage by stage, each receiving only what the plan sends it
        for stage, phase in zip(plan.stages, phases):
            env = held(stage, index)
            if stage.index:
                env.update({v: outputs[index][stage.index - 1][v] for v in stage.forward_recv})
            outputs[index][stage.index].update(_run(phase.forward, env))
    if plan.loss_divisor is not None:
        counts = [next(out[plan.loss_divisor] for out in outputs[index] if plan.loss_divisor in out) for index in range(m)]
        weights = [count / sum(counts) for count in counts]
    else:
        weights = [1.0 / m] * m
    accumulated: list[dict[str, torch.Tensor]] = [{} for _ in plan.stages]
    for index, weight in enumerate(weights):  # backward, last stage first
        for stage, phase in reversed(list(zip(plan.stages, phases))):
            mine = outputs[index][stage.index]
            env = held(stage, index)
            env.update({v: mine[v] for v in stage.saved})
            if stage.index + 1 < len(plan.stages):
                env.update({v: outputs[index][stage.index + 1][v] for v in stage.backward_recv})
            if plan.loss_divisor is not None and plan.loss_divisor not in env:
                env[plan.loss_divisor] = counts[index]  # every stage that accumulates reads its microbatch's divisor
            results = _run(phase.backward, env)
            mine.update(results)
            for value in stage.accumulated:
                part = results[value] * weight
                sums = accumulated[stage.index]
                sums[value] = part if value not in sums else sums[value] + part
    loss = sum(next(out[plan.loss] for out in outputs[index] if plan.loss in out) * weights[index] for index in range(m))
    state: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for stage, phase in zip(plan.stages, phases):  # the update, once, on the accumulated gradients
        env = held(stage, 0)
        env.update(accumulated[stage.index])
        env.update({t.value: accumulated[t.source][t.value] for t in plan.transfers
                    if t.kind == "gradient" and t.target == stage.index})
        results = _run(phase.update, env)
        for output in phase.update.outputs:
            if output.replaces is not None:
                state[output.replaces] = results[output.name]
            elif output.role is Role.GRAD:
                grads[output.source.removeprefix("grad:")] = results[output.name]
    for parameter, (value, where) in plan.grads.items():
        grads.setdefault(parameter, accumulated[where].get(value))
    return {"loss": loss, "state": state, "grads": grads}


def _run(graph, env: dict[str, Any]) -> dict[str, Any]:
    """Run one phase on what its stage has; a value it reads that nothing sent it is an error of the plan."""
    missing = [gi.value.name for gi in graph.inputs if gi.value.name not in env]
    if missing:
        raise PipelineError(f"phase {graph.name!r} reads {missing[:3]}, which its stage neither holds nor was sent")
    results = execute_graph(graph, [env[gi.value.name] for gi in graph.inputs])
    return {output.name: value for output, value in zip(graph.outputs, results)}
