"""JAX frontend: capture of whole train steps into MetaIR, params as data, and the single-device interpreter."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

from metadist.frontends.jax import JaxCaptureError, JaxWorkload, capture_jax, run_graph  # noqa: E402
from metadist.frontends.jax.capture import INLINED  # noqa: E402
from metadist.frontends.jax.params import decode_param, encode_param  # noqa: E402
from metadist.ir import Literal, Role, graph_from_json, graph_to_json  # noqa: E402
from metadist.workloads.jax_builtin import JAX_BUILTIN_NAMES, jax_builtin_workload  # noqa: E402

pytestmark = pytest.mark.jax


@pytest.fixture(scope="module", params=JAX_BUILTIN_NAMES)
def captured(request):
    workload = jax_builtin_workload(request.param)
    return workload, capture_jax(workload)


def test_roles_and_replaces_links(captured):
    workload, step = captured
    graph = step.graph
    n_params = len(jax.tree_util.tree_leaves(workload.params))
    n_state = len(jax.tree_util.tree_leaves(workload.opt_state))
    n_batch = len(jax.tree_util.tree_leaves(workload.batch))
    assert len(graph.inputs_by_role(Role.PARAM)) == n_params
    assert len(graph.inputs_by_role(Role.OPTIM_STATE)) == n_state
    assert len(graph.inputs_by_role(Role.BATCH)) == n_batch
    assert graph.parameter_count() == workload.extras["params"]
    (loss,) = graph.outputs_by_role(Role.LOSS)
    assert graph.value(loss.name).spec.shape == ()
    for role in (Role.PARAM, Role.OPTIM_STATE):
        outputs = graph.outputs_by_role(role)
        replaced = {output.replaces for output in outputs}
        assert replaced == {graph_input.value.name for graph_input in graph.inputs_by_role(role)}
        for output in outputs:  # an updated state has the shape and dtype of the input it replaces
            assert graph.value(output.name).spec == graph.value(output.replaces).spec
            assert output.source == output.replaces  # both name the pytree path, e.g. params.fc0.w


def test_graph_is_flat_and_named_by_primitive(captured):
    _, step = captured
    targets = set(step.graph.op_histogram())
    assert all(target.startswith("jax.lax.") for target in targets)
    assert not {f"jax.lax.{name}" for name in INLINED} & targets, "call-like primitives must be inlined"
    assert "jax.lax.dot_general" in targets
    assert step.raw_params == {}, "every equation param of the built-ins round-trips through MetaIR"


def test_text_form_and_json_round_trip(captured):
    _, step = captured
    graph = step.graph
    text = graph.to_text()
    assert text.startswith(f"graph {graph.name} (")
    assert "jax.lax.dot_general(" in text and "dimension_numbers=" in text
    again = graph_from_json(graph_to_json(graph))
    assert again == graph
    assert again.to_text() == text


def test_interpreter_reproduces_the_jitted_step_exactly(captured):
    workload, step = captured
    inputs = step.graph_inputs(workload.params, workload.opt_state, workload.batch)
    loss, params, opt_state = step.unflatten_outputs(run_graph(step.graph, inputs))
    want_loss, want_params, want_state = jax.jit(workload.train_step())(workload.params, workload.opt_state, workload.batch)
    assert float(loss) == float(want_loss)
    got_leaves = jax.tree_util.tree_leaves((params, opt_state))
    want_leaves = jax.tree_util.tree_leaves((want_params, want_state))
    worst = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(got_leaves, want_leaves))
    assert worst == 0.0, f"largest difference {worst}"


def test_interpreter_runs_a_deserialized_graph():
    workload = jax_builtin_workload("jax-mlp")
    step = capture_jax(workload)
    inputs = step.graph_inputs(workload.params, workload.opt_state, workload.batch)
    again = graph_from_json(graph_to_json(step.graph))
    np.testing.assert_array_equal(run_graph(again, inputs)[0], run_graph(step.graph, inputs)[0])


# -- params as data --------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        None, 3, 2.5, True, "x", (1, (2, 3)), np.dtype("float32"), jax.lax.GatherScatterMode.FILL_OR_DROP,
        jax.lax.Precision.HIGHEST,
        jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)),
    ],
)
def test_params_round_trip(value):
    encoded = encode_param(value, "test")
    assert decode_param(encoded) == value
    assert type(decode_param(encoded)) is type(value) or isinstance(value, (list, tuple))


def test_dtype_param_is_a_dtype_literal():
    assert encode_param(jnp.dtype("bfloat16"), "test") == Literal("dtype", "bfloat16")


def test_unrepresentable_param_is_a_clear_error():
    with pytest.raises(JaxCaptureError, match="cannot represent"):
        encode_param(lambda x: x, "equation f param 'fun'")


# -- errors ------------------------------------------------------------------------


def _tiny_workload(loss_fn):
    params = {"w": jnp.ones((4, 3), jnp.float32)}
    batch = {"x": jnp.arange(8, dtype=jnp.float32).reshape(2, 4)}
    return JaxWorkload(params=params, batch=batch, loss_fn=loss_fn, optimizer=optax.sgd(0.1), name="tiny")


def test_data_dependent_while_loop_is_a_clear_error():
    def loss_fn(params, batch):
        scaled = jax.lax.while_loop(lambda x: jnp.sum(x) > 1.0, lambda x: x * 0.5, batch["x"])  # batch only: no grad
        return jnp.sum(scaled @ params["w"])

    with pytest.raises(JaxCaptureError, match="trip count that depends on traced values.*lax.scan.*fori_loop"):
        capture_jax(_tiny_workload(loss_fn))


def test_a_failing_step_is_a_capture_error():
    def loss_fn(params, batch):
        return jnp.sum(batch["x"] @ params["w"].T)  # (2, 4) @ (3, 4): shapes do not fit

    with pytest.raises(JaxCaptureError, match="failed while being traced"):
        capture_jax(_tiny_workload(loss_fn))


def test_workload_checks_its_optimizer():
    with pytest.raises(JaxCaptureError, match="GradientTransformation"):
        JaxWorkload(params={}, batch={}, loss_fn=lambda p, b: 0.0, optimizer=object())


def test_sgd_step_captures_with_custom_jvp_inlined():
    def loss_fn(params, batch):
        return jnp.mean(jax.nn.relu(batch["x"] @ params["w"]))  # relu is a custom_jvp

    workload = _tiny_workload(loss_fn)
    step = capture_jax(workload)
    assert "jax.lax.custom_jvp_call" not in step.graph.op_histogram()
    inputs = step.graph_inputs(workload.params, workload.opt_state, workload.batch)
    loss, params, _ = step.unflatten_outputs(run_graph(step.graph, inputs))
    want_loss, want_params, _ = jax.jit(workload.train_step())(workload.params, workload.opt_state, workload.batch)
    assert float(loss) == float(want_loss)
    np.testing.assert_array_equal(params["w"], want_params["w"])


def test_unknown_builtin_names_the_valid_ones():
    from metadist.workload import WorkloadError

    with pytest.raises(WorkloadError, match="Did you mean 'jax-mlp'"):
        jax_builtin_workload("jax-mpl")
