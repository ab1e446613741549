"""Developer probe: variants of the split-row LayerNorm backward's per-row exchange (16-bit).

The 16-bit split kernel (4096 x 8 warps, two programs per SM, 0.66-0.70 of copy at 16K-64K on
an H100) spent 44% of its stall cycles at CTA barriers (eighteenth session, Nsight Compute).
This probe re-implements its loop (aligned rows, a weight, every gradient, scratch buffers, the
next item prefetched at the top of the loop) with switches, to find what the exchange costs:

* ROWS = 2: two rows per work item, unrolled, their four sums in one reduction, one publish and
  one wait per item (half the barriers per row).
* LAG = 1: publish row r, then finish row r - step (published by the peers an item earlier),
  keeping that row's x and dy in 16-bit form meanwhile.
* MODE 1: no wait (wrong dx: bounds the wait); MODE 3: no exchange at all, the piece's own sums
  stand in (wrong dx: bounds the whole exchange); MODE 5: sums stored and peers' read without
  barrier, counter or wait (wrong dx); MODE 2: x and dy kept in 16-bit form across the wait
  and the next two items prefetched; MODE 6: the sums themselves as flags (one 64-bit word per
  piece, slots filled with an impossible bit pattern before the launch, readers poll their
  row's slots): no counter, no barrier, no fence; MODE 7 (``_ln_bwd_split_lag``): MODE 6's
  words with a one-row lag, the lagged row's x and dy read again from L2, so no program waits
  for a row its peers have not long finished.

Results (benchmarks/results/tune-h100-2026-11-25/split_rows-*.json, docs/performance.md,
twenty-first session): no exchange 0.94 of copy, no wait 0.76, the shipped exchange 0.70; every
correct variant level with or slower than the shipped kernel, except MODE 7 at 64K on 2048 x 4
(+7%; slower at 16K/32K).

    PYTHONPATH=/tmp/t36:$PWD python benchmarks/dev/split_rows.py regs   # local: registers
    OUT=dir python benchmarks/dev/split_rows.py bench                   # GPU: check and time
    VARIANTS="1,0,6,4096,8,128;..." POLL_LIMIT=100000 ...               # a subset; bounded polls

Always set POLL_LIMIT on the GPU: the first run of the MODE 6 variants without it did not finish
within 500 s (which variant hung was not established: 8192 x 16, the one MODE 6 tiling not run
again; the runs with a limit finished with every slot published and correct results).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

from fusedops.triton._common import await_row


@triton.jit
def _add_pairs(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def _add_quads(a1, b1, c1, d1, a2, b2, c2, d2):
    return a1 + a2, b1 + b2, c1 + c2, d1 + d2


@triton.jit
def _peer_sums(stats_ptr, row, C: tl.constexpr, C_P2: tl.constexpr, N):
    peers = tl.arange(0, C_P2)
    base = (row * C + peers) * 2
    ok = peers < C
    c1 = tl.sum(tl.load(stats_ptr + base, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
    c2 = tl.sum(tl.load(stats_ptr + base + 1, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
    return c1 / N, c2 / N


@triton.jit
def _publish(stats_ptr, count_ptr, slot, s1, s2, counter):
    tl.store(stats_ptr + slot, s1)
    tl.store(stats_ptr + slot + 1, s2)
    tl.debug_barrier()
    tl.atomic_add(count_ptr + counter, 1, sem="release")


EMPTY = tl.constexpr(-1)  # all ones: (s1, s2) both a NaN with a payload no float32 arithmetic produces
POLL_LIMIT = tl.constexpr(int(os.environ.get("POLL_LIMIT", 1 << 30)))  # a debugging bound
CANONICAL = tl.constexpr(0x7FFFFFFF7FFFFFFF)  # the canonical NaN pair, stored instead should a sum be EMPTY


@triton.jit
def _publish_word(slots_ptr, slot, s1, s2):
    lo = s1.to(tl.uint32, bitcast=True).to(tl.uint64)
    hi = s2.to(tl.uint32, bitcast=True).to(tl.uint64)
    word = (lo | (hi << 32)).to(tl.int64, bitcast=True)
    word = tl.where(word == EMPTY, CANONICAL, word)
    tl.store(slots_ptr + slot, word)


@triton.jit
def _poll_words(at, ok, words):
    """``words`` once no slot of ``at`` (the row's C slots) holds EMPTY (bounded by POLL_LIMIT)."""
    polls = 0
    while (tl.sum(((words == EMPTY) & ok).to(tl.int32), axis=0) > 0) & (polls < POLL_LIMIT):
        words = tl.load(at, mask=ok, other=0, volatile=True)
        polls += 1
    return words


@triton.jit
def _words_sums(words, ok, N):
    """The row's (sum s1, sum s2) / N from its pieces' 64-bit words."""
    bits = words.to(tl.uint64, bitcast=True)
    s1 = (bits & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    s2 = (bits >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    return tl.sum(tl.where(ok, s1, 0.0), axis=0) / N, tl.sum(tl.where(ok, s2, 0.0), axis=0) / N


@triton.jit
def _await_words(slots_ptr, row, C: tl.constexpr, C_P2: tl.constexpr, N):
    peers = tl.arange(0, C_P2)
    ok = peers < C
    at = slots_ptr + row.to(tl.int64) * C + peers
    words = _poll_words(at, ok, tl.load(at, mask=ok, other=0, volatile=True))
    return _words_sums(words, ok, N)


@triton.jit
def _ln_bwd_split_rows(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, stats_ptr, count_ptr,
    M, N, L, stride, num_items, num_progs,
    BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, ROWS: tl.constexpr,
    LAG: tl.constexpr, MODE: tl.constexpr,
):
    # Item = (group of ROWS rows, chunk), group-major; the grid is a multiple of C, so a program
    # keeps one chunk (weight and dweight/dbias partials in registers); 1-D tiles with scalar
    # row bases as in the shipped kernel. ROWS == 2: the two rows unrolled, their four sums in
    # one reduction, one publish and one wait per item. LAG (ROWS == 1): a program publishes
    # row r, then finishes row r - step (published by its peers one item earlier), keeping that
    # row's x and dy in their 16-bit form meanwhile; the last row is finished after the loop.
    # The next item is always prefetched at the top of the loop (the shipped 16-bit rule).
    # MODE (ROWS == 1, LAG == 0): 1 skips the wait, 3 the whole exchange (no publish, no peer
    # sums: the row's own piece sums stand in), both giving wrong dx (bounds on what the wait and
    # the exchange cost); 5 stores the sums and reads the peers' without barrier, counter or
    # wait (wrong dx: what the publish's barrier and release cost); 6 exchanges through the sums
    # themselves: each piece stores its (s1, s2) as one 64-bit word into a slot filled with an
    # impossible bit pattern before the launch, and the readers poll the row's C slots until no
    # slot holds it (no counter, no barrier, no fence: one store and one round trip); 2 keeps x
    # and dy in 16-bit form across the wait (x̂ and w·dy recomputed after it) and prefetches
    # two items ahead with the registers that frees.
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    chunk = pid % C
    pos = chunk * L + lanes
    cmask = (lanes < L) & (pos < N)
    step = (num_progs // C) * ROWS
    dt = dx_ptr.dtype.element_ty
    w = tl.load(w_ptr + pos, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK], tl.float32)
    db_acc = tl.zeros([BLOCK], tl.float32)
    r0 = ((pid // C) * ROWS).to(tl.int64)
    x_next = tl.load(x_ptr + r0 * stride + pos, mask=cmask, other=0.0)
    dy_next = tl.load(dy_ptr + r0 * stride + pos, mask=cmask, other=0.0)
    if ROWS == 2:
        m1 = cmask & (r0 + 1 < M)
        x_next1 = tl.load(x_ptr + (r0 + 1) * stride + pos, mask=m1, other=0.0)
        dy_next1 = tl.load(dy_ptr + (r0 + 1) * stride + pos, mask=m1, other=0.0)
    if MODE == 2:
        r1 = r0 + step
        x_next2 = tl.load(x_ptr + r1 * stride + pos, mask=cmask & (r1 < M), other=0.0)
        dy_next2 = tl.load(dy_ptr + r1 * stride + pos, mask=cmask & (r1 < M), other=0.0)
    prev_row = -1
    prev_x = tl.zeros([BLOCK], dt)
    prev_dy = tl.zeros([BLOCK], dt)
    for item in range(pid, num_items, num_progs):
        group = item // C
        row = group * ROWS
        row64 = row.to(tl.int64)
        x_raw = x_next
        dy_raw = dy_next
        nxt = row64 + step
        if MODE == 2:
            x_next = x_next2
            dy_next = dy_next2
            more = cmask & (nxt + step < M)
            x_next2 = tl.load(x_ptr + (nxt + step) * stride + pos, mask=more, other=0.0)
            dy_next2 = tl.load(dy_ptr + (nxt + step) * stride + pos, mask=more, other=0.0)
        else:
            more = cmask & (nxt < M)
            x_next = tl.load(x_ptr + nxt * stride + pos, mask=more, other=0.0)
            dy_next = tl.load(dy_ptr + nxt * stride + pos, mask=more, other=0.0)
        if ROWS == 2:
            x_raw1 = x_next1
            dy_raw1 = dy_next1
            more1 = cmask & (nxt + 1 < M)
            x_next1 = tl.load(x_ptr + (nxt + 1) * stride + pos, mask=more1, other=0.0)
            dy_next1 = tl.load(dy_ptr + (nxt + 1) * stride + pos, mask=more1, other=0.0)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        x = x_raw.to(tl.float32)
        dy = dy_raw.to(tl.float32)
        xhat = (x - mean) * rstd
        dw_acc += dy * xhat
        db_acc += dy
        wdy = dy * w
        if ROWS == 2:
            ok1 = row + 1 < M
            mean1 = tl.load(mean_ptr + row + 1, mask=ok1, other=0.0)
            rstd1 = tl.load(rstd_ptr + row + 1, mask=ok1, other=0.0)
            xhat1 = (x_raw1.to(tl.float32) - mean1) * rstd1
            dy1 = dy_raw1.to(tl.float32)
            dw_acc += dy1 * xhat1
            db_acc += dy1
            wdy1 = dy1 * w
            s1, s2, s1b, s2b = tl.reduce((xhat * wdy, wdy, xhat1 * wdy1, wdy1), 0, _add_quads)
            tl.store(stats_ptr + (row * C + chunk) * 2, s1)
            tl.store(stats_ptr + (row * C + chunk) * 2 + 1, s2)
            tl.store(stats_ptr + ((row + 1) * C + chunk) * 2, s1b, mask=ok1)
            tl.store(stats_ptr + ((row + 1) * C + chunk) * 2 + 1, s2b, mask=ok1)
            tl.debug_barrier()
            tl.atomic_add(count_ptr + group, 1, sem="release")
            await_row(count_ptr, group, C)
            c1, c2 = _peer_sums(stats_ptr, row, C, C_P2, N)
            c1b, c2b = _peer_sums(stats_ptr, row + 1, C, C_P2, N)
            tl.store(dx_ptr + row64 * stride + pos,
                     ((wdy - (xhat * c1 + c2)) * rstd).to(dt), mask=cmask)
            tl.store(dx_ptr + (row64 + 1) * stride + pos,
                     ((wdy1 - (xhat1 * c1b + c2b)) * rstd1).to(dt), mask=cmask & ok1)
        else:
            s1, s2 = tl.reduce((xhat * wdy, wdy), 0, _add_pairs)
            if MODE == 5:
                tl.store(stats_ptr + (row * C + chunk) * 2, s1)
                tl.store(stats_ptr + (row * C + chunk) * 2 + 1, s2)
            elif MODE == 6:
                _publish_word(count_ptr, row * C + chunk, s1, s2)
            elif MODE != 3:
                _publish(stats_ptr, count_ptr, (row * C + chunk) * 2, s1, s2, row)
            if LAG:
                if prev_row >= 0:
                    await_row(count_ptr, prev_row, C)
                    c1, c2 = _peer_sums(stats_ptr, prev_row, C, C_P2, N)
                    pm = tl.load(mean_ptr + prev_row)
                    pr = tl.load(rstd_ptr + prev_row)
                    pxhat = (prev_x.to(tl.float32) - pm) * pr
                    pwdy = prev_dy.to(tl.float32) * w
                    tl.store(dx_ptr + prev_row.to(tl.int64) * stride + pos,
                             ((pwdy - (pxhat * c1 + c2)) * pr).to(dt), mask=cmask)
                prev_row = row
                prev_x = x_raw
                prev_dy = dy_raw
            else:
                if MODE == 3:
                    c1 = s1 / N
                    c2 = s2 / N
                elif MODE == 6:
                    c1, c2 = _await_words(count_ptr, row, C, C_P2, N)
                else:
                    if MODE != 1:
                        await_row(count_ptr, row, C)
                    c1, c2 = _peer_sums(stats_ptr, row, C, C_P2, N)
                if MODE == 2:
                    xhat = (x_raw.to(tl.float32) - mean) * rstd
                    wdy = dy_raw.to(tl.float32) * w
                tl.store(dx_ptr + row64 * stride + pos,
                         ((wdy - (xhat * c1 + c2)) * rstd).to(dt), mask=cmask)
    if LAG:
        if prev_row >= 0:
            await_row(count_ptr, prev_row, C)
            c1, c2 = _peer_sums(stats_ptr, prev_row, C, C_P2, N)
            pm = tl.load(mean_ptr + prev_row)
            pr = tl.load(rstd_ptr + prev_row)
            pxhat = (prev_x.to(tl.float32) - pm) * pr
            pwdy = prev_dy.to(tl.float32) * w
            tl.store(dx_ptr + prev_row.to(tl.int64) * stride + pos,
                     ((pwdy - (pxhat * c1 + c2)) * pr).to(dt), mask=cmask)
    out = part_ptr + (pid // C).to(tl.int64) * N
    tl.store(out + pos, dw_acc, mask=cmask)
    tl.store(out + (num_progs // C) * N + pos, db_acc, mask=cmask)


@triton.jit
def _finish_lagged(x_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, slots_ptr, words, at, ok, xp, dyp,
                   prow, pos, cmask, w, stride, N):
    # Row prow's dx from its x and dy (read again, from L2) once its peers' words are in.
    c1, c2 = _words_sums(_poll_words(at, ok, words), ok, N)
    pm = tl.load(mean_ptr + prow)
    pr = tl.load(rstd_ptr + prow)
    xhat = (xp.to(tl.float32) - pm) * pr
    wdy = dyp.to(tl.float32) * w
    dx = (wdy - (xhat * c1 + c2)) * pr
    tl.store(dx_ptr + prow.to(tl.int64) * stride + pos, dx.to(dx_ptr.dtype.element_ty),
             mask=cmask)


@triton.jit
def _ln_bwd_split_lag(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, stats_ptr, slots_ptr,
    M, N, L, stride, num_items, num_progs,
    BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, ROWS: tl.constexpr,
    LAG: tl.constexpr, MODE: tl.constexpr,
):
    # MODE 7: the one-row lag with the sums as flags (MODE 6's words) and the lagged row's x and
    # dy read again from L2: at the top of item r the program issues the next item's loads
    # (HBM), row r - step's loads (L2) and its peers' words; it reduces row r and stores its
    # word (no barrier, no fence, no counter), then finishes row r - step, whose words were
    # published an item earlier (a poll only if a peer is late). Nothing of the lagged row is
    # held in registers across the reduction except what its loads return.
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    peers = tl.arange(0, C_P2)
    ok_peer = peers < C
    chunk = pid % C
    pos = chunk * L + lanes
    cmask = (lanes < L) & (pos < N)
    step = num_progs // C
    w = tl.load(w_ptr + pos, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK], tl.float32)
    db_acc = tl.zeros([BLOCK], tl.float32)
    r0 = (pid // C).to(tl.int64)
    x_next = tl.load(x_ptr + r0 * stride + pos, mask=cmask, other=0.0)
    dy_next = tl.load(dy_ptr + r0 * stride + pos, mask=cmask, other=0.0)
    for item in range(pid, num_items, num_progs):
        row = item // C
        row64 = row.to(tl.int64)
        x_raw = x_next
        dy_raw = dy_next
        more = cmask & (row64 + step < M)
        x_next = tl.load(x_ptr + (row64 + step) * stride + pos, mask=more, other=0.0)
        dy_next = tl.load(dy_ptr + (row64 + step) * stride + pos, mask=more, other=0.0)
        prow = row - step
        lagged = item >= pid + num_progs  # this program finished an item before
        pmask = cmask & lagged
        xp = tl.load(x_ptr + prow.to(tl.int64) * stride + pos, mask=pmask, other=0.0)
        dyp = tl.load(dy_ptr + prow.to(tl.int64) * stride + pos, mask=pmask, other=0.0)
        at = slots_ptr + prow.to(tl.int64) * C + peers
        pok = ok_peer & lagged
        words = tl.load(at, mask=pok, other=0, volatile=True)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        x = x_raw.to(tl.float32)
        dy = dy_raw.to(tl.float32)
        xhat = (x - mean) * rstd
        dw_acc += dy * xhat
        db_acc += dy
        wdy = dy * w
        s1, s2 = tl.reduce((xhat * wdy, wdy), 0, _add_pairs)
        _publish_word(slots_ptr, row * C + chunk, s1, s2)
        if item >= pid + num_progs:
            _finish_lagged(x_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, slots_ptr, words, at, pok,
                           xp, dyp, prow, pos, cmask, w, stride, N)
    last = pid + ((num_items - 1 - pid) // num_progs) * num_progs  # this program's last item
    if last < num_items:
        prow = last // C
        xp = tl.load(x_ptr + prow.to(tl.int64) * stride + pos, mask=cmask, other=0.0)
        dyp = tl.load(dy_ptr + prow.to(tl.int64) * stride + pos, mask=cmask, other=0.0)
        at = slots_ptr + prow.to(tl.int64) * C + peers
        words = tl.load(at, mask=ok_peer, other=0, volatile=True)
        _finish_lagged(x_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, slots_ptr, words, at, ok_peer,
                       xp, dyp, prow, pos, cmask, w, stride, N)
    out = part_ptr + (pid // C).to(tl.int64) * N
    tl.store(out + pos, dw_acc, mask=cmask)
    tl.store(out + (num_progs // C) * N + pos, db_acc, mask=cmask)


VARIANTS = [  # (ROWS, LAG, MODE, piece, warps, register cap)
    (1, 0, 0, 4096, 8, 128), (1, 0, 3, 4096, 8, 128), (1, 0, 7, 4096, 8, 128),
    (1, 0, 7, 4096, 8, None), (1, 0, 7, 2048, 4, 128), (1, 0, 7, 2048, 8, 128),
    (1, 0, 7, 8192, 16, 128), (1, 0, 7, 4096, 16, 128),
]


def regs_report() -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from regs_split import compile_sm90, resources

    print(f"Triton {triton.__version__}, sm_90, bf16 rows of 16384")
    for rows, lag, mode, piece, warps, cap in VARIANTS:
        fn = _ln_bwd_split_lag if mode == 7 else _ln_bwd_split_rows
        names = fn.arg_names
        ptrs = {"mean_ptr": "*fp32", "rstd_ptr": "*fp32", "part_ptr": "*fp32",
                "stats_ptr": "*fp32", "count_ptr": "*i64" if mode == 6 else "*i32",
                "slots_ptr": "*i64"}
        C = 16384 // piece
        consts = {"BLOCK": piece, "C": C, "C_P2": C, "ROWS": rows, "LAG": lag, "MODE": mode}
        pointers = {a: ptrs.get(a, "*bf16") for a in names if a.endswith("_ptr")}
        k = compile_sm90(fn, consts, pointers, [*pointers, "N", "L", "stride"], warps, cap)
        regs, stack = resources(k)
        per_warp = -(-regs * 32 // 256) * 256
        per_sm = min(65536 // (per_warp * warps), 64 // warps)
        print(f"rows {rows} lag {lag} mode {mode} piece {piece} warps {warps} cap {cap}: {regs} registers, "
              f"{stack} B stack, {per_sm} per SM, bar.sync {k.asm['ptx'].count('bar.sync')}")


_REGS: dict = {}


def split_rows_backward(dy, x, w, mean, rstd, rows: int, lag: int, mode: int, piece: int,
                        warps: int, cap):
    from fusedops.triton import layernorm as tln
    M, N = x.shape
    C = triton.cdiv(N, piece)
    groups = triton.cdiv(M, rows)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    opts = {"num_warps": warps}
    if cap:
        opts["maxnreg"] = cap
    key = (x.dtype, N, rows, lag, mode, piece, warps, cap)
    consts = dict(BLOCK=piece, C=C, C_P2=triton.next_power_of_2(C), ROWS=rows, LAG=lag,
                  MODE=mode)
    kernel = _ln_bwd_split_lag if mode == 7 else _ln_bwd_split_rows
    if key not in _REGS:
        slots = torch.empty(1, dtype=torch.int64 if mode in (6, 7) else torch.int32,
                            device=x.device)
        args = (dy, x, w, mean, rstd, dy, mean, mean, slots, M, N, piece, N, groups * C)
        k = kernel.warmup(*args, 1024, **consts, grid=(1,), **opts)
        k._init_handles()
        per_warp = -(-k.n_regs * 32 // 256) * 256
        _REGS[key] = (k.n_regs, max(1, min(65536 // (per_warp * warps), 64 // warps)))
    progs = min(groups * C, sms * _REGS[key][1] // C * C)
    part = torch.empty((2, progs // C, N), dtype=torch.float32, device=x.device)
    stats = torch.empty((M * C * 2,), dtype=torch.float32, device=x.device)
    if mode in (6, 7):  # count_ptr: the 64-bit slots, one per (row, chunk)
        count = torch.full((M * C,), -1, dtype=torch.int64, device=x.device)
    else:
        count = torch.zeros((groups,), dtype=torch.int32, device=x.device)
    dx = torch.empty_like(x)
    kernel[(progs,)](dy, x, w, mean, rstd, dx, part, stats, count, M, N, piece, N, groups * C,
                     progs, **consts, **opts, launch_cooperative_grid=True)
    dw, db = tln._reduce_partials(part, True, True, dtypes=(w.dtype, w.dtype))
    if mode in (6, 7) and key not in _LEFT:  # first call only (it synchronises)
        _LEFT[key] = int((count == -1).sum())  # slots never published (a poll limit hit)
    return dx, dw, db


_LEFT: dict = {}


def debug6() -> None:
    """Mode 6 on a small problem with a poll limit: which slots still hold EMPTY afterwards."""
    from fusedops.triton import layernorm as tln
    for piece, warps in ((4096, 8), (4096, 16)):
        M, N = 512, 16384
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        _, mean, rstd = tln.layernorm_forward(x, w, None, 1e-5, x.dtype)
        ref = tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
        C = N // piece
        slots = torch.full((M * C,), -1, dtype=torch.int64, device="cuda")
        dx = torch.empty_like(x)
        progs = 132 * (2 if warps == 8 else 1) // C * C
        part = torch.empty((2, progs // C, N), dtype=torch.float32, device="cuda")
        _ln_bwd_split_rows[(progs,)](dy, x, w, mean, rstd, dx, part, mean, slots, M, N, piece,
                                     N, M * C, progs, BLOCK=piece, C=C, C_P2=C, ROWS=1, LAG=0,
                                     MODE=6, num_warps=warps, maxnreg=128,
                                     launch_cooperative_grid=True)
        torch.cuda.synchronize()
        empty = (slots == -1).nonzero().flatten()
        err = ((dx.float() - ref[0].float()).abs().max()).item()
        print(f"piece {piece} warps {warps}: {empty.numel()} slots still EMPTY "
              f"(first {empty[:8].tolist()}), dx err {err:.2e}", flush=True)


def bench() -> None:
    from triton.testing import do_bench

    from fusedops.triton import layernorm as tln
    sys.path.insert(0, os.path.dirname(__file__))
    from lnbwd_case import case, copy_tbps

    copy = copy_tbps()
    print(torch.cuda.get_device_name(), triton.__version__, f"copy {copy:.3f} TB/s", flush=True)
    recs = []
    specs = [(torch.bfloat16, n) for n in (16384, 32768, 65536)] + [(torch.float16, 16384)]
    for dt, N in specs:
        x, dy, w, mean, rstd, nbytes = case(dt, N)
        ref = tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True)
        line = f"{str(dt)[6:]:9s} N={N:6d}"
        t = do_bench(lambda: tln.layernorm_backward(dy, x, w, mean, rstd, True, True, True),
                     rep=50)
        recs.append(dict(dtype=str(dt), N=N, variant="shipped", tbps=nbytes / t / 1e9))
        line += f" shipped {nbytes / t / 1e9:.2f}"
        chosen = os.environ.get("VARIANTS")
        chosen = ([tuple(None if v == "None" else int(v) for v in spec.split(","))
                   for spec in chosen.split(";")] if chosen else VARIANTS)
        for var in chosen:
            name = "r{}l{}m{}x{}w{}c{}".format(*var)
            try:
                out = split_rows_backward(dy, x, w, mean, rstd, *var)
                err = max(((o.float() - r.float()).abs().max() / (1 + r.float().abs().max())).item()
                          for o, r in zip(out, ref, strict=True))
                t = do_bench(lambda var=var: split_rows_backward(dy, x, w, mean, rstd, *var),
                             rep=50)
                tb = nbytes / t / 1e9
            except Exception as exc:  # noqa: BLE001
                tb, err = 0.0, f"{type(exc).__name__}: {str(exc)[:100]}"
            regs = _REGS.get((x.dtype, N, *var))
            if (x.dtype, N, *var) in _LEFT:
                line += f" [left {_LEFT[(x.dtype, N, *var)]}]"
            recs.append(dict(dtype=str(dt), N=N, variant=name, tbps=tb, err=err, regs=regs))
            line += f" | {name} {tb:.2f} ({regs}, {err if isinstance(err, str) else f'{err:.0e}'})"
        print(line, flush=True)
        del x, dy, w, mean, rstd, ref
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "split_rows.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                       "copy_tbps": copy, "records": recs}, f, indent=1)


if __name__ == "__main__":
    {"regs": regs_report, "debug6": debug6}.get((sys.argv[1:] or ["bench"])[0], bench)()
