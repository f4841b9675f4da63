"""Halo factors: the rule form, discovery of conv/pool halo widths by execution (and refusal of
too-small widths), strategies, pricing, lowering, and a 2-rank gloo run of a spatially split conv net."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from metadist.frontends.torch.discovery import TorchExecutor
from metadist.ir import Concat, Factor, Mesh, MetaOp, Node, Reduce, Rule, RuleError, Replicate, Shard, TensorSpec, Value, ValueRef, parse_rule
from metadist.ir.plan import AxisChoice, NodeStrategy, PlanError, strategy_from_choices
from metadist.shardcombine import discover
from metadist.shardcombine.executor import OpCall
from metadist.shardcombine.recheck import check_rule_by_execution
from metadist.shardcombine.signature import signature_of
from metadist.shardcombine.verify import check_factor

TORCH = TorchExecutor()
X, Y, Z = ValueRef("x"), ValueRef("y"), ValueRef("z")
F32 = "float32"


def aten(target: str, args: tuple, inputs: list, outputs: list) -> OpCall:
    outs = tuple(None if o is None else Value(f"y{i}", TensorSpec(o[0], o[1])) for i, o in enumerate(outputs))
    return OpCall(Node("n", MetaOp(f"aten.{target}"), args, (), outs), tuple(TensorSpec(shape, F32) for shape in inputs))


def conv2d(kernel=3, padding=1, stride=1, size=16):
    out = (size + 2 * padding - kernel) // stride + 1
    return aten("convolution.default", (X, Y, None, (stride, stride), (padding, padding), (1, 1), False, (0, 0), 1),
                [(4, 3, size, size), (8, 3, kernel, kernel)], [((4, 8, out, out), F32)])


def avg_pool(count_include_pad=True):
    return aten("avg_pool2d.default", (X, (3, 3), (1, 1), (1, 1), False, count_include_pad),
                [(4, 3, 12, 12)], [((4, 3, 12, 12), F32)])


# ----------------------------------------------------------------- the rule form


def test_halo_rules_round_trip_through_text_and_json():
    text = "abcd,eb__->aecd | b:sum c:halo=1 d:halo=2"
    rule = parse_rule(text)
    assert rule.to_text() == text
    assert [factor.halo for factor in rule.factors] == [0, 0, 1, 2, 0]
    assert Rule.from_dict(json.loads(json.dumps(rule.to_dict()))) == rule
    assert parse_rule("ab->ab | a:chunk=2").factors[0].outputs == (Concat(0, chunk=2),)


def test_a_halo_factor_must_concatenate_every_output_with_one_width():
    with pytest.raises(RuleError, match="halo"):
        Factor((0,), (Concat(0, halo=1), Reduce("sum")))
    with pytest.raises(RuleError, match="halo"):
        Factor((0,), (Concat(0, halo=1), Concat(0, halo=2)))


# ----------------------------------------------------------------- discovery


@pytest.mark.parametrize(
    "call,text",
    [
        (conv2d(3, 1), "abcd,eb__->aecd | b:sum c:halo=1 d:halo=1 | pass 0:sum 1:sum"),
        (conv2d(5, 2), "abcd,eb__->aecd | b:sum c:halo=2 d:halo=2 | pass 0:sum 1:sum"),
        # stride 2: pieces on even boundaries; the left neighbour's last row, trimmed 2 * 8 / 16 = 1 output row
        (conv2d(3, 1, stride=2), "abcd,eb__->aecd | b:sum c:halo=2 d:halo=2 | pass 0:sum 1:sum"),
        (avg_pool(True), "abcd->abcd | c:halo=1 d:halo=1 | pass 0:sum"),
        # zeros at the border would be left out of the count: no spatial factor at all
        (avg_pool(False), "ab__->ab__ | pass 0:sum"),
        # the indices output holds positions in the whole plane: no spatial factor
        (aten("max_pool2d_with_indices.default", (X, (3, 3), (1, 1), (1, 1)), [(4, 3, 12, 12)],
              [((4, 3, 12, 12), F32), ((4, 3, 12, 12), "int64")]), "ab__->ab__,ab__"),
    ],
    ids=["conv3x3", "conv5x5", "conv3x3-stride2", "avg-pool", "avg-pool-no-pad-count", "max-pool-indices"],
)
def test_discovery_finds_the_smallest_halo_width(call, text):
    assert discover(call, TORCH).to_text() == text


def test_a_too_small_halo_is_refused_and_the_discovered_one_holds():
    call = conv2d(5, 2)
    inputs = TORCH.example_inputs(call, np.random.default_rng(7), call.input_shapes)
    for halo, holds in ((0, False), (1, False), (2, True), (3, True)):
        factor = Factor((2, None), (Concat(2, halo=halo),))
        for shards, uneven in ((2, True), (3, False), (4, False)):
            mismatch = check_factor(call, TORCH, factor, inputs, shards, uneven=uneven)
            assert (mismatch is None) == holds, (halo, shards, mismatch)


def test_the_oracle_re_check_fails_a_wrong_halo_width_and_passes_the_right_one():
    call = conv2d(5, 2)
    wrong = parse_rule("abcd,eb__->aecd | b:sum c:halo=1 d:halo=1")
    right = discover(call, TORCH)
    checks = {check.what: check.ok for check in check_rule_by_execution(call, wrong, TORCH)}
    assert [ok for what, ok in checks.items() if "halo" in what] == [False, False]
    assert all(check.ok for check in check_rule_by_execution(call, right, TORCH))


def test_convolution_signatures_hold_kernel_sizes():
    assert signature_of(conv2d(3, 1)).key != signature_of(aten(
        "convolution.default", (X, Y, None, (1, 1), (1, 1), (1, 1), False, (0, 0), 1),
        [(4, 3, 16, 16), (8, 3, 5, 5)], [((4, 8, 14, 14), F32)])).key


# ----------------------------------------------------------------- strategies, cost, lowering


def test_halo_strategies_record_the_width_and_keep_to_one_axis():
    from metadist.solver.strategies import node_strategies

    rule = parse_rule("abcd,eb__->aecd | b:sum c:halo=1 d:halo=1")
    strategy = strategy_from_choices(rule, (AxisChoice("factor", 2),))
    assert strategy.inputs == ((Shard(2),), (Replicate(),)) and strategy.outputs == ((Shard(2),),) and strategy.halos == (1,)
    assert NodeStrategy.from_dict(strategy.to_dict()) == strategy
    with pytest.raises(PlanError, match="two mesh axes"):
        strategy_from_choices(rule, (AxisChoice("factor", 2), AxisChoice("factor", 2)))
    shapes, out = ((4, 3, 16, 16), (8, 3, 3, 3)), ((4, 8, 16, 16),)
    found = node_strategies(rule, shapes, out, Mesh((2, 2)))
    halos = {tuple(str(c) for c in st.choices): st.halos for st in found.strategies}
    assert halos[("f2", "f3")] == (1, 1) and ("f2", "f2") not in halos and found.excluded_inexpressible > 0
    narrow = node_strategies(parse_rule("abcd,eb__->aecd | b:sum c:halo=4"), ((4, 3, 8, 8), (8, 3, 9, 9)), ((4, 8, 8, 8),), Mesh((4,)))
    assert all(not st.halos for st in narrow.strategies) and narrow.excluded_indivisible > 0  # 2-row pieces, halo 4


def test_the_halo_exchange_is_priced_as_an_all_gather_of_the_border_rows():
    from metadist.cost.cluster import resolve_cluster
    from metadist.cost.comm import halo_exchange_seconds

    cluster = resolve_cluster("cpu-gloo", Mesh((2,)))
    rule = parse_rule("abcd,eb__->aecd | b:sum c:halo=1 d:halo=1")
    specs = (TensorSpec((4, 3, 16, 16), F32), TensorSpec((8, 3, 3, 3), F32))
    seconds, sent = halo_exchange_seconds(specs, strategy_from_choices(rule, (AxisChoice("factor", 2),)), cluster)
    assert sent == 4 * 3 * 16 * 2 * 4 and seconds > 0  # 2 rows of (4, 3, ., 16) floats to the one other rank
    assert halo_exchange_seconds(specs, strategy_from_choices(rule, (AxisChoice("factor", 0),)), cluster) == (0.0, 0.0)


CONVNET = textwrap.dedent(
    """
    import torch
    import metadist


    class ConvNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1, stride=2)
            self.head = torch.nn.Linear(8, 4)

        def forward(self, x):  # (B, 3, 16, 16)
            h = torch.relu(self.conv1(x))  # (B, 8, 16, 16)
            h = torch.relu(self.conv2(h))  # (B, 8, 8, 8)
            return self.head(h.mean(dim=(2, 3)))  # (B, 4)


    def workload():
        torch.manual_seed(0)
        return metadist.Workload(
            model=ConvNet(),
            batch={"x": torch.randn(4, 3, 16, 16), "y": torch.randint(0, 4, (4,))},
            loss_fn=lambda model, batch: torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"]),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        )
    """
)


@pytest.fixture(scope="module")
def convnet_halo_plan(tmp_path_factory):
    """The solver's plan for the conv net on 2 ranks, with both convolutions split along H (halo 1, then 2)."""
    from metadist.api import capture_and_discover
    from metadist.cost.cluster import resolve_cluster
    from metadist.ir.plan import Plan
    from metadist.solver import plan_graph

    root = tmp_path_factory.mktemp("halo")
    (root / "convnet.py").write_text(CONVNET)
    graph, rules = capture_and_discover(f"{root / 'convnet.py'}:workload", str(root / "rules.db"))
    plan = plan_graph(graph, rules, resolve_cluster("cpu-gloo", Mesh((2,))))
    strategies = dict(plan.node_strategies)
    for node in graph.nodes:
        rule = rules.rules.get(node.name)
        index = next((i for i, f in enumerate(rule.factors) if f.halo and f.inputs[0] == 2), None) if rule else None
        if index is not None:
            strategies[node.name] = strategy_from_choices(rule, (AxisChoice("factor", index),))
    assert sorted(s.halos for s in strategies.values() if s.halos) == [(1,), (2,)]
    plan = Plan(plan.graph_name, plan.graph_fingerprint, plan.metadist_version, plan.mesh, strategies,
                plan.input_shardings, plan.output_shardings, plan.estimate, plan.solver)
    (root / "plan.json").write_text(plan.to_json())
    return root, graph, plan


def test_lowering_exchanges_halos_before_and_trims_after_the_convolutions(convnet_halo_plan):
    from metadist.lowering import lower

    _, graph, plan = convnet_halo_plan
    edge, interior = lower(graph, plan, (0,)), lower(graph, plan, (1,))
    text = edge.to_text()
    assert "halo_exchange(axis 0, dim 2, halo 1) [4, 3, 8, 16] -> [4, 3, 10, 16]" in text
    assert "halo_exchange(axis 0, dim 2, halo 2) [4, 8, 8, 16] -> [4, 8, 12, 16]" in text
    assert "halo_trim(axis 0, dim 2, trim 1) [4, 8, 10, 16] -> [4, 8, 8, 16]" in text
    assert "halo_trim(axis 0, dim 2, trim 1) [4, 8, 6, 8] -> [4, 8, 4, 8]" in text
    # all-gather of 2h rows: (k-1) * 2h rows sent; the same on both ranks
    count, sent = edge.predicted_comm()[("halo_exchange", 0)]
    assert count == 2 and sent == (4 * 3 * 2 * 16 + 4 * 8 * 4 * 16) * 4
    assert interior.predicted_comm()[("halo_exchange", 0)] == (count, sent)


@pytest.mark.distributed
def test_a_spatially_split_conv_net_runs_on_two_gloo_ranks_and_matches_one_device(convnet_halo_plan):
    from test_run_matrix import assert_check_passed, run_metadist

    root, _, _ = convnet_halo_plan
    result = run_metadist(f"{root / 'convnet.py'}:workload", "--nproc", "2", "--steps", "3", "--check", "--optimizer", "sgd",
                          "--plan", str(root / "plan.json"), "--timeout-s", "120")
    assert_check_passed(result)
    assert "halo_exchange" in result.stdout
