"""The Triton kernels compile for a GPU (sm_90) on a machine without one.

The interpreter runs the kernels' arithmetic but not the compiler, so this lowers them through
Triton's CUDA backend to a cubin in a subprocess with TRITON_INTERPRET unset."""

import os
import shutil
import subprocess
import sys

# Like every kernel test module: decide before anything imports triton (the interpreter must be
# on from triton's first import for the other kernel tests; this one compiles in a subprocess).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytestmark = pytest.mark.slow     # processes, servers or sweeps (tests/conftest.py)


def _cuda_backend_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _cuda_backend_available(), reason="triton without its CUDA backend")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "tiered_cache.kernels.aot_check", "--arch", "90", "--quick"],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
