"""Mixed precision policies: the dtypes a training step computes and reduces in.

A :class:`PrecisionPolicy` has the meaning of FSDP2's ``MixedPrecisionPolicy``: the parameters
(and the optimizer state) stay in their own dtype, float32 (the **master** copy), and are cast to
``param_dtype`` for the forward and backward computation, one cast per parameter per step, which
autograd's backward casts back (so each gradient reaches the optimizer in float32). Floating batch
leaves are cast too (``cast_forward_inputs``). Gradients are reduced across devices in
``reduce_dtype``: the solver refuses any plan that reduces a parameter's gradient in another dtype
(:mod:`metadist.solver.precision`). Where the cast of a parameter runs relative to its all-gather is the solver's
choice like any other: it may keep float32 master shards and gather the half-precision copies,
half the bytes.

``float16`` has 5 exponent bits: gradients below 2**-24 underflow to zero and those below 2**-14
lose precision, so a float16 step needs dynamic loss scaling (a ``torch.amp.GradScaler`` in the
step, which MetaDist captures, inf/NaN step skipping included). ``bfloat16`` has float32's range
and needs none.

Frozen, framework-free data: the frontends apply the policy at capture, the solver reads
``reduce_dtype``, the runtime checks the device supports ``param_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .graph import DTYPE_BYTES, IRError

__all__ = ["PRECISIONS", "PrecisionPolicy", "DTYPE_ALIASES", "dtype_from_text"]

PRECISIONS = ("fp32", "bf16", "fp16")
"""The policy names ``--precision`` and ``metadist.compile(precision=...)`` take."""

DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "f32": "float32", "f16": "float16"}
"""Short spellings of the MetaIR dtype names."""

_FLOATS = ("float32", "bfloat16", "float16")


def dtype_from_text(text: str) -> str:
    """``bf16`` / ``bfloat16`` -> ``bfloat16``; an error names the accepted spellings."""
    name = DTYPE_ALIASES.get(text, text)
    if name not in _FLOATS:
        raise IRError(f"{text!r} is not a training dtype; use one of fp32, bf16, fp16 (or float32, bfloat16, float16)")
    return name


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """What a step computes in and what its gradients are reduced in (FSDP2's MixedPrecisionPolicy)."""

    param_dtype: str | None = None
    """MetaIR dtype the floating parameters are cast to for computation (once per step; the cast's backward brings
    their gradients back to the parameters' own dtype); None computes in the parameters' dtype."""
    reduce_dtype: str | None = None
    """MetaIR dtype every reduction of a parameter's gradient across devices happens in; None leaves it to the solver
    (the cheapest: the computation dtype, before the cast back)."""
    cast_forward_inputs: bool = True
    """Cast floating batch leaves to ``param_dtype`` (integer leaves, token ids, stay as they are)."""

    def __post_init__(self) -> None:
        for field_name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, field_name)
            if value is not None and value not in DTYPE_BYTES:
                raise IRError(f"PrecisionPolicy.{field_name}={value!r} is not a MetaIR dtype")

    @staticmethod
    def named(name: str, reduce_dtype: str | None = "default") -> "PrecisionPolicy":
        """The policy ``fp32``, ``bf16`` or ``fp16``. Mixed policies reduce in float32 by default (torchtitan's
        choice); ``reduce_dtype`` overrides it (``bf16`` halves the gradient bytes)."""
        if name not in PRECISIONS:
            raise IRError(f"precision {name!r}: choose one of {', '.join(PRECISIONS)}")
        if name == "fp32":
            reduce = None if reduce_dtype in ("default", None) else dtype_from_text(reduce_dtype)
            return PrecisionPolicy(reduce_dtype=reduce)
        reduce = "float32" if reduce_dtype == "default" else (None if reduce_dtype is None else dtype_from_text(reduce_dtype))
        return PrecisionPolicy(param_dtype=DTYPE_ALIASES[name], reduce_dtype=reduce)

    @property
    def name(self) -> str:
        """``fp32``, ``bf16`` or ``fp16`` after the compute dtype (``fp32`` when nothing is cast)."""
        short = {value: key for key, value in DTYPE_ALIASES.items() if key in PRECISIONS}
        return short.get(self.param_dtype or "float32", self.param_dtype or "float32")

    @property
    def is_mixed(self) -> bool:
        return self.param_dtype is not None and self.param_dtype != "float32"

    @property
    def needs_loss_scaling(self) -> bool:
        """float16 computation: gradients underflow without a loss scale."""
        return self.param_dtype == "float16"

    def describe(self) -> str:
        compute = self.param_dtype or "the parameters' dtype"
        reduce = self.reduce_dtype or "the solver's choice"
        return f"{self.name}: compute in {compute}, float32 master weights and optimizer state, gradient reductions in {reduce}"

    def to_dict(self) -> dict:
        return {"param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype, "cast_forward_inputs": self.cast_forward_inputs}


FP32 = PrecisionPolicy()
