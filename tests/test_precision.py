"""Mixed precision: the policy, its capture (casts, GradScaler), its pricing, the solver's reduce dtype, the check."""

from __future__ import annotations

import copy

import pytest
import torch

from metadist.cost import resolve_cluster
from metadist.cost.cluster import A100, CPU_CORE, V100
from metadist.frontends.torch import CaptureError, capture_step
from metadist.frontends.torch.precision import SUBNORMAL_METRIC, underflow_warning
from metadist.ir import IRError, Mesh, PrecisionPolicy, Role, dtype_from_text
from metadist.lowering.program import CoalescedReshard, Reshard
from metadist.runtime.check import MEASURED_TOLERANCES, ReferenceRun, compare_runs
from metadist.solver import SolverError
from metadist.solver.planner import check_device_dtypes

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def plain_step(model, optimizer, batch):
    loss = model(batch["x"]).square().mean() * batch["weight"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def scaled_step(scaler):
    def step(model, optimizer, batch):
        loss = model(batch["x"]).square().mean() * batch["weight"]
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        return loss

    return step


def _batch(weight: float = 1.0):
    torch.manual_seed(1)
    return {"x": torch.randn(6, 8), "weight": torch.tensor(weight)}


def _eager_mixed_step(model, optimizer, batch, dtype, scaler=None):
    """What FSDP2's MixedPrecisionPolicy computes on one device: parameters cast once, gradients back in float32."""
    params = {name: param.to(dtype) for name, param in model.named_parameters()}
    x = batch["x"].to(dtype)
    loss = torch.func.functional_call(model, params, (x,)).square().mean() * batch["weight"].to(dtype)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad()
    return loss


# -- the policy ------------------------------------------------------------------------------------
def test_named_policies_and_bad_names():
    bf16 = PrecisionPolicy.named("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.is_mixed, bf16.needs_loss_scaling) == ("bfloat16", "float32", True, False)
    assert PrecisionPolicy.named("fp16").needs_loss_scaling
    assert PrecisionPolicy.named("bf16", "bf16").reduce_dtype == "bfloat16"
    assert not PrecisionPolicy.named("fp32").is_mixed
    with pytest.raises(IRError, match="choose one of fp32, bf16, fp16"):
        PrecisionPolicy.named("fp8")
    with pytest.raises(IRError, match="not a training dtype"):
        dtype_from_text("int8")


# -- capture -----------------------------------------------------------------------------------------
def test_bf16_capture_keeps_float32_master_weights_and_matches_the_eager_policy():
    model, batch = Tiny(), _batch()
    eager_model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_optimizer = torch.optim.AdamW(eager_model.parameters(), lr=1e-2)
    captured = capture_step(plain_step, model, optimizer, batch, precision="bf16", keep_grads=True)
    params = [gi for gi in captured.graph.inputs if gi.role is Role.PARAM]
    assert params and all(gi.value.spec.dtype == "float32" for gi in params)
    assert all(captured.graph.value(out.name).spec.dtype == "float32" for out in captured.graph.outputs if out.role is Role.GRAD)
    assert any(value.spec.dtype == "bfloat16" for value in captured.graph.iter_values())
    for _ in range(3):
        got = captured.run(model, optimizer, batch)
        want = _eager_mixed_step(eager_model, eager_optimizer, batch, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    for (name, a), b in zip(model.named_parameters(), eager_model.parameters()):
        assert a.dtype == torch.float32
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name
    assert all(optimizer.state[p]["exp_avg"].dtype == torch.float32 for p in model.parameters())


def test_a_captured_linear_layer_reads_its_weight_transposed_forward_and_its_input_transposed_for_the_weight_grad():
    """The layouts the cost model prices bfloat16 matmuls by (``Work.layout``), on torch's own trace of two linear
    layers: each forward matmul reads its weight transposed (nt), each weight's gradient the activations (tn), the
    input's gradient both row-major. The first layer's input needs no gradient: 2 + 2 + 1 matmuls."""
    from collections import Counter

    from metadist.cost.compute import node_work

    model = Tiny()
    captured = capture_step(plain_step, model, torch.optim.SGD(model.parameters(), lr=1e-2), _batch(), precision="bf16")
    graph = captured.graph
    layouts = Counter(work.layout for work in (node_work(graph, node) for node in graph.nodes) if work.operands)
    assert layouts == Counter({"nt": 2, "tn": 2, "": 1})


def test_grad_scaler_is_captured_with_inf_steps_skipped_as_eager_skips_them():
    model, batch = Tiny(), _batch()
    eager_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_optimizer = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    # an initial scale that overflows float16: the first step is skipped and the scale backs off
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2)
    eager_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2)
    captured = capture_step(scaled_step(scaler), model, optimizer, batch, precision="fp16")
    assert captured.scaler is scaler
    start = [p.detach().clone() for p in model.parameters()]
    scales = []
    for index in range(6):
        got = captured.run(model, optimizer, batch)
        want = _eager_mixed_step(eager_model, eager_optimizer, batch, torch.float16, eager_scaler)
        assert torch.equal(got, want)
        assert torch.equal(scaler._scale, eager_scaler._scale), f"step {index}"
        assert torch.equal(scaler._growth_tracker, eager_scaler._growth_tracker), f"step {index}"
        scales.append(float(scaler._scale))
        if index == 0:  # skipped: nothing moved
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), start))
    assert scales[0] == 2.0 ** 15  # backed off by half
    assert any(later > earlier for earlier, later in zip(scales, scales[1:]))  # grew after clean steps
    for a, b in zip(model.parameters(), eager_model.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), start))  # later steps did update


