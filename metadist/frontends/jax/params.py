"""Encode a JAX equation's params as MetaIR arguments, and decode them back.

MetaIR arguments are plain data (ints, floats, bools, strings, tuples,
:class:`~metadist.ir.Literal`). A jaxpr equation's params map onto them so:

==========================================  =============================================
param                                       MetaIR argument
==========================================  =============================================
None, bool, int, float, str, tuple          itself (numpy scalars become Python scalars)
a dtype                                     ``Literal("dtype", "float32")``
an enum member (``GatherScatterMode``...)   ``Literal("jax.enum.GatherScatterMode", "FILL_OR_DROP")``
a NamedTuple of plain data                  ``Literal("jax.struct", "GatherDimensionNumbers(offset_dims=(1,), ...)")``
a scatter's ``update_jaxpr``/``consts``     dropped; rebuilt from the primitive on decode
==========================================  =============================================

A jaxpr literal operand (a scalar such as ``2.0:f32[]``) is a non-tensor
argument ``Literal("jax.scalar", "float32:2.0")``. Anything else (a callable,
a nested jaxpr that was not inlined) raises :class:`JaxCaptureError`.
Decoding only ever builds classes from a fixed registry: no ``eval``.
"""

from __future__ import annotations

import ast
import enum
import functools
from typing import Any, Mapping

import numpy as np

from ...ir import Literal
from .errors import JaxCaptureError

__all__ = ["decode_param", "decode_params", "encode_param", "encode_scalar", "decode_scalar", "DTYPE_KIND"]

DTYPE_KIND = "dtype"
ENUM_KIND = "jax.enum."
STRUCT_KIND = "jax.struct"
SCALAR_KIND = "jax.scalar"

#: Scatter primitives whose ``update_jaxpr`` is a fixed reduction, rebuilt on decode.
SCATTER_COMBINERS = {"scatter-add": "add", "scatter-mul": "mul", "scatter-min": "min", "scatter-max": "max", "scatter": None}
_DROPPED = ("update_jaxpr", "update_consts")


def dtype_name(dtype: Any) -> str:
    """The MetaIR name of a JAX/numpy dtype (``float32``, ``bfloat16``...)."""
    return np.dtype(dtype).name


def encode_param(value: Any, where: str) -> Any:
    """One equation param as a MetaIR argument; ``where`` names it in errors."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, enum.Enum):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.dtype):
        return Literal(DTYPE_KIND, dtype_name(value))
    if isinstance(value, enum.Enum):
        _check_enum(type(value), where)
        return Literal(ENUM_KIND + type(value).__name__, value.name)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return Literal(STRUCT_KIND, _struct_text(value, where))
    if isinstance(value, (tuple, list)):
        return tuple(encode_param(item, where) for item in value)
    raise JaxCaptureError(
        f"{where} is a {type(value).__name__} ({_short(value)}), which MetaIR cannot represent as data. "
        "MetaDist captures jaxprs whose params are scalars, tuples, dtypes, enums and NamedTuples of these; "
        "control flow (cond, while) and opaque callables are not supported yet: rewrite the step without them"
    )


def decode_param(arg: Any) -> Any:
    """The JAX value of one encoded param."""
    if isinstance(arg, Literal):
        if arg.kind == DTYPE_KIND:
            return np.dtype(arg.value)
        if arg.kind.startswith(ENUM_KIND):
            return _enum_classes()[arg.kind.removeprefix(ENUM_KIND)][arg.value]
        if arg.kind == STRUCT_KIND:
            return _parse_struct(arg.value)
        if arg.kind == SCALAR_KIND:
            return decode_scalar(arg)
        raise JaxCaptureError(f"the JAX frontend cannot decode the literal {arg}; it was not made by this frontend")
    if isinstance(arg, tuple):
        return tuple(decode_param(item) for item in arg)
    return arg


def decode_params(primitive_name: str, kwargs: tuple[tuple[str, Any], ...], operand_dtypes: tuple[Any, ...]) -> dict[str, Any]:
    """A node's kwargs as ``bind`` params, rebuilding what encoding dropped."""
    params = {key: decode_param(arg) for key, arg in kwargs}
    if primitive_name in SCATTER_COMBINERS:
        params["update_jaxpr"], params["update_consts"] = _scatter_update(primitive_name, operand_dtypes[0])
    return params


