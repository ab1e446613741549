"""Developer probe: the split-row LayerNorm backward with its per-row exchange on chip.

The twenty-first session measured the 16-bit split kernel at 0.70 of copy with its exchange
through global memory (publish, fence, counter, poll, the peers' sums read back from L2) and
0.94 with the exchange taken out (split_rows.py). Hopper runs a *thread-block cluster*'s CTAs
at once on neighbouring SMs, and they can write each other's shared memory (distributed shared
memory) and meet at a hardware barrier. Triton 3.6's ``tl`` exposes neither (a kernel compiled
with ``num_ctas > 1`` fails in its CTA planning pass once it reduces), so this probe

* compiles an ordinary one-CTA kernel and launches it through Triton's own C launcher with the
  packed metadata's CTA count set to C (the launcher then asks the driver for clusters of C
  CTAs: program ``pid`` is piece ``pid % C`` of cluster ``pid // C``), and a dynamic shared
  memory size covering Triton's own use plus 2·C·8 bytes of exchange slots beyond it (their
  offset a kernel argument);
* exchanges each row's two partial sums in one inline-PTX block: threads 0..C-1 of each CTA
  store the CTA's (s1, s2) into slot [parity][rank] of CTA t's shared memory (``mapa`` +
  ``st.shared::cluster``), the cluster meets at ``barrier.cluster`` (release / acquire), and
  every thread sums the C local slots in rank order (so every piece gets the same sums).
  Slots alternate between two parities by row: a peer can only write a slot parity again after
  the next row's barrier, which this CTA reaches only after reading it.

Clusters depend on nothing outside themselves, so the grid needs no co-residency guarantee
beyond the cluster's own (no cooperative launch); it is the driver's count of clusters held at
once (cuOccupancyMaxActiveClusters): sized from registers alone it ran partly in a second wave.
MODE 1 (barrier only) and 2 (no barrier, no exchange) give wrong dx on purpose (bounds); MODE 3
(``_ln_bwd_cluster_lag``) splits the barrier: arrive, reduce the next row, then wait.

Results (H100, benchmarks/results/tune-h100-2026-11-25/cluster_rows-*.json; docs/performance.md,
twenty-second session): bf16 16K 2.34 TB/s on 2048 x 4 (shipped cooperative kernel 2.08), 32K
2.27 (2.04), 64K 2.10 on 4096 x 8 (1.98); float32 16K-64K 2.77-2.85 on 8192 x 8 (2.60-2.64);
barrier only 2.39, no barrier 2.84 (the barrier, not the exchange, is what remains); MODE 3
slower everywhere (registers). Shipped as ``_ln_bwd_split``'s CLUSTER variant
(fusedops/triton/_clusters.py), whose slots sit at the end of the dynamic shared memory
instead of at an offset passed in.

    PYTHONPATH=/tmp/t36:$PWD python benchmarks/dev/cluster_rows.py ptx     # local: sm_90 PTX/SASS
    OUT=dir python benchmarks/dev/cluster_rows.py bench                     # GPU: check and time
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

from fusedops.triton._clusters import max_active_clusters  # the product's driver query


def _exchange_asm(C: int) -> str:
    """PTX: ($0, $1) = sums over the cluster's C CTAs of ($2, $3); $4 this CTA's rank, $5 the
    row's parity (0/1), $6 the slots' byte offset in dynamic shared memory (after Triton's)."""
    lines = [
        "{",
        ".reg .u32 fo_t, fo_base, fo_slot, fo_remote;",
        ".reg .pred fo_p;",
        ".reg .f32 fo_a, fo_b;",
        "mov.u32 fo_t, %tid.x;",
        "mov.u32 fo_base, global_smem;",
        "add.u32 fo_base, fo_base, $6;",
        f"mad.lo.u32 fo_base, $5, {8 * C}, fo_base;",
        "mad.lo.u32 fo_slot, $4, 8, fo_base;",
        f"setp.lt.u32 fo_p, fo_t, {C};",
        "@fo_p mapa.shared::cluster.u32 fo_remote, fo_slot, fo_t;",
        "@fo_p st.shared::cluster.v2.f32 [fo_remote], {$2, $3};",
        "barrier.cluster.arrive.release;",
        "barrier.cluster.wait.acquire;",
        "ld.shared.v2.f32 {$0, $1}, [fo_base];",
    ]
    for i in range(1, C):
        lines += [f"ld.shared.v2.f32 {{fo_a, fo_b}}, [fo_base+{8 * i}];",
                  "add.f32 $0, $0, fo_a;", "add.f32 $1, $1, fo_b;"]
    lines.append("}")
    return "\n".join(lines)


EXCHANGE_2 = tl.constexpr(_exchange_asm(2))
EXCHANGE_4 = tl.constexpr(_exchange_asm(4))
EXCHANGE_8 = tl.constexpr(_exchange_asm(8))
EXCHANGE_16 = tl.constexpr(_exchange_asm(16))
def _publish_asm(C: int) -> str:
    """PTX: store ($1, $2) into slot [$4][$3] of every CTA of the cluster (threads 0..C-1, one
    peer each; $3 rank, $4 parity, $5 the slots' offset), then arrive (release) at the cluster
    barrier without waiting; $0 = $3 (a value to order later code after)."""
    return "\n".join([
        "{",
        ".reg .u32 fo_t, fo_slot, fo_remote;",
        ".reg .pred fo_p;",
        "mov.u32 fo_t, %tid.x;",
        "mov.u32 fo_slot, global_smem;",
        "add.u32 fo_slot, fo_slot, $5;",
        f"mad.lo.u32 fo_slot, $4, {8 * C}, fo_slot;",
        "mad.lo.u32 fo_slot, $3, 8, fo_slot;",
        f"setp.lt.u32 fo_p, fo_t, {C};",
        "@fo_p mapa.shared::cluster.u32 fo_remote, fo_slot, fo_t;",
        "@fo_p st.shared::cluster.v2.f32 [fo_remote], {$1, $2};",
        "barrier.cluster.arrive.release;",
        "mov.u32 $0, $3;",
        "}",
    ])


def _collect_asm(C: int) -> str:
    """PTX: wait (acquire) at the cluster barrier, then ($0, $1) = the sums of the C slots of
    parity $2 in rank order ($3 the slots' offset)."""
    lines = [
        "{",
        ".reg .u32 fo_base;",
        ".reg .f32 fo_a, fo_b;",
        "barrier.cluster.wait.acquire;",
        "mov.u32 fo_base, global_smem;",
        "add.u32 fo_base, fo_base, $3;",
        f"mad.lo.u32 fo_base, $2, {8 * C}, fo_base;",
        "ld.shared.v2.f32 {$0, $1}, [fo_base];",
    ]
    for i in range(1, C):
        lines += [f"ld.shared.v2.f32 {{fo_a, fo_b}}, [fo_base+{8 * i}];",
                  "add.f32 $0, $0, fo_a;", "add.f32 $1, $1, fo_b;"]
    lines.append("}")
    return "\n".join(lines)


PUBLISH_2 = tl.constexpr(_publish_asm(2))
PUBLISH_4 = tl.constexpr(_publish_asm(4))
PUBLISH_8 = tl.constexpr(_publish_asm(8))
PUBLISH_16 = tl.constexpr(_publish_asm(16))
COLLECT_2 = tl.constexpr(_collect_asm(2))
COLLECT_4 = tl.constexpr(_collect_asm(4))
COLLECT_8 = tl.constexpr(_collect_asm(8))
COLLECT_16 = tl.constexpr(_collect_asm(16))
# Every CTA of the cluster has started before any writes another's shared memory.
CLUSTER_SYNC = tl.constexpr("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n"
                            "mov.u32 $0, $1;")


@triton.jit
def _cluster_sums(s1, s2, rank, parity, slots_at, C: tl.constexpr):
    if C == 2:
        asm: tl.constexpr = EXCHANGE_2
    elif C == 4:
        asm: tl.constexpr = EXCHANGE_4
    elif C == 8:
        asm: tl.constexpr = EXCHANGE_8
    else:
        asm: tl.constexpr = EXCHANGE_16
    return tl.inline_asm_elementwise(asm, "=f,=f,f,f,r,r,r", [s1, s2, rank, parity, slots_at],
                                     dtype=(tl.float32, tl.float32), is_pure=False, pack=1)


@triton.jit
def _publish(s1, s2, rank, parity, slots_at, C: tl.constexpr):
    if C == 2:
        asm: tl.constexpr = PUBLISH_2
    elif C == 4:
        asm: tl.constexpr = PUBLISH_4
    elif C == 8:
        asm: tl.constexpr = PUBLISH_8
    else:
        asm: tl.constexpr = PUBLISH_16
    return tl.inline_asm_elementwise(asm, "=r,f,f,r,r,r", [s1, s2, rank, parity, slots_at],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _collect(parity, slots_at, C: tl.constexpr):
    if C == 2:
        asm: tl.constexpr = COLLECT_2
    elif C == 4:
        asm: tl.constexpr = COLLECT_4
    elif C == 8:
        asm: tl.constexpr = COLLECT_8
    else:
        asm: tl.constexpr = COLLECT_16
    return tl.inline_asm_elementwise(asm, "=f,=f,r,r", [parity, slots_at],
                                     dtype=(tl.float32, tl.float32), is_pure=False, pack=1)


@triton.jit
def _lagged_dx(x_raw, dy_raw, w, mean_ptr, rstd_ptr, dx_ptr, row, stride, pos, cmask, c1, c2):
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    xhat = (x_raw.to(tl.float32) - mean) * rstd
    wdy = dy_raw.to(tl.float32) * w
    tl.store(dx_ptr + row.to(tl.int64) * stride + pos,
             ((wdy - (xhat * c1 + c2)) * rstd).to(dx_ptr.dtype.element_ty), mask=cmask)


@triton.jit(do_not_specialize=["M", "num_progs", "slots_at"])
def _ln_bwd_cluster_lag(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr,
    M, N, stride, num_progs, slots_at,
    BLOCK: tl.constexpr, C: tl.constexpr, PREFETCH: tl.constexpr, MODE: tl.constexpr,
):
    # MODE 3: the cluster barrier split in two. A program arrives once its row's sums are in
    # its peers' slots, then loads and reduces its next row (the next-but-one row's loads in
    # flight) before it waits for the first row's barrier and writes that row's dx from the
    # row's x and dy kept in their 16-bit form: a late peer costs only what exceeds one row of
    # work. Rows alternate slot parities (a slot is written again only after the barrier of
    # the row between, which its reader passes after reading it).
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    chunk = pid % C
    pos = chunk * BLOCK + lanes
    cmask = pos < N
    step = num_progs // C
    w = tl.load(w_ptr + pos, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK], tl.float32)
    db_acc = tl.zeros([BLOCK], tl.float32)
    first = pid // C
    started = tl.inline_asm_elementwise(CLUSTER_SYNC, "=r,r", [chunk], dtype=tl.int32,
                                        is_pure=False, pack=1)
    r0 = first.to(tl.int64)
    prev_x = tl.load(x_ptr + r0 * stride + pos, mask=cmask, other=0.0)
    prev_dy = tl.load(dy_ptr + r0 * stride + pos, mask=cmask, other=0.0)
    more = cmask & (r0 + step < M)
    x_next = tl.load(x_ptr + (r0 + step) * stride + pos, mask=more, other=0.0)
    dy_next = tl.load(dy_ptr + (r0 + step) * stride + pos, mask=more, other=0.0)
    mean = tl.load(mean_ptr + first)
    rstd = tl.load(rstd_ptr + first)
    xhat = (prev_x.to(tl.float32) - mean) * rstd
    dy = prev_dy.to(tl.float32)
    dw_acc += dy * xhat
    db_acc += dy
    wdy = dy * w
    s1, s2 = tl.reduce((xhat * wdy, wdy), 0, _add_pairs)
    parity = started * 0
    _publish(s1, s2, chunk, parity, slots_at, C)
    prev_row = first
    for row in range(first + step, M, step):
        row64 = row.to(tl.int64)
        x_raw = x_next
        dy_raw = dy_next
        more = cmask & (row64 + step < M)
        x_next = tl.load(x_ptr + (row64 + step) * stride + pos, mask=more, other=0.0)
        dy_next = tl.load(dy_ptr + (row64 + step) * stride + pos, mask=more, other=0.0)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        xhat = (x_raw.to(tl.float32) - mean) * rstd
        dy = dy_raw.to(tl.float32)
        dw_acc += dy * xhat
        db_acc += dy
        wdy = dy * w
        s1, s2 = tl.reduce((xhat * wdy, wdy), 0, _add_pairs)
        t1, t2 = _collect(parity, slots_at, C)
        _lagged_dx(prev_x, prev_dy, w, mean_ptr, rstd_ptr, dx_ptr, prev_row, stride, pos, cmask,
                   t1 / N, t2 / N)
        parity = 1 - parity
        _publish(s1, s2, chunk, parity, slots_at, C)
        prev_row = row
        prev_x = x_raw
        prev_dy = dy_raw
    t1, t2 = _collect(parity, slots_at, C)
    _lagged_dx(prev_x, prev_dy, w, mean_ptr, rstd_ptr, dx_ptr, prev_row, stride, pos, cmask,
               t1 / N, t2 / N)
    out = part_ptr + (pid // C).to(tl.int64) * N
    tl.store(out + pos, dw_acc, mask=cmask)
    tl.store(out + step * N + pos, db_acc, mask=cmask)


@triton.jit
def _add_pairs(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


# k.run below bypasses Triton's argument specialisation: the arguments that vary between calls
# of one compiled kernel are not specialised (M = 1 at warm-up would become a constant).
@triton.jit(do_not_specialize=["M", "num_progs", "slots_at"])
def _ln_bwd_cluster(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr,
    M, N, stride, num_progs, slots_at,
    BLOCK: tl.constexpr, C: tl.constexpr, PREFETCH: tl.constexpr, MODE: tl.constexpr,
):
    # Program pid: piece pid % C (columns [piece·BLOCK, +BLOCK)) of the rows pid // C,
    # pid // C + num_progs // C, ... (one cluster of C CTAs per row at a time). The weight and
    # the dweight/dbias partials of the piece stay in registers; PREFETCH: the next row's x and
    # dy are loaded at the top of the loop (the shipped 16-bit rule). MODE 1 (a bound, wrong
    # dx): the cluster meets at the barrier but exchanges nothing, the piece's own sums times C
    # stand in; MODE 2 (a bound, wrong dx): no barrier and no exchange.
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    chunk = pid % C
    pos = chunk * BLOCK + lanes
    cmask = pos < N
    step = num_progs // C
    dt = dx_ptr.dtype.element_ty
    w = tl.load(w_ptr + pos, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK], tl.float32)
    db_acc = tl.zeros([BLOCK], tl.float32)
    r0 = (pid // C).to(tl.int64)
    started = tl.inline_asm_elementwise(CLUSTER_SYNC, "=r,r", [chunk], dtype=tl.int32,
                                        is_pure=False, pack=1)
    if PREFETCH:
        x_next = tl.load(x_ptr + r0 * stride + pos, mask=cmask, other=0.0)
        dy_next = tl.load(dy_ptr + r0 * stride + pos, mask=cmask, other=0.0)
    parity = started * 0
    for row in range(pid // C, M, step):
        row64 = row.to(tl.int64)
        if PREFETCH:
            x_raw = x_next
            dy_raw = dy_next
            more = cmask & (row64 + step < M)
            x_next = tl.load(x_ptr + (row64 + step) * stride + pos, mask=more, other=0.0)
            dy_next = tl.load(dy_ptr + (row64 + step) * stride + pos, mask=more, other=0.0)
        else:
            x_raw = tl.load(x_ptr + row64 * stride + pos, mask=cmask, other=0.0)
            dy_raw = tl.load(dy_ptr + row64 * stride + pos, mask=cmask, other=0.0)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        x = x_raw.to(tl.float32)
        dy = dy_raw.to(tl.float32)
        xhat = (x - mean) * rstd
        dw_acc += dy * xhat
        db_acc += dy
        wdy = dy * w
        s1, s2 = tl.reduce((xhat * wdy, wdy), 0, _add_pairs)
        if MODE == 0:
            t1, t2 = _cluster_sums(s1, s2, chunk, parity, slots_at, C)
        elif MODE == 1:
            t1 = tl.inline_asm_elementwise(CLUSTER_SYNC, "=r,r", [s1.to(tl.int32, bitcast=True)],
                                           dtype=tl.int32, is_pure=False,
                                           pack=1).to(tl.float32, bitcast=True) * C
            t2 = s2 * C
        else:
            t1 = s1 * C
            t2 = s2 * C
        parity = 1 - parity
        c1 = t1 / N
        c2 = t2 / N
        tl.store(dx_ptr + row64 * stride + pos, ((wdy - (xhat * c1 + c2)) * rstd).to(dt),
                 mask=cmask)
    out = part_ptr + (pid // C).to(tl.int64) * N
    tl.store(out + pos, dw_acc, mask=cmask)
    tl.store(out + step * N + pos, db_acc, mask=cmask)


def ptx_report() -> None:
    """Compile for sm_90 locally; print registers, spills and the exchange's PTX/SASS."""
    sys.path.insert(0, os.path.dirname(__file__))
    from regs_split import compile_sm90, resources

    print(f"Triton {triton.__version__}, sm_90, bf16 rows of 16384")
    for piece, warps, prefetch, mode in ((4096, 8, 1, 0), (2048, 4, 1, 0), (8192, 16, 1, 0),
                                         (4096, 8, 1, 3), (2048, 4, 1, 3), (8192, 16, 1, 3)):
        C = 16384 // piece
        fn = _ln_bwd_cluster_lag if mode == 3 else _ln_bwd_cluster
        names = fn.arg_names
        ptrs = {"mean_ptr": "*fp32", "rstd_ptr": "*fp32", "part_ptr": "*fp32"}
        pointers = {a: ptrs.get(a, "*bf16") for a in names if a.endswith("_ptr")}
        k = compile_sm90(fn, {"BLOCK": piece, "C": C, "PREFETCH": prefetch, "MODE": mode},
                         pointers, [*pointers, "N", "stride", "slots_at"], warps, None)
        regs, stack = resources(k)
        print(f"piece {piece} x {warps} warps prefetch {prefetch} mode {mode}: {regs} registers, "
              f"{stack} B stack, shared {k.metadata.shared} B, "
              f"barrier.cluster {k.asm['ptx'].count('barrier.cluster')}", flush=True)


_KERNELS: dict = {}


def _compiled(x, w, mean, piece: int, warps: int, prefetch: int, cap, mode: int = 0):
    """(compiled kernel, C, clusters the GPU holds at once) for x's dtype and N."""
    N = x.shape[1]
    C = triton.cdiv(N, piece)
    key = (x.dtype, N, piece, warps, prefetch, cap, mode)
    if key not in _KERNELS:
        opts = {"num_warps": warps}
        if cap:
            opts["maxnreg"] = cap
        args = (x, x, w, mean, mean, x, mean, 1, N, N, C, 0)  # float32 statistics, partials
        kernel = _ln_bwd_cluster_lag if mode == 3 else _ln_bwd_cluster
        k = kernel.warmup(*args, BLOCK=piece, C=C, PREFETCH=prefetch, MODE=mode,
                                   grid=(1,), **opts)
        k._init_handles()
        slots_at = -(-k.metadata.shared // 16) * 16
        _KERNELS[key] = (k, C, max_active_clusters(k.function, C, warps, slots_at + 16 * C))
    return _KERNELS[key]


def cluster_backward(dy, x, w, mean, rstd, piece: int, warps: int, prefetch: int, cap,
                     clusters: int | None = None, mode: int = 0):
    """(dx, dweight, dbias) of the split-row backward exchanging on chip (x contiguous)."""
    from fusedops.triton import layernorm as tln
    M, N = x.shape
    k, C, active = _compiled(x, w, mean, piece, warps, prefetch, cap, mode)
    clusters = min(clusters or active, M)
    progs = clusters * C
    part = torch.empty((2, clusters, N), dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x)
    stream = torch.cuda.current_stream().cuda_stream
    slots_at = -(-k.metadata.shared // 16) * 16
    meta = (warps, C, slots_at + 16 * C)
    k.run(clusters, 1, 1, stream, k.function, meta, None, None, None,
          dy, x, w, mean, rstd, dx, part, M, N, N, progs, slots_at, piece, C, prefetch, mode)
    dw, db = tln._reduce_partials(part, True, True, dtypes=(w.dtype, w.dtype))
    return dx, dw, db


VARIANTS = [  # (piece, warps, prefetch, register cap, clusters or None: as many as fit at
    # once, MODE)
    (4096, 8, 1, 128, None, 0), (4096, 8, 1, 128, None, 3), (4096, 8, 1, None, None, 3),
    (2048, 4, 1, 128, None, 0), (2048, 4, 1, 128, None, 3), (2048, 4, 1, None, None, 3),
    (2048, 4, 1, 128, None, 2), (8192, 16, 1, 128, None, 0), (8192, 16, 1, 128, None, 3),
    (8192, 8, 1, None, None, 0), (8192, 8, 1, None, None, 3), (2048, 8, 1, None, None, 3),
    (1024, 4, 1, None, None, 3),
]


def bench() -> None:
    from triton.testing import do_bench

    from fusedops.triton import layernorm as tln
    sys.path.insert(0, os.path.dirname(__file__))
    from lnbwd_case import case, copy_tbps

    copy = copy_tbps()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__,
          f"copy {copy:.3f} TB/s", flush=True)
    recs = []
    specs = [(torch.bfloat16, n) for n in (16384, 32768, 65536, 131072, 262144)]
    specs += [(torch.float16, 16384)] + [(torch.float32, n) for n in (16384, 32768, 65536)]
    chosen = os.environ.get("VARIANTS")
    chosen = ([tuple(None if v == "None" else int(v) for v in spec.split(","))
               for spec in chosen.split(";")] if chosen else VARIANTS)
    for dt, N in specs:
        x, dy, w, mean, rstd, nbytes = case(dt, N)
        ref = tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
        t = do_bench(lambda: tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True),
                     rep=50)
        recs.append(dict(dtype=str(dt), N=N, variant="shipped", tbps=nbytes / t / 1e9,
                         frac=nbytes / t / 1e9 / copy))
        line = f"{str(dt)[6:]:9s} N={N:6d} shipped {nbytes / t / 1e9:.2f}"
        for var in chosen:
            piece, warps, prefetch, cap, clusters, mode = (*var, 0)[:6]
            name = f"p{piece}w{warps}f{prefetch}c{cap}g{clusters}m{mode}"
            if not 1 < N // piece <= 16 or N % piece:
                continue
            regs = None
            try:
                out = cluster_backward(dy, x, w, mean, rstd, *var)
                torch.cuda.synchronize()
                err = max(((o.float() - r.float()).abs().max() / (1 + r.float().abs().max())).item()
                          for o, r in zip(out, ref, strict=True))
                t = do_bench(lambda var=var: cluster_backward(dy, x, w, mean, rstd, *var), rep=50)
                tb = nbytes / t / 1e9
                k, C, active = _compiled(x, w, mean, piece, warps, prefetch, cap, mode)
                regs = (k.n_regs, k.n_spills, active)
            except Exception as exc:  # noqa: BLE001
                tb, err = 0.0, f"{type(exc).__name__}: {str(exc)[:160]}"
            recs.append(dict(dtype=str(dt), N=N, variant=name, tbps=tb, frac=tb / copy,
                             err=err, regs=regs))
            line += f" | {name} {tb:.2f} ({regs}, {err if isinstance(err, str) else f'{err:.0e}'})"
        print(line, flush=True)
        del x, dy, w, mean, rstd, ref
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "cluster_rows.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "copy_tbps": copy, "records": recs}, f,
                      indent=1)


def debug() -> None:
    """Small problems: each output's error against the shipped backward, where NaNs sit."""
    from fusedops.triton import layernorm as tln
    sys.path.insert(0, os.path.dirname(__file__))
    from lnbwd_case import case

    for dt in (torch.float32, torch.bfloat16):
        for M, prefetch in ((8, 1), (8, 0), (200, 1)):
            x, dy, w, mean, rstd, _ = case(dt, 16384, total=M * 16384)
            ref = tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
            out = cluster_backward(dy, x, w, mean, rstd, 4096, 8, prefetch, None, clusters=2)
            torch.cuda.synchronize()
            for name, o, r in zip(("dx", "dw", "db"), out, ref, strict=True):
                bad = (~torch.isfinite(o.float())).nonzero()
                err = ((o.float() - r.float()).abs().nan_to_num(1e9).max()).item()
                print(f"{dt} M={M} prefetch {prefetch} {name}: err {err:.2e}, "
                      f"{bad.shape[0]} non-finite, first {bad[:4].tolist()}, "
                      f"ref finite {bool(torch.isfinite(r.float()).all())}", flush=True)


if __name__ == "__main__":
    {"ptx": ptx_report, "debug": debug}.get((sys.argv[1:] or ["bench"])[0], bench)()
