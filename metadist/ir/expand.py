"""Canonical names, and a graph of ``L`` repeated layers expanded from a capture of four.

**Canonical names.** A node is named after its op (``mm``, ``add``...), numbered per name in graph
order (``mm``, ``mm_1``, ``mm_2``...), and the read outputs of a multi-output node are ``getitem``,
``getitem_1``... (outputs nobody reads are ``<node>.<index>``). Names then depend only on the
sequence of ops, so a graph expanded from fewer layers and the same step captured whole get the
same names, the same JSON and the same fingerprint.

**Expansion.** Deep models repeat one block (a ``ModuleList`` of identical layers). The frontend
captures the step with the list cut to its first four layers; :func:`expand_layers` writes the
graph of ``L`` layers from it. The layer of a graph input is read from its name (``<prefix><i>.``,
``prefix`` being the list's module path). Nodes are labelled as :mod:`metadist.solver.shrink` does:
a node reading state inputs of exactly one layer sets the label to that layer, one reading state of
no layer clears it, others keep it; the step is then a sequence of **runs** of one label, which
come in **sweeps** of four adjacent runs, labelled ``0, 1, 2, 3`` (forward, optimizer) or
``3, 2, 1, 0`` (backward). Layer 0's runs stay, layer 3's become layer ``L - 1``'s, and the run of
layer 1 in every sweep is copied for layers ``1 .. L - 2`` in the sweep's direction; layer 2's runs
are not copied (layer 2 is written from layer 1 like every middle layer) but are read to check references.

A node of captured layer ``r`` standing for layer ``X`` that reads a value made by the node at
offset ``p`` of a run of captured label ``l`` reads, in the expansion, the node at offset ``p`` of
the same sweep's run for layer ``X + l - r`` (its neighbour layer stays its neighbour); inputs of a
layer shift the same way. Nodes outside every run read layers 0 and 3 (which stay the first and the
last); reading a middle layer from outside a run has no single meaning and is refused. Each
mapped reference is checked: the target run has a node at that offset doing the same op.
Whatever cannot be expanded raises :class:`ExpansionError`; the frontend then captures the step
whole. The frontend also verifies the result: the expansion of the four captured layers to four
must give back the capture itself, layer 2 included
(:func:`metadist.frontends.torch.repeat.capture_repeated`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable

from .graph import STATE_ROLES, Arg, Graph, GraphInput, GraphOutput, IRError, Node, Role, Value, ValueRef

__all__ = ["CAPTURED_LAYERS", "ExpansionError", "canonical_names", "LayerNames", "expand_layers", "expand_layers_traced", "op_base_name"]

CAPTURED_LAYERS = 4
"""Layers a step is captured with before expansion: the first, two middle ones, and the last.

Layers ``0``, ``1`` and ``3`` are the template; layer ``2`` is written from layer ``1`` like every other
middle layer, so expanding the capture to four layers and comparing it with itself verifies that the
middle layers repeat as the expansion assumes (:func:`metadist.frontends.torch.repeat.capture_repeated`)."""
LAST = CAPTURED_LAYERS - 1
"""The captured label of the last layer."""
TEMPLATE_LABELS = (0, 1, LAST)
"""Captured labels whose runs are copied into the expansion; the others are only read to check references."""


class ExpansionError(IRError):
    """The step does not repeat its layers in a way :func:`expand_layers` can write out; the message says where."""


# -- canonical names -------------------------------------------------------------------


def op_base_name(target: str) -> str:
    """``aten.mm.default`` -> ``mm``; ``jax.lax.dot_general`` -> ``dot_general``."""
    parts = target.split(".")
    if parts[0] != "jax" and len(parts) == 3:
        return parts[1]
    return parts[-1]


def _single_output(node: Node) -> bool:
    return len(node.outputs) == 1 and node.outputs[0] is not None and node.outputs[0].name == node.name


def canonical_names(graph: Graph, base_of: Callable[[str], str] = op_base_name) -> tuple[Graph, dict[str, str]]:
    """The graph with canonical node and value names, and the renaming (old value name -> new)."""
    used = {graph_input.value.name for graph_input in graph.inputs}
    counts: dict[str, int] = {}

    def fresh(base: str) -> str:
        number = counts.get(base, 0)
        name = base if number == 0 else f"{base}_{number}"
        while name in used:
            number += 1
            name = f"{base}_{number}"
        counts[base] = number + 1
        used.add(name)
        return name

    read = {output.name for output in graph.outputs}
    for node in graph.nodes:
        read.update(node.input_names)
    renamed: dict[str, str] = {}
    nodes = []
    for node in graph.nodes:
        name = fresh(base_of(node.op.target))
        if _single_output(node):
            renamed[node.name] = name
        else:
            for index, value in enumerate(node.outputs):
                if value is not None:
                    renamed[value.name] = fresh("getitem") if value.name in read else f"{name}.{index}"
        nodes.append(_renamed_node(node, name, renamed))
    outputs = tuple(replace(output, name=renamed.get(output.name, output.name)) for output in graph.outputs)
    return Graph(inputs=graph.inputs, nodes=tuple(nodes), outputs=outputs, name=graph.name), renamed


def _renamed_node(node: Node, name: str, renamed: dict[str, str]) -> Node:
    def arg(item: Arg) -> Arg:
        if isinstance(item, ValueRef):
            return ValueRef(renamed.get(item.name, item.name))
        if isinstance(item, tuple):
            return tuple(arg(inner) for inner in item)
        return item

    outputs = tuple(None if value is None else Value(renamed.get(value.name, value.name), value.spec) for value in node.outputs)
    return Node(name, node.op, tuple(arg(item) for item in node.args), tuple((key, arg(item)) for key, item in node.kwargs), outputs)


# -- expansion -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Run:
    label: int
    start: int
    """Position of the run's first node in the graph."""
    length: int


