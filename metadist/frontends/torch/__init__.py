"""The PyTorch frontend: capture a training step into MetaIR, and execute MetaIR ops with torch."""

from .capture import TorchStep, capture, capture_step
from .errors import CaptureError
from .execute import execute_graph, execute_node, resolve_op

__all__ = ["CaptureError", "TorchStep", "capture", "capture_step", "execute_graph", "execute_node", "resolve_op"]
