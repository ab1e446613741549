"""Developer probe (no GPU needed): registers and spills of the split-row LayerNorm backward
(``_ln_bwd_split``) compiled for sm_90 by the local Triton, per (piece, warps, PREFETCH, cap),
and the programs of that size an H100/H200 SM holds by registers (65536 per SM). (Commit
cbb0941 also compiled RELOAD and pipelined variants, since removed; tune round 47.)

    PYTHONPATH=/tmp/t36:$PWD python benchmarks/dev/regs_split.py   # the lent machine's Triton
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fusedops.triton import layernorm as tln

POINTERS = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "mean_ptr": "*fp32",
            "rstd_ptr": "*fp32", "dx_ptr": "*bf16", "part_ptr": "*fp32", "stats_ptr": "*fp32",
            "count_ptr": "*i32"}


def compiled(n: int, chunk: int, warps: int, prefetch: int, cap: int | None):
    fn = tln._ln_bwd_split
    C, L = tln.split_pieces(n, chunk, 0)
    consts = dict(BLOCK=tln.next_pow2(L), C=C, C_P2=tln.next_pow2(C), HAS_W=True,
                  NEED_DX=True, NEED_DW=True, NEED_DB=True, PREFETCH=prefetch, PARKED=False,
                  VEC=0, PAIRED=True)
    aligned = list(POINTERS) + ["N", "L", "stride_dy", "stride_x", "stride_dx"]
    return compile_sm90(fn, consts, POINTERS, aligned, warps, cap)


def compile_sm90(fn, consts: dict, pointers: dict, aligned: list, warps: int, cap: int | None):
    """``fn`` compiled for sm_90 by the local Triton: ``consts`` as constexprs, ``pointers``
    (argument -> type, e.g. "*bf16"), other arguments int32, those in ``aligned`` declared
    16-byte divisible (as the launches specialise them), a register cap if ``cap``."""
    names = fn.arg_names
    sig = {a: pointers.get(a, "constexpr" if a in consts else "i32") for a in names}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    opts = {"num_warps": warps}
    if cap:
        opts["maxnreg"] = cap
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def resources(kernel) -> tuple[int, int]:
    """(registers per thread, spill stores in bytes) from the cubin (cuobjdump)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs = int(re.search(r"REG:(\d+)", text).group(1))
    stack = int(re.search(r"STACK:(\d+)", text).group(1))
    return regs, stack


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90, bf16 rows of 16384")
    for chunk, warps, prefetch, cap in ((4096, 8, 1, 128), (4096, 8, 1, None), (4096, 8, 0, None),
                                        (2048, 4, 1, None), (2048, 4, 0, None),
                                        (4096, 8, 0, 96), (2048, 8, 1, None)):
        regs, stack = resources(compiled(16384, chunk, warps, prefetch, cap))
        per_warp = -(-regs * 32 // 256) * 256  # allocated per warp in units of 256
        per_sm = min(65536 // (per_warp * warps), 64 // warps)
        print(f"piece {chunk:5d} warps {warps:2d} prefetch {prefetch} cap {cap!s:4s}: "
              f"{regs:3d} registers, {stack:3d} B stack, {per_sm} programs/SM, "
              f"{per_sm * chunk} elements/SM")

if __name__ == "__main__":
    main()
