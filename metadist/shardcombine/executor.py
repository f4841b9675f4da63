"""The seam between ShardCombine and a framework: how to run one op on numpy arrays.

ShardCombine never imports torch or jax. A frontend implements
:class:`OpExecutor` (PyTorch: ``metadist.frontends.torch.discovery.TorchExecutor``);
discovery hands it an :class:`OpCall` (a node with the specs of its tensor inputs)
and numpy arrays, possibly of other (stand-in or sliced) shapes than the node's.

Arrays of dtypes numpy lacks (bfloat16) travel as float32; the executor rounds
them to the real dtype on the way in and back, and tolerances follow the spec's
dtype, not the array's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from ..ir import Graph, Node, TensorSpec

__all__ = ["ExecutionRefused", "OpCall", "OpExecutor", "kept_dims", "op_call"]


class ExecutionRefused(RuntimeError):
    """The executor cannot run this op on these shapes (a shape-carrying argument has no rewrite)."""


@dataclass(frozen=True)
class OpCall:
    """One node together with the specs of its tensor inputs (``node.input_names`` order, repeats kept).

    The specs are the shapes the node's arguments were written for: an executor
    rewrites shape-carrying arguments (view sizes, split sizes...) relative to them.
    """

    node: Node
    input_specs: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_specs", tuple(self.input_specs))
        if len(self.input_specs) != len(self.node.input_names):
            raise ValueError(
                f"node {self.node.name!r} reads {len(self.node.input_names)} tensors, "
                f"got {len(self.input_specs)} input specs"
            )

    @property
    def target(self) -> str:
        return self.node.op.target

    @property
    def input_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(spec.shape for spec in self.input_specs)


def op_call(graph: Graph, node: Node) -> OpCall:
    """The :class:`OpCall` of a graph node, with its input specs read from the graph."""
    return OpCall(node, tuple(graph.value(name).spec for name in node.input_names))


@runtime_checkable
class OpExecutor(Protocol):
    """Runs single ops of one framework on numpy arrays.

    Optionally, an executor may define ``session()``, a context manager that
    discovery enters around each op's many small runs (the PyTorch executor
    runs kernels single-threaded there: several times faster for tiny shapes).
    It may also define ``kept_dims(call)`` (see :func:`kept_dims`): the input dims whose real
    sizes the op's arguments refer to, which stand-in shapes then keep.
    """

    framework: str
    """``"torch"`` or ``"jax"``: part of the rule database key."""
    framework_version: str
    """The framework's version: rules are stored per version."""

    def adapt(self, call: OpCall, shapes: Sequence[tuple[int, ...]]) -> OpCall:
        """The same op written for inputs of ``shapes``: shape-carrying arguments rewritten.

        Raises :class:`ExecutionRefused` where no rewrite expresses the op on these shapes.
        """
        ...

    def run(self, call: OpCall, inputs: Sequence[np.ndarray]) -> list[np.ndarray | None]:
        """Run the op with ``inputs`` in place of its tensor inputs; one entry per node output.

        ``inputs`` may have other shapes than ``call.input_specs``; the executor
        adapts shape-carrying arguments (as :meth:`adapt`) or raises
        :class:`ExecutionRefused`. Outputs the op does not produce are None.
        """
        ...

    def example_inputs(
        self, call: OpCall, rng: np.random.Generator, shapes: Sequence[tuple[int, ...]]
    ) -> list[np.ndarray]:
        """Draw inputs of ``shapes`` that no coincidence can pass.

        Floats with mixed signs and magnitudes away from 0 and 1; index-valued
        integers (embedding ids, gather indices, loss targets) inside their valid
        range; other integers small and mixed; bools mixed.
        """
        ...


def kept_dims(executor: OpExecutor, call: OpCall) -> tuple[tuple[int, ...], ...]:
    """Per tensor input, the dims whose real sizes the op's arguments refer to (empty: every dim may shrink).

    A slice ``[0:64]`` of a dim of 128 means something else on a dim of 18, and no rewrite of its
    bounds keeps the meaning; stand-in and fresh shapes keep such dims at their real size instead
    (:func:`metadist.shardcombine.shapes.standin_shapes_keeping`). Executors without the optional
    ``kept_dims`` method keep none.
    """
    method = getattr(executor, "kept_dims", None)
    kept = tuple(tuple(dims) for dims in method(call)) if method is not None else ()
    if kept and len(kept) != len(call.input_specs):
        raise ValueError(f"{type(executor).__name__}.kept_dims gave {len(kept)} entries for {len(call.input_specs)} inputs")
    return kept or tuple(() for _ in call.input_specs)
