"""JAX frontend: ShardCombine's executor for JAX primitives, and discovery of their rules."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from metadist.frontends.jax import capture_jax  # noqa: E402
from metadist.frontends.jax.discovery import JaxOpExecutor  # noqa: E402
from metadist.ir.rule import Concat, Reduce  # noqa: E402
from metadist.shardcombine import ExecutionRefused, OpExecutor, discover, graph_rules, op_call  # noqa: E402
from metadist.workloads.jax_builtin import jax_builtin_workload  # noqa: E402

pytestmark = pytest.mark.jax


@pytest.fixture(scope="module")
def gpt2():
    return capture_jax(jax_builtin_workload("jax-gpt2-tiny"))


def first_call(step, target: str, shapes=None):
    """The op call of the first node running ``target`` (on inputs of ``shapes`` if given)."""
    for node in step.graph.nodes:
        call = op_call(step.graph, node)
        if node.op.target == target and (shapes is None or call.input_shapes == shapes):
            return call
    raise AssertionError(f"no {target} node with input shapes {shapes}")


def whole_and_pieces(executor, call, split: dict[int, int], seed: int = 0):
    """Run ``call`` whole and on the two halves of each input dim in ``split`` (input index -> dim)."""
    rng = np.random.default_rng(seed)
    inputs = executor.example_inputs(call, rng, call.input_shapes)
    whole = executor.run(call, inputs)
    pieces = []
    for half in range(2):
        sliced = []
        for index, array in enumerate(inputs):
            if index in split:
                dim = split[index]
                size = array.shape[dim] // 2
                array = np.take(array, np.arange(half * size, (half + 1) * size), axis=dim)
            sliced.append(array)
        pieces.append(executor.run(call, sliced))
    return whole, pieces


def test_executor_implements_the_protocol():
    executor = JaxOpExecutor()
    assert isinstance(executor, OpExecutor)
    assert executor.framework == "jax" and executor.framework_version == jax.__version__


def test_every_gpt2_node_runs_on_example_inputs_with_its_spec(gpt2):
    executor = JaxOpExecutor()
    rng = np.random.default_rng(0)
    for node in gpt2.graph.nodes[:300]:
        call = op_call(gpt2.graph, node)
        outputs = executor.run(call, executor.example_inputs(call, rng, call.input_shapes))
        for value, output in zip(node.outputs, outputs):
            assert output.shape == value.spec.shape and output.dtype == np.dtype(value.spec.dtype), node


def test_dot_general_on_row_and_contraction_pieces(gpt2):
    executor = JaxOpExecutor()
    call = first_call(gpt2, "jax.lax.dot_general", ((8, 16, 64), (64, 192)))
    (whole,), pieces = whole_and_pieces(executor, call, {0: 0})
    np.testing.assert_allclose(np.concatenate([piece[0] for piece in pieces], axis=0), whole, rtol=1e-6)
    (whole,), pieces = whole_and_pieces(executor, call, {0: 2, 1: 0})
    np.testing.assert_allclose(pieces[0][0] + pieces[1][0], whole, rtol=1e-4, atol=1e-5)


def test_reshape_into_heads_follows_a_split_width(gpt2):
    executor = JaxOpExecutor()
    call = first_call(gpt2, "jax.lax.reshape", ((8, 16, 64),))
    assert call.node.outputs[0].spec.shape == (8, 16, 4, 16)
    adapted = executor.adapt(call, [(8, 16, 32)])
    assert dict(adapted.node.kwargs)["new_sizes"] == (8, 16, 2, 16)
    assert adapted.node.outputs[0].spec.shape == (8, 16, 2, 16)
    (whole,), pieces = whole_and_pieces(executor, call, {0: 2})
    np.testing.assert_array_equal(np.concatenate([piece[0] for piece in pieces], axis=2), whole)


def test_embedding_gather_on_width_pieces(gpt2):
    executor = JaxOpExecutor()
    call = first_call(gpt2, "jax.lax.gather")
    (whole,), pieces = whole_and_pieces(executor, call, {0: 1})
    np.testing.assert_array_equal(np.concatenate([piece[0] for piece in pieces], axis=2), whole)


def test_broadcast_and_split_follow_their_inputs(gpt2):
    executor = JaxOpExecutor()
    for target in ("jax.lax.broadcast_in_dim", "jax.lax.split"):
        call = next(op_call(gpt2.graph, node) for node in gpt2.graph.nodes
                    if node.op.target == target and node.input_names and gpt2.graph.value(node.input_names[0]).spec.rank >= 2)
        whole, pieces = whole_and_pieces(executor, call, {0: 0})
        for index, output in enumerate(whole):
            np.testing.assert_array_equal(np.concatenate([piece[index] for piece in pieces], axis=0), output)


def test_slice_that_cuts_the_split_dim_is_refused(gpt2):
    executor = JaxOpExecutor()
    call = first_call(gpt2, "jax.lax.slice")  # wpe[:seq]: cuts dim 0
    shape = call.input_shapes[0]
    with pytest.raises(ExecutionRefused, match="cannot be split"):
        executor.adapt(call, [(shape[0] // 2, shape[1])])


def test_discovery_finds_the_matmul_and_embedding_rules(gpt2):
    executor = JaxOpExecutor()
    matmul = discover(first_call(gpt2, "jax.lax.dot_general", ((8, 16, 64), (64, 192))), executor)
    factors = {(factor.inputs, factor.outputs) for factor in matmul.factors}
    assert ((0, None), (Concat(0),)) in factors  # batch rows
    assert ((2, 0), (Reduce("sum"),)) in factors  # the contraction: partial sums
    assert ((None, 1), (Concat(2),)) in factors  # output columns
    embedding = discover(first_call(gpt2, "jax.lax.gather"), executor)
    assert ((1, None), (Concat(2),)) in {(factor.inputs, factor.outputs) for factor in embedding.factors}


@pytest.mark.slow
def test_discovery_covers_every_gpt2_op_with_tensor_inputs(gpt2, jax_rules_db):
    from metadist.shardcombine.database import RuleDatabase

    with RuleDatabase(jax_rules_db) as db:  # shared with test_jax_sharded's pipeline tests (conftest)
        rules = graph_rules(gpt2.graph, JaxOpExecutor(), db=db)
        assert {entry.framework for entry in db.entries()} == {"jax"}
    no_inputs = {name for name, reason in rules.missing.items() if "no tensor inputs" in reason}
    assert set(rules.missing) == no_inputs, {name: rules.missing[name] for name in set(rules.missing) - no_inputs}
    assert len(rules.rules) + len(rules.missing) == len(gpt2.graph.nodes)
