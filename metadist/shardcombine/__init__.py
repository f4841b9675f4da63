"""ShardCombine: discover every op's SPMD rule by execution, with no hand-written per-op rules.

Framework-free (numpy only; a test imports it with torch and jax blocked). A
frontend supplies an :class:`OpExecutor` that runs single ops on numpy arrays.
"""

from .api import DiscoveryStats, GraphRules, RuleStore, graph_rules, signature_groups
from .combine import check_combine, close, infer_combine, recombine, tolerance_for
from .discover import DiscoveryConfig, NoRule, candidate_factors, discover, random_op_rule
from .executor import ExecutionRefused, OpCall, OpExecutor, op_call
from .signature import SHAPE_OPS, OpSignature, signature_of
from .verify import Mismatch, check_factor, check_partial_pass, split_inputs

__all__ = [
    "DiscoveryConfig",
    "DiscoveryStats",
    "ExecutionRefused",
    "GraphRules",
    "Mismatch",
    "NoRule",
    "OpCall",
    "OpExecutor",
    "OpSignature",
    "RuleStore",
    "SHAPE_OPS",
    "candidate_factors",
    "check_combine",
    "check_factor",
    "check_partial_pass",
    "close",
    "discover",
    "graph_rules",
    "infer_combine",
    "op_call",
    "random_op_rule",
    "recombine",
    "signature_groups",
    "signature_of",
    "split_inputs",
    "tolerance_for",
]
