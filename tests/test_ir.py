"""MetaIR: framework-free, validated, printable, JSON round-trippable."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from metadist.ir import (
    Graph,
    GraphInput,
    GraphOutput,
    IRError,
    Literal,
    Mesh,
    MeshError,
    MetaOp,
    Node,
    Partial,
    Replicate,
    Role,
    Shard,
    TensorSpec,
    Value,
    RuleError,
    ValueRef,
    graph_from_json,
    graph_to_json,
    parse_rule,
    parse_sharding,
)
from metadist.ir.plan import AxisChoice, NodeStrategy, Plan, PlanError, graph_fingerprint, strategy_from_choices


def tiny_graph() -> Graph:
    w = Value("w", TensorSpec((4, 3), "float32"))
    x = Value("x", TensorSpec((2, 4), "float32"))
    y = Value("y", TensorSpec((2, 3), "float32"))
    loss = Value("loss", TensorSpec((), "float32"))
    w2 = Value("w2", TensorSpec((4, 3), "float32"))
    return Graph(
        inputs=(GraphInput(w, Role.PARAM, "fc.weight"), GraphInput(x, Role.BATCH, "x")),
        nodes=(
            Node("mm", MetaOp("aten.mm.default"), (ValueRef("x"), ValueRef("w")), (), (y,)),
            Node("sum", MetaOp("aten.sum.dim_IntList"), (ValueRef("y"), (0, 1), False), (("dtype", Literal("dtype", "float32")),), (loss,)),
            Node("upd", MetaOp("aten.add.Tensor"), (ValueRef("w"), float("-inf")), (), (w2,)),
        ),
        outputs=(GraphOutput("loss", Role.LOSS, source="loss"), GraphOutput("w2", Role.PARAM, replaces="w")),
        name="tiny",
    )


GOLDEN_TEXT = """\
graph tiny (2 inputs, 3 nodes, 2 outputs)
  in  %w: f32[4, 3] param 'fc.weight'
  in  %x: f32[2, 4] batch 'x'
  mm: %y: f32[2, 3] = aten.mm.default(%x, %w)
  sum: %loss: f32[] = aten.sum.dim_IntList(%y, [0, 1], False, dtype=dtype:float32)
  upd: %w2: f32[4, 3] = aten.add.Tensor(%w, -inf)
  out %loss loss 'loss'
  out %w2 param <- %w
