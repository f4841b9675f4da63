"""MetaIR: the framework-free graph, placements, rules and meshes.

This package imports neither torch nor jax; a test proves it.
"""

from .graph import (
    DTYPE_BYTES,
    STATE_ROLES,
    Arg,
    Graph,
    GraphInput,
    GraphOutput,
    IRError,
    Literal,
    MetaOp,
    Node,
    Role,
    TensorSpec,
    Value,
    ValueRef,
)
from .mesh import Mesh, MeshError
from .routing import ExpertRouting
from .precision import PRECISIONS, PrecisionPolicy, dtype_from_text
from .placement import Partial, Placement, PlacementError, Replicate, Shard, format_sharding, parse_placement, parse_sharding
from .rule import RULE_FORMAT_VERSION, Combine, Concat, Factor, Identity, PartialPass, Reduce, Rule, RuleError, parse_rule
from .serialize import GRAPH_FORMAT_VERSION, graph_from_dict, graph_from_json, graph_to_dict, graph_to_json

__all__ = [name for name in dir() if not name.startswith("_")]
