"""Compile every Triton kernel for a CUDA architecture without a GPU.

The interpreter (``TRITON_INTERPRET=1``) checks what the kernels compute but not that they
compile: it accepts things the compiler rejects (non-constexpr globals, dtype mismatches in
``tl.dot``, unsupported casts). This lowers each kernel, in the configurations the launchers
use, through Triton's CUDA backend down to a cubin (bundled ptxas), so a CPU-only CI catches
those errors. Run in a process where ``TRITON_INTERPRET`` is unset:

    python -m tiered_cache.kernels.aot_check [--arch 90] [--quick | --full]

Exit status 0 when every kernel compiled; the failures are printed otherwise.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
import traceback
from collections.abc import Callable

import torch

TYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8e4nv", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32",
    torch.int64: "i64",
}


def _compile(kernel, arg_type: Callable[[str], str], meta: dict, arch: int) -> None:
    """Lower ``kernel`` with every non-constexpr argument typed by ``arg_type(name)``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    meta = dict(meta)
    num_warps = meta.pop("num_warps", 4)
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in meta else arg_type(n) for n in names}
    constexprs = {(names.index(k),): v for k, v in meta.items()}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def _attention_types(kv: torch.dtype, q: torch.dtype, out: str) -> Callable[[str], str]:
    def arg_type(name: str) -> str:
        if name == "q_ptr":
            return "*" + TYPES[q]
        if name in ("kg_ptr", "kh_ptr", "vg_ptr", "vh_ptr"):
            return "*" + TYPES[kv]
        if name in ("ksg_ptr", "ksh_ptr", "vsg_ptr", "vsh_ptr", "lse_ptr"):
            return "*fp32"
        pointers = {"bt_ptr": "*i32", "tier_ptr": "*i8", "len_ptr": "*i32", "o_ptr": "*" + out}
        if name in pointers:
            return pointers[name]
        return "fp32" if name == "qk_scale" else "i32"

    return arg_type


# --quick keeps one configuration per code path: split + merge, FP8 dequantization, prefill.
QUICK = ("decode kv=bf16 q=bf16 splits=8", "decode kv=fp8e4nv q=bf16 splits=1",
         "prefill kv=fp8e4nv q=bf16")


def cases(full: bool, quick: bool = False) -> list[tuple[str, Callable[[int], None]]]:
    """(name, compile-for-arch) for each kernel configuration to check."""
    from . import copy as kcopy
    from . import decode, fp8, merge, prefill

    fp8_dtype = torch.float8_e4m3fn
    out: list[tuple[str, Callable[[int], None]]] = []
    # (kv dtype, q dtype): the 70B serving case, FP8 storage, fp16; fp32 (slow to build) on --full
    combos = [(torch.bfloat16, torch.bfloat16), (fp8_dtype, torch.bfloat16),
              (torch.float16, torch.float16)]
    if full:
        combos += [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]
    for kv, q in combos:
        for splits in (1, 8):
            meta = decode.decode_meta(q_dtype=q, kv_dtype=kv, group=8, head_dim=128, block_size=16,
                                      num_splits=splits, has_host=True, interpreted=False)
            types = _attention_types(kv, q, TYPES[q] if splits == 1 else "fp32")
            out.append((f"decode kv={TYPES[kv]} q={TYPES[q]} splits={splits}",
                        lambda arch, t=types, m=meta: _compile(decode._decode_kernel, t, m, arch)))
        meta = prefill.prefill_meta(q_dtype=q, kv_dtype=kv, group=8, head_dim=128, block_size=16,
                                    has_host=True, interpreted=False)
        types = _attention_types(kv, q, TYPES[q])
        out.append((f"prefill kv={TYPES[kv]} q={TYPES[q]}",
                    lambda arch, t=types, m=meta: _compile(
                        prefill._prefill_kernel, lambda n, t=t: "i32" if n in ("seq_len", "n_new")
                        else t(n), m, arch)))
    meta = decode.decode_meta(q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, group=1,
                              head_dim=64, block_size=16, num_splits=1, has_host=False,
                              interpreted=False)
    out.append(("decode GPU pool only, D=64, G=1", lambda arch, m=meta: _compile(
        decode._decode_kernel, _attention_types(torch.bfloat16, torch.bfloat16, "bf16"), m, arch)))
    out.append(("merge_splits", lambda arch: _compile(
        merge._merge_splits_kernel,
        lambda n: {"po_ptr": "*fp32", "pl_ptr": "*fp32", "o_ptr": "*bf16"}.get(n, "i32"),
        dict(NUM_SPLITS=8, S_PAD=8, HEAD_DIM=128, D_PAD=128), arch)))
    out.append(("merge_two", lambda arch: _compile(
        merge._merge_two_kernel,
        lambda n: {"l1_ptr": "*fp32", "l2_ptr": "*fp32", "l_ptr": "*fp32"}.get(
            n, "*bf16" if n.endswith("_ptr") else "i32"),
        dict(HEAD_DIM=128, D_PAD=128, BLOCK_R=16), arch)))
    out.append(("copy_chunks", lambda arch: _compile(
        kcopy._copy_chunks_kernel,
        lambda n: {"src_ptr": "*i16", "dst_ptr": "*i16", "layers_ptr": "*i32"}.get(
            n, "*i64" if n.endswith("_ptr") else "i64"),
        dict(CHUNK=16 * 8 * 128, BLOCK=4096), arch)))
    out.append(("quantize_fp8", lambda arch: _compile(
        fp8._quantize_fp8_kernel,
        lambda n: {"x_ptr": "*bf16", "y_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}[n],
        dict(NUMEL=16 * 8 * 128, BLOCK=2048, FMAX=448.0), arch)))
    if quick:
        out = [c for c in out if not c[0].startswith(("decode", "prefill")) or c[0] in QUICK]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compile the Triton kernels for a GPU, no GPU needed.")
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    p.add_argument("--full", action="store_true", help="also the float32 variants (slow)")
    p.add_argument("--quick", action="store_true", help="one configuration per code path")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    failures = 0
    for name, build in cases(args.full, args.quick):
        t0 = time.perf_counter()
        try:
            build(args.arch)
            print(f"ok    {name} ({time.perf_counter() - t0:.1f} s)")
        except Exception:
            failures += 1
            print(f"FAIL  {name}\n{traceback.format_exc(limit=2)}")
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
