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
