"""LayerNorm backward kernels (``@triton.jit`` only): the fused single-block kernel, the dx row
kernels and the dweight/dbias column and partial-sum kernels. The split-row kernel is in
``layernorm_bwd_split.py``; the rules that pick them: ``configs/layernorm.py``."""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.backends.triton.kernels.common import (
    row_body,
    row_edges,
    split_edges,
    split_head,
    tile_rows,
)


@triton.jit
def over_rows(acc, ACC_1D: tl.constexpr):
    """A program's partial row from its accumulator: (ROWS, BLOCK) ones summed over rows."""
    if ACC_1D:
        row = acc
    else:
        row = tl.sum(acc, axis=0)
    return row


@triton.jit
def _add_pairs(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def row_sums(a, b, axis: tl.constexpr, PAIRED: tl.constexpr):
    """(sum(a), sum(b)) over ``axis``: one paired reduction (one cross-warp exchange) or two."""
    if PAIRED:
        return tl.reduce((a, b), axis, _add_pairs)
    else:
        return tl.sum(a, axis=axis), tl.sum(b, axis=axis)


@triton.jit
def ln_bwd_single(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr,
    M, N, stride_dy, stride_x, stride_dx, num_tiles, num_progs, first_tile, M_dx,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_W: tl.constexpr,
    NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, VEC: tl.constexpr,
    HOLD_W: tl.constexpr, ACC_1D: tl.constexpr, PARKED: tl.constexpr,
    PAIRED: tl.constexpr, STAGES: tl.constexpr,
):
    # NEED_DW/NEED_DB: per-program partials, part_ptr is (2, num_progs, N) float32. ACC_1D: fold
    # each tile's rows into (BLOCK_N,) accumulators at once (fewer registers); otherwise keep
    # (ROWS, BLOCK_N) accumulators and reduce over rows once at the end (no cross-warp reduction
    # per tile). VEC > 0 (unaligned rows, see row_body in kernels/common.py): all tiles of a program
    # share one misalignment (the launcher makes num_progs a multiple of VEC, or gives each
    # program one tile), so accumulator lane j is column pid_head + j throughout, and the
    # columns outside the aligned body accumulate in (2·VEC,) edge accumulators.
    # PARKED (see _park): tiles first_tile.. are processed and dx is written for rows below
    # M_dx only (the rows from M_dx on hold the parked partials until a second launch writes
    # their dx); first_tile is a multiple of VEC, so a program's misalignment holds.
    pid = tl.program_id(0)
    if PARKED:
        start = first_tile + pid
    else:
        start = pid
    cols = tl.arange(0, BLOCK_N)
    if VEC > 0:
        first_rows, pid_head = tile_rows(start, stride_x, ROWS, VEC)
        pid_body = ((N - pid_head) // VEC) * VEC
    if HAS_W and HOLD_W:  # see ln_fwd_single
        if VEC > 0:
            w = tl.load(w_ptr + pid_head + cols, mask=cols < pid_body,
                        other=0.0).to(tl.float32)[None, :]
        else:
            w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if ACC_1D:
        dw_acc = tl.zeros([BLOCK_N], tl.float32)
        db_acc = tl.zeros([BLOCK_N], tl.float32)
    else:
        dw_acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        db_acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    if VEC > 0:
        if ACC_1D or ROWS == 1:
            dwe_acc = tl.zeros([2 * VEC], tl.float32)
            dbe_acc = tl.zeros([2 * VEC], tl.float32)
        else:
            dwe_acc = tl.zeros([ROWS, 2 * VEC], tl.float32)
            dbe_acc = tl.zeros([ROWS, 2 * VEC], tl.float32)
    # STAGES > 1: Triton software-pipelines the tile loop (the next tiles' loads are copied
    # into shared memory asynchronously while this one is reduced; see fused_bwd_stages).
    for tile in tl.range(start, num_tiles, num_progs, num_stages=STAGES):
        rows, head = tile_rows(tile, stride_x, ROWS, VEC)
        row_mask = rows < M
        offs_x, mask = row_body(rows, head, M, N, stride_x, BLOCK_N, VEC)
        offs_dy, _ = row_body(rows, head, M, N, stride_dy, BLOCK_N, VEC)
        x = tl.load(x_ptr + offs_x, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs_dy, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        if VEC > 0:  # unaligned rows: edges loaded with the body
            if ROWS == 1:
                # One row: a 1-D edge tile with its own statistics. As a [1, 2·VEC] slice of
                # the body's layout, Triton 3.6 gave every thread 8 of its elements (26 scalar
                # loads per thread per row in the SASS; docs/performance.md, "Known gaps").
                e_row = tile
                j = tl.arange(0, 2 * VEC)
                e_col = tl.where(j < VEC, j, head + ((N - head) // VEC) * VEC + (j - VEC))
                e_mask = row_mask & tl.where(j < VEC, j < head, e_col < N)
                e_offs = e_row.to(tl.int64) * stride_x + e_col
                e_mean = tl.sum(mean, axis=0)  # the one row's, as scalars
                e_rstd = tl.sum(rstd, axis=0)
            else:
                e_offs, e_mask, e_col = row_edges(rows, head, M, N, stride_x, VEC)
                e_mean = mean[:, None]
                e_rstd = rstd[:, None]
            xe = tl.load(x_ptr + e_offs, mask=e_mask, other=0.0).to(tl.float32)
            dye = tl.load(dy_ptr + e_offs, mask=e_mask, other=0.0).to(tl.float32)
            xhe = tl.where(e_mask, (xe - e_mean) * e_rstd, 0.0)
        # No tl.where on the masked lanes: there dy is 0 (and rows past M have mean = rstd = 0),
        # so they add nothing to any sum unless xhat is not finite, which it then also is on
        # the row's own lanes (a NaN row either way). One select per element less (H200, bf16
        # 768: 2.15 -> 2.58 TB/s).
        xhat = (x - mean[:, None]) * rstd[:, None]
        if NEED_DX:
            if HAS_W:
                if not HOLD_W:
                    wmask = cols < ((N - head) // VEC) * VEC if VEC > 0 else cols < N
                    w = tl.load(w_ptr + head + cols, mask=wmask,
                                other=0.0).to(tl.float32)[None, :]
                wdy = dy * w
            else:
                wdy = dy
            c1, c2 = row_sums(xhat * wdy, wdy, 1, PAIRED)
            if VEC > 0:
                if HAS_W:
                    wdye = dye * tl.load(w_ptr + e_col, mask=e_col < N, other=0.0).to(tl.float32)
                else:
                    wdye = dye
                if ROWS == 1:
                    c1 += tl.sum(xhe * wdye, axis=0)
                    c2 += tl.sum(wdye, axis=0)
                else:
                    c1 += tl.sum(xhe * wdye, axis=1)
                    c2 += tl.sum(wdye, axis=1)
            c1 = c1 / N
            c2 = c2 / N
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            offs_dx, _ = row_body(rows, head, M, N, stride_dx, BLOCK_N, VEC)
            dx_mask = mask
            if PARKED:  # (offsets from row_body(..., M_dx, ...) cost 9-25% on unaligned rows)
                dx_mask = mask & (rows < M_dx)[:, None]
            tl.store(dx_ptr + offs_dx, dx.to(dx_ptr.dtype.element_ty), mask=dx_mask)
            if VEC > 0:
                if ROWS == 1:
                    dxe = (wdye - (xhe * tl.sum(c1, axis=0) + tl.sum(c2, axis=0))) * e_rstd
                    if PARKED:
                        e_mask = e_mask & (rows < M_dx)
                else:
                    dxe = (wdye - (xhe * c1[:, None] + c2[:, None])) * e_rstd
                    if PARKED:
                        e_mask = e_mask & (rows < M_dx)[:, None]
                tl.store(dx_ptr + e_offs, dxe.to(dx_ptr.dtype.element_ty), mask=e_mask)
        if ACC_1D:
            if NEED_DW:
                dw_acc += tl.sum(dy * xhat, axis=0)
            if NEED_DB:
                db_acc += tl.sum(dy, axis=0)
        else:
            if NEED_DW:
                dw_acc += dy * xhat
            if NEED_DB:
                db_acc += dy
        if VEC > 0:
            if ACC_1D and ROWS > 1:
                if NEED_DW:
                    dwe_acc += tl.sum(dye * xhe, axis=0)
                if NEED_DB:
                    dbe_acc += tl.sum(dye, axis=0)
            else:  # one row (a 1-D edge tile), or (ROWS, 2·VEC) accumulators
                if NEED_DW:
                    dwe_acc += dye * xhe
                if NEED_DB:
                    dbe_acc += dye
    out = part_ptr + pid.to(tl.int64) * N
    dw_row = over_rows(dw_acc, ACC_1D)
    db_row = over_rows(db_acc, ACC_1D)
    if VEC > 0:
        dwe_row = over_rows(dwe_acc, ACC_1D or ROWS == 1)
        dbe_row = over_rows(dbe_acc, ACC_1D or ROWS == 1)
        # Every column of the partial row is written once: the body from the lanes, the rest
        # (columns [0, head) and [head + body, N)) from the edge accumulators.
        body_cols = pid_head + cols
        body_ok = cols < pid_body
        j = tl.arange(0, 2 * VEC)
        e_cols = tl.where(j < VEC, j, pid_head + pid_body + (j - VEC))
        e_ok = tl.where(j < VEC, j < pid_head, e_cols < N)
    else:
        body_cols = cols
        body_ok = cols < N
    if NEED_DW:
        tl.store(out + body_cols, dw_row, mask=body_ok)
        if VEC > 0:
            tl.store(out + e_cols, dwe_row, mask=e_ok)
    if NEED_DB:
        # num_progs may arrive as the constant 1; (programs x N) fits int32 for these rows.
        tl.store(out + num_progs * N + body_cols, db_row, mask=body_ok)
        if VEC > 0:
            tl.store(out + num_progs * N + e_cols, dbe_row, mask=e_ok)


@triton.jit
def piece_sums(dy_row, x_row, w_ptr, cols, cmask, mean, rstd, HAS_W: tl.constexpr,
                PAIRED: tl.constexpr, PTX: tl.constexpr):
    # One piece of a row's statistics as ln_bwd_split computes them: sum(xhat·w·dy), sum(w·dy)
    # (w·dy explicitly rounded there).
    x = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
    dy = tl.load(dy_row + cols, mask=cmask, other=0.0).to(tl.float32)
    xhat = (x - mean) * rstd
    if HAS_W:
        wdy = rounded_mul(dy, tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32), PTX)
    else:
        wdy = dy
    return row_sums(xhat * wdy, wdy, 0, PAIRED)


@triton.jit
def rounded_mul(a, b, PTX: tl.constexpr):
    """a·b rounded to float32 before any use: an explicitly rounded PTX multiply is never
    contracted into a multiply-add (PTX: False, the interpreter, which never contracts)."""
    if PTX:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def piece_dx(dy_row, x_row, w_ptr, dx_row, cols, cmask, mean, rstd, c1, c2,
              HAS_W: tl.constexpr, PTX: tl.constexpr):
    # dx of one piece from its row's combined statistics, as ln_bwd_split writes it after its
    # exchange (w·dy an explicitly rounded product there too).
    x = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
    wdy = tl.load(dy_row + cols, mask=cmask, other=0.0).to(tl.float32)
    xhat = tl.where(cmask, (x - mean) * rstd, 0.0)
    if HAS_W:
        wdy = rounded_mul(wdy, tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32),
                           PTX)
    dx = (wdy - (xhat * c1 + c2)) * rstd
    tl.store(dx_row + cols, dx.to(dx_row.dtype.element_ty), mask=cmask)


@triton.jit
def ln_bwd_dx_pieces(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, N, L, stride_dy, stride_x, stride_dx,
    row0, BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, HAS_W: tl.constexpr,
    PTX: tl.constexpr, VEC: tl.constexpr, PAIRED: tl.constexpr,
):
    # dx of row row0 + program id, bit for bit as ln_bwd_split computes it (same pieces of L
    # columns, or of the aligned body plus the edges with VEC > 0, the same BLOCK and warps, so
    # the same per-piece reductions, combined over a (C_P2,) vector as that kernel combines its
    # peers' sums), but in one program that reads the row twice: no statistics buffer, no
    # cooperating programs (for the few rows whose dx cannot hold that kernel's scratch, see
    # _split_backward). w·dy is an explicitly rounded product here as there (PTX, see
    # rounded_mul): never contracted into a multiply-add, however the code falls into basic
    # blocks (a wait loop separates the product from the subtraction in the cooperative split
    # kernel, nothing does in its cluster variant or here).
    row = row0 + tl.program_id(0)
    row64 = row.to(tl.int64)
    x_row = x_ptr + body_at(row64, stride_x, VEC)
    dy_row = dy_ptr + body_at(row64, stride_dy, VEC)
    dx_row = dx_ptr + body_at(row64, stride_dx, VEC)
    lanes = tl.arange(0, BLOCK)
    peers = tl.arange(0, C_P2)
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    if VEC > 0:
        head, limit = split_head(row, N, stride_x, VEC)
        w_body = w_ptr + head
    else:
        limit = N
        w_body = w_ptr
    s1 = tl.zeros([C_P2], tl.float32)
    s2 = tl.zeros([C_P2], tl.float32)
    for piece in range(C):
        pos = piece * L + lanes
        a, b = piece_sums(dy_row, x_row, w_body, pos, (lanes < L) & (pos < limit), mean, rstd,
                           HAS_W, PAIRED, PTX)
        if VEC > 0:  # the edges, with piece 0 (every piece adds a sum, as in the split kernel)
            _, emask, ecols = split_edges(row, piece, N, stride_x, VEC)
            ea, eb = piece_sums(dy_ptr + row64 * stride_dy, x_ptr + row64 * stride_x, w_ptr,
                                 ecols, emask, mean, rstd, HAS_W, PAIRED, PTX)
            a += ea
            b += eb
        s1 = tl.where(peers == piece, a, s1)
        s2 = tl.where(peers == piece, b, s2)
    c1 = tl.sum(s1, axis=0) / N
    c2 = tl.sum(s2, axis=0) / N
    for piece in range(C):
        pos = piece * L + lanes
        piece_dx(dy_row, x_row, w_body, dx_row, pos, (lanes < L) & (pos < limit), mean, rstd,
                  c1, c2, HAS_W, PTX)
    if VEC > 0:
        _, emask, ecols = split_edges(row, 0, N, stride_x, VEC)
        piece_dx(dy_ptr + row64 * stride_dy, x_ptr + row64 * stride_x, w_ptr,
                  dx_ptr + row64 * stride_dx, ecols, emask, mean, rstd, c1, c2, HAS_W, PTX)


@triton.jit
def ln_bwd_dx_published(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, stats_ptr, done_ptr, N, L, stride_dy,
    stride_x, stride_dx, row0, num_progs, late_from,
    BLOCK: tl.constexpr, C: tl.constexpr, C_P2: tl.constexpr, HAS_W: tl.constexpr,
    PTX: tl.constexpr, VEC: tl.constexpr,
):
    # dx of piece pid % C of row row0 + pid // C from the per-piece statistics a parked
    # ln_bwd_split launch left in dx's storage (see _split_backward), bit for bit as that
    # kernel computes it after its exchange: the same (C_P2,) sum of the peers' statistics, and
    # w·dy an explicitly rounded product (see rounded_mul).
    # VEC > 0: pieces of the aligned body, piece 0 with the edges, as in the split kernel.
    # The statistics lie in the storage of the last pieces: programs from late_from on (whose
    # dx covers them) write only once every program has read what it needs (done_ptr: a
    # zeroed counter there too). The others never wait, so the grid needs no co-residency.
    pid = tl.program_id(0)
    row = row0 + pid // C
    row64 = row.to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    peers = tl.arange(0, C_P2)
    pos = (pid % C) * L + lanes
    base = (row * C + peers) * 2
    ok = peers < C
    c1 = tl.sum(tl.load(stats_ptr + base, mask=ok, other=0.0, cache_modifier=".cg"),
                axis=0) / N
    c2 = tl.sum(tl.load(stats_ptr + base + 1, mask=ok, other=0.0, cache_modifier=".cg"),
                axis=0) / N
    tl.debug_barrier()  # every thread's statistics loads happen before the release
    tl.atomic_add(done_ptr, 1, sem="release")
    if pid >= late_from:
        seen = tl.atomic_add(done_ptr, 0, sem="acquire")
        while seen < num_progs:
            seen = tl.atomic_add(done_ptr, 0, sem="acquire")
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    if VEC > 0:
        head, body = split_head(row, N, stride_x, VEC)
        piece_dx(dy_ptr + body_at(row64, stride_dy, VEC), x_ptr + body_at(row64, stride_x, VEC),
                  w_ptr + head, dx_ptr + body_at(row64, stride_dx, VEC), pos,
                  (lanes < L) & (pos < body), mean, rstd, c1, c2, HAS_W, PTX)
        _, emask, ecols = split_edges(row, 0, N, stride_x, VEC)
        emask = emask & (pid % C + ecols * 0 == 0)  # piece 0's (a vector test: the interpreter
        # rejects a scalar-and-vector mask)
        piece_dx(dy_ptr + row64 * stride_dy, x_ptr + row64 * stride_x, w_ptr,
                  dx_ptr + row64 * stride_dx, ecols, emask, mean, rstd, c1, c2, HAS_W, PTX)
    else:
        piece_dx(dy_ptr + row64 * stride_dy, x_ptr + row64 * stride_x, w_ptr,
                  dx_ptr + row64 * stride_dx, pos, (lanes < L) & (pos < N), mean, rstd, c1, c2,
                  HAS_W, PTX)


@triton.jit
def ln_bwd_dx_looped(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, N, stride_dy, stride_x, stride_dx,
    CHUNK: tl.constexpr, HAS_W: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    dy_row = dy_ptr + row.to(tl.int64) * stride_dy
    dx_row = dx_ptr + row.to(tl.int64) * stride_dx
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    lanes = tl.arange(0, CHUNK)
    acc1 = tl.zeros([CHUNK], tl.float32)
    acc2 = tl.zeros([CHUNK], tl.float32)
    for start in range(0, N, CHUNK):
        cols = start + lanes
        valid = cols < N
        x = tl.load(x_row + cols, mask=valid, other=0.0).to(tl.float32)
        wdy = tl.load(dy_row + cols, mask=valid, other=0.0).to(tl.float32)
        if HAS_W:
            wdy = wdy * tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        xhat = tl.where(valid, (x - mean) * rstd, 0.0)
        acc1 += xhat * wdy
        acc2 += wdy
    c1 = tl.sum(acc1, axis=0) / N
    c2 = tl.sum(acc2, axis=0) / N
    for start in range(0, N, CHUNK):
        cols = start + lanes
        valid = cols < N
        x = tl.load(x_row + cols, mask=valid, other=0.0).to(tl.float32)
        wdy = tl.load(dy_row + cols, mask=valid, other=0.0).to(tl.float32)
        if HAS_W:
            wdy = wdy * tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        xhat = (x - mean) * rstd
        dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=valid)


@triton.jit
def ln_bwd_dwdb_columns(
    dy_ptr, x_ptr, mean_ptr, rstd_ptr, dw_part_ptr, db_part_ptr, M, N, stride_dy, stride_x,
    rows_per_split, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, ONE_STRIDE: tl.constexpr,
):
    col_block = tl.program_id(0)
    split = tl.program_id(1)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < N
    # 2-D accumulators, reduced over rows once at the end (no cross-warp reduction per tile).
    dw_acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    db_acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    row_start = split * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, M)
    for r0 in range(row_start, row_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        # With unaligned rows every access is a scalar one with its own 64-bit address: one
        # offset for both tensors where their strides agree halves that arithmetic (H200, bf16
        # N = 65537: 2.1x faster together with the tile below).
        dy_offs = rows64[:, None] * stride_dy + cols[None, :]
        dy = tl.load(dy_ptr + dy_offs, mask=mask, other=0.0).to(tl.float32)
        if NEED_DW:
            x_offs = dy_offs if ONE_STRIDE else rows64[:, None] * stride_x + cols[None, :]
            x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            # no select on xhat: masked lanes have dy = 0, and a non-finite xhat there lies in
            # a column past N (never stored) or a row whose own columns are NaN already
            dw_acc += dy * ((x - mean[:, None]) * rstd[:, None])
        if NEED_DB:
            db_acc += dy
    # float32 partials, or (one split) dweight/dbias themselves in the parameters' dtypes
    if NEED_DW:
        tl.store(dw_part_ptr + split.to(tl.int64) * N + cols,
                 tl.sum(dw_acc, axis=0).to(dw_part_ptr.dtype.element_ty), mask=col_mask)
    if NEED_DB:
        tl.store(db_part_ptr + split.to(tl.int64) * N + cols,
                 tl.sum(db_acc, axis=0).to(db_part_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def sum_partials(part_ptr, dw_ptr, db_ptr, P, N, FIRST: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_C: tl.constexpr):
    # part: (2, P, N) float32 (dweight, dbias partials); program (column block, set - FIRST).
    # A fixed (BLOCK_P, BLOCK_C) tile order and reduction tree: bitwise reproducible run to run,
    # and wide enough that thousands of partial rows do not serialise into dependent loads.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    which = tl.program_id(1) + FIRST
    cmask = cols < N
    base = part_ptr + which.to(tl.int64) * P * N
    acc = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        acc += tl.load(base + p.to(tl.int64)[:, None] * N + cols[None, :],
                       mask=(p < P)[:, None] & cmask[None, :], other=0.0)
    total = tl.sum(acc, axis=0)
    # dweight/dbias may be in the parameters' dtypes: rounded once, from the float32 sum.
    if which == 0:
        tl.store(dw_ptr + cols, total.to(dw_ptr.dtype.element_ty), mask=cmask)
    else:
        tl.store(db_ptr + cols, total.to(db_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def body_at(row64, stride, VEC: tl.constexpr):
    """Offset of lane 0 of a row in the LayerNorm backward's split kernels: the row's start, or
    (VEC > 0, rows that start unaligned) its first 16-byte boundary, visibly a multiple of VEC
    to the compiler, so the body's accesses are 16-byte vectors."""
    start = row64 * stride
    if VEC > 0:
        start = ((start + (VEC - 1)) // VEC) * VEC
    return start


@triton.jit
def piece_at(x_ptr, dy_ptr, row64, stride_x, stride_dy, pos, mask, VEC: tl.constexpr):
    """(x, dy) of a split-row program's piece of row ``row64``, in the inputs' dtype."""
    return (tl.load(x_ptr + body_at(row64, stride_x, VEC) + pos, mask=mask, other=0.0),
            tl.load(dy_ptr + body_at(row64, stride_dy, VEC) + pos, mask=mask, other=0.0))
