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
RANDOM_PRIMITIVES = frozenset({"random_bits", "random_seed", "random_split", "random_fold_in", "threefry2x32",
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
    from jax import lax
    from jax.extend.core import Primitive

    found: dict[str, Any] = {}
    for module in (jax.extend.core.primitives, lax):
        for attr in dir(module):
            value = getattr(module, attr, None)
            if isinstance(value, Primitive):
                found.setdefault(value.name, value)
    return found


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
