# Two commands (README): `make demo` sets everything up and runs the main job;
# `make test` runs the whole test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test setup bench zoo clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,jax]'
	# an editable install leaves MetaDist's sources uncompiled; where PYTHONDONTWRITEBYTECODE is set, every
	# process (each rank of a run) would compile them again: ~1 s of a short run
	$(BIN)/python -m compileall -q metadist
	touch $(STAMP)

setup: $(STAMP)

# The main job: capture gpt2-tiny's step; then plan a 12-layer, 768-wide GPT-2 (85M parameters) and train it on
# 2 local CPU processes (gloo), checking loss, gradients, parameters and optimizer state against one device.
demo: $(STAMP)
	$(BIN)/metadist capture gpt2-tiny --top 10
	OMP_NUM_THREADS=1 $(BIN)/metadist run examples/gpt_85m.py --nproc 2 --steps 2 --check

test: $(STAMP)
	$(BIN)/python -m pytest -q

# Benchmarks side by side (4 local gloo processes on CPU) and the simulated scale study;
# regenerates docs/benchmarks.md and docs/img/*.png from the run's result files.
bench: $(STAMP)
	$(BIN)/python -m metadist.bench.suite --nproc 4

# Every model of the zoo under --check on meshes (2) and (2, 2); regenerates docs/models.md.
zoo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m metadist.bench.zoo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
