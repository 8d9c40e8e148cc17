"""The vLLM engine tests run only where vLLM is installed (`make test-vllm` builds .venv-vllm
with the CPU build); elsewhere this directory is not collected."""

import importlib.util

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
