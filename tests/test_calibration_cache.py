"""This machine's calibration: cache key, cache file, the cluster it gives, and the one automatic run."""

from __future__ import annotations

import json

import pytest

from metadist.config import settings_from_env
from metadist.cost import ClusterError
from metadist.cost.calibrate import (
    calibration_key, calibration_path, default_cpu_cluster, load_calibration, machine_cluster, machine_fingerprint,
    save_calibration,
)
from metadist.ir import Mesh

REPORT = {
    "backend": "gloo", "world_size": 2, "mesh": [2], "memory_capacity_bytes": None, "unsupported": [],
    "device": {"peak_flops_per_s": 3e10, "memory_bandwidth_bytes_per_s": 5e9, "op_overhead_s": 4e-6},
    "measurements": [{"axis": 0, "op": op, "bytes": nbytes, "seconds": 2e-4 + nbytes / 1e9 * (2 if op in ("all_reduce", "reduce_scatter") else 1)}
                     for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") for nbytes in (4096, 1 << 20)],
}


def test_the_key_names_machine_torch_backend_and_process_count():
    fingerprint = machine_fingerprint()
    assert set(fingerprint) == {"processor", "machine", "cpu_count", "memory_gib"}
    key = calibration_key(2, "gloo", "2.13.0", fingerprint)
    assert key.startswith("gloo-2proc-") and key == calibration_key(2, "gloo", "2.13.0", dict(fingerprint))
    others = {calibration_key(4, "gloo", "2.13.0", fingerprint), calibration_key(2, "gloo", "2.14.0", fingerprint),
              calibration_key(2, "nccl", "2.13.0", fingerprint), calibration_key(2, "gloo", "2.13.0", {**fingerprint, "cpu_count": 99})}
    assert key not in others and len(others) == 4


def test_a_cached_report_gives_the_cluster_over_any_mesh_of_its_size(tmp_path):
    path = calibration_path(tmp_path, 4)
    assert load_calibration(path) is None
    save_calibration(path, {**REPORT, "world_size": 4, "mesh": [4]}, 4)
    told = []
    cluster = machine_cluster(Mesh((2, 2)), tmp_path, announce=told.append)  # read from the cache: nothing measured
    assert told == [] and cluster.mesh == Mesh((2, 2))
    assert cluster.link(0) == cluster.link(1) and cluster.link(0).reduce_scatter_as_all_reduce
    assert cluster.device.op_overhead_s == 4e-6 and cluster.device.peak_flops_per_s == 3e10
    path.write_text("{broken")
    with pytest.raises(ClusterError, match="metadist calibrate"):
        machine_cluster(Mesh((4,)), tmp_path)


def test_an_axis_smaller_than_the_processes_takes_the_link_timed_on_groups_of_its_size(tmp_path):
    """Version 7: the calibration times collectives on groups of 2 of 4 processes as well; a 2x2 mesh's axes are
    priced by them, a mesh of 4 by the collectives among all 4; a pair's wait is its own in-step figure's, where
    measured, else the whole link's."""
    def rows(axis, size, fixed):
        return [{"axis": axis, "group_size": size, "op": op, "bytes": nbytes, "seconds": fixed + nbytes / 1e9}
                for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") for nbytes in (4096, 1 << 20)]

    report = {**REPORT, "world_size": 4, "mesh": [4], "measurements": rows(0, 4, 4e-3) + rows(-1, 2, 5e-4),
              "device": {**REPORT["device"], "in_step_collective_s": 9e-3}}
    save_calibration(calibration_path(tmp_path, 4), report, 4)
    flat, square = machine_cluster(Mesh((4,)), tmp_path), machine_cluster(Mesh((2, 2)), tmp_path)
    assert square.link(0) == square.link(1) != flat.link(0)
    assert square.link(0).sync_s == flat.link(0).sync_s > 0
    for kind in ("all_gather", "all_reduce"):  # the fitted fixed costs: 4 ms among 4, 0.5 ms between 2
        assert flat.link(0).kind_cost(kind)[0] == pytest.approx(4e-3, rel=0.05)
        assert square.link(0).kind_cost(kind)[0] == pytest.approx(5e-4, rel=0.05)
    # with the pairs' in-step all-reduce measured, a pair's wait is that figure less the pair's isolated all-reduce
    measured = {**report, "device": {**report["device"], "in_step_collective_s:2": 2e-3}}
    save_calibration(calibration_path(tmp_path, 4), measured, 4)
    pair = machine_cluster(Mesh((2, 2)), tmp_path).link(1)
    isolated = pair.kind_cost("all_reduce")[0] + 4096 / pair.kind_cost("all_reduce")[1]
    assert pair.sync_s == pytest.approx(2e-3 - isolated, rel=0.05) and pair.sync_s != flat.link(0).sync_s
    assert machine_cluster(Mesh((4,)), tmp_path).link(0) == flat.link(0)
    without = {**report, "measurements": rows(0, 4, 4e-3)}  # a calibration without them: the whole link everywhere
    save_calibration(calibration_path(tmp_path, 4), without, 4)
    assert machine_cluster(Mesh((2, 2)), tmp_path).link(1) == machine_cluster(Mesh((4,)), tmp_path).link(0)


def test_the_group_sizes_timed_are_the_axes_other_meshes_of_the_processes_have():
    from metadist.cost.calibrate_worker import _group_sizes

    assert _group_sizes(4, [4]) == [2] and _group_sizes(4, [2, 2]) == []
    assert _group_sizes(8, [8]) == [2, 4] and _group_sizes(2, [2]) == [] and _group_sizes(6, [6]) == [2, 3]


def test_settings_choose_the_cpu_cluster(tmp_path):
    assert settings_from_env({"METADIST_CACHE_DIR": str(tmp_path)}).cpu_cluster == "calibrated"
    settings = settings_from_env({"METADIST_CACHE_DIR": str(tmp_path), "METADIST_CPU_CLUSTER": "cpu-gloo"})
    assert default_cpu_cluster(Mesh((2,)), settings.cpu_cluster, settings.cache_dir).name == "cpu-gloo"
    assert not (tmp_path / "calibration").exists()


@pytest.mark.distributed
def test_first_use_calibrates_once_then_reads_the_cache(tmp_path):
    told = []
    first = machine_cluster(Mesh((2,)), tmp_path, sizes="4096,65536", announce=told.append)
    assert len(told) == 1 and "calibrating this machine for 2" in told[0]
    cached = json.loads(calibration_path(tmp_path, 2).read_text())
    assert cached["nproc"] == 2 and cached["report"]["backend"] == "gloo"
    assert cached["report"]["device"]["op_overhead_s"] > 0 and cached["report"]["device"]["peak_flops_per_s"] > 0
    announced = len(told)  # more where other work on the machine had a launch measured again
    again = machine_cluster(Mesh((2,)), tmp_path, announce=told.append)
    assert len(told) == announced and again == first


def test_calibrating_again_drops_the_timed_shapes(tmp_path, monkeypatch):
    """``metadist calibrate`` replaces the calibration and deletes the shapes timed at the last one's speed (matmuls,
    fused attention, relayouts: :mod:`metadist.cost.timed_shapes`): the next plan times them again."""
    import metadist.cost.calibrate as calibrate_module
    from metadist.cli.main import main
    from metadist.cost import attention_times, matmul_times, relayout_times
    from metadist.cost.calibrate import cluster_from_report

    monkeypatch.setenv("METADIST_CACHE_DIR", str(tmp_path))
    told = {}

    def calibrate(nproc, mesh, sizes, **options):
        told.update(options)
        return cluster_from_report(REPORT, mesh), REPORT

    monkeypatch.setattr(calibrate_module, "calibrate", calibrate)
    stale = [timed.table_path(tmp_path) for timed in (matmul_times, attention_times, relayout_times)]
    stale[0].parent.mkdir(parents=True)
    for path, timed in zip(stale, (matmul_times, attention_times, relayout_times)):
        path.write_text(json.dumps({"format": timed.TABLE_FORMAT, "version": timed.TABLE_VERSION, "times": []}))
    assert len(set(stale)) == 3
    assert main(["calibrate", "--nproc", "2"]) == 0
    assert not any(path.exists() for path in stale) and load_calibration(calibration_path(tmp_path, 2)) == REPORT
    assert told["launches"] is None  # the default: decided by the processes per core (default_launches)
    assert main(["calibrate", "--nproc", "2", "--launches", "2"]) == 0 and told["launches"] == 2


def test_calibrate_prints_the_dtensor_figures_it_measured(tmp_path, monkeypatch, capsys):
    """torch's DTensor costs (an elementwise op's, a parallel linear's op's and its all-reduce's) are printed where
    measured, and only those: an older report without the module figure does not print it as 0."""
    import metadist.cost.calibrate as calibrate_module
    from metadist.cli.main import main
    from metadist.cost.calibrate import cluster_from_report

    monkeypatch.setenv("METADIST_CACHE_DIR", str(tmp_path))
    for extra, printed in (({}, None), ({"dtensor_op_s": 12e-6}, "adds 12.0 us an elementwise op "),
                           ({"dtensor_op_s": 12e-6, "dtensor_module_op_s": 35e-6},
                            "adds 12.0 us an elementwise op, 35.0 us an op of a parallel linear "),
                           ({"dtensor_op_s": 12e-6, "dtensor_module_op_s": 35e-6, "dtensor_collective_s": 350e-6},
                            "35.0 us an op of a parallel linear, 350.0 us a parallel linear's all-reduce ")):
        report = {**REPORT, "device": {**REPORT["device"], **extra}}
        monkeypatch.setattr(calibrate_module, "calibrate",
                            lambda nproc, mesh, sizes, report=report, **options: (cluster_from_report(report, mesh), report))
        assert main(["calibrate", "--nproc", "2"]) == 0
        out = " ".join(capsys.readouterr().out.split())  # rich wraps the line at the terminal's width
        if printed is None:
            assert "DTensor" not in out
        else:
            assert printed in out and ("parallel linear" in out) == ("dtensor_module_op_s" in extra)
            assert ("a parallel linear's all-reduce" in out) == ("dtensor_collective_s" in extra)


def _launch(device: dict, seconds: float, **other) -> dict:
    return {**REPORT, "world_size": 4, "mesh": [4], **other, "device": device,
            "measurements": [{"axis": 0, "group_size": 4, "op": "all_reduce", "bytes": 4096, "seconds": seconds},
                             {"axis": -1, "group_size": 2, "op": "all_gather", "bytes": 4096, "seconds": seconds / 4}]}


def test_launches_merge_into_each_figures_median():
    """Version 25: where processes share cores each figure is the median over several launches, so that one launch's
    outlier (a captured step timed 1.5x the others') moves no price."""
    from metadist.cost.calibrate import merge_reports

    reports = [_launch({"captured_step_s": 0.9e-3, "in_step_collective_s:2": 5e-3, "matmul_curve:float32:4096": 2e10}, 3.7e-3,
                       unsupported=[{"axis": 0, "group_size": 4, "op": "all_to_all", "reason": "not in this backend"}]),
               _launch({"captured_step_s": 1.43e-3, "in_step_collective_s:2": 6e-3, "matmul_curve:float32:4096": 3e10}, 9.9e-3,
                       unsupported=[{"axis": 0, "group_size": 4, "op": "all_to_all", "reason": "not in this backend"}]),
               _launch({"captured_step_s": 1.0e-3, "in_step_collective_s:2": 2.7e-3}, 3.9e-3)]  # its curve stopped sooner
    merged = merge_reports(reports)
    assert merged["launches"] == 3 and merged["backend"] == "gloo" and merged["world_size"] == 4
    assert merged["device"] == {"captured_step_s": 1.0e-3, "in_step_collective_s:2": 5e-3,
                                "matmul_curve:float32:4096": pytest.approx(2.5e10)}  # the two launches that timed it
    rows = {(row["axis"], row["op"]): row["seconds"] for row in merged["measurements"]}
    assert rows == {(0, "all_reduce"): 3.9e-3, (-1, "all_gather"): pytest.approx(3.9e-3 / 4)}
    assert all(row["group_size"] in (2, 4) and row["bytes"] == 4096 for row in merged["measurements"])
    assert [item["op"] for item in merged["unsupported"]] == ["all_to_all"]
    assert merge_reports(reports[:1])["device"] == reports[0]["device"]
    with pytest.raises(ClusterError, match="different setups .*world_size"):
        merge_reports([reports[0], {**reports[1], "world_size": 2}])
    with pytest.raises(ValueError):
        merge_reports([])


def test_processes_that_outnumber_the_cores_calibrate_over_three_launches(tmp_path, monkeypatch):
    import metadist.cost.calibrate as calibrate_module
    from metadist.cost.calibrate import SHARED_CORE_LAUNCHES, default_launches, run_workers

    monkeypatch.setattr(calibrate_module.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert SHARED_CORE_LAUNCHES == 3 and default_launches(4) == 3 and default_launches(2) == default_launches(1) == 1
    launched = []

    def launch(nproc, mesh, sizes, timeout_s):
        launched.append(nproc)
        fixed = (4e-3, 9e-3, 3e-3)[(len(launched) - 1) % 3]
        rows = [{"axis": axis, "group_size": size, "op": op, "bytes": nbytes, "seconds": fixed / (4 // size) + nbytes / 1e9}
                for axis, size in ((0, 4), (-1, 2)) for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
                for nbytes in (4096, 1 << 20)]
        device = {**REPORT["device"], "captured_nodes": 100.0, "captured_roofline_s": 1e-5,
                  "captured_step_s": (1.0e-3, 1.43e-3, 0.9e-3)[(len(launched) - 1) % 3]}
        return {**REPORT, "world_size": 4, "mesh": [4], "device": device, "measurements": rows}

    monkeypatch.setattr(calibrate_module, "_launch_workers", launch)
    seen = []
    report = run_workers(4, Mesh((4,)), "4096", on_launch=lambda index, total: seen.append((index, total)))
    assert launched == [4, 4, 4] and seen == [(1, 3), (2, 3), (3, 3)]
    assert report["launches"] == 3 and report["device"]["captured_step_s"] == 1.0e-3
    launched.clear()
    assert "launches" not in run_workers(4, Mesh((4,)), "4096", launches=1) and launched == [4]  # one launch: as measured
    with pytest.raises(ClusterError, match="--launches 1 or more"):
        run_workers(4, Mesh((4,)), "4096", launches=0)
    # the first use says so, and caches the merged report
    launched.clear()
    told = []
    cluster = machine_cluster(Mesh((2, 2)), tmp_path, announce=told.append)
    assert launched == [4, 4, 4] and "the median of 3 launches" in told[0]
    assert cluster.device.op_overhead_s == pytest.approx((1.0e-3 - 1e-5) / 100)  # the median launch's step, not 1.43 ms
    assert load_calibration(calibration_path(tmp_path, 4))["launches"] == 3


def test_other_work_counts_where_the_launch_leaves_no_core_free(monkeypatch):
    """What other work takes from a calibration: its cores' worth beyond those the launch's processes leave free (one
    process takes every core; several, one OpenMP thread each unless ``OMP_NUM_THREADS`` says more)."""
    import metadist.cost.calibrate as calibrate_module
    from metadist.cost.calibrate import contended_cores

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(calibrate_module.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert [contended_cores({"other_load_cores": 0.6}, n) for n in (1, 2, 4)] == [0.6, 0.6, 0.6]
    assert contended_cores({"other_load_cores": None}, 1) == contended_cores({}, 4) == 0.0  # not recorded
    monkeypatch.setattr(calibrate_module.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert contended_cores({"other_load_cores": 3.0}, 4) == 0.0  # 12 of the 16 cores left free
    assert contended_cores({"other_load_cores": 3.0}, 1) == 3.0  # one process's threads take all 16
    assert contended_cores({"other_load_cores": 14.5}, 4) == pytest.approx(2.5)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert contended_cores({"other_load_cores": 3.0}, 4) == 3.0  # 4 processes of 4 threads


def test_a_launch_contended_by_other_work_is_measured_again(tmp_path, monkeypatch):
    """A launch during which other work ran on the machine's cores is run again (up to OTHER_LOAD_RETRIES times) and
    the least contended kept; where every try was contended, the first use says so once the cache is written."""
    import metadist.cost.calibrate as calibrate_module
    from metadist.cost.calibrate import OTHER_LOAD_LIMIT_CORES, OTHER_LOAD_RETRIES, busy_note, run_workers

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(calibrate_module.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    loads: list[float | None] = []

    def launch(nproc, mesh, sizes, timeout_s):
        load = loads.pop(0)
        device = {**REPORT["device"], "peak_flops_per_s": 1e9 / (1 + (load or 0))}
        if nproc == 4:
            return _launch(device, 4e-3, other_load_cores=load)
        return {**REPORT, "device": device, "other_load_cores": load}

    monkeypatch.setattr(calibrate_module, "_launch_workers", launch)
    told: list[str] = []
    loads[:] = [1.0, 0.1, 0.0]
    report = run_workers(2, Mesh((2,)), "4096", on_busy=told.append)
    assert loads == [0.0] and report["other_load_cores"] == 0.1  # measured again once, that launch kept
    assert len(told) == 1 and "other work used 1.00 cores" in told[0] and f"(1 of {OTHER_LOAD_RETRIES})" in told[0]
    assert busy_note(report, 2) is None
    told.clear()
    loads[:] = [None, 0.9]  # a machine without /proc/stat: nothing to judge, one launch
    assert run_workers(2, Mesh((2,)), "4096", on_busy=told.append)["other_load_cores"] is None and not told
    # every try contended: the least contended launch is kept, and the note tells the user what to do
    loads[:] = [1.0, 0.6, 0.9]
    report = run_workers(2, Mesh((2,)), "4096", on_busy=told.append)
    assert not loads and report["other_load_cores"] == 0.6 and len(told) == OTHER_LOAD_RETRIES
    assert report["device"]["peak_flops_per_s"] == pytest.approx(1e9 / 1.6)
    note = busy_note(report, 2)
    assert note is not None and "0.60 cores" in note and "metadist calibrate --nproc 2" in note
    assert OTHER_LOAD_LIMIT_CORES < 0.6
    loads[:] = [1.0, 0.7, 0.8]
    told.clear()
    machine_cluster(Mesh((2,)), tmp_path, announce=told.append)
    assert "calibrating this machine" in told[0] and "0.70 cores" in told[-1] and len(told) == 2 + OTHER_LOAD_RETRIES
    assert load_calibration(calibration_path(tmp_path, 2))["other_load_cores"] == 0.7
    # several launches (processes outnumbering the cores): each launch judged on its own, the merge keeps the busiest
    loads[:] = [0.0, 0.2, 0.9, 0.1]
    merged = run_workers(4, Mesh((4,)), "4096", launches=3)
    assert not loads and merged["other_load_cores_by_launch"] == [0.0, 0.2, 0.1] and merged["other_load_cores"] == 0.2


@pytest.mark.skipif(not __import__("pathlib").Path("/proc/stat").exists(), reason="reads Linux's /proc/stat")
def test_the_busy_time_counts_other_processes_and_not_the_launchs_own():
    """The two readings a launch's other load is taken from: a child that has ended and been waited for is the
    launch's own work; a process still running beside it is other work."""
    import subprocess
    import sys
    import time

    from metadist.cost.calibrate import _busy_seconds, _own_cpu_seconds

    spin = [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 0.6: pass"]
    busy, own = _busy_seconds(), _own_cpu_seconds()
    subprocess.run(spin, check=True)  # waited for: its CPU time is this process's children's
    busy_after, own_after = _busy_seconds(), _own_cpu_seconds()
    assert busy_after - busy >= 0.4 and own_after - own >= 0.4
    assert (busy_after - busy) - (own_after - own) < 0.3
    other = subprocess.Popen(spin)
    try:
        busy, own = _busy_seconds(), _own_cpu_seconds()
        time.sleep(0.5)  # the other process spins meanwhile, not yet waited for
        busy_after, own_after = _busy_seconds(), _own_cpu_seconds()
    finally:
        other.wait()
    assert (busy_after - busy) - (own_after - own) >= 0.3


def test_a_calibration_launch_gives_its_ranks_one_thread_as_metadist_run_does(monkeypatch):
    """The calibration's workers run with the threads ``metadist run`` gives its ranks (forking.rank_environment):
    one each where ``OMP_NUM_THREADS`` is unset, empty or blank (torchrun leaves an empty one as it is, and torch then
    runs a thread per core in every rank), the user's number where one is set; an outer launch's variables dropped."""
    from metadist.cost.calibrate import _fresh_launch_env

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer")
    for value in (None, "", "  "):
        if value is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", value)
        env = _fresh_launch_env(4)
        assert env["OMP_NUM_THREADS"] == "1" and "RANK" not in env and "TORCHELASTIC_RUN_ID" not in env
        assert _fresh_launch_env(1).get("OMP_NUM_THREADS") == value  # one process: every core, as torchrun leaves it
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _fresh_launch_env(4)["OMP_NUM_THREADS"] == "3"