@dataclass(frozen=True)
class _Sweep:
    runs: tuple[_Run, ...]
    """The :data:`CAPTURED_LAYERS` runs in graph order."""

    @property
    def ascending(self) -> bool:
        return self.runs[0].label == 0

    def run(self, label: int) -> _Run:
        return self.runs[label if self.ascending else LAST - label]


class LayerNames:
    """Reads and rewrites layer indices in names under one module path ``prefix`` (graph inputs, outputs' sources,
    ``grad:`` names, parameter names)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def of(self, name: str) -> int | None:
        text = name.removeprefix("grad:")
        if not text.startswith(self.prefix):
            return None
        head = text[len(self.prefix):].split(".", 1)[0].split(":", 1)[0]
        return int(head) if head.isdigit() else None

    def moved(self, name: str, layer: int) -> str:
        marker = "grad:" if name.startswith("grad:") else ""
        text = name.removeprefix("grad:")
        rest = text[len(self.prefix):]
        head = rest.split(".", 1)[0].split(":", 1)[0]
        return f"{marker}{self.prefix}{layer}{rest[len(head):]}"


def _labels(graph: Graph, layers: LayerNames) -> list[int | None]:
    layer_of = {gi.value.name: layers.of(gi.value.name) for gi in graph.inputs if gi.role in STATE_ROLES}
    labels: list[int | None] = []
    label: int | None = None
    for node in graph.nodes:
        read = {layer_of[name] for name in node.input_names if name in layer_of}
        if read:
            label = read.pop() if len(read) == 1 else None
        labels.append(label)
    return labels


def _sweeps(labels: list[int | None]) -> list[_Sweep]:
    runs: list[_Run] = []
    for position, label in enumerate(labels):
        if label is None:
            continue
        if runs and runs[-1].label == label and runs[-1].start + runs[-1].length == position:
            runs[-1] = replace(runs[-1], length=runs[-1].length + 1)
        else:
            runs.append(_Run(label, position, 1))
    k = CAPTURED_LAYERS
    if len(runs) % k:
        raise ExpansionError(f"the step's layers make {len(runs)} runs, not sweeps of {k} (labels {[r.label for r in runs][:12]}...)")
    ascending, descending = tuple(range(k)), tuple(reversed(range(k)))
    sweeps = []
    for index in range(0, len(runs), k):
        group = tuple(runs[index:index + k])
        order = tuple(run.label for run in group)
        if order not in (ascending, descending):
            raise ExpansionError(f"runs {index}..{index + k - 1} of the step have layers {order}, not a sweep {ascending} or {descending}")
        if any(a.start + a.length != b.start for a, b in zip(group, group[1:])):
            raise ExpansionError(f"the runs of sweep {index // k} (layers {order}) are not adjacent")
        sweeps.append(_Sweep(group))
    return sweeps


class _Expansion:
    """The expanded nodes, inputs and outputs of one graph (see the module docstring)."""

    def __init__(self, graph: Graph, layers: LayerNames, count: int) -> None:
        self.graph, self.layers, self.count = graph, layers, count
        labels = _labels(graph, layers)
        self.sweeps = _sweeps(labels)
        self.where: dict[int, tuple[int, int, int]] = {}
        """Graph position -> (sweep index, captured label, offset in its run)."""
        for index, sweep in enumerate(self.sweeps):
            for run in sweep.runs:
                for offset in range(run.length):
                    self.where[run.start + offset] = (index, run.label, offset)
        self.position = {node.name: index for index, node in enumerate(graph.nodes)}
        self.made_by: dict[str, tuple[int, int]] = {}
        """Value name -> (producer position, output index)."""
        for index, node in enumerate(graph.nodes):
            for slot, value in enumerate(node.outputs):
                if value is not None:
                    self.made_by[value.name] = (index, slot)
        self.input_layer = {gi.value.name: layers.of(gi.value.name) for gi in graph.inputs}
        self.constants = _layer_constants(graph, self.where)
        """Captured label -> its layer's tensor constants in input order (what each layer's trace created)."""
        self.constant_of = {name: (label, index) for label, names in self.constants.items() for index, name in enumerate(names)}

    # -- where a layer's copy of a node lives
    def _layer_of_label(self, label: int) -> int:
        assert label in (0, LAST), label
        return 0 if label == 0 else self.count - 1

    def _target(self, sweep: int, layer: int, offset: int, source_position: int) -> tuple[Node, str]:
        """The captured node standing at ``offset`` of ``sweep``'s run for ``layer``, and the suffix of its copy."""
        runs = self.sweeps[sweep]
        if layer == 0 or layer == self.count - 1:
            run, suffix = runs.run(0 if layer == 0 else LAST), ""
        elif 0 < layer < self.count - 1:
            run, suffix = runs.run(1), f"~{layer}"
        else:
            raise ExpansionError(f"a node of sweep {sweep} reads layer {layer}, outside the {self.count} layers")
        if offset >= run.length:
            raise ExpansionError(f"a node reads offset {offset} of sweep {sweep}'s run for layer {layer}, which has {run.length} nodes")
        target = self.graph.nodes[run.start + offset]
        source = self.graph.nodes[source_position]
        if target.op != source.op or len(target.outputs) != len(source.outputs):
            raise ExpansionError(
                f"layer {layer}'s node at offset {offset} of sweep {sweep} is {target.op.target}, but the captured reference "
                f"is {source.op.target}: the layers do not line up"
            )
        return target, suffix

    def value(self, name: str, layer: int | None, label: int | None) -> str:
        """What a reader of captured ``label`` standing for ``layer`` (None: outside the runs) reads for ``name``."""
        input_layer = self.input_layer.get(name)
        if input_layer is not None:
            return self.layers.moved(name, self._shift(layer, label, input_layer, name))
        if name in self.constant_of:
            owner, index = self.constant_of[name]
            return self._constant(index, self._shift(layer, label, owner, name))
        made = self.made_by.get(name)
        where = None if made is None else self.where.get(made[0])
        if where is None:
            return name
        position, slot = made
        sweep, value_label, offset = where
        target, suffix = self._target(sweep, self._shift(layer, label, value_label, name), offset, position)
        value = target.outputs[slot]
        if value is None:
            raise ExpansionError(f"{name} maps to output {slot} of {target.name}, which that node does not make")
        return value.name + suffix

    def _constant(self, index: int, layer: int) -> str:
        """The name of the ``index``-th tensor constant of ``layer`` (a middle layer's: layer 1's, suffixed)."""
        if layer == 0 or layer == self.count - 1:
            return self.constants[0 if layer == 0 else LAST][index]
        if 0 < layer < self.count - 1:
            return f"{self.constants[1][index]}~{layer}"
        raise ExpansionError(f"a node reads the constants of layer {layer}, outside the {self.count} layers")

    def _shift(self, layer: int | None, label: int | None, target_label: int, name: str) -> int:
        if label is None:
            if target_label not in (0, LAST):
                raise ExpansionError(f"{name} (of a middle captured layer) is read outside the layers' runs: "
                                     "which of the layers it stands for is not known")
            return self._layer_of_label(target_label)
        assert layer is not None
        return layer + target_label - label

    def copy_node(self, node: Node, layer: int | None, label: int | None, suffix: str) -> Node:
        def arg(item: Arg) -> Arg:
            if isinstance(item, ValueRef):
                return ValueRef(self.value(item.name, layer, label))
            if isinstance(item, tuple):
                return tuple(arg(inner) for inner in item)
            return item

        outputs = tuple(None if v is None else Value(v.name + suffix, v.spec) for v in node.outputs)
        return Node(node.name + suffix, node.op, tuple(arg(item) for item in node.args),
                    tuple((key, arg(item)) for key, item in node.kwargs), outputs)

    # -- the three lists (nodes, inputs, outputs)
    def nodes(self) -> list[Node]:
        nodes: list[Node] = []
        position = 0
        graph_nodes = self.graph.nodes
        while position < len(graph_nodes):
            where = self.where.get(position)
            if where is None:
                nodes.append(self.copy_node(graph_nodes[position], None, None, ""))
                position += 1
                continue
            sweep_index, label, _ = where
            sweep = self.sweeps[sweep_index]
            for run in sweep.runs:
                members = graph_nodes[run.start:run.start + run.length]
                if run.label == 1:
                    layers = range(1, self.count - 1) if sweep.ascending else range(self.count - 2, 0, -1)
                    for layer in layers:
                        nodes.extend(self.copy_node(node, layer, 1, f"~{layer}") for node in members)
                elif run.label in TEMPLATE_LABELS:
                    layer = self._layer_of_label(run.label)
                    nodes.extend(self.copy_node(node, layer, run.label, "") for node in members)
            position = sweep.runs[-1].start + sweep.runs[-1].length
        return nodes

    def _repeat(self, items: tuple, layer_of: Callable, emit: Callable) -> list:
        """Items in order: a consecutive block of the middle layer's items once per middle layer, the last layer's moved."""
        result, block = [], []

        def flush() -> None:
            for layer in range(1, self.count - 1):
                result.extend(emit(item, layer, 1) for item in block)
            block.clear()

        for item in items:
            captured = layer_of(item)
            if captured == 1:
                block.append(item)
                continue
            if captured is not None and captured not in TEMPLATE_LABELS:
                continue  # a spare middle layer's item: written from layer 1's
            flush()
            result.append(emit(item, None if captured is None else self._layer_of_label(captured), captured))
        flush()
        return result

    def inputs(self) -> list[GraphInput]:
        def emit(graph_input: GraphInput, layer, captured) -> GraphInput:
            if captured is None:
                return graph_input
            if graph_input.value.name in self.constant_of:  # renumbered with the others by expand_layers
                name = self._constant(self.constant_of[graph_input.value.name][1], layer)
                return GraphInput(Value(name, graph_input.value.spec), graph_input.role, graph_input.source)
            value = Value(self.layers.moved(graph_input.value.name, layer), graph_input.value.spec)
            source = self.layers.moved(graph_input.source, layer) if self.layers.of(graph_input.source) is not None else graph_input.source
            return GraphInput(value, graph_input.role, source)

        def layer_of(graph_input: GraphInput) -> int | None:
            owner = self.constant_of.get(graph_input.value.name)
            return self.input_layer[graph_input.value.name] if owner is None else owner[0]

        return self._repeat(self.graph.inputs, layer_of, emit)

    def outputs(self) -> list[GraphOutput]:
        def layer_of(output: GraphOutput) -> int | None:
            if output.replaces is not None:
                return self.input_layer[output.replaces]
            return self.layers.of(output.source)

        def emit(output: GraphOutput, layer, captured) -> GraphOutput:
            if captured is None:
                return replace(output, name=self.value(output.name, None, None))
            return GraphOutput(
                self.value(output.name, layer, captured), output.role,
                None if output.replaces is None else self.layers.moved(output.replaces, layer),
                self.layers.moved(output.source, layer) if self.layers.of(output.source) is not None else output.source,
            )

        return self._repeat(self.graph.outputs, layer_of, emit)


