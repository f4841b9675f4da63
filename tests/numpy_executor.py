"""A ShardCombine executor over numpy functions, shared by the framework-free tests.

``NumpyExecutor(ops)`` runs ``ops[target](*inputs)`` (a list of outputs) in
float64, on sign-alternating draws away from zero.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from metadist.ir import TensorSpec
from metadist.shardcombine import OpCall


class NumpyExecutor:
    """The OpExecutor protocol for the numpy ops in ``ops`` (no shape-carrying arguments)."""

    framework = "numpy"
    framework_version = np.__version__

    def __init__(self, ops: Mapping[str, Callable[..., list]]) -> None:
        self.ops = ops

    def adapt(self, call: OpCall, shapes: Sequence[tuple[int, ...]]) -> OpCall:
        return OpCall(call.node, tuple(TensorSpec(tuple(s), spec.dtype) for s, spec in zip(shapes, call.input_specs)))

    def run(self, call: OpCall, inputs: Sequence[np.ndarray]) -> list[np.ndarray | None]:
        return self.ops[call.target](*inputs)

    def example_inputs(self, call: OpCall, rng: np.random.Generator, shapes) -> list[np.ndarray]:
        return [rng.choice([-1.0, 1.0], size=s) * rng.uniform(0.5, 1.5, size=s) for s in shapes]
