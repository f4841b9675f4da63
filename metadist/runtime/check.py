"""Check mode: the same K steps on one device and distributed, compared tensor by tensor.

Tolerances (fp32): ``|distributed - single| <= atol + rtol * |single|`` with
``rtol = 1e-4`` and ``atol = 1e-5``. A distributed step sums in another order
(partial sums per shard, then an all-reduce), so each reduction differs by a
few ulps (about 1e-7 relative), and the differences grow through a few steps.
Measured on the tiny built-ins (3 steps, 2 and 2x2 meshes): gradients differ
by at most 3.5e-7 absolute, updated state by at most 6e-6, both inside the
bound, while a wrong shard, a missing reduction or a mask drawn differently
is off by O(1). ``atol`` covers values near zero, where relative error means
little (large relative differences of tiny gradients are expected). A
replicated plan runs the very same kernels and matches exactly.

Mixed precision (a precision policy, or a step under ``torch.autocast``): the reference runs under
the same policy, and the tolerance is that of the narrowest floating dtype the step computes in
(:func:`tolerance_for_graph`). bfloat16 keeps 8 significant bits (a rounding step of 2**-8 = 0.4% of a
value), float16 11 (0.1%); a distributed step rounds its partial sums in another order, each rounding
up to half a step, and a reduction's error follows the magnitude of what it sums rather than of its
result, so a fixed bound is either loose or wrong. The bound is measured instead: under a policy the
reference also runs the same steps in float32 (a step written under ``torch.autocast``: captured
once more with its autocast regions off), and each tensor's distance between the two
single-device runs (how far rounding to the policy's dtype moved it, ``rounding``) enters the bound
``|got - want| <= atol + rtol * |want| + rounding_factor * rounding`` with ``rounding_factor = 3``
(two runs that round differently may each sit ``rounding`` away, on opposite sides, plus growth
through the steps). bfloat16 adds ``rtol = 0.02``, float16 ``0.005`` (a few rounding steps). A
wrong shard or a missing reduction moves a tensor by a large share of its magnitude, far beyond the
rounding, and still fails. A step that computes in a narrow dtype by itself (bfloat16 parameters)
has no float32 twin: it is held to ``rtol + magnitude_rtol * max|want|`` (bfloat16: 0.05 and 0.02).
Measured with ``metadist run gpt2-tiny --nproc 2 --check --precision bf16`` (3 AdamW steps): the
largest gradient difference is 1.6 times its rounding (wpe: 1.5e-3 against 9.5e-4); the fixed
bfloat16 bound (0.02 x max|want| = 1.05e-3 there) fails it.

Known limit: Adam/AdamW divide each gradient element by its own running RMS.
An element whose true gradient is zero (a conv bias followed by batch norm)
has a gradient of pure rounding noise, which Adam turns into a step of about
``lr`` in a direction set by the noise: such parameters differ by up to
``lr`` per step between ANY two summation orders, not only between devices.
So a parameter element whose reference gradient, at any step, was below
``noise_factor`` (10) times the largest gradient difference seen is
noise-dominated (measured: one element of a bert-tiny weight, whose
gradient at some step was below 2e-6, ends 1.6e-5 away after 3 AdamW steps
while its gradients and moments agree to 1e-4): a miss
there is counted and reported as excused, not failed (its gradient, and the
optimizer's moments, are still held to the tolerance). Buffers derived from
such parameters (batch-norm statistics after a conv bias) are not excused:
check those models with ``--optimizer sgd``, where the update is linear in
the gradient (the small CNN passes that way).

The comparison reads one copy of a replicated value (the first device's). Each rank's copies are also
compared with the others' through a fingerprint of each piece (its sum, absolute sum and the sum of every third
element; :func:`metadist.runtime.replicas.replica_disagreements`, for a pipeline within each stage's sub-mesh): a
rank whose replicated parameters or states drifted (a kernel that computed a whole output from an empty piece did so
on one rank of four) fails the check as ``replicas:NAME@rankR`` even while the first device's copy is right.

The noise floor is measured from the gradients' differences, so only a check
that compares gradients excuses anything. A plan file made for the step
without gradient outputs (``metadist plan``) compares none: parameter
elements whose gradient is pure rounding noise are then held to the
tolerance and meet it only by chance. GPT-2's key biases are such elements
(softmax ignores a shift shared by every key, so their gradient is zero in
exact arithmetic). Measured on GPT-2 with 6 heads over 4 ranks, 3 AdamW
steps at lr 1e-3: key-bias gradients below 1.3e-11 and values near 1.7e-6;
two single-device runs (1 and 4 threads) end 1.1e-6 apart there, the
distributed run 2.8e-6 away, all under ``atol`` only because the noise
happened to stay far below Adam's ``eps`` (1e-8); a noise gradient near
``eps`` moves such an element by up to ``lr`` per step. With its
gradients compared (largest difference 2.1e-7) the same run excuses them.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from ..frontends.torch import capture_step
from ..frontends.torch.materialize import has_meta_tensors, materialize
from ..ir import Role
from .errors import CheckError

__all__ = ["TOLERANCES", "Tolerance", "Difference", "CheckReport", "ReferenceRun", "TensorStream", "compare_runs", "reference_run", "run_out",
           "tolerance_for_graph"]


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """Elementwise tolerance: ``|got - want| <= atol + rtol * |want|``."""

    rtol: float = 1e-4
    """Relative tolerance (fp32: reduction order changes results by ~1e-7 per op)."""
    atol: float = 1e-5
    """Absolute tolerance, for values near zero."""
    noise_factor: float = 10.0
    """A parameter element is noise-dominated when its reference gradient, at some step, was below
    this many times the largest gradient difference seen; its updated value is not held to ``rtol``/``atol``."""
    magnitude_rtol: float = 0.0
    """Share of the tensor's largest magnitude added to each element's bound (mixed precision: a reduction's
    rounding follows the magnitude of the terms it sums, not of its result)."""
    rounding_factor: float = 0.0
    """Multiple of each tensor's measured rounding (the policy's reference against its float32 twin) added to
    its bound (:attr:`ReferenceRun.rounding`); 0 for float32 steps."""
    dtype: str = "float32"
    """The narrowest dtype the step computes in, which these figures are for."""


TOLERANCES = {
    "float32": Tolerance(),
    "bfloat16": Tolerance(rtol=5e-2, magnitude_rtol=2e-2, dtype="bfloat16"),
    "float16": Tolerance(rtol=1e-2, magnitude_rtol=4e-3, dtype="float16"),
}
"""Check tolerances by the narrowest floating dtype a step computes in (see the module docstring)."""


MEASURED_TOLERANCES = {
    "bfloat16": Tolerance(rtol=2e-2, rounding_factor=3.0, dtype="bfloat16"),
    "float16": Tolerance(rtol=5e-3, rounding_factor=3.0, dtype="float16"),
}
"""Check tolerances of a step under a precision policy, whose rounding is measured against a float32 twin."""


def tolerance_for_graph(graph: Any, measured: bool = False) -> Tolerance:
    """The tolerance of a step: that of the narrowest floating dtype among its values (float32 if none is narrower);
    ``measured``: the reference measured each tensor's rounding against a float32 twin run."""
    dtypes = {value.spec.dtype for value in graph.iter_values()}
    for dtype in ("bfloat16", "float16"):
        if dtype in dtypes:
            return (MEASURED_TOLERANCES if measured else TOLERANCES)[dtype]
    return TOLERANCES["float32"]


