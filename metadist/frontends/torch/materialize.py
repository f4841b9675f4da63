"""Initialise a meta-device model one module at a time, with values that do not depend on the mesh.

A model built on the ``meta`` device has shapes and no values. MetaDist
defines its values by :func:`iter_materialized`: every module that directly
owns meta parameters or buffers (a *unit*) is initialised on its own, from
a generator seeded by ``(seed, the unit's qualified name)``:

1. the unit's own meta tensors are made real (uninitialised) on the CPU;
   every other tensor of the model stays on ``meta``, where writes cost
   nothing and change nothing;
2. the init of the unit runs, then the init of each ancestor up to the root,
   in that order (the post-order of ``nn.Module.apply``), so an ancestor's
   init that rewrites a child's tensor (GPT-2's scaled ``c_proj`` init) lands
   on the unit's tensors as it would in a whole-model init;
3. the unit's tensors are handed to the caller and the module gets its meta
   tensors back.

The init of a module is, in order of preference: the caller's ``init_fn``;
the HuggingFace root's ``_init_weights(module)`` for ``transformers`` models;
the unit's own ``reset_parameters()`` (ancestors add nothing). A unit with
meta tensors and none of these is an error that says how to fix it.

Because each unit's values depend only on the seed and the unit's name, a
single device that materialises the whole model (:func:`materialize`) and a
rank that keeps only its shards of each unit (the runtime) hold the same
values. Peak memory is the largest unit's tensors, not the model.

A parameter shared by several modules (tied embeddings) is initialised by
the first module that owns it, in ``named_modules`` order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from .errors import CaptureError

__all__ = ["MaterializedTensor", "MaterializeError", "has_meta_tensors", "iter_materialized", "materialize"]


class MaterializeError(CaptureError):
    """A meta-device model cannot be initialised; the message says what to change."""


@dataclass(frozen=True)
class MaterializedTensor:
    """One initialised parameter or buffer of a meta model, whole, on the CPU."""

    kind: str
    """``param`` or ``buffer``."""
    name: str
    """Its name in ``model.named_parameters()`` / ``model.named_buffers()``."""
    tensor: torch.Tensor


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` lives on the meta device."""
    return any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


def iter_materialized(
    model: nn.Module,
    *,
    seed: int = 0,
    init_fn: Callable[[nn.Module], None] | None = None,
    device: torch.device | str = "cpu",
) -> Iterator[MaterializedTensor]:
    """Yield every meta parameter and buffer of ``model`` initialised, one unit at a time.

    The model is left as it was (its tensors stay on ``meta``); each yielded
    tensor is the caller's to keep or to slice and drop. Tensors that are
    already real are not yielded.
    """
    modules = dict(model.named_modules())
    names = _canonical_names(model)
    done: set[int] = set()
    hf_init = _hf_init(model)
    for qualified, module in modules.items():
        own = _own_meta_tensors(module, done)
        if not own:
            continue
        init_chain = [module, *(_ancestors(qualified, modules))]
        if init_fn is None and hf_init is None and not hasattr(module, "reset_parameters"):
            listed = ", ".join(f"{qualified}.{name}" if qualified else name for _, name, _ in own)
            raise MaterializeError(
                f"module {qualified or '<root>'!r} ({type(module).__name__}) owns meta tensors ({listed}) and has no "
                "reset_parameters(); MetaDist cannot know their initial values. Give the module a "
                "reset_parameters(), pass init_fn=... (called as init_fn(module)), or build the model on a real device"
            )
        saved = {}
        for kind, name, tensor in own:
            real = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            saved[(kind, name)] = tensor
            if kind == "param":
                module._parameters[name] = nn.Parameter(real, requires_grad=tensor.requires_grad)
            else:
                module._buffers[name] = real
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(_unit_seed(seed, qualified))
                _run_inits(init_chain, module, init_fn, hf_init)
            results = []
            for kind, name, tensor in own:
                store = module._parameters if kind == "param" else module._buffers
                value = store[name].detach()
                full_name = names[(kind, id(tensor))]
                results.append(MaterializedTensor(kind, full_name, value))
                done.add(id(tensor))
        finally:
            for (kind, name), tensor in saved.items():
                (module._parameters if kind == "param" else module._buffers)[name] = tensor
        yield from results


def materialize(
    model: nn.Module,
    *,
    seed: int = 0,
    init_fn: Callable[[nn.Module], None] | None = None,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """Give every meta parameter and buffer of ``model`` its values, whole, on ``device`` (in place).

    The single-device counterpart of the runtime's shard-by-shard
    initialisation: both give the values of :func:`iter_materialized`. Tied
    parameters stay tied (one tensor). Returns ``model``.
    """
    values = {(item.kind, item.name): item.tensor for item in iter_materialized(model, seed=seed, init_fn=init_fn, device=device)}
    names = _canonical_names(model)
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in replaced:
                value = values[("param", names[("param", id(param))])]
                replaced[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
            module._parameters[name] = replaced[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device.type == "meta":
                module._buffers[name] = values[("buffer", names[("buffer", id(buffer))])]
    return model


def _canonical_names(model: nn.Module) -> dict[tuple[str, int], str]:
    """(kind, id(tensor)) -> the name ``named_parameters``/``named_buffers`` gives it (first owner wins)."""
    names = {("param", id(p)): n for n, p in model.named_parameters()}
    names.update({("buffer", id(b)): n for n, b in model.named_buffers()})
    return names


def _own_meta_tensors(module: nn.Module, done: set[int]) -> list[tuple[str, str, torch.Tensor]]:
    own = [("param", n, p) for n, p in module._parameters.items() if p is not None]
    own += [("buffer", n, b) for n, b in module._buffers.items() if b is not None]
    return [(kind, name, t) for kind, name, t in own if t.device.type == "meta" and id(t) not in done]


def _ancestors(qualified: str, modules: dict[str, nn.Module]) -> list[nn.Module]:
    """The module's ancestors, nearest first, the root last."""
    if not qualified:
        return []
    parts = qualified.split(".")
    return [modules[".".join(parts[:cut])] for cut in range(len(parts) - 1, -1, -1)]


def _hf_init(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """A ``transformers`` model's per-module init, or None for other models."""
    init = getattr(model, "_init_weights", None)
    return init if callable(init) and hasattr(model, "config") else None


def _run_inits(chain: list[nn.Module], unit: nn.Module, init_fn, hf_init) -> None:
    for module in chain:
        if init_fn is not None:
            init_fn(module)
        elif hf_init is not None:
            hf_init(module)
        elif module is unit:
            unit.reset_parameters()


def _unit_seed(seed: int, qualified: str) -> int:
    digest = hashlib.sha256(f"{seed}:{qualified}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
