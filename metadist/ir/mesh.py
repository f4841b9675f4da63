"""The logical device mesh: an N-D grid of devices with named axes."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


class MeshError(ValueError):
    """A mesh is malformed."""


@dataclass(frozen=True)
class Mesh:
    """An N-D device mesh. ``shape[i]`` devices lie along axis ``axis_names[i]``."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if not shape or not all(isinstance(size, int) and size >= 1 for size in shape):
            raise MeshError(f"a mesh shape is a non-empty tuple of positive ints, got {self.shape!r}")
        names = tuple(self.axis_names) or tuple(_default_axis_names(len(shape)))
        if len(names) != len(shape):
            raise MeshError(f"mesh shape {shape} has {len(shape)} axes but {len(names)} axis names {names}")
        if len(set(names)) != len(names):
            raise MeshError(f"mesh axis names must be distinct, got {names}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_index(self, name: str) -> int:
        try:
            return self.axis_names.index(name)
        except ValueError:
            raise MeshError(f"mesh has no axis {name!r}; its axes are {self.axis_names}") from None

    @staticmethod
    def parse(text: str) -> "Mesh":
        """Parse ``"8"``, ``"2x4"`` or ``"dp=2,tp=4"``."""
        text = text.strip()
        if "=" in text:
            names, sizes = [], []
            for part in text.split(","):
                name, _, size = part.partition("=")
                names.append(name.strip())
                sizes.append(_parse_size(size, text))
            return Mesh(tuple(sizes), tuple(names))
        return Mesh(tuple(_parse_size(part, text) for part in re.split(r"[x,]", text)))

    def __str__(self) -> str:
        return "x".join(str(size) for size in self.shape) + f" ({', '.join(self.axis_names)})"


def _parse_size(text: str, whole: str) -> int:
    try:
        size = int(text)
    except ValueError:
        raise MeshError(f"cannot parse mesh {whole!r}: write sizes like 8, 2x4, or dp=2,tp=4") from None
    if size < 1:
        raise MeshError(f"mesh {whole!r} has a non-positive axis size {size}")
    return size


def _default_axis_names(ndim: int) -> list[str]:
    return [f"axis{index}" for index in range(ndim)]