@dataclass(frozen=True)
class Difference:
    """The largest differences of one tensor (or one step's loss)."""

    name: str
    max_abs: float
    max_rel: float
    ok: bool
    excused: int = 0
    """Elements outside tolerance but noise-dominated (see :attr:`Tolerance.noise_factor`)."""


@dataclass(frozen=True)
class CheckReport:
    """All compared tensors; ``ok`` when every one is within tolerance."""

    differences: tuple[Difference, ...]
    tolerance: Tolerance

    @property
    def ok(self) -> bool:
        return all(difference.ok for difference in self.differences)

    def worst(self) -> Difference:
        return max(self.differences, key=lambda d: (not d.ok, d.max_rel, d.max_abs))

    def raise_if_failed(self) -> None:
        failed = [d for d in self.differences if not d.ok]
        if failed:
            listing = "; ".join(f"{d.name}: max abs {d.max_abs:.3g}, max rel {d.max_rel:.3g}" for d in failed[:5])
            raise CheckError(
                f"{len(failed)} of {len(self.differences)} tensors differ from the single-device run beyond "
                f"{describe_tolerance(self.tolerance)}: {listing}"
            )


def describe_tolerance(tolerance: Tolerance) -> str:
    text = f"rtol={tolerance.rtol:g}, atol={tolerance.atol:g}"
    if tolerance.magnitude_rtol:
        text += f", {tolerance.magnitude_rtol:g} x max|tensor| ({tolerance.dtype})"
    if tolerance.rounding_factor:
        text += f", {tolerance.rounding_factor:g} x the {tolerance.dtype} rounding measured against float32"
    return text


