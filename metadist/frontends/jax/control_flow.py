"""Control flow in a captured step: ``scan`` unrolled, ``cond`` computed on every branch, ``while`` unrolled if static.

MetaIR is a flat graph, so a nested jaxpr of control flow is expanded into the
primitives the rest of the pipeline already knows:

- ``scan`` (``lax.scan``, ``lax.fori_loop`` with Python int bounds, and the
  scans the backward pass of a scan produces) is **unrolled**: its body is
  inlined ``length`` times (in reverse order for ``reverse=True``). The
  ``xs`` are indexed per iteration with ``slice`` + ``squeeze`` (one pair per
  stacked input and index, shared by every scan that reads it) and the ``ys``
  are stacked with ``stack``. When a scan reads the ``ys`` of an earlier scan
  (the backward scan reads the forward's residuals), it takes the per-iteration
  pieces directly, so no stack-then-slice round trip is emitted. Cost: the graph
  holds ``length`` copies of the body; the plan may shard each copy differently.
- ``cond`` (``lax.cond``, ``lax.switch``) computes **every branch** and picks
  each result with ``select_n`` on the branch index. JAX branches are pure, so
  this is exact; the cost is the work of all branches on every step (a
  ``switch`` over ``n`` cheap branches costs ``n`` times one). An index that is
  a known constant inlines only its branch.
- ``while`` is unrolled only when its condition becomes a constant in every
  iteration (a counter from literals); a trip count that depends on data cannot
  be unrolled into a static graph and is a :class:`JaxCaptureError` that says
  to use ``lax.scan`` or ``lax.fori_loop`` with Python int bounds.

The capture folds equations whose operands are all scalar literals into
literals (the loop counter of a ``fori_loop`` and what is computed from it),
so the unrolled copies index with constants and a ``cond`` on the counter
inlines one branch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from ...ir import Literal, ValueRef
from .errors import JaxCaptureError
from .params import decode_scalar

if TYPE_CHECKING:
    from .capture import _GraphBuilder

__all__ = ["CONTROL_FLOW", "MAX_WHILE_ITERATIONS", "Stacked"]

log = logging.getLogger(__name__)

#: A ``while`` loop unrolled past this many iterations is refused (its graph would be too big to plan).
MAX_WHILE_ITERATIONS = 1024


class Stacked:
    """The ``ys`` of an unrolled scan: one piece per iteration, stacked only if something reads the whole."""

    def __init__(self, pieces: list[Any]) -> None:
        self.pieces = pieces
        self.materialized: Any = None

    def materialize(self, builder: "_GraphBuilder") -> Any:
        if self.materialized is None:
            import jax.numpy as jnp

            pieces = [builder.resolve(piece) for piece in self.pieces]
            (self.materialized,) = builder.trace_inline(lambda *arrays: [jnp.stack(arrays)], pieces)
        return self.materialized


class LazyIndex:
    """``source[index]`` along dim 0, emitted only if read."""

    def __init__(self, source: Any, index: int) -> None:
        self.source = source
        self.index = index

    def materialize(self, builder: "_GraphBuilder") -> Any:
        source = builder.resolve(self.source)
        key = (source.name if isinstance(source, ValueRef) else repr(source), self.index)
        if key not in builder.index_cache:
            from jax import lax

            index = self.index
            (builder.index_cache[key],) = builder.trace_inline(
                lambda array: [lax.index_in_dim(array, index, 0, keepdims=False)], [source])
        return builder.index_cache[key]


def index_dim0(source: Any, index: int) -> Any:
    """Piece ``index`` of a scanned-over operand: a stacked piece directly, else a lazy slice."""
    if isinstance(source, Stacked):
        return source.pieces[index]
    return LazyIndex(source, index)


def unroll_scan(builder: "_GraphBuilder", eqn: Any) -> None:
    """Inline the scan body ``length`` times; the final carry and the stacked ``ys`` become the results."""
    params = eqn.params
    length, num_consts, num_carry = int(params["length"]), int(params["num_consts"]), int(params["num_carry"])
    body = params["jaxpr"]
    operands = [builder.read_raw(var) for var in eqn.invars]
    consts, carry, xs = operands[:num_consts], operands[num_consts:num_consts + num_carry], operands[num_consts + num_carry:]
    ys_vars = eqn.outvars[num_carry:]
    if length == 0:
        import jax.numpy as jnp

        for var, init in zip(eqn.outvars[:num_carry], carry):
            builder.env[var] = init
        for var in ys_vars:
            aval = builder.physical_aval(var.aval)
            (builder.env[var],) = builder.trace_inline(lambda: [jnp.zeros(aval.shape, aval.dtype)], [])
        return
    pieces: list[list[Any]] = [[None] * length for _ in ys_vars]
    order = range(length - 1, -1, -1) if params.get("reverse") else range(length)
    log.debug("unrolling a scan of length %d (%d equations in its body)", length, len(body.jaxpr.eqns))
    for index in order:
        inputs = consts + carry + [index_dim0(x, index) for x in xs]
        results = builder.inline(body.jaxpr, inputs, body.consts)
        carry = results[:num_carry]
        for stack, piece in zip(pieces, results[num_carry:]):
            stack[index] = piece
    for var, final in zip(eqn.outvars[:num_carry], carry):
        builder.env[var] = final
    for var, stack in zip(ys_vars, pieces):
        builder.env[var] = Stacked(stack)


def select_cond(builder: "_GraphBuilder", eqn: Any) -> None:
    """Compute every branch of a ``cond``/``switch`` and pick each result with ``select_n`` on the index.

    Exact (branches are pure), but every step pays the compute and memory of all branches, and their
    backward passes: a ``switch`` over ``n`` branches costs the sum of the ``n``, not the one taken.
    """
    from jax import lax

    branches = eqn.params["branches"]
    index = builder.read(eqn.invars[0])
    operands = [builder.read_raw(var) for var in eqn.invars[1:]]
    if isinstance(index, Literal):  # a constant index (e.g. inside an unrolled loop): only its branch runs
        chosen = branches[min(max(int(decode_scalar(index)), 0), len(branches) - 1)]
        for var, result in zip(eqn.outvars, builder.inline(chosen.jaxpr, operands, chosen.consts)):
            builder.env[var] = result
        return
    results = [builder.inline(branch.jaxpr, operands, branch.consts) for branch in branches]
    for position, var in enumerate(eqn.outvars):
        cases = [builder.resolve(result[position]) for result in results]
        if all(case == cases[0] for case in cases[1:]):
            builder.env[var] = cases[0]
        else:
            (builder.env[var],) = builder.trace_inline(lambda i, *values: [lax.select_n(i, *values)], [index, *cases])


def unroll_while(builder: "_GraphBuilder", eqn: Any) -> None:
    """Unroll a ``while`` whose condition folds to a constant each iteration; else a clear error."""
    params = eqn.params
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    cond_count, body_count = int(params["cond_nconsts"]), int(params["body_nconsts"])
    operands = [builder.read_raw(var) for var in eqn.invars]
    cond_consts, body_consts = operands[:cond_count], operands[cond_count:cond_count + body_count]
    carry = operands[cond_count + body_count:]
    for iteration in range(MAX_WHILE_ITERATIONS + 1):
        (predicate,) = builder.inline(cond.jaxpr, cond_consts + carry, cond.consts)
        predicate = builder.resolve(predicate)
        if not isinstance(predicate, Literal):
            raise _data_dependent_while(iteration)
        if not bool(decode_scalar(predicate)):
            break
        if iteration == MAX_WHILE_ITERATIONS:
            raise JaxCaptureError(
                f"a while_loop runs more than {MAX_WHILE_ITERATIONS} iterations; MetaDist unrolls loops into "
                "the graph, and a graph this long cannot be planned. Shorten the loop, or keep it outside the "
                "captured training step"
            )
        carry = builder.inline(body.jaxpr, body_consts + carry, body.consts)
    for var, final in zip(eqn.outvars, carry):
        builder.env[var] = final


def _data_dependent_while(iteration: int) -> JaxCaptureError:
    return JaxCaptureError(
        "a while_loop (lax.while_loop, or lax.fori_loop with traced bounds) has a trip count that depends on "
        f"traced values (its condition is not a constant in iteration {iteration}); MetaDist captures a static "
        "graph, so it cannot unroll it. Use jax.lax.scan with a fixed length, or jax.lax.fori_loop with Python "
        "int bounds (it lowers to a scan), and mask the iterations you do not need"
    )


#: Control-flow primitives and how the capture expands them.
CONTROL_FLOW: dict[str, Callable[["_GraphBuilder", Any], None]] = {
    "scan": unroll_scan,
    "cond": select_cond,
    "while": unroll_while,
}