_CONSTANT_NAME = re.compile(r"const:_tensor_constant(\d+)$")


def _layer_constants(graph: Graph, where: dict[int, tuple[int, int, int]]) -> dict[int, list[str]]:
    """Each captured label's tensor constants: those read only by the runs of that label (a layer's trace created
    them, as a KV cache's empty tensors); constants read elsewhere are shared and stay as they are."""
    readers: dict[str, set] = {gi.value.name: set() for gi in graph.inputs if gi.role is Role.CONSTANT}
    for position, node in enumerate(graph.nodes):
        for name in node.input_names:
            if name in readers:
                found = where.get(position)
                readers[name].add(None if found is None else found[1])
    owned: dict[int, list[str]] = {label: [] for label in range(CAPTURED_LAYERS)}
    for gi in graph.inputs:
        labels = readers.get(gi.value.name)
        if labels is not None and len(labels) == 1 and None not in labels:
            owned[next(iter(labels))].append(gi.value.name)
    counts = {label: len(names) for label, names in owned.items()}
    if len(set(counts.values())) > 1:
        raise ExpansionError(f"the captured layers create different numbers of tensor constants ({counts})")
    return owned if any(counts.values()) else {}


def _renumber_constants(graph: Graph) -> tuple[Graph, dict[str, str]]:
    """Tensor constants named ``const:_tensor_constant<N>`` by their order among the inputs, as a whole capture names
    them (the trace numbers constants as it creates them, layer by layer); and the renaming (old name -> new)."""
    renamed: dict[str, str] = {}
    inputs, number = [], 0
    for gi in graph.inputs:
        if gi.role is Role.CONSTANT and (_CONSTANT_NAME.match(gi.value.name) or "~" in gi.value.name):
            name = f"const:_tensor_constant{number}"
            renamed[gi.value.name] = name
            number += 1
            gi = GraphInput(Value(name, gi.value.spec), gi.role, name.removeprefix("const:"))
        inputs.append(gi)
    if not renamed:
        return graph, renamed
    nodes = tuple(_renamed_node(node, node.name, renamed) for node in graph.nodes)
    outputs = tuple(replace(output, name=renamed.get(output.name, output.name)) for output in graph.outputs)
    return Graph(inputs=tuple(inputs), nodes=nodes, outputs=outputs, name=graph.name), renamed


