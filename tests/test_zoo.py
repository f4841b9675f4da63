"""The model zoo: HuggingFace architectures with the library's defaults, trained under --check.

Tiers: the default tier checks the definitions (every model builds with the library's defaults
and takes an eager step), the page against its results file, and trains two models under --check
(``default_tier`` in the zoo: qwen2 on mesh (2, 2), t5 on mesh (2); about a minute in all);
every model on every mesh runs with ``pytest --zoo tests/test_zoo.py`` (marker ``zoo``, about an
hour on 2 CPUs), as ``python -m metadist.bench.zoo`` does when it writes docs/models.md.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from metadist.bench.zoo import ZooRun, merge_results, public_text, run_one
from metadist.bench.zoo_report import pass_rates, render_page
from metadist.ir import Mesh
from metadist.runtime.summary import CheckSummary, RunSummary, UnruledOp
from metadist.workload import WorkloadError
from metadist.workloads import load_workload
from metadist.workloads.zoo import MODELS, ZOO, ZOO_NAMES, zoo_workload

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DOCS = Path(__file__).resolve().parents[1] / "docs"
MESHES = (Mesh((2,)), Mesh((2, 2)))

# Config keys that are not sizes: setting one would step around the library's defaults.
NOT_SIZES = re.compile(r"dropout|attn_implementation|attention_implementation|layerdrop|loss|act|mask_time|"
                       r"mask_feature|spec_augment|init|eps|dtype|tie|scaling|rope|use_cache|bias")


# ---------------------------------------------------------------- the definitions


def test_the_zoo_covers_the_architectures_users_bring():
    assert len(MODELS) >= 20
    kinds = {model.kind for model in MODELS}
    assert {"decoder", "encoder", "encoder-decoder", "vision"} <= kinds
    for name in ("gpt2", "llama", "qwen2", "mistral", "bert", "roberta", "t5", "bart", "vit", "resnet"):
        assert name in ZOO
    assert len(set(ZOO_NAMES)) == len(MODELS)


@pytest.mark.parametrize("model", MODELS, ids=[model.name for model in MODELS])
def test_zoo_configs_set_sizes_only(model):
    """Library defaults: attention, dropout, activation, loss, initialisation are never set."""
    def keys(config: dict):
        for key, value in config.items():
            yield key
            if isinstance(value, dict):
                yield from keys(value)

    offending = [key for key in keys(model.config) if NOT_SIZES.search(key)]
    assert not offending, f"zoo:{model.name} sets {offending}: the zoo sets sizes only"


@pytest.mark.parametrize("model", MODELS, ids=[model.name for model in MODELS])
def test_zoo_model_builds_with_default_attention_and_takes_a_step(model):
    workload = zoo_workload(model.name)
    assert workload.name == f"zoo:{model.name}"
    # the library's default: SDPA wherever the class supports it (Bloom, Gemma2, DeBERTa-v2 and the
    # convolutional models have no SDPA path, and transformers picks eager for them by itself)
    supports_sdpa = getattr(type(workload.model), "_supports_sdpa", False)
    assert workload.model.config._attn_implementation == ("sdpa" if supports_sdpa else "eager")
    assert workload.model.training
    loss = workload.loss_fn(workload.model, workload.batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    missing = {name for name, p in workload.model.named_parameters() if p.requires_grad and p.grad is None}
    if getattr(workload.model.config, "layerdrop", 0.0) > 0:
        # LayerDrop (wav2vec2's default 0.1) skips whole layers at random while training: their weights get no
        # gradient in that step, and every other weight does
        skipped = {match.group(1) for match in map(re.compile(r"(.*\.layers\.\d+)\.").match, missing) if match}
        missing -= {name for name, _ in workload.model.named_parameters() if any(name.startswith(f"{layer}.") for layer in skipped)}
    assert not missing, f"no gradient for {sorted(missing)}"


def test_zoo_builds_are_reproducible_and_meta_builds_allocate_nothing():
    one, two = zoo_workload("qwen2"), zoo_workload("zoo:qwen2")
    for (name, a), b in zip(one.model.state_dict().items(), two.model.state_dict().values()):
        assert torch.equal(a, b), name
    for key in one.batch:
        assert torch.equal(one.batch[key], two.batch[key])
    meta = zoo_workload("qwen2", device="meta")
    assert all(p.device.type == "meta" for p in meta.model.parameters())
    assert meta.extras["params"] == one.extras["params"]


def test_zoo_names_load_as_builtins_and_unknown_names_say_which_exist():
    assert load_workload("zoo:vit").name == "zoo:vit"
    with pytest.raises(WorkloadError, match=r"unknown zoo model 'zoo:lama'.*Did you mean 'zoo:llama'"):
        load_workload("zoo:lama")
    with pytest.raises(WorkloadError, match="built on 'cpu'"):
        zoo_workload("bert", device="cuda:3")


@pytest.mark.parametrize("model", [model for model in MODELS if model.known_failure],
                         ids=[model.name for model in MODELS if model.known_failure])
def test_known_failures_stop_at_capture_with_the_stated_reason(model):
    from metadist.frontends.torch import CaptureError, capture_step

    workload = zoo_workload(model.name)
    with pytest.raises(CaptureError) as info:
        capture_step(workload.train_step(), workload.model, workload.optimizer(workload.model.parameters()),
                     workload.batch)
    assert model.failure_fragment in str(info.value)


def test_wav2vec2_without_layerdrop_is_refused_for_its_numpy_masks():
    """The second half of wav2vec2's statement: SpecAugment's numpy masks would be frozen into the graph."""
    import transformers

    from metadist.frontends.torch import CaptureError, capture_step

    workload = zoo_workload("wav2vec2")
    config = transformers.Wav2Vec2Config(**ZOO["wav2vec2"].config, layerdrop=0.0)
    model = transformers.Wav2Vec2ForSequenceClassification(config)
    with pytest.raises(CaptureError, match="numpy's `np.random`"):
        capture_step(workload.train_step(), model, workload.optimizer(model.parameters()), workload.batch)


# ---------------------------------------------------------------- the page


def _run(model: str, mesh: tuple, passed: bool, failure: str | None = None) -> ZooRun:
    summary = RunSummary(
        model=f"zoo:{model}", mesh=mesh, parameters=123, losses=(1.0, 0.9, 0.8),
        phase_seconds={"capture": 1.0, "discovery": 2.0, "solve": 0.5, "lowering": 0.25, "reference run": 9.0},
        unruled=(UnruledOp("aten.sort.default", 2, "no factor"),),
        check=CheckSummary(passed=passed, tensors=10, max_abs=3e-6 if passed else 0.5, max_rel=1e-5, worst="grad:w",
                           excused=0),
    )
    return ZooRun(model=model, mesh=mesh, parameters=123, passed=passed, wall_s=30.0, summary=summary, failure=failure)


def test_page_shows_pass_rates_rows_differences_unruled_ops_compile_seconds_and_failures():
    runs = [_run("gpt2", (2,), True), _run("gpt2", (2, 2), True), _run("t5", (2,), True),
            _run("t5", (2, 2), False, "step 0: CheckError: 1 of 10 tensors differ")]
    page = render_page(runs, {})
    assert "mesh (2): 2 of 2 (100 %), mesh (2, 2): 1 of 2 (50 %)" in page
    assert pass_rates(runs) == {(2,): (2, 2), (2, 2): (1, 2)}
    row = next(line for line in page.splitlines() if line.startswith("| `zoo:t5`"))
    assert "T5ForConditionalGeneration" in row and "| pass | **FAIL** |" in row
    assert "3.0e-06 / 5.0e-01" in row and "`aten.sort.default` (2)" in row and "3.8 / 3.8" in row
    assert "- `zoo:t5` (mesh (2, 2)): The run stops with: step 0: CheckError: 1 of 10 tensors differ" in page
    known = render_page([_run("wav2vec2", mesh, False, "capture: CaptureError: at if not skip_the_layer:")
                         for mesh in ((2,), (2, 2))], {})
    line = next(line for line in known.splitlines() if line.startswith("- `zoo:wav2vec2`"))
    assert line.startswith("- `zoo:wav2vec2` (mesh (2), (2, 2)): LayerDrop")
    assert line.endswith("The run stops with: capture: CaptureError: at if not skip_the_layer:")


def test_results_round_trip_and_merge_in_zoo_order():
    old = [_run("t5", (2,), False, "x"), _run("gpt2", (2,), True)]
    merged = merge_results(old, [_run("t5", (2,), True), _run("bert", (2, 2), True)])
    assert [(run.model, run.mesh, run.passed) for run in merged] == [
        ("gpt2", (2,), True), ("bert", (2, 2), True), ("t5", (2,), True)]
    for run in merged:
        assert ZooRun.from_dict(json.loads(json.dumps(run.to_dict()))) == run


def test_failure_lines_name_no_path_of_this_machine():
    import metadist

    repo = str(Path(metadist.__file__).resolve().parents[1])
    text = (f"capture: CaptureError: at {repo}/tests/x.py:3 and "
            f"{Path(torch.__file__).parents[1]}/transformers/models/a.py:5 (if x:)")
    cleaned = public_text(text)
    assert repo not in cleaned and "site-packages" not in cleaned
    assert "tests/x.py:3" in cleaned and "transformers/models/a.py:5" in cleaned


def test_docs_models_md_is_generated_from_the_committed_results():
    """docs/models.md is what the results file renders to; every zoo model has a row on both meshes, at least
    90 % pass on each mesh, and every failing run is a model whose known failure says why."""
    from metadist.bench.zoo import read_results

    runs, facts = read_results(DOCS / "zoo" / "results.json")
    assert facts, "the results file records the full run's command and wall time"
    assert (DOCS / "models.md").read_text() == render_page(runs, facts)
    assert {(run.model, run.mesh) for run in runs} == {(model.name, mesh.shape) for model in MODELS for mesh in MESHES}
    for mesh, (passed, total) in pass_rates(runs).items():
        assert passed >= 0.9 * total, f"mesh {mesh}: {passed} of {total} pass"
    for run in runs:
        model = ZOO[run.model]
        if model.known_failure is None:
            assert run.passed, f"zoo:{run.model} on {run.mesh} failed: {run.failure}"
        else:
            assert not run.passed and model.failure_fragment in run.failure, (run.model, run.failure)
    assert "/tmp/" not in (DOCS / "models.md").read_text() and "site-packages" not in (DOCS / "models.md").read_text()


# ---------------------------------------------------------------- training under --check


def _assert_expected(run: ZooRun) -> None:
    model = ZOO[run.model]
    if model.known_failure is None:
        assert run.passed, f"zoo:{run.model} on {run.mesh}: {run.failure}"
        assert run.summary.check.tensors > 3 and len(run.summary.losses) == 3
    else:
        assert not run.passed and model.failure_fragment in run.failure, run.failure


DEFAULT_CASES = [(model.name, mesh) for model in MODELS for mesh in MESHES if model.default_tier == mesh.shape]
ZOO_CASES = [(model.name, mesh) for model in MODELS for mesh in MESHES if model.default_tier != mesh.shape]


@pytest.mark.distributed
@pytest.mark.parametrize("model,mesh", DEFAULT_CASES, ids=[f"{m}-{'x'.join(map(str, s.shape))}" for m, s in DEFAULT_CASES])
def test_default_tier_zoo_models_train_under_check(model, mesh, tmp_path):
    _assert_expected(run_one(model, mesh, steps=3, log_dir=tmp_path, timeout_s=300))


@pytest.mark.zoo
@pytest.mark.distributed
@pytest.mark.parametrize("model,mesh", ZOO_CASES, ids=[f"{m}-{'x'.join(map(str, s.shape))}" for m, s in ZOO_CASES])
def test_zoo_model_trains_under_check(model, mesh, tmp_path):
    _assert_expected(run_one(model, mesh, steps=3, log_dir=tmp_path, timeout_s=300))
