"""JAX frontend: control flow captured flat (scan unrolled, cond/switch selected, static while unrolled).

Each test captures a whole training step (loss, gradients, optax update), runs the
captured graph on one device, and compares it with ``jax.jit`` of the original step.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

from metadist.frontends.jax import JaxWorkload, capture_jax, run_graph  # noqa: E402
from metadist.workloads.jax_builtin import ScanMLPConfig, jax_builtin_workload  # noqa: E402

pytestmark = pytest.mark.jax

#: Largest difference allowed between the captured graph and ``jax.jit`` of the step (float32, one Adam step).
#: An unrolled loop is fused differently by XLA than a loop, so the last bits may differ.
ATOL = 1e-6


def params_and_batch(seed: int = 0, index: int = 0) -> tuple[dict, dict]:
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    params = {"ws": 0.3 * jax.random.normal(keys[0], (3, 8, 8)), "bs": 0.1 * jax.random.normal(keys[1], (3, 8))}
    batch = {"x": jax.random.normal(keys[2], (4, 8)), "y": jax.random.normal(keys[3], (3, 4, 8)),
             "index": jnp.int32(index)}
    return params, batch


def workload(loss_fn, seed: int = 0, index: int = 0) -> JaxWorkload:
    params, batch = params_and_batch(seed, index)
    return JaxWorkload(params=params, batch=batch, loss_fn=loss_fn, optimizer=optax.adam(1e-2), name="control-flow")


def largest_difference(step, wl: JaxWorkload) -> float:
    """Run the captured graph on ``wl``'s arrays and compare every output with jax.jit of the step."""
    got = step.unflatten_outputs(run_graph(step.graph, step.graph_inputs(wl.params, wl.opt_state, wl.batch)))
    want = jax.jit(wl.train_step())(wl.params, wl.opt_state, wl.batch)
    pairs = zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))
    return max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0)) for a, b in pairs)


def control_flow_ops(step) -> set[str]:
    return {target for target in step.graph.op_histogram() if target.split(".")[-1] in ("scan", "cond", "while")}


def test_scan_with_carries_xs_ys_and_reverse_matches_the_step():
    def loss_fn(params, batch):
        def layer(carry, xs):
            h, total = carry  # (B, 8), ()
            w, b, y = xs  # (8, 8), (8,), (B, 8)
            h = jnp.tanh(h @ w + b) + 0.1 * y
            return (h, total + jnp.sum(h * h)), (jnp.mean(h), h[:, :2])  # ys: () and (B, 2)

        (h, total), (means, heads) = jax.lax.scan(layer, (batch["x"], 0.0), (params["ws"], params["bs"], batch["y"]))
        back, _ = jax.lax.scan(lambda h, w: (jnp.sin(h @ w), None), h, params["ws"], reverse=True)
        return jnp.mean(back) + 0.01 * total + jnp.sum(means * jnp.arange(3.0)) + jnp.mean(heads[::-1] * heads)

    wl = workload(loss_fn)
    step = capture_jax(wl)
    assert not control_flow_ops(step), "every scan, the backward's included, is unrolled"
    worst = largest_difference(step, wl)
    assert worst <= ATOL, f"largest difference {worst}"


def test_fori_loop_with_static_bounds_unrolls_with_constant_indices():
    def loss_fn(params, batch):
        def body(i, h):
            return jnp.tanh(h @ params["ws"][i] + params["bs"][i]) * (i + 1.0)

        return jnp.mean(jax.lax.fori_loop(0, 3, body, batch["x"]) ** 2)

    wl = workload(loss_fn)
    step = capture_jax(wl)
    assert not control_flow_ops(step)
    targets = step.graph.op_histogram()
    # The loop counter is folded to literals: params["ws"][i] indexes with constants, so nothing is gathered.
    assert "jax.lax.gather" not in targets
    assert targets["jax.lax.tanh"] == 3
    worst = largest_difference(step, wl)
    assert worst <= ATOL, f"largest difference {worst}"


def switch_loss(params, batch):
    h = batch["x"] @ params["ws"][0]  # (B, 8)
    h = jax.lax.cond(jnp.sum(h) > 0, jnp.tanh, lambda h: 2.0 * h, h)
    branches = [lambda h: h, jnp.sin, lambda h: h @ params["ws"][1]]
    return jnp.mean(jax.lax.switch(batch["index"], branches, h) ** 2)


@pytest.fixture(scope="module")
def switch_step():
    return capture_jax(workload(switch_loss, index=2))


@pytest.mark.parametrize("index, sign", [(0, 1.0), (1, -1.0), (2, 1.0), (2, -1.0)])
def test_switch_selects_the_branch_of_the_runtime_index(switch_step, index, sign):
    """Captured once with index 2, the graph follows the index (and the cond's predicate) it is given at run time."""
    assert not control_flow_ops(switch_step)
    assert "jax.lax.sin" in switch_step.graph.op_histogram(), "every branch is in the graph"
    wl = workload(switch_loss, index=index)
    wl = JaxWorkload(params=wl.params, batch={**wl.batch, "x": sign * wl.batch["x"]}, loss_fn=switch_loss,
                     optimizer=wl.optimizer)  # the sign of x flips the first cond's branch
    worst = largest_difference(switch_step, wl)
    assert worst <= ATOL, f"index {index}, sign {sign}: largest difference {worst}"


def test_cond_on_a_loop_counter_inlines_only_its_branch():
    def loss_fn(params, batch):
        def body(i, h):
            return jax.lax.cond(i % 2 == 0, lambda h: jnp.tanh(h @ params["ws"][i]), jnp.sin, h)

        return jnp.mean(jax.lax.fori_loop(0, 3, body, batch["x"]) ** 2)

    wl = workload(loss_fn)
    step = capture_jax(wl)
    targets = step.graph.op_histogram()
    assert targets["jax.lax.tanh"] == 2 and targets["jax.lax.sin"] == 1, "iterations 0, 2 take tanh; 1 takes sin"
    worst = largest_difference(step, wl)
    assert worst <= ATOL, f"largest difference {worst}"


def test_while_loop_with_a_static_trip_count_is_unrolled():
    def loss_fn(params, batch):
        def body(state):
            i, h = state
            return i + 1, jnp.tanh(h @ batch["y"][0].T @ batch["y"][0])  # (B, 8) @ (8, B) @ (B, 8)

        # JAX cannot differentiate a while_loop: the loop reads only the batch, the params enter after it.
        _, h = jax.lax.while_loop(lambda state: state[0] < 4, body, (0, batch["x"]))
        return jnp.mean((h @ params["ws"][1]) ** 2)

    wl = workload(loss_fn)
    step = capture_jax(wl)
    assert not control_flow_ops(step)
    assert step.graph.op_histogram()["jax.lax.tanh"] == 4
    worst = largest_difference(step, wl)
    assert worst <= ATOL, f"largest difference {worst}"


def test_backward_scan_reads_the_forward_pieces_without_restacking():
    config = ScanMLPConfig()
    step = capture_jax(jax_builtin_workload("jax-mlp-scan"))
    targets = step.graph.op_histogram()
    # Each stacked weight (w, b) is sliced once per layer, shared by the forward and the backward scan;
    # only the two stacked gradients are stacked. Residuals pass from one scan to the other piece by piece.
    assert targets["jax.lax.slice"] == 2 * config.hidden_layers
    assert targets["jax.lax.stack"] == 2
    assert "jax.lax.concatenate" not in targets