def _check_constant_order(graph: Graph) -> None:
    numbers = [int(match.group(1)) for gi in graph.inputs if gi.role is Role.CONSTANT
               and (match := _CONSTANT_NAME.match(gi.value.name))]
    if numbers != sorted(numbers):
        raise ExpansionError("the capture's tensor constants are not in the order the trace created them")


def expand_layers(graph: Graph, prefix: str, layers: int, base_of: Callable[[str], str] = op_base_name) -> Graph:
    """The graph of ``layers`` layers from ``graph``, captured with the first :data:`CAPTURED_LAYERS` of them.

    ``prefix``: the module path of the repeated layers with a trailing dot (``model.layers.``); the
    result has canonical names (:func:`canonical_names`). Raises :class:`ExpansionError` where the
    captured step does not repeat its layers as the module docstring describes.
    """
    return expand_layers_traced(graph, prefix, layers, base_of)[0]


def expand_layers_traced(graph: Graph, prefix: str, layers: int,
                         base_of: Callable[[str], str] = op_base_name) -> tuple[Graph, dict[str, str]]:
    """:func:`expand_layers`, and where each value of the expansion comes from: expanded name -> the captured
    value it copies, for every node output and tensor constant (a middle layer's copy names layer 1's value).

    A frontend carries what it knows of the captured values (their tensors, their layouts) over to the
    expansion with it (:func:`metadist.frontends.torch.repeat.capture_repeated_step`).
    """
    layers_of = LayerNames(prefix)
    found = sorted({layer for gi in graph.inputs if (layer := layers_of.of(gi.value.name)) is not None})
    if found != list(range(CAPTURED_LAYERS)):
        raise ExpansionError(f"the graph's inputs under {prefix!r} belong to layers {found}, not the {CAPTURED_LAYERS} captured ones")
    if layers < len(TEMPLATE_LABELS):
        raise ExpansionError(f"cannot expand {CAPTURED_LAYERS} captured layers to {layers}")
    _check_constant_order(graph)
    expansion = _Expansion(graph, layers_of, layers)
    expanded = Graph(inputs=tuple(expansion.inputs()), nodes=tuple(expansion.nodes()), outputs=tuple(expansion.outputs()),
                     name=graph.name)
    # a copy is named after its captured value, suffixed ``~<layer>`` for a middle layer (captured names hold no ``~``)
    copied = [gi.value.name for gi in expanded.inputs if gi.role is Role.CONSTANT]
    copied += [value.name for node in expanded.nodes for value in node.outputs if value is not None]
    renumbered, constants_renamed = _renumber_constants(expanded)
    result, values_renamed = canonical_names(renumbered, base_of)
    origin = {}
    for name in copied:
        renamed = constants_renamed.get(name, name)
        origin[values_renamed.get(renamed, renamed)] = name.split("~", 1)[0]
    return result, origin
