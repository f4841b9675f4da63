"""Built-in workloads and the model-file loader (metadist.workloads)."""

from __future__ import annotations

import math
import resource
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from metadist.workload import Workload, WorkloadError
from metadist.workloads import BUILTIN_NAMES, builtin_workload, load_workload

MOE_TINY = ("mixtral-tiny", "mixtral-mini", "qwen2-moe-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny")
TINY = ("mlp", "cnn", "gpt2-tiny", "llama-tiny", "bert-tiny", *MOE_TINY)
LARGE = tuple(name for name in BUILTIN_NAMES if name not in TINY)

# name -> the default batch: {key: shape}
DEFAULT_BATCH_SHAPES = {
    "mlp": {"inputs": (32, 64), "targets": (32,)},
    "cnn": {"inputs": (8, 3, 16, 16), "targets": (8,)},
    "gpt2-tiny": {"input_ids": (4, 16), "labels": (4, 16)},
    "gpt2-small": {"input_ids": (8, 1024), "labels": (8, 1024)},
    "gpt2-medium": {"input_ids": (8, 1024), "labels": (8, 1024)},
    "gpt2-large": {"input_ids": (8, 1024), "labels": (8, 1024)},
    "gpt2-xl": {"input_ids": (8, 1024), "labels": (8, 1024)},
    "llama-tiny": {"input_ids": (4, 16), "labels": (4, 16)},
    "llama-1b": {"input_ids": (8, 2048), "labels": (8, 2048)},
    "llama-7b": {"input_ids": (8, 2048), "labels": (8, 2048)},
    "llama-70b": {"input_ids": (1024, 4096), "labels": (1024, 4096)},
    "bert-tiny": {"input_ids": (4, 16), "attention_mask": (4, 16), "labels": (4, 16)},
    "bert-base": {"input_ids": (8, 512), "attention_mask": (8, 512), "labels": (8, 512)},
    **{name: {"input_ids": (4, 16), "labels": (4, 16)} for name in MOE_TINY},
    "mixtral-mini": {"input_ids": (4, 32), "labels": (4, 32)},
    "mixtral-8x7b": {"input_ids": (8, 2048), "labels": (8, 2048)},
}

# Published sizes (tied embeddings counted once), checked within 2%.
PUBLISHED_PARAMS = {
    "gpt2-small": 124e6,
    "gpt2-medium": 355e6,
    "gpt2-large": 774e6,
    "gpt2-xl": 1.558e9,
    "llama-1b": 1.236e9,
    "llama-7b": 6.738e9,
    "llama-70b": 68.977e9,
    "bert-base": 110e6,
    "mixtral-8x7b": 46.7e9,
}


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- built-ins


def test_builtin_names_cover_the_catalogue():
    assert set(BUILTIN_NAMES) == set(DEFAULT_BATCH_SHAPES)
    assert len(BUILTIN_NAMES) == len(set(BUILTIN_NAMES))


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_every_builtin_builds_with_its_default_device_and_batch(name):
    workload = builtin_workload(name)
    assert isinstance(workload, Workload)
    assert workload.name == name and workload.description
    expected_device = "cpu" if name in TINY else "meta"
    assert {p.device.type for p in workload.model.parameters()} == {expected_device}
    assert workload.extras["device"] == expected_device
    assert workload.extras["params"] == n_params(workload.model)
    assert workload.model.training, "built-ins train: dropout and batch norm must run in training mode"
    shapes = {key: tuple(value.shape) for key, value in workload.batch.items()}
    assert shapes == DEFAULT_BATCH_SHAPES[name]
    assert all(value.device.type == "cpu" for value in workload.batch.values()), "batches are real CPU tensors"
    if "input_ids" in workload.batch:
        vocab_size = workload.extras["config"]["vocab_size"]
        ids = workload.batch["input_ids"]
        assert ids.dtype == torch.long and 0 <= int(ids.min()) and int(ids.max()) < vocab_size
        # The library's default attention (SDPA); eager attention on request.
        assert workload.model.config._attn_implementation == "sdpa"
        assert workload.extras["config"]["_attn_implementation"] == "sdpa"
        assert builtin_workload(name, attn_implementation="eager").model.config._attn_implementation == "eager"


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_large_builtins_have_the_published_parameter_count(name):
    params = n_params(builtin_workload(name).model)
    assert params == pytest.approx(PUBLISHED_PARAMS[name], rel=0.02), f"{name}: {params:,} parameters"