def test_grad_scaler_reading_its_scale_in_the_step_is_a_capture_error():
    model, batch = Tiny(), _batch()
    scaler = torch.amp.GradScaler("cpu")

    def step(model, optimizer, batch):
        loss = model(batch["x"]).square().mean()
        scaler.scale(loss).backward()
        print(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        return loss

    with pytest.raises(CaptureError, match="get_scale"):
        capture_step(step, model, torch.optim.SGD(model.parameters(), lr=0.1), batch, precision="fp16")


def test_fp16_without_loss_scaling_counts_underflowing_gradients_and_warns_with_the_fix():
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = capture_step(plain_step, model, optimizer, _batch(1e-6), precision="fp16")
    assert any(out.role is Role.METRIC for out in captured.graph.outputs)
    captured.run(model, optimizer, _batch(1e-6))
    subnormal = int(captured.last_metrics[SUBNORMAL_METRIC])
    assert subnormal > 0
    warning = underflow_warning(subnormal, captured.watched_grad_elements)
    assert warning is not None and "GradScaler" in warning and "bf16" in warning
    # a well-scaled loss (as a GradScaler scales it): no warning
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    captured = capture_step(plain_step, model, optimizer, _batch(1e3), precision="fp16")
    captured.run(model, optimizer, _batch(1e3))
    assert underflow_warning(int(captured.last_metrics[SUBNORMAL_METRIC]), captured.watched_grad_elements) is None
    # bf16 has float32's range: nothing is counted
    model = Tiny()
    captured = capture_step(plain_step, model, torch.optim.SGD(model.parameters(), lr=0.1), _batch(1e-6), precision="bf16")
    assert not any(out.role is Role.METRIC for out in captured.graph.outputs)


# -- cost and solver ---------------------------------------------------------------------------------------
def test_devices_price_each_dtype_and_refuse_what_they_lack():
    assert A100.flops_per_s("bfloat16") == 2 * A100.flops_per_s("float32")
    assert CPU_CORE.flops_per_s("float16") < CPU_CORE.flops_per_s("float32")
    assert not V100.supports("bfloat16") and V100.supports("float16")
    model = Tiny()
    graph = capture_step(plain_step, model, torch.optim.SGD(model.parameters(), lr=0.1), _batch(), precision="bf16").graph
    with pytest.raises(SolverError, match="bfloat16.*does not support"):
        check_device_dtypes(graph, resolve_cluster("v100x8", Mesh((2,))))
    check_device_dtypes(graph, resolve_cluster("a100x8", Mesh((2,))))


def test_the_solver_reduces_gradients_in_the_policy_reduce_dtype():
    from metadist.frontends.torch.discovery import TorchExecutor
    from metadist.lowering import lower
    from metadist.shardcombine.api import rules_from_database
    from metadist.solver import baseline_plan

    model = Tiny()
    # enough rows that gathering the batch to compute it whole costs more than reducing the gradients
    batch = {"x": torch.randn(65536, 8), "weight": torch.tensor(1.0)}
    graph = capture_step(plain_step, model, torch.optim.SGD(model.parameters(), lr=0.1), batch, precision="bf16").graph
    rules = rules_from_database(graph, TorchExecutor())
    cluster = resolve_cluster("a100x8", Mesh((2,)))
    reduced = {}
    for reduce_dtype in ("float32", "bfloat16"):
        plan = baseline_plan(graph, rules, cluster, "dp", reduce_dtype=reduce_dtype)
        program = lower(graph, plan, (0,))
        kinds = [(kind, dtype) for kind, dtype in _collectives(program) if kind in ("all_reduce", "reduce_scatter")]
        assert kinds, f"a data-parallel plan reduces gradients (reduce dtype {reduce_dtype})"
        reduced[reduce_dtype] = {dtype for _, dtype in kinds}
    assert reduced["float32"] == {"float32"}
    assert "bfloat16" in reduced["bfloat16"]


def test_followers_of_a_restricted_gradient_follow_and_the_plan_still_reduces_in_the_reduce_dtype():
    """A node reading one gradient the policy restricts (bf16, reduced only in float32) cannot reduce it either, so it
    follows its producer (llama-tiny bf16 2x2: 576 -> 531 classes, LP 16 -> 9 s, the same plan); the solver's plan
    still reduces every gradient in float32."""
    from metadist.frontends.torch.discovery import TorchExecutor
    from metadist.lowering import lower
    from metadist.shardcombine.api import rules_from_database
    from metadist.solver import plan_graph
    from metadist.solver.precision import restricted_values
    from metadist.solver.problem import Restrictions, build_problem

    model = Tiny()
    # a batch large enough that splitting it pays for the gradients' reduction: at 65,536 rows the plan that prices its
    # coalesced calls as the runtime makes them gathers instead (no reduction to check)
    batch = {"x": torch.randn(262144, 8), "weight": torch.tensor(1.0)}
    graph = capture_step(plain_step, model, torch.optim.SGD(model.parameters(), lr=0.1), batch, precision="bf16").graph
    rules = rules_from_database(graph, TorchExecutor())
    cluster = resolve_cluster("a100x8", Mesh((2,)))
    restricted = restricted_values(graph, "float32")
    problem = build_problem(graph, rules.rules, cluster, Restrictions(reduce_dtype="float32"))
    inside = [node.name for node in graph.nodes
              if len(set(node.input_names)) == 1 and set(node.input_names) <= restricted
              and any(value.name in restricted for value in node.output_values)]
    assert inside, "the bf16 step has nodes from one restricted gradient to another"
    assert any(problem.member_unit[name][1] > 0 for name in inside)  # followers, not units of their own
    plan = plan_graph(graph, rules, cluster, reduce_dtype="float32")
    kinds = [(kind, dtype) for kind, dtype in _collectives(lower(graph, plan, (0,))) if kind in ("all_reduce", "reduce_scatter")]
    assert kinds and {dtype for _, dtype in kinds} == {"float32"}


def _collectives(program):
    """(kind, dtype) of every collective the rank program runs."""
    for instruction in program.instructions:
        if isinstance(instruction, CoalescedReshard):
            yield instruction.kind, instruction.dtype
        elif isinstance(instruction, Reshard):
            yield from ((step.kind, instruction.spec.dtype) for step in instruction.steps)


# -- the check ------------------------------------------------------------------------------------------
def test_measured_bf16_tolerance_passes_rounding_and_fails_a_missing_reduction():
    want = torch.linspace(-1, 1, 100)
    rounding = {"loss[0]": 1e-3, "grad:w": 4e-3, "state:w": 4e-3}
    reference = ReferenceRun((2.0,), {"w": want}, {"w": want}, {}, MEASURED_TOLERANCES["bfloat16"], rounding)
    noisy = want + 1e-2 * torch.sin(torch.arange(100.0))  # within 3x the measured rounding
    assert compare_runs(reference, [2.002], {"w": noisy}, {"w": noisy}).ok
    halved = want * 0.5  # a gradient summed on one of two ranks only
    report = compare_runs(reference, [2.002], {"w": want}, {"w": halved})
    assert not report.ok and not report.worst().ok and report.worst().name == "grad:w"


# -- torch.autocast ------------------------------------------------------------------------------------
def autocast_step(model, optimizer, batch):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(batch["x"]).square().mean() * batch["weight"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_a_step_under_autocast_is_captured_as_such_and_reproduces_eager_exactly():
    model, batch = Tiny(), _batch()
    eager_model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_optimizer = torch.optim.AdamW(eager_model.parameters(), lr=1e-2)
    captured = capture_step(autocast_step, model, optimizer, batch)
    assert any(value.spec.dtype == "bfloat16" for value in captured.graph.iter_values())
    for _ in range(3):
        assert torch.equal(captured.run(model, optimizer, batch), autocast_step(eager_model, eager_optimizer, batch))
    for a, b in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b)


def test_the_check_of_an_autocast_step_measures_its_rounding_against_the_step_without_autocast():
    from metadist.runtime.check import reference_run

    reference = reference_run(autocast_step, Tiny(), lambda params: torch.optim.SGD(params, lr=0.1), _batch(), steps=2, seed=0)
    assert reference.tolerance == MEASURED_TOLERANCES["bfloat16"]
    assert reference.rounding["grad:fc1.weight"] > 0  # bf16 rounding, measured
    assert torch.is_autocast_enabled("cpu") is False  # autocast_off restored nothing it should not have
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")


# -- the plan command ------------------------------------------------------------------------------------
def test_plan_command_plans_under_a_policy_and_refuses_bf16_on_a_device_without_it(tmp_path, capsys):
    from metadist.cli.main import main
    from metadist.ir.plan import Plan

    out = tmp_path / "plan.json"
    assert main(["plan", "mlp", "--mesh", "2", "--cluster", "a100x8", "--precision", "bf16", "--json", str(out)]) == 0
    plan = Plan.from_json(out.read_text())
    assert plan.estimate["step_s"] > 0
    capsys.readouterr()
    assert main(["plan", "mlp", "--mesh", "2", "--cluster", "v100x8", "--precision", "bf16"]) == 2
    error = capsys.readouterr().err
    assert "bfloat16" in error and "does not support" in error


def test_bf16_on_a_gpu_without_it_is_a_clear_error_before_anything_runs(monkeypatch):
    from metadist.runtime.errors import RunInputError
    from metadist.runtime.precision_check import check_device_precision

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    with pytest.raises(RunInputError, match=r"Tesla V100.*compute capability 7\.0.*--precision fp16"):
        check_device_precision(PrecisionPolicy.named("bf16"), torch.device("cuda", 0))
    check_device_precision(PrecisionPolicy.named("fp16"), torch.device("cuda", 0))  # float16 it has
    check_device_precision(PrecisionPolicy.named("bf16"), torch.device("cpu"))