def encode_params(primitive_name: str, params: Mapping[str, Any], where: str) -> tuple[tuple[str, Any], ...]:
    """An equation's params as MetaIR kwargs (sorted by name, so the text form is stable)."""
    encoded = []
    for key in sorted(params):
        if primitive_name in SCATTER_COMBINERS and key in _DROPPED:
            continue
        encoded.append((key, encode_param(params[key], f"{where} param {key!r}")))
    return tuple(encoded)


def encode_scalar(value: Any, dtype: Any) -> Literal:
    """A jaxpr literal operand (a scalar of ``dtype``) as a MetaIR literal."""
    array = np.asarray(value, dtype=dtype)
    if array.ndim != 0:
        raise JaxCaptureError(f"internal: a jaxpr literal of shape {array.shape} is not a scalar")
    return Literal(SCALAR_KIND, f"{dtype_name(array.dtype)}:{array.item()!r}")


def decode_scalar(literal: Literal) -> np.ndarray:
    """The 0-d array a ``jax.scalar`` literal stands for."""
    dtype, _, text = literal.value.partition(":")
    value = ast.literal_eval(text) if text not in ("inf", "-inf", "nan") else float(text)
    return np.asarray(value, dtype=np.dtype(dtype))


# -- registries and helpers --------------------------------------------------


@functools.lru_cache(maxsize=None)
def _enum_classes() -> dict[str, type]:
    from jax import lax

    names = ("GatherScatterMode", "Precision", "RoundingMethod", "DotAlgorithmPreset", "AccuracyMode", "FftType",
             "RandomAlgorithm")
    return {name: getattr(lax, name) for name in names if isinstance(getattr(lax, name, None), type)}


@functools.lru_cache(maxsize=None)
def _struct_classes() -> dict[str, type]:
    from jax import lax

    classes = [lax.GatherDimensionNumbers, lax.ScatterDimensionNumbers, lax.ConvDimensionNumbers]
    return {cls.__name__: cls for cls in classes}


def _check_enum(cls: type, where: str) -> None:
    if cls.__name__ not in _enum_classes():
        raise JaxCaptureError(
            f"{where} is a {cls.__name__} enum, which the JAX frontend does not know how to decode; "
            "add it to metadist.frontends.jax.params._enum_classes"
        )


def _struct_text(value: tuple, where: str) -> str:
    cls = type(value)
    if cls.__name__ not in _struct_classes():
        raise JaxCaptureError(
            f"{where} is a {cls.__name__}, which the JAX frontend does not know how to decode; "
            "add it to metadist.frontends.jax.params._struct_classes"
        )
    fields = []
    for name in value._fields:
        item = getattr(value, name)
        text = repr(item)
        if ast.literal_eval(text) != item:
            raise JaxCaptureError(f"{where}: field {name} of {cls.__name__} ({item!r}) has no literal text form")
        fields.append(f"{name}={text}")
    return f"{cls.__name__}({', '.join(fields)})"


def _parse_struct(text: str) -> Any:
    try:
        call = ast.parse(text, mode="eval").body
    except SyntaxError as err:
        raise JaxCaptureError(f"cannot parse the JAX struct literal {text!r}") from err
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args):
        raise JaxCaptureError(f"the JAX struct literal {text!r} is not of the form Name(field=value, ...)")
    cls = _struct_classes().get(call.func.id)
    if cls is None:
        raise JaxCaptureError(f"the JAX struct literal {text!r} names an unknown class {call.func.id!r}")
    return cls(**{keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords})


@functools.lru_cache(maxsize=None)
def _scatter_update(primitive_name: str, dtype: Any) -> tuple[Any, tuple]:
    """The ``update_jaxpr`` a scatter primitive carries: its combiner on two scalars."""
    import jax
    from jax import lax

    combiner = SCATTER_COMBINERS[primitive_name]
    if combiner is None:
        return None, ()
    scalar = jax.ShapeDtypeStruct((), dtype)
    function = {"add": lax.add, "mul": lax.mul, "min": lax.min, "max": lax.max}[combiner]
    closed = jax.make_jaxpr(function)(scalar, scalar)
    return closed.jaxpr, tuple(closed.consts)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