def test_llama_builtins_have_the_published_shapes():
    config_1b = builtin_workload("llama-1b").model.config
    assert (config_1b.hidden_size, config_1b.num_hidden_layers, config_1b.num_attention_heads) == (2048, 16, 32)
    assert (config_1b.num_key_value_heads, config_1b.intermediate_size, config_1b.vocab_size) == (8, 8192, 128256)
    assert config_1b.tie_word_embeddings
    config_7b = builtin_workload("llama-7b").model.config
    assert (config_7b.hidden_size, config_7b.num_hidden_layers, config_7b.intermediate_size) == (4096, 32, 11008)
    assert config_7b.vocab_size == 32000 and not config_7b.tie_word_embeddings


def test_transformer_builtins_keep_their_default_dropout():
    assert builtin_workload("gpt2-tiny").model.config.resid_pdrop == pytest.approx(0.1)
    assert builtin_workload("bert-tiny").model.config.hidden_dropout_prob == pytest.approx(0.1)


def test_llama_7b_on_meta_is_fast_and_allocates_almost_nothing():
    builtin_workload("llama-tiny")  # import transformers before measuring
    peak_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    workload = builtin_workload("llama-7b")
    elapsed_s = time.perf_counter() - start
    peak_growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before_kib) / 1024
    assert all(p.is_meta for p in workload.model.parameters())
    assert elapsed_s < 5.0, f"building llama-7b on meta took {elapsed_s:.1f} s"
    # Real fp32 weights would be ~27 GB; the peak may grow a little from Python objects only.
    assert peak_growth_mib < 256, f"peak RSS grew by {peak_growth_mib:.0f} MiB"