@dataclass(frozen=True)
class ReferenceRun:
    """Losses of every step and the state after the last step, by graph input name."""

    losses: tuple[float, ...]
    state: Mapping[str, torch.Tensor]
    grads: Mapping[str, torch.Tensor]
    """Gradients of the last step, by parameter name."""
    smallest_grads: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Per element, the smallest gradient magnitude over all steps (empty: use ``grads``)."""
    tolerance: Tolerance = Tolerance()
    """The tolerance for the dtypes the step computes in (:func:`tolerance_for_graph`)."""
    rounding: Mapping[str, float] = field(default_factory=dict)
    """Under a precision policy: per compared tensor (``loss[i]``, ``grad:name``, ``state:name``), the largest
    difference between this run and the same steps in float32 (empty: not measured)."""


def reference_run(
    train_step: Callable,
    model: torch.nn.Module,
    make_optimizer: Callable,
    batch: Any,
    *,
    steps: int,
    seed: int,
    init_seed: int = 0,
    init_fn: Callable | None = None,
    expert_capacity_factor: float | None = None,
    precision: Any = None,
    captured: Any = None,
) -> ReferenceRun:
    """Run ``steps`` steps of the captured graph on one device, on a copy of ``model``.

    A model with meta tensors is materialised whole (``materialize(copy, seed=init_seed)``):
    the values the distributed run's shards hold. ``precision``: the policy the distributed run
    uses; a GradScaler the step uses must be the reference's own (its state moves with the steps).
    ``captured``: the distributed run's own capture of this step (``keep_grads=True``, under the same
    policy and capacity factor), run on the copy instead of capturing it again (seconds: GPT-2 85M
    takes 5 s of CPU); a step with a GradScaler is always captured again, with the reference's scaler.
    """
    from ..frontends.torch.precision import policy_of

    policy = policy_of(precision)
    if captured is not None and (captured.scaler is not None or captured.precision != policy
                                 or not any(output.role is Role.GRAD for output in captured.graph.outputs)):
        raise ValueError("reference_run(captured=...) takes a capture with gradient outputs, under the same precision "
                         "policy and without a GradScaler")
    run = _single_device(train_step, model, make_optimizer, batch, steps, seed, init_seed, init_fn, policy,
                         expert_capacity_factor=expert_capacity_factor, captured=captured)
    if policy.is_mixed:  # the twin: the same step without the policy's casts
        twin = _single_device(train_step, model, make_optimizer, batch, steps, seed, init_seed, init_fn,
                              replace(policy, param_dtype=None), expert_capacity_factor=expert_capacity_factor)
    elif run.tolerance.dtype != "float32":  # written under torch.autocast (or in a narrow dtype): try without autocast
        twin = _single_device(train_step, model, make_optimizer, batch, steps, seed, init_seed, init_fn, policy,
                              autocast=False, expert_capacity_factor=expert_capacity_factor)
        if twin.tolerance.dtype != "float32":
            return run  # the step computes in a narrow dtype by itself: the fixed tolerance of that dtype
    else:
        return run
    rounding = {f"loss[{step}]": abs(a - b) for step, (a, b) in enumerate(zip(run.losses, twin.losses))}
    for kind, mine, theirs in (("grad", run.grads, twin.grads), ("state", run.state, twin.state)):
        for name, tensor in mine.items():
            if name in theirs and theirs[name].shape == tensor.shape and tensor.numel():
                rounding[f"{kind}:{name}"] = float((tensor.double() - theirs[name].double()).abs().max())
    return replace(run, tolerance=MEASURED_TOLERANCES.get(run.tolerance.dtype, run.tolerance), rounding=rounding)


def _single_device(train_step, model, make_optimizer, batch, steps, seed, init_seed, init_fn, policy,
                   autocast: bool = True, expert_capacity_factor: float | None = None, captured: Any = None) -> ReferenceRun:
    from ..frontends.torch.precision import autocast_off

    model = copy.deepcopy(model)
    if has_meta_tensors(model):
        materialize(model, seed=init_seed, init_fn=init_fn)
    optimizer = make_optimizer(model.parameters())
    if captured is not None:  # the same capture, run on the copy: its inputs are found by name
        torch_step = captured
    else:
        with contextlib.nullcontext() if autocast else autocast_off():
            torch_step = capture_step(train_step, model, optimizer, batch, keep_grads=True, name="reference", precision=policy,
                                      expert_capacity_factor=expert_capacity_factor)  # the same experts' dispatch
    scaler_start = _scaler_start(torch_step.scaler)
    torch.manual_seed(seed)
    losses, smallest = [], {}
    # The copy is this function's own: its tensors are kept as they are, not cloned, and the last step's gradients
    # are let go (once read) before the next step makes its own. Each held copy was new memory for the next step:
    # on gpt-85m the reference's second step took 1.5-2x the first, in the kernel's page faults.
    for _ in range(steps):
        for param in model.parameters():
            param.grad = None
        losses.append(float(torch_step.run(model, optimizer, batch)))
        for name, param in model.named_parameters():
            if param.grad is not None:
                magnitude = param.grad.detach().abs()
                if name in smallest:
                    torch.minimum(smallest[name], magnitude, out=smallest[name])
                else:
                    smallest[name] = magnitude
    full = torch_step.gather_inputs(model, optimizer, batch)
    state = {slot.name: tensor.detach() for slot, tensor in zip(torch_step.slots, full)
             if slot.kind in ("param", "buffer", "state")}
    grads = {name: param.grad.detach() for name, param in model.named_parameters() if param.grad is not None}
    _restore_scaler(torch_step.scaler, scaler_start)  # a second run of the same step starts where this one did
    return ReferenceRun(tuple(losses), state, grads, smallest, tolerance_for_graph(torch_step.graph))


def _scaler_start(scaler: Any) -> dict:
    from ..frontends.torch.scaler import SCALER_STATE_KEYS, scaler_state

    return {} if scaler is None else {key: scaler_state(scaler, key).clone() for key in SCALER_STATE_KEYS}


def _restore_scaler(scaler: Any, start: dict) -> None:
    from ..frontends.torch.scaler import write_scaler_state

    for key, tensor in start.items():
        write_scaler_state(scaler, key, tensor)


@dataclass(frozen=True)
class TensorStream:
    """Named tensors handed over one at a time: a distributed run's whole tensors gathered one by one
    (:meth:`metadist.runtime.CompiledStep.state_one_by_one`), so that the comparison holds one at a time."""

    names: frozenset[str]
    """Every name ``pairs`` yields, known before any tensor is made."""
    pairs: Iterator[tuple[str, torch.Tensor]]
    """``(name, tensor)``, each once; made when asked for, so a consumer lets each go before asking for the next."""


def compare_runs(
    reference: ReferenceRun,
    losses: list[float],
    state: Mapping[str, torch.Tensor] | TensorStream,
    grads: Mapping[str, torch.Tensor] | TensorStream | None,
    tolerance: Tolerance | None = None,
    replicas: Sequence[tuple[str, float, int]] = (),
) -> CheckReport:
    """Compare a distributed run with the reference: every loss, gradient and state tensor.

    ``grads=None`` compares no gradients (a plan made for the step without gradient outputs).
    ``tolerance``: None takes the reference's (by the dtypes its step computes in).
    ``state`` and ``grads`` may come one tensor at a time (:class:`TensorStream`): each is compared and let go
    before the next is asked for, the gradients first (their differences set the state's noise floor), then the
    state; both streams are run to their end, also when the comparison stops on an error (:func:`run_out`).
    ``replicas``: the values whose copies on the ranks that hold the same piece disagree, ``(name, relative
    difference, rank)`` (:meth:`metadist.runtime.CompiledStep.replica_disagreements`); each fails the check as
    ``replicas:NAME@rankR``.
    """
    try:
        report = _compare(reference, losses, state, grads, tolerance)
    finally:
        run_out(grads, state)
    drifted = tuple(Difference(f"replicas:{name}@rank{rank}", difference, difference, False) for name, difference, rank in replicas)
    return replace(report, differences=report.differences + drifted) if drifted else report


def run_out(*streams: Any) -> None:
    """Each :class:`TensorStream` among ``streams`` run to its end, in order, its tensors let go; anything else is
    skipped. What a rank that does not compare runs in step with the one that does (the gathering is collective)."""
    for stream in streams:
        if isinstance(stream, TensorStream):
            for _ in stream.pairs:
                pass


def _compare(reference: ReferenceRun, losses: list[float], state, grads, tolerance: Tolerance | None) -> CheckReport:
    tolerance = reference.tolerance if tolerance is None else tolerance
    differences = [
        _difference(f"loss[{step}]", torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), tolerance, rounding=reference.rounding)
        for step, (got, want) in enumerate(zip(losses, reference.losses))
    ]
    if len(losses) != len(reference.losses):
        raise CheckError(f"the distributed run has {len(losses)} losses, the reference {len(reference.losses)}")
    compared = [("state", _names(state), reference.state)]
    if grads is not None:
        compared.append(("grad", _names(grads), reference.grads))
    for kind, got_names, want_all in compared:
        missing = sorted(set(want_all) ^ got_names)
        if missing:
            raise CheckError(f"the runs hold different {kind} tensors: {missing[:5]} in only one of them")
    grad_differences = []
    for name, got in _pairs(grads) if grads is not None else ():
        grad_differences.append(_difference(f"grad:{name}", got, reference.grads[name], tolerance, rounding=reference.rounding))
        del got  # let it go before the next one is made
    grad_differences.sort(key=lambda difference: difference.name)
    noise_floor = tolerance.noise_factor * max((d.max_abs for d in grad_differences), default=0.0)
    differences += grad_differences
    state_differences = []
    for name, got in _pairs(state):
        # params only: optimizer states and buffers are held to the tolerance
        gradient = reference.smallest_grads.get(name, reference.grads.get(name))
        noise = None if gradient is None else (lambda gradient=gradient: gradient.detach().cpu().abs() <= noise_floor)
        state_differences.append(_difference(f"state:{name}", got, reference.state[name], tolerance, noise,
                                             rounding=reference.rounding))
        del got
    differences += sorted(state_differences, key=lambda difference: difference.name)
    return CheckReport(tuple(differences), tolerance)


def _names(tensors: Mapping[str, torch.Tensor] | TensorStream) -> frozenset[str]:
    return tensors.names if isinstance(tensors, TensorStream) else frozenset(tensors)


def _pairs(tensors: Mapping[str, torch.Tensor] | TensorStream) -> Iterator[tuple[str, torch.Tensor]]:
    return tensors.pairs if isinstance(tensors, TensorStream) else iter(sorted(tensors.items(), key=lambda item: item[0]))


def _difference(name: str, got: torch.Tensor, want: torch.Tensor, tolerance: Tolerance,
                noise: Callable[[], torch.Tensor] | None = None, rounding: Mapping[str, float] | None = None) -> Difference:
    """Largest differences; ``noise()`` marks elements whose misses are excused (counted, not failed), computed only
    when some element misses.

    Computed in float32 (float64 for float64 and integer tensors): the difference of two float32 values is exact when they are
    within a factor of two of each other (Sterbenz) and otherwise off by half an ulp of itself, far below any
    tolerance here; so the check costs a few passes over each tensor, not a float64 copy of every one (the 85M
    GPT's check took 14 s that way, 1 s this way). The common case, every element finite and within its bound, is
    decided by one reduction, the largest ``|got - want| - rtol * |want|``, without a boolean mask per element;
    anything else is looked at element by element (:func:`_difference_closely`).

    A NaN or infinity is a miss unless both runs hold it at that element (NaN where the reference has NaN, the same
    infinity): the distributed run then agrees with the single device, and the element is left out of the largest
    differences.
    """
    if got.shape != want.shape:
        raise CheckError(f"{name}: the distributed run has shape {tuple(got.shape)}, the reference {tuple(want.shape)}")
    narrow = all(tensor.is_floating_point() and tensor.element_size() <= 4 for tensor in (got, want))
    dtype = torch.float32 if narrow else torch.float64  # integers (counters, ids) and float64 exactly
    got, want = got.detach().cpu().to(dtype), want.detach().cpu().to(dtype)
    if got.numel() == 0:
        return Difference(name, 0.0, 0.0, True)
    extra = tolerance.rounding_factor * (rounding or {}).get(name, 0.0) if tolerance.rounding_factor else 0.0
    error = got.sub(want).abs_()
    magnitude = want.abs()
    max_abs, largest = float(error.max()), float(magnitude.max())
    offset = tolerance.atol + tolerance.magnitude_rtol * largest + extra
    if math.isfinite(max_abs) and math.isfinite(largest):
        relative = error / magnitude  # NaN or infinite where |want| is 0: masked below, as |want| <= atol there
        max_rel = float(relative.masked_fill_(magnitude <= tolerance.atol, 0.0).max())  # relative error means little near 0
        if float(error.sub_(magnitude, alpha=tolerance.rtol).max()) <= offset:  # error now holds error - rtol * |want|
            return Difference(name, max_abs, max_rel, True)
    return _difference_closely(name, got, want, tolerance, noise, extra)


def _difference_closely(name: str, got: torch.Tensor, want: torch.Tensor, tolerance: Tolerance,
                        noise: Callable[[], torch.Tensor] | None, extra: float) -> Difference:
    """:func:`_difference` element by element: some element misses its bound or is not finite."""
    agree = got.eq(want) | (got.isnan() & want.isnan())  # equal infinities, NaN in both
    error = got.sub(want).abs_().masked_fill_(agree, 0.0)
    magnitude = want.abs().masked_fill_(agree, 0.0)
    max_abs = float(error.max())
    significant = magnitude > tolerance.atol  # relative error means little near zero
    max_rel = float(torch.where(significant, error / magnitude, 0.0).max()) if bool(significant.any()) else 0.0
    finite = magnitude[magnitude.isfinite()]
    offset = tolerance.atol + tolerance.magnitude_rtol * (float(finite.max()) if finite.numel() else 0.0) + extra
    # a value not finite in either run, where the two disagree, misses whatever its bound, and is never excused
    unequal = agree.logical_not_() & (got.isfinite() & want.isfinite()).logical_not_()
    missed = (error <= magnitude.mul_(tolerance.rtol).add_(offset)).logical_not_() | unequal  # a NaN error misses
    if not bool(missed.any()):
        return Difference(name, max_abs, max_rel, True)
    excused = int((missed & unequal.logical_not_() & noise()).sum()) if noise is not None else 0
    return Difference(name, max_abs, max_rel, int(missed.sum()) == excused, excused)
