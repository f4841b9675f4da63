"""Workloads for the CLI and the benchmarks: built-in models and user model files.

``load_workload("gpt2-small")`` builds a built-in; ``load_workload("path/to/file.py[:function]")``
imports a model file and calls its function (default ``workload``). Built-ins are
random-initialised from configs (nothing is downloaded); large ones live on the meta device.
"""

from __future__ import annotations

from .builtin import BUILTIN_NAMES, builtin_workload
from .loader import load_workload

__all__ = ["BUILTIN_NAMES", "builtin_workload", "load_workload"]
