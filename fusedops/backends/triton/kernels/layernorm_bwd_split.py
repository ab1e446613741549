"""The split-row LayerNorm backward kernel (``@triton.jit`` only): long rows in cooperating
pieces, through global memory or a thread-block cluster (``runtime/clusters.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.backends.triton.kernels.clusters import (
    cluster_peer_sums,
    cluster_publish,
    cluster_start,
)
from fusedops.backends.triton.kernels.common import await_row, publish_row, split_edges, split_head
from fusedops.backends.triton.kernels.layernorm_bwd import body_at, piece_at, rounded_mul, row_sums


@triton.jit
def ln_bwd_split(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, stats_ptr, count_ptr,
    N, L, stride_dy, stride_x, stride_dx, M_dx, num_items, num_progs,
    BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, HAS_W: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
    PREFETCH: tl.constexpr, PARKED: tl.constexpr, VEC: tl.constexpr, PAIRED: tl.constexpr,
    CLUSTER: tl.constexpr,
):
    # Work item = (row, chunk), row-major, on a grid that is a multiple of C: a program always
    # gets the same chunk (pid % C), so it keeps that chunk's weight and its dweight/dbias
    # partials in registers across rows. Each chunk publishes its two partial row sums, waits for
    # its row's other chunks (see runtime/split.py), then writes its piece of dx:
    # x and dy are read once, dx written once, partials are (2, num_progs / C, N) float32.
    # PREFETCH: see runtime/split.py. PARKED: dx is written for rows below M_dx only (see
    # ln_bwd_single); ln_bwd_dx_published writes the others with the same arithmetic.
    # VEC > 0 (rows that start unaligned; x, dy and dx share the row stride): lane j is
    # position chunk·L + j of the row's aligned body, column head + chunk·L + j, and piece 0
    # also has the row's edges (split_edges). The grid is a multiple of C·VEC (or one item per
    # program), so all rows of a program share one head: its weight and accumulator columns,
    # edges included, are fixed.
    # CLUSTER (aligned rows, launched by runtime.clusters.ClusterLauncher): the C programs of a row
    # are one thread-block cluster, which exchanges the sums through shared memory and the
    # cluster barrier instead of the counters (the statistics are still stored for the parked
    # tail's second launch); VEC must be 0. w·dy is an explicitly rounded product (never
    # contracted into a multiply-add, see rounded_mul), in the sums and in dx alike, as in
    # ln_bwd_dx_pieces and ln_bwd_dx_published: with or without a wait loop between the
    # product and the subtraction, every variant writes the same bits.
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    peers = tl.arange(0, C_P2)
    pos = (pid % C) * L + lanes
    step = num_progs // C
    parity = pid * 0
    if CLUSTER and NEED_DX:
        parity = cluster_start(parity)
    if VEC > 0:
        # weight and partial columns head + pos, from a scalar base (no tensor of columns live
        # across the row loop: pos is, for the addresses)
        head, body = split_head(pid // C, N, stride_x, VEC)
        w_at = w_ptr + head
        cmask = (lanes < L) & (pos < body)
        _, emask, ecols = split_edges(pid // C, pid % C, N, stride_x, VEC)
        if HAS_W:
            we = tl.load(w_ptr + ecols, mask=emask, other=0.0).to(tl.float32)
        dwe_acc = tl.zeros([2 * VEC], tl.float32)
        dbe_acc = tl.zeros([2 * VEC], tl.float32)
    else:
        head = 0
        w_at = w_ptr
        cmask = (lanes < L) & (pos < N)
    if HAS_W:
        w = tl.load(w_at + pos, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK], tl.float32)
    db_acc = tl.zeros([BLOCK], tl.float32)
    if PREFETCH > 0:
        x_next, dy_next = piece_at(x_ptr, dy_ptr, (pid // C).to(tl.int64), stride_x,
                                    stride_dy, pos, cmask, VEC)
    for item in range(pid, num_items, num_progs):
        row = item // C
        row64 = row.to(tl.int64)
        if PREFETCH > 0:
            x = x_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            more = cmask & (item + num_progs < num_items)
            if PREFETCH == 1:
                x_next, dy_next = piece_at(x_ptr, dy_ptr, row64 + step, stride_x, stride_dy,
                                            pos, more, VEC)
        else:
            x, dy = piece_at(x_ptr, dy_ptr, row64, stride_x, stride_dy, pos, cmask, VEC)
            x = x.to(tl.float32)
            dy = dy.to(tl.float32)
        if VEC > 0:
            xe = tl.load(x_ptr + row64 * stride_x + ecols, mask=emask, other=0.0).to(tl.float32)
            dye = tl.load(dy_ptr + row64 * stride_dy + ecols, mask=emask,
                          other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        xhat = (x - mean) * rstd  # no select: masked lanes have dy = 0 (see ln_bwd_single)
        if VEC > 0:
            xhe = tl.where(emask, (xe - mean) * rstd, 0.0)
        # Accumulate before waiting: only xhat and w·dy stay live across the wait.
        if NEED_DW:
            dw_acc += dy * xhat
            if VEC > 0:
                dwe_acc += dye * xhe
        if NEED_DB:
            db_acc += dy
            if VEC > 0:
                dbe_acc += dye
        if NEED_DX:
            if HAS_W:
                wdy = rounded_mul(dy, w, True)
            else:
                wdy = dy
            s1, s2 = row_sums(xhat * wdy, wdy, 0, PAIRED)
            if VEC > 0:
                if HAS_W:
                    wdye = rounded_mul(dye, we, True)
                else:
                    wdye = dye
                s1 += tl.sum(xhe * wdye, axis=0)
                s2 += tl.sum(wdye, axis=0)
            tl.store(stats_ptr + item * 2, s1)
            tl.store(stats_ptr + item * 2 + 1, s2)
            if CLUSTER:
                token = cluster_publish(s1, s2, pid % C, parity, C)
                p1, p2 = cluster_peer_sums(peers, parity, token, C)
                parity = 1 - parity
                if PREFETCH >= 2:
                    x_next, dy_next = piece_at(x_ptr, dy_ptr, row64 + step, stride_x,
                                                stride_dy, pos, more, VEC)
                c1 = tl.sum(p1, axis=0) / N
                c2 = tl.sum(p2, axis=0) / N
            else:
                publish_row(count_ptr, row)
                if PREFETCH == 3:
                    x_next, dy_next = piece_at(x_ptr, dy_ptr, row64 + step, stride_x,
                                                stride_dy, pos, more, VEC)
                await_row(count_ptr, row, C)
                if PREFETCH == 2:
                    x_next, dy_next = piece_at(x_ptr, dy_ptr, row64 + step, stride_x,
                                                stride_dy, pos, more, VEC)
                base = (row * C + peers) * 2
                ok = peers < C
                c1 = tl.sum(tl.load(stats_ptr + base, mask=ok, other=0.0, cache_modifier=".cg"),
                            axis=0) / N
                c2 = tl.sum(tl.load(stats_ptr + base + 1, mask=ok, other=0.0,
                                    cache_modifier=".cg"), axis=0) / N
            dx = ((wdy - (xhat * c1 + c2)) * rstd).to(dx_ptr.dtype.element_ty)
            dx_at = dx_ptr + body_at(row64, stride_dx, VEC) + pos
            if PARKED:
                tl.store(dx_at, dx, mask=cmask & (row < M_dx))
            else:
                tl.store(dx_at, dx, mask=cmask)
            if VEC > 0:
                dxe = ((wdye - (xhe * c1 + c2)) * rstd).to(dx_ptr.dtype.element_ty)
                if PARKED:
                    tl.store(dx_ptr + row64 * stride_dx + ecols, dxe, mask=emask & (row < M_dx))
                else:
                    tl.store(dx_ptr + row64 * stride_dx + ecols, dxe, mask=emask)
        elif PREFETCH >= 2:
            x_next, dy_next = piece_at(x_ptr, dy_ptr, row64 + step, stride_x, stride_dy, pos,
                                        more, VEC)
    out = part_ptr + (pid // C).to(tl.int64) * N
    db_out = out + (num_progs // C) * N  # < 2^31: partial rows x N
    if NEED_DW:
        tl.store(out + head + pos, dw_acc, mask=cmask)
        if VEC > 0:
            tl.store(out + ecols, dwe_acc, mask=emask)
    if NEED_DB:
        tl.store(db_out + head + pos, db_acc, mask=cmask)
        if VEC > 0:
            tl.store(db_out + ecols, dbe_acc, mask=emask)
