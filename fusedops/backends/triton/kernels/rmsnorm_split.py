"""The split-row RMSNorm kernels (``@triton.jit`` only): rows too long for one program in C
cooperating pieces (``runtime/split.py``), also exchanging through a thread-block cluster
(``runtime/clusters.py``). The rules that pick them: ``configs/rmsnorm.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.backends.triton.kernels.clusters import (
    cluster_peer_sums,
    cluster_piece,
    cluster_publish,
    cluster_start,
)
from fusedops.backends.triton.kernels.common import (
    await_row,
    publish_row,
    split_head,
    split_piece,
)
from fusedops.backends.triton.kernels.rmsnorm import rstd_of, sum_sq


@triton.jit
def body_start(row64, stride, VEC: tl.constexpr):
    """Offset of lane 0 of a row's pieces: the row's start, or (VEC > 0, rows that start
    unaligned) its first 16-byte boundary, visibly a multiple of VEC to the compiler."""
    start = row64 * stride
    if VEC > 0:
        start = ((start + (VEC - 1)) // VEC) * VEC
    return start


@triton.jit
def piece_edges(row, chunk, N, stride, VEC: tl.constexpr):
    """``(offs, mask, col)`` of the columns of row ``row`` outside its aligned body (a 2·VEC
    tile: lanes < VEC the head, the rest the tail), masked off except for piece 0 (as
    kernels/common.py's split_edges, with the piece test as a vector: the interpreter rejects
    a scalar-and-vector mask)."""
    head, body = split_head(row, N, stride, VEC)
    j = tl.arange(0, 2 * VEC)
    col = tl.where(j < VEC, j, head + body + (j - VEC))
    mask = tl.where(j < VEC, j < head, col < N) & (j * 0 + chunk == 0)
    return row.to(tl.int64) * stride + col, mask, col


@triton.jit
def rms_fwd_split(
    x_ptr, w_ptr, y_ptr, rstd_ptr, stats_ptr, count_ptr, N, L, stride_x, stride_y, eps,
    num_items, num_progs,
    BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, HAS_W: tl.constexpr,
    STATS: tl.constexpr, PREFETCH: tl.constexpr, VEC: tl.constexpr, CLUSTER: tl.constexpr,
):
    # Work item = (row, piece), row-major, on a grid that is a multiple of C: a program always
    # has the same piece (split_piece in kernels/common.py), of rows num_progs // C apart. Each
    # piece publishes its sum of squares (one float per item in stats), waits for its row's
    # other pieces and writes y from the row's total: x read once, y written once.
    # VEC > 0: pieces of the aligned body, piece 0 also the edges, x and y share the row
    # stride; the grid is a multiple of C·VEC (or one item per program), so a program's rows
    # share one misalignment and its weight columns are fixed: the weight is loaded once.
    # PREFETCH: see runtime/split.py. CLUSTER (aligned rows, VEC = 0, launched by
    # runtime.clusters.ClusterLauncher): the C programs of a row are one thread-block cluster
    # exchanging the sums on chip (stats and count unused).
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    peers = tl.arange(0, C_P2)
    chunk = pid % C
    step = num_progs // C
    parity = pid * 0
    if CLUSTER:
        parity = cluster_start(parity)
    if VEC > 0 and HAS_W:
        head, body = split_head(pid // C, N, stride_x, VEC)
        w = tl.load(w_ptr + head + chunk * L + lanes,
                    mask=(lanes < L) & (chunk * L + lanes < body), other=0.0).to(tl.float32)
    if PREFETCH > 0:
        offs, mask, pos = split_piece(pid // C, chunk, L, N, stride_x, BLOCK, VEC)
        x_next = tl.load(x_ptr + offs, mask=mask, other=0.0)
    for item in range(pid, num_items, num_progs):
        row = pid * 0 + item // C  # (a tensor also where the interpreter's loop gives ints)
        offs, mask, pos = split_piece(row, chunk, L, N, stride_x, BLOCK, VEC)
        if PREFETCH > 0:
            x = x_next.to(tl.float32)
            n_offs, n_mask, n_pos = split_piece(row + step, chunk, L, N, stride_x, BLOCK, VEC)
            # (a vector test: the interpreter rejects a scalar-and-vector mask)
            n_mask = n_mask & (lanes * 0 + item + num_progs < num_items)
            if PREFETCH == 1:
                x_next = tl.load(x_ptr + n_offs, mask=n_mask, other=0.0)
        else:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        ss = sum_sq(x, 0)
        if VEC > 0:
            e_offs, e_mask, e_col = piece_edges(row, chunk, N, stride_x, VEC)
            xe = tl.load(x_ptr + e_offs, mask=e_mask, other=0.0).to(tl.float32)
            ss += sum_sq(xe, 0)
        if CLUSTER:
            token = cluster_publish(ss, ss, chunk, parity, C)
            sums, sums2 = cluster_peer_sums(peers, parity, token, C)
            parity = 1 - parity
            if PREFETCH >= 2:
                x_next = tl.load(x_ptr + n_offs, mask=n_mask, other=0.0)
            total = tl.sum(sums, axis=0)
        else:
            tl.store(stats_ptr + item, ss)
            publish_row(count_ptr, row)
            if PREFETCH == 3:
                x_next = tl.load(x_ptr + n_offs, mask=n_mask, other=0.0)
            await_row(count_ptr, row, C)
            if PREFETCH == 2:
                x_next = tl.load(x_ptr + n_offs, mask=n_mask, other=0.0)
            total = tl.sum(tl.load(stats_ptr + row * C + peers, mask=peers < C, other=0.0,
                                   cache_modifier=".cg"), axis=0)
        rstd = rstd_of(total, N, eps, EXACT)
        y = x * rstd
        if HAS_W:
            if VEC > 0:
                y = y * w
            else:  # (per row, from L2: the registers go to the piece and its prefetch)
                y = y * tl.load(w_ptr + pos, mask=mask, other=0.0).to(tl.float32)
        offs_y, mask_y, pos_y = split_piece(row, chunk, L, N, stride_y, BLOCK, VEC)
        tl.store(y_ptr + offs_y, y.to(y_ptr.dtype.element_ty), mask=mask_y)
        if VEC > 0:
            ye = xe * rstd
            if HAS_W:
                ye = ye * tl.load(w_ptr + e_col, mask=e_mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + e_offs, ye.to(y_ptr.dtype.element_ty), mask=e_mask)
        if STATS:
            tl.store(rstd_ptr + row, rstd, mask=chunk == 0)


@triton.jit
def piece_at(x_ptr, dy_ptr, row64, stride_x, stride_dy, pos, mask, VEC: tl.constexpr):
    """(x, dy) of a split-row program's piece of row ``row64``, in the inputs' dtype."""
    return (tl.load(x_ptr + body_start(row64, stride_x, VEC) + pos, mask=mask, other=0.0),
            tl.load(dy_ptr + body_start(row64, stride_dy, VEC) + pos, mask=mask, other=0.0))


@triton.jit
def rms_bwd_split(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, part_ptr, stats_ptr, count_ptr,
    N, L, stride_dy, stride_x, stride_dx, num_items, num_progs,
    BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, HAS_W: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, PREFETCH: tl.constexpr, VEC: tl.constexpr,
    CLUSTER: tl.constexpr,
):
    # Work item = (row, piece) as in rms_fwd_split: a program keeps one piece of columns, so
    # its weight and its dweight partials stay in registers across its rows; partials are
    # (num_progs // C, N) float32, one row per group of C programs. With NEED_DX each piece
    # publishes Σ x̂·w·dy of its columns, waits for its row's other pieces and writes its
    # piece of dx: x and dy read once, dx written once.
    # VEC > 0 (x, dy and dx share the row stride): pieces of the aligned body (lane j of piece
    # c: column head + c·L + j), piece 0 also the edges; the grid is a multiple of C·VEC (or
    # one item per program), so head is fixed per program.
    # CLUSTER (aligned rows, launched by runtime.clusters.ClusterLauncher): the C programs of a
    # row are one thread-block cluster exchanging the sums through shared memory.
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    peers = tl.arange(0, C_P2)
    pos = (pid % C) * L + lanes
    step = num_progs // C
    parity = pid * 0
    if CLUSTER and NEED_DX:
        parity = cluster_start(parity)
    if VEC > 0:
        head, body = split_head(pid // C, N, stride_x, VEC)
        cmask = (lanes < L) & (pos < body)
        e_offs, emask, ecols = piece_edges(pid // C, pid % C, N, stride_x, VEC)
        if HAS_W:
            we = tl.load(w_ptr + ecols, mask=emask, other=0.0).to(tl.float32)
        dwe_acc = tl.zeros([2 * VEC], tl.float32)
    else:
        head = 0
        cmask = (lanes < L) & (pos < N)
    if HAS_W:
        w = tl.load(w_ptr + head + pos, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK], tl.float32)
    if PREFETCH > 0:
        x_next, dy_next = piece_at(x_ptr, dy_ptr, (pid // C).to(tl.int64), stride_x,
                                   stride_dy, pos, cmask, VEC)
    for item in range(pid, num_items, num_progs):
        row = pid * 0 + item // C  # (a tensor also where the interpreter's loop gives ints)
        row64 = row.to(tl.int64)
        if PREFETCH > 0:
            x = x_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            more = cmask & (lanes * 0 + item + num_progs < num_items)
            if PREFETCH == 1:
                x_next, dy_next = piece_at(x_ptr, dy_ptr, row64 + step, stride_x, stride_dy,
                                           pos, more, VEC)
        else:
            x, dy = piece_at(x_ptr, dy_ptr, row64, stride_x, stride_dy, pos, cmask, VEC)
            x = x.to(tl.float32)
            dy = dy.to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd  # masked lanes: x = dy = 0, nothing added to any sum
        if VEC > 0:
            xhe = tl.load(x_ptr + row64 * stride_x + ecols, mask=emask,
                          other=0.0).to(tl.float32) * rstd
            dye = tl.load(dy_ptr + row64 * stride_dy + ecols, mask=emask,
                          other=0.0).to(tl.float32)
        if NEED_DW:  # before any wait: only x̂ and w·dy stay live across it
            dw_acc += dy * xhat
            if VEC > 0:
                dwe_acc += dye * xhe
        if NEED_DX:
            if HAS_W:
                g = dy * w
            else:
                g = dy
            s = tl.sum(xhat * g, axis=0)
            if VEC > 0:
                if HAS_W:
                    ge = dye * we
                else:
                    ge = dye
                s += tl.sum(xhe * ge, axis=0)
            if CLUSTER:
                token = cluster_publish(s, s, pid % C, parity, C)
                sums, sums2 = cluster_peer_sums(peers, parity, token, C)
                parity = 1 - parity
                if PREFETCH >= 2:
                    x_next, dy_next = piece_at(x_ptr, dy_ptr, row64 + step, stride_x,
                                               stride_dy, pos, more, VEC)
            else:
                tl.store(stats_ptr + item, s)
                publish_row(count_ptr, row)
                if PREFETCH == 3:
                    x_next, dy_next = piece_at(x_ptr, dy_ptr, row64 + step, stride_x,
                                               stride_dy, pos, more, VEC)
                await_row(count_ptr, row, C)
                if PREFETCH == 2:
                    x_next, dy_next = piece_at(x_ptr, dy_ptr, row64 + step, stride_x,
                                               stride_dy, pos, more, VEC)
                sums = tl.load(stats_ptr + row * C + peers, mask=peers < C, other=0.0,
                               cache_modifier=".cg")
            c = tl.sum(sums, axis=0) / N
            dx = ((g - xhat * c) * rstd).to(dx_ptr.dtype.element_ty)
            tl.store(dx_ptr + body_start(row64, stride_dx, VEC) + pos, dx, mask=cmask)
            if VEC > 0:
                dxe = ((ge - xhe * c) * rstd).to(dx_ptr.dtype.element_ty)
                tl.store(dx_ptr + row64 * stride_dx + ecols, dxe, mask=emask)
        elif PREFETCH >= 2:
            x_next, dy_next = piece_at(x_ptr, dy_ptr, row64 + step, stride_x, stride_dy, pos,
                                       more, VEC)
    if NEED_DW:
        out = part_ptr + (pid // C).to(tl.int64) * N
        tl.store(out + head + pos, dw_acc, mask=cmask)
        if VEC > 0:
            tl.store(out + ecols, dwe_acc, mask=emask)


@triton.jit
def rms_fwd_pieces(
    x_ptr, w_ptr, y_ptr, rstd_ptr, M, stride_x, stride_y, eps, num_progs,
    N: tl.constexpr, L: tl.constexpr, CHUNK: tl.constexpr, C: tl.constexpr,
    C_P2: tl.constexpr, HAS_W: tl.constexpr, STATS: tl.constexpr,
):
    # Aligned rows of N = C·L in thread-block clusters of C programs (runtime/clusters.py),
    # program pid the piece pid % C of rows num_progs // C apart. A piece is never held: as in
    # rms_fwd_unrolled, pass 1 streams it in unrolled chunks (kept in L2) for its sum of
    # squares, the cluster exchanges the sums on chip, and pass 2 reads the piece again from L2
    # to write y. A cluster's rows are C times shorter than the unrolled kernel's, so what its
    # programs keep in L2 between the passes fits where whole rows do not.
    EXACT: tl.constexpr = y_ptr.dtype.element_ty == tl.float32
    pid, piece, parity = cluster_piece(C)
    lanes = tl.arange(0, CHUNK)
    peers = tl.arange(0, C_P2)
    for row in range(pid // C, M, num_progs // C):
        x_piece = x_ptr + row.to(tl.int64) * stride_x + piece * L
        acc = tl.zeros([CHUNK], tl.float32)
        for start in tl.static_range(0, L, CHUNK):
            x = tl.load(x_piece + start + lanes, eviction_policy="evict_last").to(tl.float32)
            acc = tl.fma(x, x, acc)
        ss = tl.sum(acc, axis=0)
        token = cluster_publish(ss, ss, piece, parity, C)
        sums, sums2 = cluster_peer_sums(peers, parity, token, C)
        parity = 1 - parity
        rstd = rstd_of(tl.sum(sums, axis=0), N, eps, EXACT)
        if STATS:
            tl.store(rstd_ptr + row, rstd, mask=piece == 0)
        y_piece = y_ptr + row.to(tl.int64) * stride_y + piece * L
        for start in tl.static_range(0, L, CHUNK):
            y = tl.load(x_piece + start + lanes, eviction_policy="evict_first").to(tl.float32)
            y = y * rstd
            if HAS_W:
                y = y * tl.load(w_ptr + piece * L + start + lanes,
                                eviction_policy="evict_last").to(tl.float32)
            tl.store(y_piece + start + lanes, y.to(y_ptr.dtype.element_ty))


@triton.jit
def piece_dot(x_piece, dy_piece, w_piece, lanes, L: tl.constexpr, CHUNK: tl.constexpr,
              HAS_W: tl.constexpr):
    """Σ x·w·dy over one streamed piece (its chunks kept in L2 for the second pass)."""
    s = tl.zeros([CHUNK], tl.float32)
    for start in tl.static_range(0, L, CHUNK):
        x = tl.load(x_piece + start + lanes, eviction_policy="evict_last").to(tl.float32)
        g = tl.load(dy_piece + start + lanes, eviction_policy="evict_last").to(tl.float32)
        if HAS_W:
            g = g * tl.load(w_piece + start + lanes, eviction_policy="evict_last").to(tl.float32)
        s = tl.fma(x, g, s)
    return tl.sum(s, axis=0)


@triton.jit
def dx_chunk(x_piece, dy_piece, w_piece, dx_piece, start, lanes, rstd, c, HAS_W: tl.constexpr):
    """Write one chunk's dx = rstd·(g − x̂·c) (x and dy read again, from L2) and return its
    dweight terms dy·x̂ (float32)."""
    xhat = tl.load(x_piece + start + lanes, eviction_policy="evict_first").to(tl.float32) * rstd
    dy = tl.load(dy_piece + start + lanes, eviction_policy="evict_first").to(tl.float32)
    g = dy
    if HAS_W:
        g = dy * tl.load(w_piece + start + lanes, eviction_policy="evict_last").to(tl.float32)
    tl.store(dx_piece + start + lanes, ((g - xhat * c) * rstd).to(dx_piece.dtype.element_ty))
    return dy * xhat


@triton.jit
def rms_bwd_pieces(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, part_ptr, M, stride_dy, stride_x, stride_dx,
    num_progs, N: tl.constexpr, L: tl.constexpr, CHUNK: tl.constexpr, C: tl.constexpr,
    C_P2: tl.constexpr, HAS_W: tl.constexpr, NEED_DW: tl.constexpr,
):
    # The backward of aligned rows N = C·L in clusters of C programs, as rms_fwd_pieces: pass 1
    # streams the piece's x and dy (kept in L2) for Σ x̂·w·dy, the cluster exchanges the sums,
    # pass 2 reads them again from L2, writes dx and adds dy·x̂ to the piece's dweight
    # accumulators (one per chunk, L / CHUNK <= 4, unrolled by hand: the only registers kept
    # across rows). The grid is persistent; partials are (num_progs // C, N) float32.
    tl.static_assert(L // CHUNK <= 4)
    pid, piece, parity = cluster_piece(C)
    lanes = tl.arange(0, CHUNK)
    peers = tl.arange(0, C_P2)
    w_piece = w_ptr + piece * L
    acc0 = tl.zeros([CHUNK], tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for row in range(pid // C, M, num_progs // C):
        row64 = row.to(tl.int64)
        x_piece = x_ptr + row64 * stride_x + piece * L
        dy_piece = dy_ptr + row64 * stride_dy + piece * L
        dx_piece = dx_ptr + row64 * stride_dx + piece * L
        s = piece_dot(x_piece, dy_piece, w_piece, lanes, L, CHUNK, HAS_W)
        token = cluster_publish(s, s, piece, parity, C)
        sums, sums2 = cluster_peer_sums(peers, parity, token, C)
        parity = 1 - parity
        rstd = tl.load(rstd_ptr + row)
        c = tl.sum(sums, axis=0) * rstd / N
        acc0 += dx_chunk(x_piece, dy_piece, w_piece, dx_piece, 0, lanes, rstd, c, HAS_W)
        if L > CHUNK:
            acc1 += dx_chunk(x_piece, dy_piece, w_piece, dx_piece, CHUNK, lanes, rstd, c, HAS_W)
        if L > 2 * CHUNK:
            acc2 += dx_chunk(x_piece, dy_piece, w_piece, dx_piece, 2 * CHUNK, lanes, rstd, c,
                             HAS_W)
        if L > 3 * CHUNK:
            acc3 += dx_chunk(x_piece, dy_piece, w_piece, dx_piece, 3 * CHUNK, lanes, rstd, c,
                             HAS_W)
    if NEED_DW:
        out = part_ptr + (pid // C).to(tl.int64) * N + piece * L + lanes
        tl.store(out, acc0)
        if L > CHUNK:
            tl.store(out + CHUNK, acc1)
        if L > 2 * CHUNK:
            tl.store(out + 2 * CHUNK, acc2)
        if L > 3 * CHUNK:
            tl.store(out + 3 * CHUNK, acc3)
