"""The rank program's small elementwise ops batched into ``_foreach`` calls, and repeated small ops merged.

Every test compares against the same program run one op per node: the values must be
bitwise equal, collectives and random draws must keep their order.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx

from metadist.runtime.batching import batch_elementwise, merge_duplicates

aten = torch.ops.aten


def _shaped(graph: torch.fx.Graph, target, args, shape, kwargs=None) -> torch.fx.Node:
    node = graph.call_function(target, args, kwargs or {})
    node.meta["metadist_local_shapes"] = (tuple(shape),)
    return node


def _adam_like(shapes):
    """Per-tensor chains shaped like a captured AdamW update: 0-d bias corrections and tensor updates."""
    graph = torch.fx.Graph()
    beta = graph.placeholder("beta")
    lr = graph.placeholder("lr")
    outputs = []
    inputs = [beta, lr]
    for index, shape in enumerate(shapes):
        param, grad, avg, step = (graph.placeholder(f"{kind}{index}") for kind in ("p", "g", "m", "s"))
        inputs += [param, grad, avg, step]
        new_step = _shaped(graph, aten.add.Tensor, (step, 1), ())
        power = _shaped(graph, aten.pow.Tensor_Tensor, (beta, new_step), ())
        correction = _shaped(graph, aten.rsub.Scalar, (power, 1), ())
        size = _shaped(graph, aten.div.Tensor, (lr, correction), ())
        weight = _shaped(graph, aten.rsub.Scalar, (beta, 1), ())
        new_avg = _shaped(graph, aten.lerp.Tensor, (avg, grad, weight), shape)
        root = _shaped(graph, aten.sqrt.default, (_shaped(graph, aten.mul.Tensor, (new_avg, new_avg), shape),), shape)
        denominator = _shaped(graph, aten.add.Tensor, (root, 1e-8), shape)
        update = _shaped(graph, aten.addcdiv.default, (param, new_avg, denominator), shape, {"value": -0.01})
        scaled = _shaped(graph, aten.mul.Tensor, (update, _shaped(graph, aten.neg.default, (size,), ())), shape)
        outputs += [_shaped(graph, aten.add.Tensor, (param, scaled), shape, {"alpha": 0.5}), new_avg, new_step]
    graph.output(tuple(outputs))
    values = [torch.tensor(0.9), torch.tensor(1e-3)]
    for shape in shapes:
        values += [torch.randn(shape), torch.randn(shape), torch.randn(shape), torch.tensor(float(len(values)))]
    return graph, values


def _run(graph: torch.fx.Graph, values, root=None):
    return torch.fx.GraphModule(root or torch.nn.Module(), graph)(*values)


def _calls(graph: torch.fx.Graph, name: str) -> int:
    return sum(1 for node in graph.nodes if node.op == "call_function" and name in str(node.target))


def test_parallel_chains_become_foreach_calls_with_bitwise_equal_results():
    torch.manual_seed(0)
    graph, values = _adam_like([(3, 4), (5,), (2, 2, 2), (7, 1)])
    want = _run(graph, values)
    batched, stats = batch_elementwise(graph)
    got = _run(batched, values)
    assert len(got) == len(want) and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))
    # each of a chain's 13 ops is one foreach call over the 4 chains (an rsub is two: neg, then add)
    assert (stats.ops_before, stats.batched, stats.groups, stats.ops_after) == (52, 52, 13, 13 + 2), stats
    assert _calls(batched, "_foreach_lerp") == 1 and _calls(batched, "lerp.Tensor") == 0
    assert _calls(batched, "_foreach_addcdiv") == 1


def test_large_tensors_and_lone_ops_stay_as_they_are():
    graph, values = _adam_like([(200, 100), (3,)])
    batched, stats = batch_elementwise(graph, max_numel=1000)
    got, want = _run(batched, values), _run(graph, values)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # only the 0-d bias corrections pair up: the (3,) tensor's ops have no partner under the cap
    assert _calls(batched, "lerp.Tensor") == 2 and _calls(batched, "_foreach_lerp") == 0
    # the six 0-d ops of each chain (step + 1, beta ** step, 1 - that, lr / that, 1 - beta, -size) pair up
    assert (stats.groups, stats.batched, stats.ops_after) == (6, 12, 26 - 12 + 6 + 2), stats


class _Recorder(torch.nn.Module):
    """Stands for the ``comm`` submodule: records the order of its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def collective(self, tensor: torch.Tensor, tag: str) -> torch.Tensor:
        self.calls.append(tag)
        return tensor * 2


