"""What MetaIR states about data-dependent routing: the static dispatch of each experts layer.

A mixture-of-experts layer routes each token to ``k`` of ``E`` experts; how many tokens an expert
gets depends on the data. MetaIR has static shapes only, so a frontend captures such a layer as a
capacity-bounded dispatch (for PyTorch: ``metadist.frontends.torch.moe``) and records it here, one
:class:`ExpertRouting` per experts call, on ``Graph.routing``. The record is the stated
equivalence: with ``capacity >= group_tokens`` (dropless) the captured graph computes what the
model's own data-dependent code computes (up to rounding); with a smaller capacity, tokens past an
expert's capacity in their group lose that expert's share, and the record says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

__all__ = ["ExpertRouting", "computed_over_routed"]


@dataclass(frozen=True, kw_only=True)
class ExpertRouting:
    """How one experts layer was captured: its static dispatch, stated."""

    module: str
    """The experts module's qualified name in the model."""
    num_experts: int
    """``E``: experts of the layer (the dim expert parallelism splits)."""
    top_k: int
    """``k``: experts each token is routed to."""
    tokens: int
    """``T``: tokens the layer sees per step (global)."""
    groups: int
    """``G``: dispatch groups of consecutive tokens (``T = G * S``)."""
    group_tokens: int
    """``S``: tokens per group."""
    capacity: int
    """``C``: slots per expert and group; ``C >= S`` is dropless."""

    def __post_init__(self) -> None:
        if self.groups * self.group_tokens != self.tokens or min(self.num_experts, self.top_k, self.capacity) < 1:
            raise ValueError(f"inconsistent expert routing record {self}")

    @property
    def dropless(self) -> bool:
        """No token can be dropped: the captured layer equals the model's own (rounding aside)."""
        return self.capacity >= self.group_tokens

    def describe(self) -> str:
        mode = ("dropless" if self.dropless
                else f"capacity {self.capacity} of {self.group_tokens} per expert and group (tokens past it dropped)")
        return (f"{self.module}: {self.num_experts} experts, top-{self.top_k}, {self.tokens} tokens in "
                f"{self.groups} groups of {self.group_tokens}, {mode}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ExpertRouting":
        return cls(**data)


def computed_over_routed(records: Sequence[ExpertRouting]) -> float:
    """Token rows the static experts of ``records`` compute (``E * G * C`` each) over the rows their routing asks for
    (``T * k`` each): ``E / k`` when dropless, what the static shapes cost against a library that runs each expert on
    its own tokens."""
    return (sum(r.num_experts * r.groups * r.capacity for r in records)
            / sum(r.tokens * r.top_k for r in records))
