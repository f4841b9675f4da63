"""The cache and the pricing shared by the ops a plan times by local shape on this machine (issue #16, part 2).

:mod:`.matmul_times` (matmuls) and :mod:`.attention_times` (fused attention) each list the local calls a
step may run (their keys), time the ones missing from a per-machine cache file beside the calibration, and put the
times into the device the cost model prices with (scaled by the calibration's sustained slowdown). This module is that
common part, with :mod:`.relayout_times` (relayout copies): the cache file (:func:`read_times`, :func:`write_times`),
:func:`with_timed` and :func:`time_within_budget`, and :func:`with_measured_shapes`, which prices a step on all three.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from .cluster import Cluster, ClusterError

logger = logging.getLogger(__name__)


def cached_table_path(cache_dir: Path, what: str) -> Path:
    """Where this machine's times of ``what`` (``matmul``, ``attention``, ``relayout``) are cached: beside the
    calibration, per machine and torch version as it is."""
    from .calibrate import _torch_version, calibration_key

    return Path(cache_dir) / "calibration" / f"{calibration_key(1, what, _torch_version())}.json"


def local_cuts(sizes: tuple[int, ...], mesh_shape: tuple[int, ...], cuttable: range) -> Iterator[tuple[int, ...]]:
    """The largest piece of ``sizes`` for every way of giving each mesh axis (of ``mesh_shape``) to one of the
    ``cuttable`` dims or to none (``ceil`` of each dim over the product of its axes; repeats included)."""
    for assignment in itertools.product((None, *cuttable), repeat=len(mesh_shape)):
        pieces = [1] * len(sizes)
        for axis, dim in enumerate(assignment):
            if dim is not None:
                pieces[dim] *= mesh_shape[axis]
        yield tuple(-(-size // count) for size, count in zip(sizes, pieces))


def one_thread_seconds(call: Callable[[], object]) -> float:
    """Median seconds of one ``call()`` on the CPU with one intra-op thread, as each rank of a local run has (the
    process's thread count restored after)."""
    import torch

    from .calibrate_worker import _per_call_seconds

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _per_call_seconds(call, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)


def read_times(path: Path, table_format: str, version: int, what: str,
               key_of: Callable[[list], tuple]) -> dict[tuple, float]:
    """The cached times at ``path`` (empty when there is none): each row's key made by ``key_of`` from the row less its
    last item (the seconds). A damaged file, or one of another format or version, is an error that says how to redo
    it; ``what`` names the table in it (``matmul``, ``attention``)."""
    if not path.is_file():
        return {}
    try:
        document = json.loads(path.read_text())
        if document.get("format") != table_format or document.get("version") != version:
            raise ValueError(f"format {document.get('format')!r} version {document.get('version')!r}")
        return {key_of(list(row[:-1])): float(row[-1]) for row in document["times"]}
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        raise ClusterError(f"the cached {what} times {path} cannot be read ({err}); delete the file: the shapes are "
                           f"timed again on the next plan") from None


def write_times(path: Path, table_format: str, version: int, table: Mapping[tuple, float]) -> None:
    """Write ``table`` ({key: seconds}) at ``path``, atomically."""
    from ..files import write_atomically

    document = {"format": table_format, "version": version,
                "times": [[*key, seconds] for key, seconds in sorted(table.items())]}
    write_atomically(path, json.dumps(document))


def with_timed(cluster: Cluster, keys: Mapping[tuple, Any], path: Path, *, read: Callable[[Path], dict],
               write: Callable[[Path, dict], None], time_missing: Callable[[list], tuple[dict, int]], field: str,
               measure: bool, skipped_note: str) -> Cluster:
    """``cluster`` with its device's ``field`` (``matmul_seconds``, ``attention_seconds``) holding the times of ``keys``.

    The cached times at ``path`` are read (``read``); with ``measure``, the keys missing are timed first
    (``time_missing(missing) -> (timed, skipped count)``) and the cache written again (``write``) with what another
    process may have added meanwhile. Each time is scaled by the device's sustained slowdown, as its rates are; a key
    neither cached nor timed is left out (the cost model keeps its own price), and ``skipped_note`` (with ``%d``, the
    count) is logged when some were."""
    table = read(path)
    missing = [key for key in keys if key not in table]
    if measure and missing:
        timed, skipped = time_missing(missing)
        if timed:
            table = {**read(path), **timed}
            write(path, table)
        if skipped:
            logger.info(skipped_note, skipped)
    device = cluster.device
    priced = {key: table[key] * device.sustained_slowdown for key in keys if key in table}
    merged = {**dict(getattr(device, field)), **priced}
    return replace(cluster, device=replace(device, **{field: tuple(sorted(merged.items()))}))


def time_within_budget(missing: list[tuple], price_s: Callable[[tuple], float], time_one: Callable[[tuple], float],
                       what: str, announce: Callable[[str], None] | None, path: Path,
                       refused: tuple[type[Exception], ...] = ()) -> tuple[dict[tuple, float], int]:
    """Time the ``missing`` keys (``time_one(key)`` seconds), cheapest first by ``price_s`` (the cost model's price of
    the key without its time, before the slowdown): those priced above :data:`~.matmul_times.LONGEST_TIMED_S` are
    not timed, and none after :data:`~.matmul_times.TIMING_BUDGET_S` of timing. An error of the ``refused`` types
    (a shape torch refuses) leaves that key untimed, and the log says why. Returns (the times, how many keys were left
    untimed); ``announce(text)`` is told before more than 8 keys of ``what`` (``matmul``...) are timed."""
    from .matmul_times import LONGEST_TIMED_S, TIMING_BUDGET_S

    wanted = [key for key in missing if price_s(key) <= LONGEST_TIMED_S]
    if announce is not None and len(wanted) > 8:
        announce(f"timing {len(wanted)} {what} shape(s) of this step on this machine, once; cached in {path}")
    timed: dict[tuple, float] = {}
    started = time.perf_counter()
    for key in sorted(wanted, key=price_s):
        if time.perf_counter() - started > TIMING_BUDGET_S:
            break
        try:
            timed[key] = time_one(key)
        except refused as err:  # priced without its time, and said so
            logger.info("%s shape %s not timed: torch refused it (%s)", what, key, str(err).splitlines()[0])
    logger.info("timed %d %s shape(s) in %.1f s", len(timed), what, time.perf_counter() - started)
    return timed, len(missing) - len(timed)


def with_measured_shapes(cluster: Cluster, graph: Any, cache_dir: Path, *, measure: bool = True,
                         announce: Callable[[str], None] | None = None) -> Cluster:
    """``cluster`` with its device pricing ``graph``'s matmuls
    (:func:`~.matmul_times.with_measured_matmuls`), its fused attention
    (:func:`~.attention_times.with_measured_attention`) and its relayout copies
    (:func:`~.relayout_times.with_measured_relayouts`) at their times on this machine: how a plan made here prices a
    step. ``measure`` and ``announce`` as theirs."""
    from .attention_times import with_measured_attention
    from .matmul_times import with_measured_matmuls
    from .relayout_times import with_measured_relayouts

    cluster = with_measured_matmuls(cluster, graph, cache_dir, measure=measure, announce=announce)
    cluster = with_measured_attention(cluster, graph, cache_dir, measure=measure, announce=announce)
    return with_measured_relayouts(cluster, graph, cache_dir, measure=measure, announce=announce)
