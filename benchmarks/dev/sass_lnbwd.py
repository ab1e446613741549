"""Developer probe (no GPU needed): compile the fused LayerNorm backward (``_ln_bwd_single``) for
sm_90 with the local Triton and count the SASS instructions of its row-tile loop.

    python benchmarks/dev/sass_lnbwd.py

Two bf16 configurations as launched for M·N = 2^27: N = 8192 (aligned, two-row tiles) and
N = 8193 (unaligned rows: aligned body plus edges, one-row tiles). For each, the loop body's
instruction count, per element per thread, and the most frequent opcodes. Triton's bundled
ptxas/nvdisasm do the work, so the numbers are those of the local Triton version (the lent
machine runs 3.6); they are indicative of where instructions go, not a timing.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fusedops.triton import layernorm as tln

POINTERS = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "mean_ptr": "*fp32",
            "rstd_ptr": "*fp32", "dx_ptr": "*bf16", "part_ptr": "*fp32"}


def sass(block: int, rows: int, vec: int, warps: int) -> str:
    fn = tln._ln_bwd_single
    names = fn.arg_names
    consts = dict(BLOCK_N=block, ROWS=rows, HAS_W=True, NEED_DX=True, NEED_DW=True,
                  NEED_DB=True, VEC=vec, HOLD_W=True, ACC_1D=True, PARKED=True, PAIRED=False, STAGES=1)
    sig = {n: POINTERS.get(n, "constexpr" if n in consts else "i32") for n in names}
    aligned = list(POINTERS) + ([] if vec else ["stride_dy", "stride_x", "stride_dx", "N"])
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def loop_body(text: str) -> list[str]:
    """The longest loop: instructions from a backward branch's target to the branch."""
    instrs, labels = [], {}
    for line in text.splitlines():
        label = re.match(r"^\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instrs)
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(.*?)\s*;", line)
        if m:
            instrs.append(m.group(1))
    body: list[str] = []
    for i, ins in enumerate(instrs):
        target = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", ins)
        start = labels.get(target.group(1), i + 1) if target else i + 1
        if start <= i and i + 1 - start > len(body):
            body = instrs[start:i + 1]
    return body


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90, bf16, 16 warps")
    for tag, block, rows, vec in (("N=8192 (two-row tiles)", 8192, 2, 0),
                                  ("N=8193 (one-row tiles, body + edges)", 8192, 1, 8)):
        body = loop_body(sass(block, rows, vec, 16))
        per_thread = rows * block // (16 * 32)
        ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in body)
        print(f"{tag}: loop {len(body)} instructions, {per_thread} elements per thread per "
              f"iteration, {len(body) / per_thread:.1f} per element; "
              + ", ".join(f"{k} {v}" for k, v in ops.most_common(10)))


if __name__ == "__main__":
    main()
