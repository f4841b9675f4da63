"""ShardCombine's framework-free core: combiners, shapes, signatures, and the search on numpy ops.

A fake executor implements a few ops in numpy (matmul, sum, cumsum, softmax,
layer norm, scale-and-shift), so the search is tested without any framework.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from numpy_executor import NumpyExecutor

from metadist.ir import Concat, Identity, MetaOp, Node, Reduce, Rule, TensorSpec, Value, ValueRef
from metadist.shardcombine import (
    DiscoveryConfig,
    NoRule,
    OpCall,
    OpExecutor,
    candidate_factors,
    check_combine,
    close,
    discover,
    infer_combine,
    random_op_rule,
    signature_of,
    tolerance_for,
)
from metadist.shardcombine.shapes import (
    piece_sizes,
    reshape_for,
    reshape_groups,
    standin_reshape,
    standin_shapes,
    standin_shapes_keeping,
)


# ----------------------------------------------------------------- a numpy executor


def _layer_norm(x: np.ndarray) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(axis=-1, keepdims=True) + 1e-5)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


_NUMPY_OPS = {
    "np.matmul": lambda a, b: [a @ b],
    "np.sum0": lambda a: [a.sum(axis=0)],
    "np.cumsum1": lambda a: [np.cumsum(a, axis=1)],
    "np.softmax": lambda a: [_softmax(a)],
    "np.layer_norm": lambda a: [_layer_norm(a), a.mean(axis=-1, keepdims=True)],
    "np.shift": lambda a: [a + 1e-6],
    "np.scale": lambda a: [3.0 * a],
    "np.random": lambda a: [np.random.default_rng().normal(size=a.shape)],
}


def np_call(target: str, shapes: list[tuple[int, ...]], out_shapes: list[tuple[int, ...]], tags=()) -> OpCall:
    refs = tuple(ValueRef(f"x{i}") for i in range(len(shapes)))
    outs = tuple(Value(f"y{i}", TensorSpec(s, "float64")) for i, s in enumerate(out_shapes))
    return OpCall(Node("n", MetaOp(target, frozenset(tags)), refs, (), outs), tuple(TensorSpec(s, "float64") for s in shapes))


EXECUTOR = NumpyExecutor(_NUMPY_OPS)


def test_numpy_executor_implements_the_protocol():
    assert isinstance(EXECUTOR, OpExecutor)


# ----------------------------------------------------------------- combiners


def test_combiners_recombine_concat_reduce_identity():
    whole = np.arange(12.0).reshape(3, 4) - 5.5
    assert check_combine([whole[:, :1], whole[:, 1:]], whole, Concat(1), "float64")
    assert not check_combine([whole[:, 1:], whole[:, :1]], whole, Concat(1), "float64")  # order matters
    parts = [whole * 0.25, whole * 0.75]
    assert infer_combine(parts, whole, "float64") == Reduce("sum")
    assert infer_combine([whole, whole], whole, "float64") == Identity()  # not max/min: identity is preferred
    assert infer_combine([whole, np.minimum(whole, 0)], whole, "float64") == Reduce("max")
    assert infer_combine([whole, whole + 1], whole, "float64") == Reduce("min")
    assert infer_combine([whole + 1, whole - 2], whole, "float64") is False
    assert infer_combine([None, None], None, "float64") is None


def test_tolerances_follow_dtype():
    want = np.ones(4, dtype=np.float32)
    assert close(want * (1 + 1e-6), want, "float32")
    assert not close(want * (1 + 1e-3), want, "float32")
    assert close(want * (1 + 1e-2), want, "bfloat16")
    assert not close(np.ones(4) * (1 + 1e-8), np.ones(4), "float64")
    assert tolerance_for("int64").exact and not close(np.array([1, 2]), np.array([1, 3]), "int64")
    assert not close(np.array([np.nan]), np.array([np.nan]), "float32")  # NaN never matches


# ----------------------------------------------------------------- shapes


def test_reshape_groups_and_rewrites():
    assert reshape_groups((4, 16, 64), (4, 16, 4, 16)) == [((0,), (0,)), ((1,), (1,)), ((2,), (2, 3))]
    assert reshape_groups((4, 1, 6), (4, 6)) == [((0,), (0,)), ((1,), ()), ((2,), (1,))]
    assert reshape_for((4, 16, 64), (4, 16, 4, 16), (4, 16, 32)) == (4, 16, 2, 16)  # heads split
    assert reshape_for((4, 16, 64), (64, 64), (2, 16, 64)) == (32, 64)  # leading dim of a merge
    assert reshape_for((4, 16, 64), (4, 16, 4, 16), (4, 16, 24)) is None  # 24 is no multiple of 16
    standin = standin_reshape((8192, 50257), (8, 1024, 50257))
    assert standin[0] % 1024 == 0 and standin[1] < 100


def test_standin_shapes_keep_ones_equalities_and_order():
    shapes = standin_shapes([(32, 64), (64, 256), (1, 256)])
    assert shapes == ((6, 12), (12, 18), (1, 18))
    assert all(size % 6 == 0 for shape in shapes for size in shape if size > 1)


def test_standin_shapes_keep_the_sizes_the_arguments_refer_to():
    # RoPE: a slice of the head dim (128) keeps it; the other sizes shrink, in order among themselves
    assert standin_shapes_keeping([(8, 32, 2048, 128)], [(3,)]) == ((6, 12, 18, 128),)
    assert standin_shapes_keeping([(1024, 64, 4096, 128)], [(3,)]) == ((12, 6, 18, 128),)  # LLaMA-70B
    # every dim of a kept size keeps it (equal sizes stay equal); with nothing kept: the plain stand-ins
    assert standin_shapes_keeping([(4, 64, 64), (64,)], [(2,), ()]) == ((6, 64, 64), (64,))
    assert standin_shapes_keeping([(32, 64), (1, 256)], [(), ()]) == standin_shapes([(32, 64), (1, 256)])
    # a stand-in never takes a kept size: the sizes stay distinct
    assert standin_shapes_keeping([(3, 4, 5, 12)], [(3,)]) == ((6, 18, 24, 12),)


def test_piece_sizes_are_uneven_when_possible():
    assert piece_sizes(6, 2, uneven=True) == [2, 4]
    assert piece_sizes(6, 3, uneven=True) == [1, 2, 3]
    assert piece_sizes(6, 3, uneven=False) == [2, 2, 2]
    assert piece_sizes(2, 3, uneven=False) is None


# ----------------------------------------------------------------- signatures


def _sig(shapes, dims=-1, target="aten._softmax.default"):
    node = Node("n", MetaOp(target), (ValueRef("x"), dims, False), (), (Value("y", TensorSpec(shapes[0], "float32")),))
    return signature_of(OpCall(node, tuple(TensorSpec(s, "float32") for s in shapes)))


def test_signature_ignores_sizes_but_not_structure():
    assert _sig([(4, 16, 64)]).key == _sig([(8, 1024, 768)]).key  # widths do not matter
    assert _sig([(4, 16, 64)], -1) == _sig([(4, 16, 64)], 2)  # negative dims normalized
    assert _sig([(4, 1, 64)]).key != _sig([(4, 16, 64)]).key  # broadcast dims do
    assert _sig([(4, 4, 64)]).key != _sig([(4, 16, 64)]).key  # equal sizes do
    assert _sig([(4, 16, 64)], target="aten.view.default").key != _sig([(8, 16, 64)], target="aten.view.default").key
    assert hash(_sig([(4, 16, 64)])) == hash(_sig([(2, 8, 32)]))


# ----------------------------------------------------------------- the search


def test_candidates_respect_sizes_and_broadcasting():
    candidates = candidate_factors([(6, 12), (12, 18), (1, 18)])
    assert (0, None, None) in candidates and (1, 0, None) in candidates and (None, 1, 1) in candidates
    assert all(c[2] != 0 for c in candidates)  # the size-1 dim never carries a factor


def test_matmul_has_three_factors_and_linear_passes():
    rule = discover(np_call("np.matmul", [(8, 16), (16, 4)], [(8, 4)]), EXECUTOR)
    assert str(rule) == "ab,bc->ac | b:sum | pass 0:sum 1:sum"


def test_batched_matmul_has_four_factors():
    rule = discover(np_call("np.matmul", [(2, 8, 16), (2, 16, 4)], [(2, 8, 4)]), EXECUTOR)
    assert str(rule) == "abc,acd->abd | c:sum | pass 0:sum 1:sum"


def test_sum_over_a_dim_is_partial_and_linear():
    assert str(discover(np_call("np.sum0", [(6, 12)], [(12,)]), EXECUTOR)) == "ab->b | a:sum | pass 0:sum"


def test_cumsum_is_not_split_along_the_scanned_dim():
    rule = discover(np_call("np.cumsum1", [(6, 12)], [(6, 12)]), EXECUTOR)
    assert str(rule) == "a_->a_ | pass 0:sum"
    assert all(factor.inputs != (1,) for factor in rule.factors)


def test_softmax_is_not_split_along_its_dim():
    assert str(discover(np_call("np.softmax", [(6, 12)], [(6, 12)]), EXECUTOR)) == "a_->a_"


def test_layer_norm_keeps_the_normalized_dim_whole_for_every_output():
    rule = discover(np_call("np.layer_norm", [(4, 6, 12)], [(4, 6, 12), (4, 6, 1)]), EXECUTOR)
    assert str(rule) == "ab_->ab_,ab_"


def test_small_additive_constants_are_not_linear():
    rule = discover(np_call("np.shift", [(6, 12)], [(6, 12)]), EXECUTOR)
    assert "sum" not in str(rule) and "0:max" in str(rule)  # x + eps commutes with max, not with sum
    assert "0:sum" in str(discover(np_call("np.scale", [(6, 12)], [(6, 12)]), EXECUTOR))


def test_nondeterministic_ops_get_a_reason():
    with pytest.raises(NoRule, match="non-deterministic"):
        discover(np_call("np.random", [(6, 12)], [(6, 12)]), EXECUTOR)


def test_random_ops_get_the_elementwise_rule():
    rule = random_op_rule(np_call("np.random", [(6, 1, 12)], [(6, 1, 12)], tags=("random",)))
    assert rule == Rule.parse("a_b->a_b")


def test_no_tensor_inputs_is_a_reason():
    node = Node("n", MetaOp("np.zeros"), ((3,),), (), (Value("y", TensorSpec((3,), "float64")),))
    with pytest.raises(NoRule, match="no tensor inputs"):
        discover(OpCall(node, ()), EXECUTOR)


def test_config_demands_two_draws_and_two_shard_counts():
    with pytest.raises(ValueError):
        DiscoveryConfig(seeds=(0,))
    with pytest.raises(ValueError):
        DiscoveryConfig(shard_counts=(2,))


def test_core_imports_without_torch_or_jax():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['jax'] = None\n"
        "import metadist.shardcombine, metadist.shardcombine.api, metadist.shardcombine.verify\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
