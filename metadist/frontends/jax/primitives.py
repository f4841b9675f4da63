"""JAX primitives by name: MetaOp targets and the registry that resolves them back.

A primitive ``p`` is named ``jax.lax.<p.name>`` in MetaIR (``jax.lax.dot_general``,
``jax.lax.scatter-add``). :func:`resolve_primitive` finds it again among the
primitives ``jax.extend.core.primitives`` and ``jax.lax`` export.
"""

from __future__ import annotations

import functools
from typing import Any

from .errors import JaxCaptureError

__all__ = ["PREFIX", "op_target", "op_tags", "resolve_primitive"]

PREFIX = "jax.lax."

#: Primitives that draw random numbers (their results depend on a key, not only on values).
#: ``threefry2x32`` is not one: it is a deterministic hash of its operands (keys and counters), so
#: ShardCombine checks its rule by execution like any elementwise op's. The typed-key primitives
#: (``random_bits``...) never reach a graph: the capture rewrites them onto key data (:mod:`.keys`).
RANDOM_PRIMITIVES = frozenset({"random_bits", "random_seed", "random_split", "random_fold_in",
                               "rng_uniform", "rng_bit_generator"})


def op_target(primitive: Any) -> str:
    """The MetaOp target of a primitive."""
    return PREFIX + primitive.name


def op_tags(primitive: Any) -> frozenset[str]:
    """MetaOp tags of a primitive (``random`` for random-number primitives)."""
    return frozenset({"random"}) if primitive.name in RANDOM_PRIMITIVES else frozenset()


@functools.lru_cache(maxsize=None)
def _registry() -> dict[str, Any]:
    import jax.extend.core
    import jax.extend.random
    from jax import lax
    from jax.extend.core import Primitive

    found: dict[str, Any] = {}
    for module in (jax.extend.core.primitives, lax, jax.extend.random):
        for attr in dir(module):
            value = getattr(module, attr, None)
            if isinstance(value, Primitive):
                found.setdefault(value.name, value)
    for primitive in _key_data_primitives():
        found.setdefault(primitive.name, primitive)
    return found


def _key_data_primitives() -> list[Any]:
    """Primitives of the threefry key-data functions (``iota_2x32_shape``), which no public module exports."""
    import jax
    import jax.extend.random
    import numpy as np

    impl = jax.extend.random.threefry_prng_impl
    closed = jax.make_jaxpr(lambda data: impl.random_bits(data, bit_width=32, shape=(2,)))(
        jax.ShapeDtypeStruct((2,), np.uint32))
    return [eqn.primitive for eqn in closed.jaxpr.eqns]


def resolve_primitive(target: str) -> Any:
    """The JAX primitive a MetaOp target names."""
    import jax

    if not target.startswith(PREFIX):
        raise JaxCaptureError(f"{target!r} is not a JAX op (JAX targets start with {PREFIX!r})")
    name = target.removeprefix(PREFIX)
    primitive = _registry().get(name)
    if primitive is None:
        raise JaxCaptureError(
            f"this JAX ({jax.__version__}) has no primitive {name!r} (from MetaOp {target!r}); the graph was "
            "captured with another JAX version: capture it again"
        )
    return primitive


def register_primitive(primitive: Any) -> None:
    """Make a primitive met during capture resolvable (one not exported by jax.lax)."""
    _registry().setdefault(primitive.name, primitive)
