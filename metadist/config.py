"""Settings read from the environment, in one place (docs/design.md, "Layering").

Code deep inside MetaDist never reads ``os.environ``: the entry points call
:func:`settings_from_env` once and pass the frozen :class:`Settings` down.

Environment variables:

``METADIST_CACHE_DIR``
    Folder for MetaDist's persistent caches (the rule database ``rules.sqlite``).
    Default: the user's cache folder, ``platformdirs.user_cache_dir("metadist")``.

``METADIST_CPU_CLUSTER``
    The cost model's cluster when a CPU run or benchmark names none: ``calibrated`` (default: this
    machine as measured and cached by :func:`metadist.cost.calibrate.machine_cluster`), or a preset
    name or cluster JSON file (the test suite sets ``cpu-gloo`` so that its plans do not depend on
    the machine).

``METADIST_HOST_HEAP``
    ``keep`` (default): a compiled step on CPU has glibc keep freed memory for reuse instead of returning
    it to the system (:func:`metadist.runtime.host_memory.keep_freed_host_memory`); ``system`` leaves the
    C library's settings as they are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

__all__ = ["CACHE_DIR_ENV", "CPU_CLUSTER_ENV", "CALIBRATED", "HOST_HEAP_ENV", "HOST_HEAPS", "Settings", "settings_from_env"]

CACHE_DIR_ENV = "METADIST_CACHE_DIR"
"""The environment variable that overrides :attr:`Settings.cache_dir`."""
CPU_CLUSTER_ENV = "METADIST_CPU_CLUSTER"
"""The environment variable that overrides :attr:`Settings.cpu_cluster`."""
CALIBRATED = "calibrated"
"""``cpu_cluster`` value: this machine, calibrated on first use and cached."""
HOST_HEAP_ENV = "METADIST_HOST_HEAP"
"""The environment variable that overrides :attr:`Settings.host_heap`."""
HOST_HEAPS = ("keep", "system")
"""``host_heap`` values."""


@dataclass(frozen=True, kw_only=True)
class Settings:
    """MetaDist's process-wide settings, as read from the environment."""

    cache_dir: Path
    """Folder of the persistent caches; the rule database is ``cache_dir / "rules.sqlite"``."""
    cpu_cluster: str = CALIBRATED
    """The cost model's cluster for CPU runs that name none: ``calibrated``, a preset or a cluster JSON file."""
    host_heap: str = "keep"
    """``keep``: a compiled step on CPU keeps freed host memory for reuse; ``system``: the C library's defaults."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        if self.host_heap not in HOST_HEAPS:
            raise ValueError(f"{HOST_HEAP_ENV}={self.host_heap!r}: choose one of {', '.join(HOST_HEAPS)}")

    @property
    def keeps_host_memory(self) -> bool:
        """Whether a compiled step on CPU has the C library keep freed memory for reuse (``host_heap == "keep"``)."""
        return self.host_heap == "keep"

    @property
    def rule_db_path(self) -> Path:
        """Where the rule database lives unless a path is given explicitly (``--db PATH``)."""
        return self.cache_dir / "rules.sqlite"


def settings_from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """Read the settings from ``environ`` (default: ``os.environ``). The only reader of MetaDist's variables."""
    env = os.environ if environ is None else environ
    cache_dir = env.get(CACHE_DIR_ENV, "").strip()
    if not cache_dir:
        import platformdirs

        cache_dir = platformdirs.user_cache_dir("metadist")
    return Settings(cache_dir=Path(cache_dir), cpu_cluster=env.get(CPU_CLUSTER_ENV, "").strip() or CALIBRATED,
                    host_heap=env.get(HOST_HEAP_ENV, "").strip() or "keep")


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the system reports one (Linux), else the CPU count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
