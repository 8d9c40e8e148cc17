# The two commands: `make run` and `make test`. Both create .venv and install on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= configs/default.yaml
export TRITON_INTERPRET ?= $(if $(shell command -v nvidia-smi 2>/dev/null),0,1)

.PHONY: run test bench lint install wheel-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Without a GPU, pin the CPU torch wheel: an unpinned torch pulls a multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[dev,hf,tools,remote]'
	# Compile the default policy's numba kernels once (~20 s of CPU; cached on disk), so no
	# test or server pays it at its first request.
	$(PY) -c "from tiered_cache.policies.duel_arrays import warm_up; warm_up()"
	touch $(STAMP)

install: $(STAMP)

# The main job (one engine: no reuse / GPU only / tiered), then the node daemon's job (two
# engine processes sharing prefixes through `tiered-cache serve`).
run: $(STAMP)
	$(VENV)/bin/tiered-cache run --config $(CONFIG)
	$(VENV)/bin/tiered-cache run-shared --config $(CONFIG)

test: $(STAMP)
	$(VENV)/bin/pytest

bench: $(STAMP)
	$(PY) benchmarks/control_plane.py
	$(PY) benchmarks/migration.py --threads 1
	$(PY) benchmarks/compaction.py
	$(PY) benchmarks/attention.py
	$(PY) benchmarks/replay.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# A wheel built from the repo, installed in a clean venv, must import the mapped subpackages,
# and its tools must run without the `tools` extra (no matplotlib, no tqdm) where they can. It
# runs from an empty directory: a stray module in /tmp (an `nt.py`, say) would shadow the stdlib.
wheel-check: $(STAMP)
	rm -rf build dist /tmp/tc-wheel-venv /tmp/tc-wheel-run
	mkdir -p /tmp/tc-wheel-run
	$(PY) -m pip wheel -q --no-deps -w dist . >/dev/null
	python3 -m venv /tmp/tc-wheel-venv
	/tmp/tc-wheel-venv/bin/pip install -q torch==2.13.0 dist/*.whl
	cd /tmp/tc-wheel-run && /tmp/tc-wheel-venv/bin/python -c "import tiered_cache.kernels, tiered_cache.migrator, tiered_cache, tiered_cache.tools.replay; print('wheel ok:', tiered_cache.__file__)"
	cd /tmp/tc-wheel-run && /tmp/tc-wheel-venv/bin/tiered-cache --version
	cd /tmp/tc-wheel-run && /tmp/tc-wheel-venv/bin/tiered-cache plan >/dev/null
	cd /tmp/tc-wheel-run && /tmp/tc-wheel-venv/bin/tiered-cache replay --workload chat --requests 50 --gpu-blocks 200 >/dev/null

clean:
	rm -rf build dist *.egg-info .pytest_cache
