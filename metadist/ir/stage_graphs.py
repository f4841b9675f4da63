"""The graphs of a pipeline stage: the whole stage (what its plan is made for) and its three phases.

- :func:`stage_graph`: the stage's forward, backward and update nodes as one graph, for the
  stage's own plan. Its inputs are the state it holds, the batch, constants and hyperparameters
  it reads, the random values it reads (``batch`` role: drawn whole, any sharding is a slice),
  the values it receives (``activation``) and the gradients other stages send it (``grad``); its
  outputs are the values it sends, its updated state and, on the last stage, the loss;
- :func:`phase_graphs`: the same nodes split into the forward and backward phases (run per
  microbatch) and the update phase (run once), each with the values it hands to the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .graph import Graph, GraphOutput, Role
from .pipeline import Stage, Transfer
from .subgraph import extract

__all__ = ["PhaseGraphs", "phase_graphs", "stage_graph"]


def _roles(stage: Stage, transfers: Sequence[Transfer]) -> dict[str, Role]:
    roles = {value: Role.BATCH for value in stage.drawn}
    roles.update({value: Role.ACTIVATION for value in (*stage.forward_recv, *stage.backward_recv)})
    roles.update({t.value: Role.GRAD for t in transfers if t.kind == "gradient" and t.target == stage.index})
    return roles


def _state_outputs(graph: Graph, stage: Stage) -> list[GraphOutput]:
    owned = set(stage.owned)
    return [out for out in graph.outputs if out.replaces in owned]


def _made(graph: Graph, nodes: Sequence[str]) -> set[str]:
    return {value.name for name in nodes for value in graph.node(name).output_values}


def stage_graph(graph: Graph, stage: Stage, loss: str, transfers: Sequence[Transfer] = ()) -> Graph:
    """The whole stage as one graph (see the module docstring)."""
    nodes = (*stage.forward, *stage.backward, *stage.update)
    made = _made(graph, nodes)
    sent = [*stage.forward_send, *stage.backward_send,
            *(t.value for t in transfers if t.kind == "gradient" and t.source == stage.index)]
    outputs = [GraphOutput(value, Role.ACTIVATION, source=f"send:{value}") for value in dict.fromkeys(sent)]
    if loss in made:
        outputs.append(GraphOutput(loss, Role.LOSS, source="loss"))
    outputs += _state_outputs(graph, stage)
    inputs = (*stage.state, *stage.forward_recv, *stage.backward_recv)
    return extract(graph, nodes, outputs, roles=_roles(stage, transfers), inputs=inputs,
                   name=f"{graph.name}.stage{stage.index}")


@dataclass(frozen=True)
class PhaseGraphs:
    """A stage's forward, backward and update phases as graphs."""

    forward: Graph
    backward: Graph
    update: Graph


def phase_graphs(graph: Graph, stage: Stage, loss: str, loss_divisor: str | None, transfers: Sequence[Transfer] = ()) -> PhaseGraphs:
    """The three phases of ``stage``.

    Forward: inputs start with the received values (``forward_recv``); outputs are the values sent up, the
    saved values, and (where made) the loss and its divisor. Backward: inputs start with the saved values, then
    the received ones (``backward_recv``); outputs are the values sent down, then the accumulated ones. Update:
    inputs start with the accumulated values, then the gradients received from other stages; outputs are the
    updated state, then the gradients the update itself sums.
    """
    roles = _roles(stage, transfers)
    made_forward = _made(graph, stage.forward)
    forward_out = [*stage.forward_send, *stage.saved]
    forward_out += [value for value in (loss, loss_divisor) if value is not None and value in made_forward]
    forward = extract(graph, stage.forward, [GraphOutput(v, Role.ACTIVATION) for v in dict.fromkeys(forward_out)],
                      roles=roles, inputs=stage.forward_recv, name=f"{graph.name}.stage{stage.index}.forward")
    backward_out = [*stage.backward_send, *stage.accumulated]
    backward = extract(graph, stage.backward, [GraphOutput(v, Role.ACTIVATION) for v in dict.fromkeys(backward_out)],
                       roles={**roles, **{v: Role.ACTIVATION for v in stage.saved}},
                       inputs=(*stage.saved, *stage.backward_recv), name=f"{graph.name}.stage{stage.index}.backward")
    received = [t.value for t in transfers if t.kind == "gradient" and t.target == stage.index]
    made_update = _made(graph, stage.update)
    grads = [out for out in graph.outputs_by_role(Role.GRAD) if out.name in made_update]
    update = extract(graph, stage.update, [*_state_outputs(graph, stage), *grads],
                     roles={**roles, **{v: Role.GRAD for v in stage.accumulated}},
                     inputs=(*stage.accumulated, *received), name=f"{graph.name}.stage{stage.index}.update")
    return PhaseGraphs(forward, backward, update)
