"""MetaDist: automatic parallelism for ordinary training steps.

The public API is a thin facade. Importing ``metadist`` imports no framework:
``metadist.capture`` and friends load the PyTorch frontend on first use.
"""

from __future__ import annotations

from typing import Any

from .ir import Graph, Mesh, PrecisionPolicy, Role
from .workload import Workload, WorkloadError

__version__ = "0.1.0"

_LAZY = {
    "capture": ("metadist.frontends.torch.capture", "capture"),
    "CaptureError": ("metadist.frontends.torch.errors", "CaptureError"),
    "load_workload": ("metadist.workloads", "load_workload"),
    "builtin_workload": ("metadist.workloads", "builtin_workload"),
    "compile": ("metadist.api", "compile"),
    "plan": ("metadist.api", "plan"),
    "CompileOptions": ("metadist.api", "CompileOptions"),
    "Plan": ("metadist.ir.plan", "Plan"),
    "materialize": ("metadist.frontends.torch.materialize", "materialize"),
    "Checkpointer": ("metadist.runtime.checkpointer", "Checkpointer"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'metadist' has no attribute {name!r}")


__all__ = ["Graph", "Mesh", "PrecisionPolicy", "Role", "Workload", "WorkloadError", "__version__", *_LAZY]
