"""Load a workload from a spec: a built-in name or ``path/to/file.py[:function]``.

A model file is imported by path (its folder is on ``sys.path`` while it runs, so it may import
its neighbours); the function (default ``workload``) is called with no arguments and must return
a :class:`metadist.workload.Workload`. Every failure is a :class:`WorkloadError` that names the
file and says what to change; an exception raised by the user's code is chained to it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

from ..workload import Workload, WorkloadError
from .builtin import BUILTINS, builtin_workload, unknown_builtin_message
from .zoo import PREFIX as ZOO_PREFIX

DEFAULT_FUNCTION = "workload"
"""The function a model file is asked for when the spec names none."""


def load_workload(spec: str) -> Workload:
    """The workload ``spec`` names: a built-in (see ``BUILTIN_NAMES``) or ``path/to/file.py[:function]``."""
    if spec in BUILTINS:
        return builtin_workload(spec)
    if spec.startswith(ZOO_PREFIX):
        from .zoo import zoo_workload

        return zoo_workload(spec)
    if spec.startswith("jax-"):
        from .jax_builtin import jax_builtin_workload  # imports no jax until the workload is built

        return jax_builtin_workload(spec)
    path, function = parse_spec(spec)
    if path.suffix != ".py" and not path.exists():
        raise WorkloadError(unknown_builtin_message(spec))
    if not path.is_file():
        why = "is a folder" if path.is_dir() else "does not exist"
        raise WorkloadError(
            f"model file {str(path)!r} {why} (looked in {str(path.resolve().parent)!r}); "
            "pass the path of a Python file, as path/to/file.py[:function], or a built-in name"
        )
    module = _import_file(path)
    return _call_workload_function(module, path, function)


def parse_spec(spec: str) -> tuple[Path, str]:
    """Split ``path/to/file.py[:function]`` into the path and the function name."""
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isidentifier() and head:
        return Path(head), tail
    if sep and head.endswith(".py"):
        raise WorkloadError(
            f"{tail!r} in {spec!r} is not a Python function name; write path/to/file.py:function_name"
        )
    return Path(spec), DEFAULT_FUNCTION


def _import_file(path: Path) -> ModuleType:
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    module_name = f"metadist_workload_{resolved.stem}_{digest}"
    import_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if import_spec is None or import_spec.loader is None:
        raise WorkloadError(f"cannot import model file {str(path)!r}: Python has no loader for it; name it *.py")
    module = importlib.util.module_from_spec(import_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up here
    folder = str(resolved.parent)
    sys.path.insert(0, folder)
    try:
        import_spec.loader.exec_module(module)
    except BaseException as err:
        sys.modules.pop(module_name, None)
        if not isinstance(err, Exception):
            raise  # KeyboardInterrupt, SystemExit: not the file's fault to report
        raise WorkloadError(
            f"importing model file {str(path)!r} raised {type(err).__name__}: {err}; "
            "fix the file (the chained exception above shows where)"
        ) from err
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module


def _call_workload_function(module: ModuleType, path: Path, function: str) -> Workload:
    target = getattr(module, function, None)
    if target is None:
        defined = sorted(
            name for name, value in vars(module).items()
            if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_")
        )
        listing = ", ".join(defined) if defined else "none"
        raise WorkloadError(
            f"model file {str(path)!r} has no function {function!r}; functions it defines: {listing}. "
            f"Define {function}() returning metadist.Workload, or name another as {path}:function"
        )
    if not callable(target):
        raise WorkloadError(
            f"{function!r} in model file {str(path)!r} is a {type(target).__name__}, not a function; "
            f"define def {function}() -> metadist.Workload"
        )
    try:
        result = target()
    except Exception as err:
        raise WorkloadError(
            f"{function}() in model file {str(path)!r} raised {type(err).__name__}: {err}; "
            "fix the function (the chained exception above shows where)"
        ) from err
    if not isinstance(result, (Workload, _jax_workload_type())):
        hint = " (did it forget to return?)" if result is None else ""
        raise WorkloadError(
            f"{function}() in model file {str(path)!r} returned {type(result).__name__}{hint}, not a Workload; "
            "return metadist.Workload(model=..., batch=..., loss_fn=..., optimizer=...) "
            "(or, for JAX, metadist.frontends.jax.JaxWorkload(params=..., batch=..., loss_fn=..., optimizer=...))"
        )
    if not result.name:
        result = dataclasses.replace(result, name=f"{path.stem}:{function}")
    return result


def _jax_workload_type() -> type:
    """The JAX workload class (its module imports no jax)."""
    from ..frontends.jax.workload import JaxWorkload

    return JaxWorkload