def _collective_program(coalesced: bool):
    """Collectives on four inputs, a per-tensor chain on each (a random draw in the second), then either
    one collective on all four results (a coalesced bucket) or one each in reverse order."""
    graph = torch.fx.Graph()
    comm = graph.get_attr("comm")
    inputs = [graph.placeholder(f"x{index}") for index in range(4)]
    results = []
    for index, x in enumerate(inputs):
        gathered = graph.call_method("collective", (comm, x, f"c{index}"))
        scaled = _shaped(graph, aten.mul.Tensor, (gathered, 3.0), (4,))
        if index == 1:
            noise = _shaped(graph, aten.bernoulli.p, (scaled, 0.5), (4,))
            scaled = _shaped(graph, aten.add.Tensor, (scaled, noise), (4,))
        results.append(_shaped(graph, aten.sqrt.default, (_shaped(graph, aten.abs.default, (scaled,), (4,)),), (4,)))
    if coalesced:
        bucket = graph.call_method("collective", (comm, _shaped(graph, aten.cat.default, (results,), (16,)), "d"))
        graph.output((bucket,))
    else:
        graph.output(tuple(graph.call_method("collective", (comm, results[index], f"d{index}")) for index in reversed(range(4))))
    return graph, [torch.randn(4) for _ in range(4)]


def _run_recorded(graph: torch.fx.Graph, values):
    root = torch.nn.Module()
    root.comm = _Recorder()
    torch.manual_seed(7)
    result = torch.fx.GraphModule(root, graph)(*values)
    return result, root.comm.calls


@pytest.mark.parametrize("coalesced", [True, False])
def test_collectives_and_random_draws_keep_their_order(coalesced):
    graph, values = _collective_program(coalesced)
    want, want_calls = _run_recorded(graph, values)
    batched, stats = batch_elementwise(graph)
    got, got_calls = _run_recorded(batched, values)
    assert got_calls == want_calls
    assert want_calls == ["c0", "c1", "c2", "c3", *(["d"] if coalesced else ["d3", "d2", "d1", "d0"])]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    positions = {node: position for position, node in enumerate(batched.nodes)}
    (draw,) = [node for node in batched.nodes if node.target is aten.bernoulli.p]
    collectives = [node for node in batched.nodes if node.op == "call_method"]
    assert positions[collectives[1]] < positions[draw] < positions[collectives[4]]
    if coalesced:
        # the four chains end in one collective: their abs and sqrt line up, and the muls of the three chains
        # without a draw (the second chain is two ops longer)
        assert (stats.groups, stats.batched) == (3, 4 + 4 + 3), stats
    else:
        # collectives in reverse order: each chain ends a different number of steps before the last collective
        assert stats.groups == 0, stats