"""


def test_text_form_is_stable():
    assert tiny_graph().to_text() == GOLDEN_TEXT


def test_json_round_trip_is_exact_and_plain_json():
    graph = tiny_graph()
    text = graph_to_json(graph)
    json.loads(text)  # strict JSON: no NaN/Infinity tokens
    assert "Infinity" not in text
    again = graph_from_json(text)
    assert again == graph
    assert again.to_text() == graph.to_text()
    assert graph_to_json(again) == text


def test_json_rejects_foreign_versions():
    data = json.loads(graph_to_json(tiny_graph()))
    data["version"] = 99
    with pytest.raises(IRError, match="version 99"):
        graph_from_json(json.dumps(data))


def test_graph_queries():
    graph = tiny_graph()
    assert graph.producer("y").name == "mm"
    assert graph.producer("w") is None
    assert [node.name for node in graph.users("w")] == ["mm", "upd"]
    assert graph.parameter_count() == 12
    assert graph.bytes_by_role() == {"param": 48, "batch": 32}
    assert graph.op_histogram()["aten.mm.default"] == 1


def test_graph_validation_errors_name_the_problem():
    x = Value("x", TensorSpec((2,), "float32"))
    y = Value("y", TensorSpec((2,), "float32"))
    with pytest.raises(IRError, match="reads %nope before it is defined"):
        Graph((GraphInput(x, Role.BATCH),), (Node("n", MetaOp("aten.neg.default"), (ValueRef("nope"),), (), (y,)),), ())
    with pytest.raises(IRError, match="defined twice"):
        Graph((GraphInput(x, Role.BATCH), GraphInput(x, Role.BATCH)), (), ())
    with pytest.raises(IRError, match="not a graph input"):
        Graph((GraphInput(x, Role.BATCH),), (), (GraphOutput("x", Role.PARAM, replaces="zz"),))
    with pytest.raises(IRError, match="unknown dtype"):
        TensorSpec((2,), "float31")
    with pytest.raises(IRError, match="argument of type"):
        Node("n", MetaOp("aten.neg.default"), (object(),), (), (y,))


def test_ir_imports_no_framework():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None
        sys.modules["jax"] = None
        import metadist, metadist.ir, metadist.ir.plan, metadist.workload
        assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None and m.split(".")[0] == "torch"]
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize(
    "text",
    ["ab,bc->ac | b:sum", "abc,acd->abd | c:sum", "a_,_,_->a_,a_,a_", "ab-> | a:sum b:sum", "ab,b->ab | pass 0:sum 1:sum", "a->a,-",
     "ab,ab->ab | pass 0:max 0:min 0+1:sum 1:max 1:min", "ab,ab,ab->ab | pass 1+2:sum"],
)
def test_rule_text_round_trip(text):
    rule = parse_rule(text)
    assert rule.to_text() == text
    assert type(rule).from_dict(json.loads(json.dumps(rule.to_dict()))) == rule


def test_rule_factor_order_and_sizes():
    rule = parse_rule("mk,kn->mn | k:sum")
    assert rule.to_text() == "ab,bc->ac | b:sum"  # letters are renamed in canonical order
    assert [factor.size(((6, 4), (4, 5))) for factor in rule.factors] == [6, 4, 5]


def test_placements_and_mesh_parse():
    assert parse_sharding("(S(0), R, P(max))") == (Shard(0), Replicate(), Partial("max"))
    assert Mesh.parse("2x4") == Mesh((2, 4), ("axis0", "axis1"))
    assert Mesh.parse("dp=2,tp=4").axis_names == ("dp", "tp")
    assert Mesh.parse("8").size == 8
    with pytest.raises(MeshError, match="cannot parse mesh"):
        Mesh.parse("2xfour")


def test_plan_strategy_derivation_and_json_round_trip():
    graph = tiny_graph()
    rule = parse_rule("mk,kn->mn | k:sum")
    column = strategy_from_choices(rule, (AxisChoice("factor", 2), AxisChoice("factor", 1)))
    assert column.inputs == ((Replicate(), Shard(1)), (Shard(1), Shard(0)))  # x: (R, S(1)), w: (S(1), S(0))
    assert column.outputs == ((Shard(1), Partial("sum")),)
    plan = Plan(
        graph_name=graph.name,
        graph_fingerprint=graph_fingerprint(graph),
        metadist_version="0.1.0",
        mesh=Mesh((2, 2)),
        node_strategies={"mm": column},
        input_shardings={"w": (Shard(1), Replicate())},
        output_shardings=((Replicate(), Replicate()),),
        estimate={"compute_s": 1.5},
    )
    again = Plan.from_json(plan.to_json())
    assert again.to_dict() == plan.to_dict()
    plan.check_for(graph, "0.1.0")
    with pytest.raises(PlanError, match="made by MetaDist 0.1.0"):
        plan.check_for(graph, "9.9.9")
    with pytest.raises(PlanError, match="another graph"):
        plan.check_for(Graph(graph.inputs, graph.nodes[:1], graph.outputs[:0], name="other"), "0.1.0")


def test_a_joint_partial_pass_takes_its_inputs_partial_together_and_round_trips_through_a_plan():
    """A joint pass (``0+1:sum``): both inputs ``Partial(sum)`` on that axis, the output ``Partial(sum)``; a plan
    names it ``P0+1:sum`` and keeps it through JSON. Only a sum can be joint, in increasing input order."""
    rule = parse_rule("ab,ab->ab | pass 0+1:sum")
    (joint,) = rule.partial_passes
    assert joint.inputs == (0, 1) and str(joint) == "0+1:sum"
    strategy = strategy_from_choices(rule, (AxisChoice("partial", 0, "sum", (1,)), AxisChoice("factor", 0)))
    assert strategy.inputs == ((Partial("sum"), Shard(0)), (Partial("sum"), Shard(0)))
    assert strategy.outputs == ((Partial("sum"), Shard(0)),)
    assert str(strategy.choices[0]) == "P0+1:sum"
    assert NodeStrategy.from_dict(json.loads(json.dumps(strategy.to_dict()))) == strategy
    with pytest.raises(PlanError, match="do not pass"):
        strategy_from_choices(rule, (AxisChoice("partial", 0, "sum"),))  # input 0 alone is not a pass of this rule
    with pytest.raises(RuleError, match="joint partial pass"):
        parse_rule("ab,ab->ab | pass 0+1:max")
    with pytest.raises(RuleError, match="missing input"):
        parse_rule("ab,ab->ab | pass 0+2:sum")
