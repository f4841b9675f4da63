"""Hand-built MetaIR training steps with hand-written rules, for the solver's tests (no tests here)."""

from __future__ import annotations

from metadist.ir import Graph, GraphInput, GraphOutput, MetaOp, Node, TensorSpec, Value, ValueRef, parse_rule

RULES = {
    "mm": "ab,bc->ac | b:sum | pass 0:sum 1:sum",
    "t": "ab->ba | pass 0:sum",
    "relu": "ab->ab",
    "relu_backward": "ab,ab->ab",
    "sum": "ab-> | a:sum b:sum | pass 0:sum",
    "ones_like": "ab->ab",
    "scale": "ab->ab | pass 0:sum",
    "add": "ab,ab->ab | pass 0:sum 1:sum",
    "sub": "ab,ab->ab | pass 0:sum 1:sum",
}


class _Builder:
    def __init__(self, dtype: str) -> None:
        self.dtype, self.nodes, self.rules, self.inputs = dtype, [], {}, []

    def input(self, name: str, shape, role: str) -> str:
        self.inputs.append(GraphInput(Value(name, TensorSpec(tuple(shape), self.dtype)), role, name))
        return name

    def op(self, kind: str, args: list[str], shape, *, rule: str | None = None) -> str:
        name = f"{kind}_{len(self.nodes)}"
        node = Node(name, MetaOp(f"test.{kind}"), tuple(ValueRef(a) for a in args), (), (Value(name, TensorSpec(tuple(shape), self.dtype)),))
        self.nodes.append(node)
        self.rules[name] = parse_rule(rule or RULES[kind])
        return name


def mlp_step(batch: int, width: int, hidden: int, layers: int = 1, dtype: str = "float32", momentum: bool = True):
    """An MLP training step: layers of ``relu(x @ w1) @ w2``, sum loss, SGD with momentum. Returns (graph, rules)."""
    b = _Builder(dtype)
    x = b.input("batch.x", (batch, width), "batch")
    weights = []
    for i in range(layers):
        w1 = b.input(f"layers.{i}.w1", (width, hidden), "param")
        w2 = b.input(f"layers.{i}.w2", (hidden, width), "param")
        weights.append((w1, w2))
    states = {w: b.input(f"{w}:momentum", b.inputs[[gi.value.name for gi in b.inputs].index(w)].value.spec.shape, "optim_state")
              for pair in weights for w in pair} if momentum else {}
    saved, h = [], x
    for w1, w2 in weights:
        pre = b.op("mm", [h, w1], (batch, hidden))
        act = b.op("relu", [pre], (batch, hidden))
        out = b.op("mm", [act, w2], (batch, width))
        saved.append((h, pre, act))
        h = out
    loss = b.op("sum", [h], ())
    grad = b.op("ones_like", [h], (batch, width))
    grads = {}
    for (w1, w2), (h_in, pre, act) in reversed(list(zip(weights, saved))):
        grads[w2] = b.op("mm", [b.op("t", [act], (hidden, batch)), grad], (hidden, width))
        d_act = b.op("mm", [grad, b.op("t", [w2], (width, hidden))], (batch, hidden))
        d_pre = b.op("relu_backward", [d_act, pre], (batch, hidden))
        grads[w1] = b.op("mm", [b.op("t", [h_in], (width, batch)), d_pre], (width, hidden))
        grad = b.op("mm", [d_pre, b.op("t", [w1], (hidden, width))], (batch, width))
    outputs = [GraphOutput(loss, "loss", source="loss")]
    for w1, w2 in weights:
        for w in (w1, w2):
            spec = next(gi.value.spec for gi in b.inputs if gi.value.name == w)
            if momentum:
                m = b.op("add", [b.op("scale", [states[w]], spec.shape), grads[w]], spec.shape)
                outputs.append(GraphOutput(m, "optim_state", replaces=states[w]))
                step = b.op("scale", [m], spec.shape)
            else:
                step = b.op("scale", [grads[w]], spec.shape)
            outputs.append(GraphOutput(b.op("sub", [w, step], spec.shape), "param", replaces=w))
    graph = Graph(tuple(b.inputs), tuple(b.nodes), tuple(outputs), name=f"mlp{layers}x{width}")
    return graph, b.rules
