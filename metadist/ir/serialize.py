"""Stable, versioned JSON form of a MetaIR graph.

The form is plain JSON (no NaN/Infinity tokens, no pickle):

    {"format": "metadist.graph", "version": 1, "name": ...,
     "inputs": [{"name", "shape", "dtype", "role", "source"}],
     "nodes": [{"name", "op", "tags", "args", "kwargs", "outputs"}],
     "outputs": [{"name", "role", "replaces"}],
     "routing": [{"module", "num_experts", "top_k", "tokens", "groups", "group_tokens", "capacity"}]}

``routing`` (the static dispatch of each experts layer, :mod:`.routing`) is present only when
the graph has experts layers.

Arguments encode tensor references as ``{"ref": name}``, literals as
``{"lit": kind, "value": v}``, tuples as lists, and non-finite floats as
``{"float": "inf" | "-inf" | "nan"}``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .graph import Arg, Graph, GraphInput, GraphOutput, IRError, Literal, MetaOp, Node, TensorSpec, Value, ValueRef
from .routing import ExpertRouting

GRAPH_FORMAT = "metadist.graph"
GRAPH_FORMAT_VERSION = 1


def encode_arg(arg: Arg) -> Any:
    if isinstance(arg, ValueRef):
        return {"ref": arg.name}
    if isinstance(arg, Literal):
        return {"lit": arg.kind, "value": arg.value}
    if isinstance(arg, tuple):
        return [encode_arg(item) for item in arg]
    if isinstance(arg, float) and not math.isfinite(arg):
        return {"float": "nan" if math.isnan(arg) else ("inf" if arg > 0 else "-inf")}
    return arg


def decode_arg(data: Any) -> Arg:
    if isinstance(data, list):
        return tuple(decode_arg(item) for item in data)
    if isinstance(data, dict):
        if "ref" in data:
            return ValueRef(data["ref"])
        if "lit" in data:
            return Literal(data["lit"], data["value"])
        if "float" in data:
            return float(data["float"])
        raise IRError(f"unknown argument encoding {data!r}")
    return data


def _encode_value(value: Value | None) -> Any:
    if value is None:
        return None
    return {"name": value.name, "shape": list(value.spec.shape), "dtype": value.spec.dtype}


def _decode_value(data: Any) -> Value | None:
    if data is None:
        return None
    return Value(data["name"], TensorSpec(tuple(data["shape"]), data["dtype"]))


def graph_to_dict(graph: Graph) -> dict[str, Any]:
    data = {
        "format": GRAPH_FORMAT,
        "version": GRAPH_FORMAT_VERSION,
        "name": graph.name,
        "inputs": [
            {**_encode_value(graph_input.value), "role": graph_input.role.value, "source": graph_input.source}
            for graph_input in graph.inputs
        ],
        "nodes": [
            {
                "name": node.name,
                "op": node.op.target,
                "tags": sorted(node.op.tags),
                "args": [encode_arg(arg) for arg in node.args],
                "kwargs": {key: encode_arg(arg) for key, arg in node.kwargs},
                "outputs": [_encode_value(value) for value in node.outputs],
            }
            for node in graph.nodes
        ],
        "outputs": [
            {
                "name": graph_output.name,
                "role": graph_output.role.value,
                "replaces": graph_output.replaces,
                "source": graph_output.source,
            }
            for graph_output in graph.outputs
        ],
    }
    if graph.routing:
        data["routing"] = [record.to_dict() for record in graph.routing]
    return data


def graph_from_dict(data: dict[str, Any]) -> Graph:
    if not isinstance(data, dict) or data.get("format") != GRAPH_FORMAT:
        raise IRError(f"not a MetaIR graph document (expected format {GRAPH_FORMAT!r})")
    if data.get("version") != GRAPH_FORMAT_VERSION:
        raise IRError(
            f"MetaIR graph format version {data.get('version')!r} is not supported by this MetaDist "
            f"(it reads version {GRAPH_FORMAT_VERSION}); capture the step again with this version"
        )
    inputs = tuple(
        GraphInput(_decode_value(item), item["role"], item.get("source", "")) for item in data["inputs"]  # type: ignore[arg-type]
    )
    nodes = tuple(
        Node(
            name=item["name"],
            op=MetaOp(item["op"], frozenset(item.get("tags", ()))),
            args=tuple(decode_arg(arg) for arg in item["args"]),
            kwargs=tuple((key, decode_arg(arg)) for key, arg in item["kwargs"].items()),
            outputs=tuple(_decode_value(value) for value in item["outputs"]),
        )
        for item in data["nodes"]
    )
    outputs = tuple(GraphOutput(item["name"], item["role"], item.get("replaces"), item.get("source", "")) for item in data["outputs"])
    routing = tuple(ExpertRouting.from_dict(item) for item in data.get("routing", ()))
    return Graph(inputs=inputs, nodes=nodes, outputs=outputs, name=data.get("name", "step"), routing=routing)


def graph_to_json(graph: Graph, indent: int | None = None) -> str:
    return json.dumps(graph_to_dict(graph), indent=indent, allow_nan=False)


def graph_from_json(text: str) -> Graph:
    return graph_from_dict(json.loads(text))
