"""Helpers shared by subcommands."""

from __future__ import annotations

__all__ = ["human_bytes", "human_count"]


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def human_count(count: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(count) >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(int(count))