@pytest.mark.parametrize("name", TINY)
def test_tiny_builtin_runs_one_eager_training_step(name):
    workload = builtin_workload(name)
    model = workload.model
    optimizer = workload.optimizer(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    loss = workload.train_step()(model, optimizer, workload.batch)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    changed = sum(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert changed > 0.5 * len(before), f"only {changed}/{len(before)} parameters moved"
    assert all(p.grad is None or not p.grad.any() for p in model.parameters()), "zero_grad ran"


@pytest.mark.parametrize("name", TINY)
def test_same_name_gives_identical_weights_and_batch(name):
    first, second = builtin_workload(name), builtin_workload(name)
    first_state, second_state = first.model.state_dict(), second.model.state_dict()
    assert first_state.keys() == second_state.keys()
    for key in first_state:
        assert torch.equal(first_state[key], second_state[key]), key
    for key in first.batch:
        assert torch.equal(first.batch[key], second.batch[key]), key


def test_building_leaves_the_callers_rng_untouched():
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    builtin_workload("gpt2-tiny")
    assert torch.equal(torch.rand(4), expected)


def test_batch_size_and_seq_len_override_the_defaults():
    workload = builtin_workload("gpt2-small", batch_size=2, seq_len=128)
    assert workload.batch["input_ids"].shape == (2, 128)
    assert (workload.extras["batch_size"], workload.extras["seq_len"]) == (2, 128)
    assert builtin_workload("cnn", batch_size=3).batch["inputs"].shape == (3, 3, 16, 16)


def test_device_override_builds_real_or_meta_weights():
    assert all(p.is_meta for p in builtin_workload("gpt2-tiny", device="meta").model.parameters())
    real = builtin_workload("bert-tiny", device="cpu")
    assert all(p.device.type == "cpu" for p in real.model.parameters())


def test_masked_lm_batch_predicts_only_masked_tokens():
    batch = builtin_workload("bert-base", batch_size=4, seq_len=64).batch
    predicted = batch["labels"] != -100
    assert predicted.any(dim=1).all(), "every row predicts at least one token"
    assert 0.05 < predicted.float().mean().item() < 0.4
    assert (batch["input_ids"][predicted] == 103).all(), "predicted tokens are [MASK]ed in the input"
    assert (batch["attention_mask"] == 1).all()


@pytest.mark.parametrize(
    ("optimizer", "expected_class", "lr"),
    [("adamw", torch.optim.AdamW, 1e-3), ("adam", torch.optim.Adam, 1e-3), ("sgd", torch.optim.SGD, 1e-2)],
)
def test_optimizer_choice(optimizer, expected_class, lr):
    workload = builtin_workload("mlp", optimizer=optimizer)
    built = workload.optimizer(workload.model.parameters())
    assert type(built) is expected_class
    assert built.param_groups[0]["lr"] == lr


def test_importing_the_package_is_quiet_and_defers_transformers():
    code = "import sys, metadist.workloads; assert 'transformers' not in sys.modules, 'transformers imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


# ---------------------------------------------------------------- builtin errors


@pytest.mark.parametrize(
    ("kwargs", "keywords"),
    [
        (dict(name="gpt2-smal"), ["unknown built-in", "'gpt2-small'", "llama-7b", "file.py"]),
        (dict(name="mlp", optimizer="lamb"), ["unknown optimizer", "'lamb'", "adamw", "sgd"]),
        (dict(name="mlp", seq_len=8), ["no sequence dim", "seq_len"]),
        (dict(name="gpt2-tiny", seq_len=100_000), ["seq_len=100000", "256"]),
        (dict(name="gpt2-tiny", batch_size=0), ["batch_size", "positive"]),
        (dict(name="mlp", device="not-a-device"), ["not-a-device", "'meta'"]),
    ],
)
def test_builtin_errors_say_what_and_how_to_fix(kwargs, keywords):
    with pytest.raises(WorkloadError) as info:
        builtin_workload(**kwargs)
    for keyword in keywords:
        assert keyword in str(info.value)


# ---------------------------------------------------------------- model files

MODEL_FILE = """
import torch
from metadist import Workload

def helper():
    return 3

def workload():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, helper())
    batch = {"x": torch.randn(2, 4), "y": torch.randn(2, 3)}
    return Workload(
        model=model,
        batch=batch,
        loss_fn=lambda model, batch: torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )

def named():
    return Workload(
        model=torch.nn.Linear(2, 2),
        batch=torch.randn(1, 2),
        loss_fn=lambda model, batch: model(batch).sum(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        name="mine",
    )

def not_a_workload():
    return {"model": None}

def forgets_to_return():
    Workload

def broken():
    raise RuntimeError("kaboom in user code")
"""


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(textwrap.dedent(MODEL_FILE))
    return path


def test_load_workload_takes_a_builtin_name():
    workload = load_workload("mlp")
    assert workload.name == "mlp" and workload.extras["params"] > 0


def test_load_workload_from_a_file_with_the_default_function(model_file):
    workload = load_workload(str(model_file))
    assert isinstance(workload, Workload)
    assert workload.name == "my_model:workload"
    loss = workload.train_step()(workload.model, workload.optimizer(workload.model.parameters()), workload.batch)
    assert math.isfinite(loss.item())


def test_load_workload_from_a_file_with_a_named_function(model_file):
    workload = load_workload(f"{model_file}:named")
    assert workload.name == "mine"
    assert workload.model.in_features == 2


def test_model_file_may_import_its_neighbours(tmp_path):
    (tmp_path / "neighbour_layers.py").write_text("import torch\nWIDTH = 5\n")
    (tmp_path / "uses_neighbour.py").write_text(textwrap.dedent("""
        import torch
        from metadist import Workload
        from neighbour_layers import WIDTH

        def workload():
            return Workload(model=torch.nn.Linear(WIDTH, 1), batch=torch.ones(1, WIDTH),
                            loss_fn=lambda m, b: m(b).sum(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    """))
    assert load_workload(str(tmp_path / "uses_neighbour.py")).model.in_features == 5


@pytest.mark.parametrize(
    ("suffix", "keywords"),
    [
        (":missing", ["no function 'missing'", "helper", "named", "workload", "my_model.py"]),
        (":not_a_workload", ["returned dict", "not a Workload", "my_model.py"]),
        (":forgets_to_return", ["returned NoneType", "forget to return"]),
        (":broken", ["broken()", "RuntimeError", "kaboom in user code", "my_model.py"]),
    ],
)
def test_model_file_errors_say_what_and_how_to_fix(model_file, suffix, keywords):
    with pytest.raises(WorkloadError) as info:
        load_workload(f"{model_file}{suffix}")
    for keyword in keywords:
        assert keyword in str(info.value)
    if suffix == ":broken":
        assert isinstance(info.value.__cause__, RuntimeError), "the user's exception is chained"


def test_model_file_that_does_not_exist(tmp_path):
    with pytest.raises(WorkloadError, match="does not exist"):
        load_workload(str(tmp_path / "nowhere.py"))
    with pytest.raises(WorkloadError, match="does not exist"):
        load_workload(f"{tmp_path / 'nowhere.py'}:fn")


def test_model_file_that_raises_on_import_names_the_file(tmp_path):
    path = tmp_path / "bad_import.py"
    path.write_text("import torch\nx = 1 / 0\n")
    with pytest.raises(WorkloadError) as info:
        load_workload(str(path))
    message = str(info.value)
    assert "bad_import.py" in message and "ZeroDivisionError" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert not any(name.startswith("metadist_workload_bad_import") for name in sys.modules)


def test_unknown_name_in_load_workload_suggests_the_closest_builtin():
    with pytest.raises(WorkloadError) as info:
        load_workload("llama7b")
    message = str(info.value)
    assert "did you mean 'llama-7b'" in message.lower()
    assert all(name in message for name in BUILTIN_NAMES)
