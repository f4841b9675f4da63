"""Typed PRNG keys in a captured step, rewritten onto their raw ``uint32`` key data.

MetaIR tensors have numpy dtypes; a typed key (``key<fry>[]`` from
``jax.random.key``, or the ``random_wrap`` that ``jax.random.bernoulli`` puts
around a raw ``PRNGKey``) has none. The capture therefore carries every key
as its key data (shape ``key_shape + impl.key_shape``, e.g. ``(..., 2)``
``uint32`` for threefry) and rewrites each equation that touches keys:

- ``random_wrap``/``random_unwrap``/``random_clone``: the key data itself, no node;
- ``random_bits``/``random_split``/``random_fold_in``/``random_seed``: the key
  implementation's own function on key data (``impl.random_bits``...), traced
  and inlined, so the graph holds ``threefry2x32``, ``iota_2x32_shape``, shifts
  and bit casts: deterministic functions of their operands, whose rules
  ShardCombine discovers by execution like any other op's;
- any other primitive on keys (``slice``, ``squeeze``, ``broadcast_in_dim``,
  ``concatenate``, ``select_n``...): the same primitive ``vmap``-ed over the
  trailing key-data dims, so JAX's own batching rules write its key-data form.

The numbers drawn are those of the single-device step, bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .errors import JaxCaptureError

if TYPE_CHECKING:
    from .capture import _GraphBuilder

__all__ = ["is_key", "key_data_aval", "rewrite_key_equation", "touches_keys"]

#: Key primitives that only change a key's type: the key data passes through.
_PASS_THROUGH = frozenset({"random_wrap", "random_unwrap", "random_clone"})


def is_key(aval: Any) -> bool:
    """Whether an abstract value is a typed PRNG key array."""
    import jax

    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def touches_keys(eqn: Any) -> bool:
    """Whether an equation reads or writes a typed key."""
    return any(is_key(var.aval) for var in (*eqn.invars, *eqn.outvars))


def key_impl(aval: Any, where: str) -> Any:
    """The PRNG implementation (threefry, rbg...) of a typed key's dtype."""
    impl = getattr(aval.dtype, "_impl", None)
    if impl is None or not hasattr(impl, "key_shape"):
        raise JaxCaptureError(f"{where}: the key dtype {aval.dtype} does not name its PRNG implementation in this "
                              "JAX version; pass raw uint32 keys (jax.random.key_data) instead of typed keys")
    return impl


def key_data_aval(aval: Any, where: str = "a typed key") -> Any:
    """The abstract value of a key array's key data (other avals unchanged)."""
    import jax
    import numpy as np

    if not is_key(aval):
        return aval
    impl = key_impl(aval, where)
    return jax.ShapeDtypeStruct(tuple(aval.shape) + tuple(impl.key_shape), np.dtype("uint32"))


def rewrite_key_equation(builder: "_GraphBuilder", eqn: Any) -> None:
    """Emit ``eqn`` (which reads or writes typed keys) as operations on key data."""
    name = eqn.primitive.name
    where = f"equation {name}"
    if name in _PASS_THROUGH:
        builder.env[eqn.outvars[0]] = builder.read_raw(eqn.invars[0])
        return
    operands = [builder.read(var) for var in eqn.invars]
    function = _KEY_PRIMITIVES.get(name, _vmapped_over_key_data)(eqn, where)
    results = builder.trace_inline(function, operands)
    for var, result in zip(eqn.outvars, results):
        builder.env[var] = result


def _batched(function: Callable, batch_dims: int) -> Callable:
    """``function`` of one key mapped over ``batch_dims`` leading dims of key arrays."""
    import jax

    for _ in range(batch_dims):
        function = jax.vmap(function)
    return function


def _random_bits(eqn: Any, where: str) -> Callable:
    aval = eqn.invars[0].aval
    impl, bit_width, shape = key_impl(aval, where), eqn.params["bit_width"], tuple(eqn.params["shape"])
    bits = _batched(lambda data: impl.random_bits(data, bit_width=bit_width, shape=shape), len(aval.shape))
    return lambda data: [bits(data)]


def _random_split(eqn: Any, where: str) -> Callable:
    aval = eqn.invars[0].aval
    impl, shape = key_impl(aval, where), tuple(eqn.params["shape"])
    split = _batched(lambda data: impl.split(data, shape), len(aval.shape))
    return lambda data: [split(data)]


def _random_fold_in(eqn: Any, where: str) -> Callable:
    aval = eqn.invars[0].aval
    impl = key_impl(aval, where)
    fold_in = _batched(lambda data, message: impl.fold_in(data, message), len(aval.shape))
    return lambda data, message: [fold_in(data, message)]


def _random_seed(eqn: Any, where: str) -> Callable:
    impl = eqn.params.get("impl")
    if impl is None or not hasattr(impl, "seed"):
        raise JaxCaptureError(f"{where}: random_seed carries no PRNG implementation; pass raw uint32 keys instead")
    seed = _batched(impl.seed, len(eqn.invars[0].aval.shape))
    return lambda seeds: [seed(seeds)]


def _vmapped_over_key_data(eqn: Any, where: str) -> Callable:
    """Any other primitive on keys: vmap it over the trailing key-data dims of its key operands."""
    import jax

    primitive, params = eqn.primitive, dict(eqn.params)
    key_avals = [var.aval for var in (*eqn.invars, *eqn.outvars) if is_key(var.aval)]
    if not all(is_key(var.aval) for var in eqn.outvars):
        raise JaxCaptureError(
            f"{where} turns typed PRNG keys into non-key values, which MetaDist cannot rewrite onto key data; "
            "use jax.random.key_data(key) and work on the raw uint32 data instead"
        )
    data_dims = len(key_impl(key_avals[0], where).key_shape)
    in_axes = tuple(-1 if is_key(var.aval) else None for var in eqn.invars)

    def logical(*operands: Any) -> list[Any]:
        result = primitive.bind(*operands, **params)
        return list(result) if primitive.multiple_results else [result]

    function = logical
    for _ in range(data_dims):
        function = jax.vmap(function, in_axes=in_axes, out_axes=-1)
    return function


_KEY_PRIMITIVES: dict[str, Callable[[Any, str], Callable]] = {
    "random_bits": _random_bits,
    "random_split": _random_split,
    "random_fold_in": _random_fold_in,
    "random_seed": _random_seed,
}
