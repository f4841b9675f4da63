"""Call an ATen operator through torch's Python binding where that binding runs the very same call.

A rank module calls its local ops as ``torch.ops.aten.<op>.<overload>``. That goes through the dispatcher's boxed path
(the arguments are converted one by one against the schema), about 2 us a call on the development machine, where
the generated Python binding (``torch.mm``, ``torch.Tensor.view``) parses them in C++ and calls the unboxed kernel in
about 1.2 us. A step of a small model calls ~500-1,000 ops, so the difference is a few percent of it.

A binding is used for a node only when it provably makes the call the node makes: under a dispatch mode that records
what reaches the dispatcher, the binding and the overload are called on meta tensors of the node's argument types,
and both must record one call, of this overload, with the same arguments (the same tensors, equal numbers of the
same types) and the same keyword arguments. The answer depends on the argument types only (which Python overload
the binding's parser picks), so it is kept per operator and argument types. Random ops, ops without a tensor
argument (factories) and bindings written in Python are left as they are.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["binding_for"]

_VERIFIED: dict[tuple, Callable | None] = {}
"""Per (overload, argument types): the binding that makes the same call, or None."""


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def binding_for(target: Any, args: tuple, kwargs: dict) -> Callable | None:
    """A torch Python binding that makes the call ``target(*args, **kwargs)`` makes (same overload, same arguments);
    None when there is none or it cannot be shown. ``args`` and ``kwargs``: the node's values on one run."""
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in target.tags:
        return None
    key = (target, _kinds(args), tuple((name, _kinds((value,))) for name, value in sorted(kwargs.items())))
    if key not in _VERIFIED:
        _VERIFIED[key] = _verified(target, args, kwargs)
    return _VERIFIED[key]


def _kinds(values: Any) -> tuple:
    """What the binding's argument parser sees of each value: its type, and a tensor's dtype and dimensions."""
    kinds = []
    for value in values:
        if isinstance(value, torch.Tensor):
            kinds.append(("tensor", value.dtype, value.dim()))
        elif isinstance(value, (list, tuple)):
            kinds.append((type(value).__name__, _kinds(value)))
        else:
            kinds.append(type(value).__name__)
    return tuple(kinds)


def _candidates(target: torch._ops.OpOverload) -> list[Callable]:
    name = target._schema.name.split("::")[-1]
    found = []
    function = getattr(torch, name, None)
    if isinstance(function, types.BuiltinFunctionType) and function is getattr(torch._C._VariableFunctions, name, None):
        found.append(function)
    method = getattr(torch.Tensor, name, None)
    if isinstance(method, types.MethodDescriptorType):  # C methods only: Python ones add their own code
        found.append(method)
    return found


def _verified(target: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Callable | None:
    if not any(isinstance(value, torch.Tensor) for value in _flat((args, kwargs))):
        return None
    candidates = _candidates(target)
    if not candidates:
        return None
    try:
        meta_args, meta_kwargs = _on_meta(args), _on_meta(kwargs)
        want = _record(target, meta_args, meta_kwargs)
    except Exception:  # no meta kernel: the overload stays
        return None
    if len(want) != 1 or want[0][0] is not target:
        return None
    for candidate in candidates:
        try:
            got = _record(candidate, meta_args, meta_kwargs)
        except Exception:  # the parser takes no such arguments: not this binding
            continue
        if len(got) == 1 and got[0][0] is target and _same(got[0][1], want[0][1]) and _same_kwargs(got[0][2], want[0][2]):
            return candidate
    return None


def _record(function: Callable, args: tuple, kwargs: dict) -> list[tuple[Any, tuple, dict]]:
    with torch.no_grad(), _Recorder() as recorder:
        function(*args, **kwargs)
    return recorder.calls


def _on_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_on_meta(item) for item in value)
    if isinstance(value, dict):
        return {key: _on_meta(item) for key, item in value.items()}
    return value


def _flat(value: Any):
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flat(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flat(item)
    else:
        yield value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    return type(a) is type(b) and a == b


def _same_kwargs(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
