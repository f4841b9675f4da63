"""The scaled dot-product attention (SDPA) family: sound rules, and sharded runs that match one device.

* The CPU kernels' rules are found by execution: batch, heads (grouped-query heads as a
  proportional factor), the query length where no ``is_causal`` flag ties positions together,
  the key length in the backward, explicit masks split along with the dims they carry.
* Candidate pieces whose shapes disagree never reach the kernels (the crash of the issue).
* The GPU-only kernels get the CPU kernel's batch and heads factors by equivalence; DTensor's own
  strategies for them agree; with dropout they get no rule.
* Captured SDPA ops without dropout are not random; with dropout on the CPU, PyTorch takes the
  matmul/softmax/dropout form, whose dropout the lowering draws whole on every rank.
* Runs on 2 and 2x2 gloo ranks, with the batch, heads (grouped), query-length and mixed splits
  forced onto the attention nodes, pass ``--check``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from metadist.frontends.torch.discovery import TorchExecutor
from metadist.frontends.torch.to_ir import dtype_name
from metadist.ir import Factor, Graph, GraphInput, GraphOutput, MetaOp, Node, TensorSpec, Value, ValueRef
from metadist.shardcombine import attention
from metadist.shardcombine.discover import NoRule, discover
from metadist.shardcombine.executor import ExecutionRefused, OpCall
from metadist.shardcombine.recheck import check_rule_by_execution
from metadist.shardcombine.verify import check_factor

aten = torch.ops.aten
B, H, L, E = 4, 4, 8, 16


def op_call(op, *args, **kwargs) -> OpCall:
    """The MetaIR call of ``op`` on ``args`` (meta tensors become inputs; outputs from the meta kernel)."""
    specs: list[TensorSpec] = []

    def encode(arg):
        if isinstance(arg, torch.Tensor):
            specs.append(TensorSpec(tuple(arg.shape), dtype_name(arg.dtype)))
            return ValueRef(f"t{len(specs) - 1}")
        return tuple(arg) if isinstance(arg, list) else arg

    encoded = tuple(encode(arg) for arg in args)
    encoded_kwargs = tuple((key, encode(value)) for key, value in kwargs.items())
    results = op(*args, **kwargs)
    outputs = tuple(
        Value(f"o{index}", TensorSpec(tuple(out.shape), dtype_name(out.dtype))) if isinstance(out, torch.Tensor) else None
        for index, out in enumerate(results)
    )
    target = f"{op.name().replace('::', '.')}.{op._overloadname}"
    return OpCall(Node("sdpa", MetaOp(target), encoded, encoded_kwargs, outputs), tuple(specs))


def meta(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def cpu_calls(causal: bool, mask: str | None, kv_heads: int) -> tuple[OpCall, OpCall]:
    """The CPU forward and backward calls: mask None, "float" (B, 1, L, L) or "per-head" (B, H, L, L).

    (The CPU kernel takes additive float masks; ``scaled_dot_product_attention`` turns a bool mask into one.)
    """
    q, k, v = meta(B, H, L, E), meta(B, kv_heads, L, E), meta(B, kv_heads, L, E)
    kwargs = {} if mask is None else {"attn_mask": meta(B, 1 if mask == "float" else H, L, L)}
    forward = op_call(aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, 0.0, causal, **kwargs)
    backward = op_call(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, meta(B, H, L, E), q, k, v,
                       meta(B, H, L, E), meta(B, H, L), 0.0, causal, **kwargs)
    return forward, backward


# ---------------------------------------------------------------- validation before execution


def test_the_issue_s_crashing_pieces_never_reach_the_kernel():
    """Key split on the batch dim against a whole query: refused, even with isolation off (in this process)."""
    _, backward = cpu_calls(False, None, 6)
    pieces = [(6, 6, 18, 12), (6, 6, 18, 12), (2, 6, 18, 12), (6, 6, 18, 12), (6, 6, 18, 12), (6, 6, 18)]
    assert "key has B = 2" in attention.shape_error(backward, pieces)
    executor = TorchExecutor(isolate=False)
    arrays = [np.ones(shape, dtype=np.float32) for shape in pieces]
    with pytest.raises(ExecutionRefused, match="key has B = 2"):
        executor.run(backward, arrays)


@pytest.mark.parametrize("shapes, error", [
    ([(4, 4, 8, 16), (4, 2, 8, 16), (4, 2, 8, 16)], None),  # grouped-query: 4 heads over 2
    ([(4, 6, 8, 16), (4, 4, 8, 16), (4, 4, 8, 16)], "6 query heads are not a multiple of 4"),
    ([(4, 4, 8, 16), (4, 4, 8, 8), (4, 4, 8, 16)], "key has E = 8"),
    ([(4, 4, 8, 16), (4, 4, 8, 16), (4, 4, 6, 16)], "value has S = 6"),
    ([(4, 4, 8, 16), (4, 4, 8, 16), (4, 4, 8, 16), (4, 1, 8, 8)], None),
    ([(4, 4, 8, 16), (4, 4, 8, 16), (4, 4, 8, 16), (2, 1, 8, 8)], "does not broadcast"),
])
def test_shape_error_names_what_disagrees(shapes, error):
    forward, _ = cpu_calls(False, "float" if len(shapes) == 4 else None, shapes[1][1])
    found = attention.shape_error(forward, shapes)
    assert (found is None) if error is None else (error in found), found


# ---------------------------------------------------------------- the CPU kernels' rules

CASES = {
    # (causal flag, mask, kv heads): (forward rule, backward rule)
    (False, None, 4): ("abc_,ab__,ab__->abc_,abc", "abc_,abc_,abd_,abd_,abc_,abc->abc_,abd_,abd_ | c:sum d:sum | pass 0:sum"),
    (True, None, 4): ("ab__,ab__,ab__->ab__,ab_", "ab__,ab__,ab__,ab__,ab__,ab_->ab__,ab__,ab__ | pass 0:sum"),
    (False, None, 2): ("abc_,ab__,ab__->abc_,abc", "abc_,abc_,abd_,abd_,abc_,abc->abc_,abd_,abd_ | c:sum d:sum | pass 0:sum"),
    (True, None, 2): ("ab__,ab__,ab__->ab__,ab_", "ab__,ab__,ab__,ab__,ab__,ab_->ab__,ab__,ab__ | pass 0:sum"),
    (False, "float", 2): ("abc_,ab__,ab__,a_c_->abc_,abc",
                          "abc_,abc_,abd_,abd_,abc_,abc,a_cd->abc_,abd_,abd_ | c:sum d:sum | pass 0:sum"),
    (False, "per-head", 2): ("abc_,ab__,ab__,abc_->abc_,abc",
                             "abc_,abc_,abd_,abd_,abc_,abc,abcd->abc_,abd_,abd_ | c:sum d:sum | pass 0:sum"),
}


@pytest.mark.parametrize("case", list(CASES), ids=[f"causal={c}-mask={m}-kv={k}" for c, m, k in CASES])
def test_cpu_kernel_rules(case):
    """a: batch; b: heads (with 2 key/value heads: proportional, 2 query heads per piece of 1);
    c: query length (not with is_causal, whose mask is aligned to the piece's own start), the
    key/value and mask pieces whole, partial key/value gradients; d: key length (backward only,
    given the logsumexp the key pieces are independent), a partial query gradient. An explicit
    mask is split with the dims it has (its size-1 heads dim never; a per-head mask with the query heads)."""
    forward, backward = cpu_calls(*case)
    executor = TorchExecutor()
    want_forward, want_backward = CASES[case]
    rules = [discover(forward, executor), discover(backward, executor)]
    assert [rule.to_text() for rule in rules] == [want_forward, want_backward]
    heads = next(factor for factor in rules[0].factors if factor.inputs[0] == 1)
    assert heads.is_proportional(forward.input_shapes) == (case[2] != H)


@pytest.mark.parametrize("case", [(False, "float", 2), (True, None, 2), (False, None, 4)])
def test_every_cpu_factor_holds_on_fresh_shapes_and_uneven_pieces(case):
    executor = TorchExecutor()
    for call in cpu_calls(*case):
        rule = discover(call, executor)
        checks = check_rule_by_execution(call, rule, executor)
        assert all(check.ok for check in checks), [(check.what, check.detail) for check in checks if not check.ok]
        inputs = executor.example_inputs(call, np.random.default_rng(7), call.input_shapes)
        for factor in rule.factors:
            uneven = not factor.is_proportional(call.input_shapes)
            assert check_factor(call, executor, factor, inputs, shards=2, uneven=uneven) is None, factor


def test_a_proportional_factor_splits_each_dim_in_proportion():
    from metadist.shardcombine.verify import split_inputs

    forward, _ = cpu_calls(True, None, 2)
    rule = discover(forward, TorchExecutor())
    heads = next(factor for factor in rule.factors if factor.inputs[0] == 1)
    assert heads.size(forward.input_shapes) == 2
    inputs = [np.arange(np.prod(shape), dtype=np.float32).reshape(shape) for shape in forward.input_shapes]
    pieces = split_inputs(inputs, heads, 2)
    assert [piece[0].shape[1] for piece in pieces] == [2, 2] and [piece[1].shape[1] for piece in pieces] == [1, 1]
    assert np.array_equal(pieces[1][0], inputs[0][:, 2:]) and np.array_equal(pieces[1][1], inputs[1][:, 1:])
    with pytest.raises(Exception, match="neither equal nor multiples"):
        Factor((1, 1), (None,)).size(((4, 6), (4, 4)))


def test_standins_keep_what_the_op_means():
    forward, backward = cpu_calls(True, "float", 2)
    q, k, v, mask = attention.standin_shapes(forward)
    assert q[1] == 2 * k[1] and k == v and mask[1] == 1 and q[2] == k[2] == mask[2] == mask[3]
    long_keys = op_call(aten._scaled_dot_product_flash_attention_for_cpu.default, meta(2, 4, 8, 16), meta(2, 4, 40, 16),
                        meta(2, 4, 40, 16))
    q, k, _ = attention.standin_shapes(long_keys)
    assert q[2] < k[2]  # L < S is kept (a causal mask's alignment depends on it)


# ---------------------------------------------------------------- the GPU kernels by equivalence


def gpu_calls() -> dict[str, OpCall]:
    f16 = torch.float16
    q, k, v = meta(B, H, L, E, dtype=f16), meta(B, H, L, E, dtype=f16), meta(B, H, L, E, dtype=f16)
    k2, v2 = meta(B, 2, L, E, dtype=f16), meta(B, 2, L, E, dtype=f16)
    grad, out, lse = meta(B, H, L, E, dtype=f16), meta(B, H, L, E, dtype=f16), meta(B, H, L)
    bias = meta(B, 1, L, L, dtype=f16)
    seed, offset = meta(2, dtype=torch.int64), meta(dtype=torch.int64)
    return {
        "flash": op_call(aten._scaled_dot_product_flash_attention.default, q, k, v, 0.0, True),
        "flash-gqa": op_call(aten._scaled_dot_product_flash_attention.default, q, k2, v2, 0.0, False),
        "efficient": op_call(aten._scaled_dot_product_efficient_attention.default, q, k, v, bias, True, 0.0, False),
        "cudnn": op_call(aten._scaled_dot_product_cudnn_attention.default, q, k, v, None, True, 0.0, True),
        "flash-backward": op_call(aten._scaled_dot_product_flash_attention_backward.default, grad, q, k2, v2, out, lse,
                                  None, None, L, L, 0.0, True, seed, offset),
        "efficient-backward": op_call(aten._scaled_dot_product_efficient_attention_backward.default, grad, q, k, v, bias,
                                      out, meta(B, H, 32), offset, offset, 0.0, [True, True, True, False], False),
        "cudnn-backward": op_call(aten._scaled_dot_product_cudnn_attention_backward.default, grad, q, k, v, out,
                                  meta(B, H, L, 1), offset, offset, None, None, None, L, L, 0.0, True),
    }


GPU_RULES = {
    "flash": "ab__,ab__,ab__->ab__,ab_,-,-,-,-,_,,_ | a:id b:id",
    "flash-gqa": "ab__,ab__,ab__->ab__,ab_,-,-,-,-,_,,_ | a:id b:id",
    "efficient": "ab__,ab__,ab__,a___->ab__,ab_,, | a:id b:id",
    "cudnn": "ab__,ab__,ab__->ab__,ab__,-,-,-,-,,,- | a:id b:id",
    "flash-backward": "ab__,ab__,ab__,ab__,ab__,ab_,_,->ab__,ab__,ab__",
    "efficient-backward": "ab__,ab__,ab__,ab__,a___,ab__,ab_,,->ab__,ab__,ab__,-",
    "cudnn-backward": "ab__,ab__,ab__,ab__,ab__,ab__,,->ab__,ab__,ab__",
}
"""a: batch, b: heads; every other output (philox seed and offset, the empty debug mask) replicated (``id``)."""


def _single_node_graph(call: OpCall) -> Graph:
    inputs = tuple(GraphInput(Value(f"t{index}", spec), "activation") for index, spec in enumerate(call.input_specs))
    outputs = tuple(GraphOutput(value.name, "activation") for value in call.node.outputs if value is not None)
    return Graph(inputs, (call.node,), outputs, name=call.node.name)


def test_gpu_kernels_take_the_cpu_kernel_s_batch_and_heads_factors_and_dtensor_agrees():
    from metadist.shardcombine.oracle import DTensorOracle, compare_node

    executor = TorchExecutor()
    calls = gpu_calls()
    with DTensorOracle(mesh_size=2) as oracle:
        for name, call in calls.items():
            rule = discover(call, executor)
            assert rule.to_text() == GPU_RULES[name], name
            comparison = compare_node(call.node, _single_node_graph(call), rule, oracle, executor)
            assert not comparison.wrong, name
            assert not comparison.only_dtensor, (name, comparison.only_dtensor)  # every DTensor strategy is ours
            assert len(comparison.agreements) >= (1 if name.startswith("efficient") else 2), (name, comparison)


def test_gpu_kernels_with_dropout_a_debug_mask_or_a_bias_gradient_get_no_rule():
    f16 = torch.float16
    q = meta(B, H, L, E, dtype=f16)
    offset = meta(dtype=torch.int64)
    cases = {
        "draws its mask by global position": op_call(aten._scaled_dot_product_flash_attention.default, q, q, q, 0.1, True),
        "debug attention mask": op_call(aten._scaled_dot_product_flash_attention.default, q, q, q, 0.0, True, True),
        "gradient of the attention bias": op_call(
            aten._scaled_dot_product_efficient_attention_backward.default, q, q, q, q, meta(B, H, L, L, dtype=f16), q,
            meta(B, H, 32), offset,
            offset, 0.0, [True, True, True, True], False),
    }
    for reason, call in cases.items():
        with pytest.raises(NoRule, match=reason):
            discover(call, TorchExecutor())


# ---------------------------------------------------------------- capture


def _captured_targets(dropout_p: float) -> dict[str, frozenset]:
    from metadist.frontends.torch import capture_step

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    batch = {"x": torch.randn(2, 4, 8, 16)}

    def step(model, optimizer, batch):
        h = model(batch["x"])
        loss = torch.nn.functional.scaled_dot_product_attention(h, h, h, dropout_p=dropout_p).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    graph = capture_step(step, model, optimizer, batch).graph
    return {node.op.target: node.op.tags for node in graph.nodes}


def test_captured_attention_without_dropout_is_not_random_and_with_dropout_takes_the_math_form():
    targets = _captured_targets(0.0)
    assert "random" not in targets["aten._scaled_dot_product_flash_attention_for_cpu.default"]
    targets = _captured_targets(0.25)
    assert not any(attention.is_attention(target) for target in targets)
    assert "random" in targets["aten.bernoulli.p"]  # drawn whole on every rank by the lowering


# ---------------------------------------------------------------- runs


def test_an_empty_piece_gives_zeros_instead_of_running_the_kernel():
    """Uneven shards can leave a rank no heads or no query positions; the CPU kernel divides by zero there."""
    from metadist.runtime.graph_module import attention_or_zeros

    forward = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    backward = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
    q = torch.randn(2, 0, 8, 16)
    out, lse = attention_or_zeros(forward, q, q, q, 0.0, False)
    assert out.shape == (2, 0, 8, 16) and lse.shape == (2, 0, 8)
    q, k = torch.randn(2, 4, 0, 16), torch.randn(2, 4, 8, 16)
    grads = attention_or_zeros(backward, q, q, k, k, q, torch.randn(2, 4, 0), 0.0, False)
    assert [tuple(g.shape) for g in grads] == [(2, 4, 0, 16), (2, 4, 8, 16), (2, 4, 8, 16)]
    assert not any(g.any() for g in grads)  # no query rows: the key and value gradients' share is zero
    q = torch.randn(2, 4, 8, 16)
    want = aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q)
    assert all(torch.equal(a, b) for a, b in zip(attention_or_zeros(forward, q, q, q), want))


MODEL_FILE = '''
"""A small model calling scaled_dot_product_attention the ways models do (grouped, causal, masked, dropout)."""
import torch
import torch.nn.functional as F
import metadist


class Attention(torch.nn.Module):
    def __init__(self, width, heads, kv_heads, mode, dropout):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.mode, self.dropout = heads, kv_heads, width // heads, mode, dropout
        self.q = torch.nn.Linear(width, heads * self.head_dim)
        self.k = torch.nn.Linear(width, kv_heads * self.head_dim, bias=False)  # a key bias has no gradient
        self.v = torch.nn.Linear(width, kv_heads * self.head_dim)
        self.o = torch.nn.Linear(heads * self.head_dim, width)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)      # (B, H, T, D)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)   # (B, Hk, T, D)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)   # (B, Hk, T, D)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask if self.mode in ("mask", "bool") else None, is_causal=self.mode == "causal",
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=self.heads != self.kv_heads)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def workload(mode="causal", kv_heads=2, dropout=0.0, sgd=True, heads=4):
    torch.manual_seed(0)
    width, seq, batch = 8 * heads, 8, 4
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([Attention(width, heads, kv_heads, mode, dropout) for _ in range(2)]),
                                 "head": torch.nn.Linear(width, 10)})
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    mask = causal.expand(batch, 1, seq, seq) if mode == "bool" else torch.zeros(batch, 1, seq, seq).masked_fill(~causal, -1e9)
    data = {"x": torch.randn(batch, seq, width), "mask": mask, "y": torch.randint(0, 10, (batch, seq))}

    def loss_fn(model, data):
        h = data["x"]
        for layer in model["layers"]:
            h = h + layer(h, data["mask"])
        return F.cross_entropy(model["head"](h).flatten(0, 1), data["y"].flatten())

    # SGD for the forced plans: AdamW divides by the root of tiny squared gradients and turns
    # summation-order noise into visible differences
    optimizer = (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)) if sgd else (
        lambda params: torch.optim.AdamW(params, lr=1e-3))
    return metadist.Workload(model=model, batch=data, loss_fn=loss_fn, optimizer=optimizer)


def gqa_causal():
    return workload("causal")


def gqa_plain():
    return workload("plain")


def mha_mask():
    return workload("mask", kv_heads=4)


def gqa_bool_mask():
    return workload("bool")


def six_heads():
    return workload("plain", kv_heads=6, heads=6)


def dropout():
    return workload("causal", kv_heads=4, dropout=0.2, sgd=False)


def gpt2_eager():
    return metadist.builtin_workload("gpt2-tiny", attn_implementation="eager")
'''

SPLITS = {"batch": 0, "heads": 1, "length": 2}


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sdpa") / "sdpa_models.py"
    path.write_text(MODEL_FILE)
    return path


def _forced_plan(spec: str, splits: tuple[str, ...], mesh: tuple[int, ...], path) -> list:
    """The solver's plan with every attention node forced onto ``splits`` (one per mesh axis); returns the
    query's sharding of each attention node."""
    from metadist.api import capture_and_discover
    from metadist.cost.cluster import resolve_cluster
    from metadist.ir import Mesh
    from metadist.ir.plan import AxisChoice, strategy_from_choices
    from metadist.solver import plan_graph

    graph, found = capture_and_discover(spec)
    plan = plan_graph(graph, found.rules, resolve_cluster("cpu-gloo", Mesh(mesh)))
    strategies = dict(plan.node_strategies)
    forced = []
    for node in graph.nodes:
        if attention.is_attention(node.op.target):
            rule, query = found.rules[node.name], attention.tensor_roles(node).index("query")
            choices = tuple(AxisChoice("factor", next(i for i, f in enumerate(rule.factors) if f.inputs[query] == SPLITS[split]))
                            for split in splits)
            strategies[node.name] = strategy_from_choices(rule, choices)
            forced.append(strategies[node.name].inputs[query])
    path.write_text(dataclasses.replace(plan, node_strategies=strategies).to_json())
    return forced


def _run(spec: str, mesh: str, *extra: str, tmp_path) -> subprocess.CompletedProcess:
    nproc = str(int(np.prod([int(size) for size in mesh.split("x")])))
    command = [sys.executable, "-m", "metadist.cli.main", "run", spec, "--nproc", nproc, "--mesh", mesh, "--steps", "3",
               "--check", "--timeout-s", "180", "--log-dir", str(tmp_path / "logs"), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("function, splits, mesh", [
    ("gqa_causal", ("heads",), "2"),             # grouped-query heads: 2 query heads with 1 key/value head per rank
    ("mha_mask", ("length",), "2"),              # query length, the mask split with it
    ("gqa_bool_mask", ("heads", "length"), "2x2"),
    ("gqa_plain", ("batch", "heads"), "2x2"),
    ("six_heads", ("heads",), "4"),              # uneven: heads 2, 2, 2, 0 (the last rank's kernels get no heads)
])
def test_forced_attention_splits_train_like_one_device(model_file, tmp_path, function, splits, mesh):
    plan = tmp_path / "plan.json"
    from metadist.ir import Shard

    queries = _forced_plan(f"{model_file}:{function}", splits, tuple(int(s) for s in mesh.split("x")), plan)
    want = tuple(Shard(SPLITS[split]) for split in splits)
    assert queries == [want] * 4  # 2 layers, forward and backward
    result = _run(f"{model_file}:{function}", mesh, "--plan", str(plan), tmp_path=tmp_path)
    assert result.returncode == 0 and "check: PASS" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("function", ["dropout", "gpt2_eager"])
def test_dropout_attention_and_eager_attention_train_like_one_device(model_file, tmp_path, function):
    result = _run(f"{model_file}:{function}", "2", tmp_path=tmp_path)
    assert result.returncode == 0 and "check: PASS" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