def test_repeated_small_ops_merge_but_outputs_stay_distinct():
    graph = torch.fx.Graph()
    beta, lr, weight, wide = (graph.placeholder(name) for name in ("beta", "lr", "weight", "wide"))
    first = _shaped(graph, aten.rsub.Scalar, (beta, 1), ())
    second = _shaped(graph, aten.rsub.Scalar, (beta, 1), ())
    uses = [_shaped(graph, aten.mul.Tensor, (lr, node), ()) for node in (first, second)]
    # small enough to merge: two equal results that are program outputs, two that reach outputs through views, and
    # two through ``_unsafe_view``, whose schema does not say it shares its input's memory: all kept apart
    outs = [_shaped(graph, aten.mul.Tensor, (weight, 2.0), (2,)) for _ in range(2)]
    viewed = [_shaped(graph, aten.view.default, (_shaped(graph, aten.add.Tensor, (weight, 1.0), (2,)), [2]), (2,))
              for _ in range(2)]
    unsafe = [_shaped(graph, aten._unsafe_view.default, (_shaped(graph, aten.add.Tensor, (weight, 3.0), (2,)), [2]), (2,))
              for _ in range(2)]
    big = [_shaped(graph, aten.mul.Tensor, (wide, 5.0), (3,)) for _ in range(2)]
    graph.output((*uses, *outs, *viewed, *unsafe, _shaped(graph, aten.add.Tensor, tuple(big), (3,))))
    values = [torch.tensor(0.9), torch.tensor(0.1), torch.randn(2), torch.randn(3)]
    want = _run(graph, values)
    merged = merge_duplicates(graph, max_numel=2)  # the (3,) ``big`` products are above this cap
    got = _run(graph, values)
    assert merged == 1 and all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[2] is not got[3]
    assert got[4].data_ptr() != got[5].data_ptr() and got[6].data_ptr() != got[7].data_ptr()
    assert _calls(graph, "rsub") == 1 and _calls(graph, "mul.Tensor") == 2 + 2 + 2 and _calls(graph, "add.Tensor") == 5


def test_a_captured_library_model_with_adamw_runs_bitwise_equal_batched(tmp_path):
    """gpt2-tiny (HuggingFace GPT-2 from its tiny config, library defaults) with AdamW on one device."""
    from metadist.frontends.torch import capture_step
    from metadist.frontends.torch.execute import execute_graph
    from metadist.ir import Mesh
    from metadist.lowering import lower, replicate_plan
    from metadist.runtime.collectives import Collectives
    from metadist.runtime.graph_module import build_rank_module
    from metadist.workloads import builtin_workload

    workload = builtin_workload("gpt2-tiny", optimizer="adamw")
    optimizer = workload.optimizer(workload.model.parameters())
    step = capture_step(workload.train_step(), workload.model, optimizer, workload.batch)
    program = lower(step.graph, replicate_plan(step.graph, Mesh((1,)), "test"), (0,))
    inputs = step.gather_inputs(workload.model, optimizer, workload.batch)
    modules = {batch: build_rank_module(program, Collectives(("unused",), (1,)), contiguous_values=step.contiguous_values,
                                        batch=batch) for batch in (False, True)}
    results = {}
    for batch, module in modules.items():
        torch.manual_seed(11)  # dropout draws
        results[batch] = module(*inputs)
    torch.manual_seed(11)
    reference = execute_graph(step.graph, inputs, step.constants, contiguous_values=step.contiguous_values)
    for got, plain, want in zip(results[True], results[False], reference):
        assert torch.equal(got, plain) and torch.equal(got, want)
    foreach = [node for node in modules[True].graph.nodes if "_foreach" in str(node.target)]
    plain_ops = sum(1 for node in modules[False].graph.nodes if node.op == "call_function")
    batched_ops = sum(1 for node in modules[True].graph.nodes
                      if node.op == "call_function" and node.target is not operator.getitem)
    assert len(foreach) >= 10 and batched_ops < plain_ops / 2, (len(foreach), batched_ops, plain_ops)


def test_a_repeated_op_whose_result_is_written_in_place_is_not_merged():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    first = _shaped(graph, aten.mul.Tensor, (x, 2.0), (3,))
    second = _shaped(graph, aten.mul.Tensor, (x, 2.0), (3,))
    written = _shaped(graph, aten.add_.Tensor, (second, 1.0), (3,))  # an in-place reader of the second copy
    graph.output((_shaped(graph, aten.add.Tensor, (first, written), (3,)),))
    values = [torch.ones(3)]
    want = _run(graph, values)
    assert merge_duplicates(graph) == 0
    assert torch.equal(_run(graph, values)[0], want[0]) and torch.equal(want[0], torch.full((3,), 5.0))
