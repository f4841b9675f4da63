"""Whether this rank's device computes in a precision policy's dtype: a clear error before anything runs."""

from __future__ import annotations

import torch

from ..ir import PrecisionPolicy
from .errors import RunInputError

__all__ = ["check_device_precision"]


def check_device_precision(policy: PrecisionPolicy, device: torch.device) -> None:
    """Refuse bfloat16 on a GPU without it (before compute capability 8.0, Ampere)."""
    if policy.param_dtype != "bfloat16" or device.type != "cuda":
        return
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return
    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    raise RunInputError(
        f"precision bf16: this GPU ({name}, compute capability {major}.{minor}) has no bfloat16 arithmetic (it needs "
        "8.0, Ampere, or newer). Train in fp16 with a GradScaler (--precision fp16, precision='fp16'), or in fp32"
    )
