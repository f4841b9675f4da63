"""A compiled step on CPU has glibc keep freed memory for reuse (runtime/host_memory.py), unless the user says not."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys

import pytest

from metadist.config import HOST_HEAP_ENV, settings_from_env


def test_the_host_heap_setting_is_read_and_checked():
    assert settings_from_env({}).host_heap == "keep"
    assert settings_from_env({HOST_HEAP_ENV: "system"}).host_heap == "system"
    assert settings_from_env({}).keeps_host_memory and not settings_from_env({HOST_HEAP_ENV: "system"}).keeps_host_memory
    with pytest.raises(ValueError, match="METADIST_HOST_HEAP='mmap': choose one of keep, system"):
        settings_from_env({HOST_HEAP_ENV: "mmap"})


def _is_glibc() -> bool:
    try:
        ctypes.CDLL(None).gnu_get_libc_version
    except (OSError, AttributeError):
        return False
    return platform.system() == "Linux"


@pytest.mark.skipif(not _is_glibc(), reason="mallopt's parameters are glibc's")
def test_glibc_serves_a_large_allocation_from_the_heap_once_the_setting_is_in_force():
    """With the setting, a 64 MiB block (past glibc's largest mmap threshold, 32 MiB) comes from the heap, and once
    freed the same block is handed out again; by default it is a mapping of its own, outside the heap."""
    script = """
import ctypes, sys
from metadist.runtime.host_memory import keep_freed_host_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def in_heap(address):
    for line in open('/proc/self/maps'):
        if line.rstrip().endswith('[heap]'):
            low, high = (int(part, 16) for part in line.split()[0].split('-'))
            if low <= address < high:
                return 1
    return 0
if sys.argv[1] == 'keep':
    assert keep_freed_host_memory() and keep_freed_host_memory()  # once per process; True again
first = libc.malloc(64 << 20)
heap = in_heap(first)
libc.free(first)
second = libc.malloc(64 << 20)
print(heap, int(first == second))
"""
    results = {}
    for mode in ("keep", "system"):
        done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        results[mode] = tuple(int(part) for part in done.stdout.split())
    assert results["keep"] == (1, 1)  # from the heap; the freed block reused
    assert results["system"][0] == 0  # glibc's default: a mapping of its own, unmapped when freed


@pytest.mark.skipif(not _is_glibc(), reason="mallopt's parameters are glibc's")
def test_the_bench_runs_every_method_with_the_same_host_heap():
    """The harness sets the host heap for its process before the first method is built (a compiled step sets it when
    it is built, so the methods timed alone before it ran with other allocator settings), records it with the machine,
    and leaves it alone under METADIST_HOST_HEAP=system."""
    script = """
import sys, types, torch
from metadist.bench import harness
assert harness.machine_info()["host_heap"] == "system"  # nothing set yet
harness.same_host_heap(types.SimpleNamespace(device=torch.device("cpu")))
print(harness.machine_info()["host_heap"])
"""
    import os

    found = {}
    for mode in ("keep", "system"):
        env = {**os.environ, HOST_HEAP_ENV: mode}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr
        found[mode] = done.stdout.split()[-1]
    assert found == {"keep": "kept", "system": "system"}
