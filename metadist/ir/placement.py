"""Placements and shardings: how one tensor lies on a mesh.

A placement says how a tensor lies on ONE mesh axis (the DTensor convention):
``Shard(dim)``, ``Replicate()`` or ``Partial(op)``. A sharding is a tuple of
placements, one per mesh axis. All are frozen, hashable, print and parse.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Union

REDUCE_OPS = ("sum", "max", "min")


class PlacementError(ValueError):
    """A placement or sharding is malformed."""


@dataclass(frozen=True)
class Shard:
    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise PlacementError(f"Shard.dim must be a non-negative int (a tensor dim), got {self.dim!r}")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in REDUCE_OPS:
            raise PlacementError(f"Partial.op must be one of {REDUCE_OPS}, got {self.op!r}")

    def __str__(self) -> str:
        return f"P({self.op})"


Placement = Union[Shard, Replicate, Partial]
Sharding = tuple  # tuple[Placement, ...], one per mesh axis

_PLACEMENT_RE = re.compile(r"^\s*(?:S\((\d+)\)|R|P\((sum|max|min)\))\s*$")


def parse_placement(text: str) -> Placement:
    match = _PLACEMENT_RE.match(text)
    if not match:
        raise PlacementError(f"cannot parse placement {text!r}; write S(dim), R or P(sum|max|min)")
    if match.group(1) is not None:
        return Shard(int(match.group(1)))
    if match.group(2) is not None:
        return Partial(match.group(2))
    return Replicate()


def format_sharding(sharding: tuple[Placement, ...]) -> str:
    return _format_sharding(tuple(sharding))


@functools.lru_cache(maxsize=4096)  # a plan of thousands of nodes writes a few dozen distinct shardings
def _format_sharding(sharding: tuple[Placement, ...]) -> str:
    return "(" + ", ".join(str(placement) for placement in sharding) + ")"


@functools.lru_cache(maxsize=4096)  # and reads them back: placements are frozen, so one parse serves every copy
def parse_sharding(text: str) -> tuple[Placement, ...]:
    body = text.strip()
    if not (body.startswith("(") and body.endswith(")")):
        raise PlacementError(f"cannot parse sharding {text!r}; write e.g. (S(0), R)")
    inner = body[1:-1].strip()
    if not inner:
        return ()
    return tuple(parse_placement(part) for part in re.split(r",\s*(?![^()]*\))", inner))


def placement_to_json(placement: Placement) -> str:
    return str(placement)


def placement_from_json(text: str) -> Placement:
    return parse_placement(text)
