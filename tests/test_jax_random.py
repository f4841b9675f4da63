"""JAX frontend: dropout and PRNG keys (raw uint32 and typed) captured onto key data, and their rules."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

from metadist.frontends.jax import JaxWorkload, capture_jax, run_graph  # noqa: E402
from metadist.frontends.jax.discovery import JaxOpExecutor  # noqa: E402
from metadist.ir.rule import Concat  # noqa: E402
from metadist.shardcombine import discover, op_call  # noqa: E402

pytestmark = pytest.mark.jax


def dropout_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w"])  # (B, 8)
    first, second = jax.random.split(batch["key"])
    keep = jax.random.bernoulli(first, 0.7, h.shape)
    h = jnp.where(keep, h / 0.7, 0.0) + 0.1 * jax.random.normal(jax.random.fold_in(second, 3), h.shape)
    return jnp.mean(h * h)


def workload(key) -> JaxWorkload:
    params = {"w": 0.3 * jax.random.normal(jax.random.PRNGKey(0), (8, 8))}
    batch = {"x": jax.random.normal(jax.random.PRNGKey(1), (16, 8)), "key": key}
    return JaxWorkload(params=params, batch=batch, loss_fn=dropout_loss, optimizer=optax.adam(1e-2), name="dropout")


def outputs(step, wl):
    graph_out = step.unflatten_outputs(run_graph(step.graph, step.graph_inputs(wl.params, wl.opt_state, wl.batch)))
    jit_out = jax.jit(wl.train_step())(wl.params, wl.opt_state, wl.batch)
    return graph_out, jit_out


def assert_same(got, want):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("make_key", [jax.random.PRNGKey, jax.random.key], ids=["raw-uint32", "typed"])
def test_dropout_step_draws_the_numbers_of_the_jitted_step(make_key):
    step = capture_jax(workload(make_key(5)))
    targets = {target.removeprefix("jax.lax.") for target in step.graph.op_histogram()}
    assert "threefry2x32" in targets
    assert not {name for name in targets if name.startswith("random_")}, "typed-key primitives are rewritten away"
    (key_input,) = [graph_input for graph_input in step.graph.inputs if graph_input.source == "batch.key"]
    assert key_input.value.spec.shape == (2,) and key_input.value.spec.dtype == "uint32"
    losses = []
    for seed in (5, 6):  # the key is an input, not a constant: another key gives another (and the jitted) result
        got, want = outputs(step, workload(make_key(seed)))
        assert_same(got, want)
        losses.append(float(got[0]))
    assert losses[0] != losses[1]


def test_threefry_rule_is_discovered_by_execution():
    """threefry2x32 is a deterministic hash of keys and counters: its rule is checked, not assumed."""
    step = capture_jax(workload(jax.random.PRNGKey(5)))
    node = next(node for node in step.graph.nodes if node.op.target == "jax.lax.threefry2x32")
    assert not node.op.is_random
    call = op_call(step.graph, node)
    rule = discover(call, JaxOpExecutor())
    # Scalar keys are replicated; each dim of the counters splits with both outputs concatenated along it.
    split_dims = {factor.outputs[0].dim for factor in rule.factors if isinstance(factor.outputs[0], Concat)}
    counter_rank = call.input_specs[-1].rank
    assert split_dims == set(range(counter_rank)) - {d for d, size in enumerate(call.input_specs[-1].shape) if size == 1}
    for factor in rule.factors:
        assert factor.inputs[0] is None and factor.inputs[1] is None, "the scalar key words are never split"
