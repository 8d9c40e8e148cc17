"""Kernels of tiered-cache: paged attention over a two-tier block table, block copies between
the layer-major GPU pool and the block-major host pool, FP8 (e4m3) quantization.

Every function takes ``backend="auto" | "triton" | "torch"``: Triton on CUDA, the pure-torch twin
on CPU (``reference.py``), overridable (tests force ``"triton"`` on CPU under
``TRITON_INTERPRET=1``). Triton is imported only when a Triton path runs.
"""

from .api import (
    copy_blocks_to_gpu,
    copy_blocks_to_host,
    dequantize_fp8,
    merge_attention_states,
    paged_decode_attention,
    prefill_attention,
    quantize_fp8,
)
from .dispatch import Backend

__all__ = [
    "Backend",
    "copy_blocks_to_gpu",
    "copy_blocks_to_host",
    "dequantize_fp8",
    "merge_attention_states",
    "paged_decode_attention",
    "prefill_attention",
    "quantize_fp8",
]
