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
    again = machine_cluster(Mesh((2,)), tmp_path, announce=told.append)
    assert len(told) == 1 and again == first


def test_calibrating_again_drops_the_timed_matmul_shapes(tmp_path, monkeypatch):
    """``metadist calibrate`` replaces the calibration and deletes the matmul times taken at the last one's speed
    (:mod:`metadist.cost.matmul_times`): the next plan times its shapes again."""
    import metadist.cost.calibrate as calibrate_module
    from metadist.cli.main import main
    from metadist.cost.calibrate import cluster_from_report
    from metadist.cost.matmul_times import table_path

    monkeypatch.setenv("METADIST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate_module, "calibrate",
                        lambda nproc, mesh, sizes: (cluster_from_report(REPORT, mesh), REPORT))
    stale = table_path(tmp_path)
    stale.parent.mkdir(parents=True)
    stale.write_text('{"format": "metadist-matmul-times", "version": 1, "times": []}')
    assert main(["calibrate", "--nproc", "2"]) == 0
    assert not stale.exists() and load_calibration(calibration_path(tmp_path, 2)) == REPORT
