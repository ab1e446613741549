// fusedops Metal shaders: row LayerNorm, forward and backward.
//
// forward:  mean = x0 + sum(x - x0) / n (x0 = the row's first element),
//           rstd = 1 / sqrt(sum((x - mean)^2) / n + eps)
//           y = (x - mean) * rstd * w + b          (w, b optional, float32)
// backward: xhat = (x - mean) * rstd,  wdy = dy * w
//           dx = (wdy - (xhat * mean(xhat * wdy) + mean(wdy))) * rstd
//           dw = sum over rows of dy * xhat,  db = sum over rows of dy
//
// dw/db are computed in two deterministic stages: each threadgroup of the backward kernel
// owns a fixed set of rows (row = threadgroup id + k * threadgroups) and writes float32
// partial sums for its rows to partial[threadgroup, :]; fusedops_layernorm_dwdb_reduce then
// sums the partials over threadgroups in a fixed order, one thread per column.
//
// Kernel names: fusedops_layernorm_{fwd,bwd}_{single,looped}_<a>_<b>, see the
// instantiations at the end. See common.metal for the host/shader contract.

#include "common.metal"

// Forward, row held in registers: exact two-pass mean/variance from registers.
template <typename T, typename U>
[[kernel]] void fusedops_layernorm_fwd_single(
    device const T* x [[buffer(0)]],
    device const float* weight [[buffer(1)]],
    device const float* bias [[buffer(2)]],
    device U* y [[buffer(3)]],
    device float* mean_out [[buffer(4)]],
    device float* rstd_out [[buffer(5)]],
    constant long& n_rows [[buffer(6)]],
    constant long& n_cols [[buffer(7)]],
    constant long& x_stride [[buffer(8)]],
    constant float& eps [[buffer(9)]],
    constant long& flags [[buffer(10)]],
    uint tg_id [[threadgroup_position_in_grid]],
    uint n_tg [[threadgroups_per_grid]],
    uint lid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float shared[FUSEDOPS_SIMD_WIDTH];
  const uint n = uint(n_cols);
  const bool aligned = (flags & FUSEDOPS_FLAG_VEC) != 0;
  const bool has_w = (flags & FUSEDOPS_FLAG_WEIGHT) != 0;
  const bool has_b = (flags & FUSEDOPS_FLAG_BIAS) != 0;
  const uint i = lid * FUSEDOPS_READS;
  float wv[FUSEDOPS_READS] = {1.0f, 1.0f, 1.0f, 1.0f};
  float bv[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (has_w) {
    fusedops_load(weight, i, n, aligned, wv, 0.0f);
  }
  if (has_b) {
    fusedops_load(bias, i, n, aligned, bv, 0.0f);
  }
  const float inv_n = 1.0f / float(n);
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    float v[FUSEDOPS_READS];
    device const T* xr = x + row * x_stride;
    fusedops_load(xr, i, n, aligned, v, 0.0f);
    // Mean about the row's first element: exact for constant rows (y is then exactly the bias,
    // as in torch) and no cancellation for rows far from zero.
    const float x0 = float(xr[0]);
    float part = 0.0f;
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      part += (i + k < n) ? v[k] - x0 : 0.0f;
    }
    const float mean = x0 + fusedops_tg_sum(part, shared, lane, sg, nsg) * inv_n;
    float sq = 0.0f;
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      v[k] = (i + k < n) ? v[k] - mean : 0.0f;
      sq += v[k] * v[k];
    }
    const float var = fusedops_tg_sum(sq, shared, lane, sg, nsg) * inv_n;
    const float rstd = precise::rsqrt(var + eps);
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      v[k] = v[k] * rstd * wv[k] + bv[k];
    }
    fusedops_store(y + row * n, i, n, aligned, v);
    if (lid == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

// Forward for any n: pass 1 mean, pass 2 variance around the mean, pass 3 writes y.
template <typename T, typename U>
[[kernel]] void fusedops_layernorm_fwd_looped(
    device const T* x [[buffer(0)]],
    device const float* weight [[buffer(1)]],
    device const float* bias [[buffer(2)]],
    device U* y [[buffer(3)]],
    device float* mean_out [[buffer(4)]],
    device float* rstd_out [[buffer(5)]],
    constant long& n_rows [[buffer(6)]],
    constant long& n_cols [[buffer(7)]],
    constant long& x_stride [[buffer(8)]],
    constant float& eps [[buffer(9)]],
    constant long& flags [[buffer(10)]],
    uint tg_id [[threadgroup_position_in_grid]],
    uint n_tg [[threadgroups_per_grid]],
    uint lid [[thread_position_in_threadgroup]],
    uint n_threads [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float shared[FUSEDOPS_SIMD_WIDTH];
  const uint n = uint(n_cols);
  const bool aligned = (flags & FUSEDOPS_FLAG_VEC) != 0;
  const bool has_w = (flags & FUSEDOPS_FLAG_WEIGHT) != 0;
  const bool has_b = (flags & FUSEDOPS_FLAG_BIAS) != 0;
  const uint step = n_threads * FUSEDOPS_READS;
  const float inv_n = 1.0f / float(n);
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    device const T* xr = x + row * x_stride;
    device U* yr = y + row * n;
    // Mean about the row's first element (see fusedops_layernorm_fwd_single).
    const float x0 = float(xr[0]);
    float acc = 0.0f;
    for (uint i = lid * FUSEDOPS_READS; i < n; i += step) {
      float v[FUSEDOPS_READS];
      fusedops_load(xr, i, n, aligned, v, 0.0f);
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        acc += (i + k < n) ? v[k] - x0 : 0.0f;
      }
    }
    const float mean = x0 + fusedops_tg_sum(acc, shared, lane, sg, nsg) * inv_n;
    acc = 0.0f;
    for (uint i = lid * FUSEDOPS_READS; i < n; i += step) {
      float v[FUSEDOPS_READS];
      fusedops_load(xr, i, n, aligned, v, 0.0f);
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        const float d = (i + k < n) ? v[k] - mean : 0.0f;
        acc += d * d;
      }
    }
    const float var = fusedops_tg_sum(acc, shared, lane, sg, nsg) * inv_n;
    const float rstd = precise::rsqrt(var + eps);
    for (uint i = lid * FUSEDOPS_READS; i < n; i += step) {
      float v[FUSEDOPS_READS];
      float wv[FUSEDOPS_READS] = {1.0f, 1.0f, 1.0f, 1.0f};
      float bv[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
      fusedops_load(xr, i, n, aligned, v, 0.0f);
      if (has_w) {
        fusedops_load(weight, i, n, aligned, wv, 0.0f);
      }
      if (has_b) {
        fusedops_load(bias, i, n, aligned, bv, 0.0f);
      }
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        v[k] = (v[k] - mean) * rstd * wv[k] + bv[k];
      }
      fusedops_store(yr, i, n, aligned, v);
    }
    if (lid == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

// Backward, rows of x and dy held in registers; this threadgroup's dw/db partials stay in
// registers across its rows and are written once at the end.
template <typename T, typename G>
[[kernel]] void fusedops_layernorm_bwd_single(
    device const G* dy [[buffer(0)]],
    device const T* x [[buffer(1)]],
    device const float* weight [[buffer(2)]],
    device const float* mean [[buffer(3)]],
    device const float* rstd [[buffer(4)]],
    device T* dx [[buffer(5)]],
    device float* dw_partial [[buffer(6)]],
    device float* db_partial [[buffer(7)]],
    constant long& n_rows [[buffer(8)]],
    constant long& n_cols [[buffer(9)]],
    constant long& dy_stride [[buffer(10)]],
    constant long& x_stride [[buffer(11)]],
    constant long& flags [[buffer(12)]],
    uint tg_id [[threadgroup_position_in_grid]],
    uint n_tg [[threadgroups_per_grid]],
    uint lid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float2 shared[FUSEDOPS_SIMD_WIDTH];
  const uint n = uint(n_cols);
  const bool aligned = (flags & FUSEDOPS_FLAG_VEC) != 0;
  const bool need_dx = (flags & FUSEDOPS_FLAG_DX) != 0;
  const bool need_dw = (flags & FUSEDOPS_FLAG_DW) != 0;
  const bool need_db = (flags & FUSEDOPS_FLAG_DB) != 0;
  const uint i = lid * FUSEDOPS_READS;
  const float inv_n = 1.0f / float(n);
  float wv[FUSEDOPS_READS] = {1.0f, 1.0f, 1.0f, 1.0f};
  if ((flags & FUSEDOPS_FLAG_WEIGHT) != 0) {
    fusedops_load(weight, i, n, aligned, wv, 0.0f);
  }
  float dw_acc[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
  float db_acc[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    float xv[FUSEDOPS_READS];
    float gv[FUSEDOPS_READS];
    fusedops_load(x + row * x_stride, i, n, aligned, xv, 0.0f);
    fusedops_load(dy + row * dy_stride, i, n, aligned, gv, 0.0f);
    const float mu = mean[row];
    const float rs = rstd[row];
    float c1 = 0.0f;
    float c2 = 0.0f;
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      xv[k] = (xv[k] - mu) * rs;  // xhat (padding columns have gv == 0)
      const float wdy = gv[k] * wv[k];
      c1 += xv[k] * wdy;
      c2 += wdy;
      dw_acc[k] += gv[k] * xv[k];
      db_acc[k] += gv[k];
    }
    if (need_dx) {
      const float2 c = fusedops_tg_sum(float2(c1, c2), shared, lane, sg, nsg) * inv_n;
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        xv[k] = (gv[k] * wv[k] - (xv[k] * c.x + c.y)) * rs;
      }
      fusedops_store(dx + row * n, i, n, aligned, xv);
    }
  }
  const bool part_aligned = (n % FUSEDOPS_READS) == 0;
  if (need_dw) {
    fusedops_store(dw_partial + ulong(tg_id) * n, i, n, part_aligned, dw_acc);
  }
  if (need_db) {
    fusedops_store(db_partial + ulong(tg_id) * n, i, n, part_aligned, db_acc);
  }
}

// Backward for any n: pass 1 accumulates the two row sums and this threadgroup's dw/db
// partials (each thread always owns the same columns, so the read-modify-write of its
// partials is race-free); pass 2 writes dx.
template <typename T, typename G>
[[kernel]] void fusedops_layernorm_bwd_looped(
    device const G* dy [[buffer(0)]],
    device const T* x [[buffer(1)]],
    device const float* weight [[buffer(2)]],
    device const float* mean [[buffer(3)]],
    device const float* rstd [[buffer(4)]],
    device T* dx [[buffer(5)]],
    device float* dw_partial [[buffer(6)]],
    device float* db_partial [[buffer(7)]],
    constant long& n_rows [[buffer(8)]],
    constant long& n_cols [[buffer(9)]],
    constant long& dy_stride [[buffer(10)]],
    constant long& x_stride [[buffer(11)]],
    constant long& flags [[buffer(12)]],
    uint tg_id [[threadgroup_position_in_grid]],
    uint n_tg [[threadgroups_per_grid]],
    uint lid [[thread_position_in_threadgroup]],
    uint n_threads [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float2 shared[FUSEDOPS_SIMD_WIDTH];
  const uint n = uint(n_cols);
  const bool aligned = (flags & FUSEDOPS_FLAG_VEC) != 0;
  const bool has_w = (flags & FUSEDOPS_FLAG_WEIGHT) != 0;
  const bool need_dx = (flags & FUSEDOPS_FLAG_DX) != 0;
  const bool need_dw = (flags & FUSEDOPS_FLAG_DW) != 0;
  const bool need_db = (flags & FUSEDOPS_FLAG_DB) != 0;
  const bool part_aligned = (n % FUSEDOPS_READS) == 0;
  const uint step = n_threads * FUSEDOPS_READS;
  const float inv_n = 1.0f / float(n);
  device float* dwp = dw_partial + ulong(tg_id) * n;
  device float* dbp = db_partial + ulong(tg_id) * n;
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    device const T* xr = x + row * x_stride;
    device const G* gr = dy + row * dy_stride;
    const bool first = row == ulong(tg_id);
    const float mu = mean[row];
    const float rs = rstd[row];
    float c1 = 0.0f;
    float c2 = 0.0f;
    for (uint i = lid * FUSEDOPS_READS; i < n; i += step) {
      float xv[FUSEDOPS_READS];
      float gv[FUSEDOPS_READS];
      float wv[FUSEDOPS_READS] = {1.0f, 1.0f, 1.0f, 1.0f};
      fusedops_load(xr, i, n, aligned, xv, 0.0f);
      fusedops_load(gr, i, n, aligned, gv, 0.0f);
      if (has_w) {
        fusedops_load(weight, i, n, aligned, wv, 0.0f);
      }
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        xv[k] = (xv[k] - mu) * rs;
        const float wdy = gv[k] * wv[k];
        c1 += xv[k] * wdy;
        c2 += wdy;
      }
      if (need_dw) {
        float p[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (!first) {
          fusedops_load(dwp, i, n, part_aligned, p, 0.0f);
        }
        for (uint k = 0; k < FUSEDOPS_READS; ++k) {
          p[k] += gv[k] * xv[k];
        }
        fusedops_store(dwp, i, n, part_aligned, p);
      }
      if (need_db) {
        float p[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (!first) {
          fusedops_load(dbp, i, n, part_aligned, p, 0.0f);
        }
        for (uint k = 0; k < FUSEDOPS_READS; ++k) {
          p[k] += gv[k];
        }
        fusedops_store(dbp, i, n, part_aligned, p);
      }
    }
    if (need_dx) {
      const float2 c = fusedops_tg_sum(float2(c1, c2), shared, lane, sg, nsg) * inv_n;
      for (uint i = lid * FUSEDOPS_READS; i < n; i += step) {
        float xv[FUSEDOPS_READS];
        float gv[FUSEDOPS_READS];
        float wv[FUSEDOPS_READS] = {1.0f, 1.0f, 1.0f, 1.0f};
        fusedops_load(xr, i, n, aligned, xv, 0.0f);
        fusedops_load(gr, i, n, aligned, gv, 0.0f);
        if (has_w) {
          fusedops_load(weight, i, n, aligned, wv, 0.0f);
        }
        for (uint k = 0; k < FUSEDOPS_READS; ++k) {
          xv[k] = (gv[k] * wv[k] - ((xv[k] - mu) * rs * c.x + c.y)) * rs;
        }
        fusedops_store(dx + row * n, i, n, aligned, xv);
      }
    }
  }
}

// Stage 2 of dw/db: out[col] = sum over g = 0 .. n_groups-1 of partial[g, col], in order.
[[kernel]] void fusedops_layernorm_dwdb_reduce(
    device const float* dw_partial [[buffer(0)]],
    device const float* db_partial [[buffer(1)]],
    device float* dw [[buffer(2)]],
    device float* db [[buffer(3)]],
    constant long& n_groups [[buffer(4)]],
    constant long& n_cols [[buffer(5)]],
    constant long& flags [[buffer(6)]],
    uint col [[thread_position_in_grid]]) {
  const ulong n = ulong(n_cols);
  if (col >= n) {
    return;
  }
  const uint groups = uint(n_groups);
  if ((flags & FUSEDOPS_FLAG_DW) != 0) {
    float acc = 0.0f;
    for (uint g = 0; g < groups; ++g) {
      acc += dw_partial[ulong(g) * n + col];
    }
    dw[col] = acc;
  }
  if ((flags & FUSEDOPS_FLAG_DB) != 0) {
    float acc = 0.0f;
    for (uint g = 0; g < groups; ++g) {
      acc += db_partial[ulong(g) * n + col];
    }
    db[col] = acc;
  }
}

// Instantiations. Forward <x>_<y>: same dtype, or half/bfloat x with float y (the output
// dtype torch uses under CUDA-style float32 autocast). Backward <x>_<dy>: dx has x's dtype.
#define FUSEDOPS_LAYERNORM_KERNEL(KERNEL, A, B)                                 \
  template [[host_name("fusedops_" #KERNEL "_" #A "_" #B)]] [[kernel]]         \
  decltype(fusedops_##KERNEL<A, B>) fusedops_##KERNEL<A, B>;

#define FUSEDOPS_LAYERNORM(A, B)                        \
  FUSEDOPS_LAYERNORM_KERNEL(layernorm_fwd_single, A, B) \
  FUSEDOPS_LAYERNORM_KERNEL(layernorm_fwd_looped, A, B) \
  FUSEDOPS_LAYERNORM_KERNEL(layernorm_bwd_single, A, B) \
  FUSEDOPS_LAYERNORM_KERNEL(layernorm_bwd_looped, A, B)

FUSEDOPS_LAYERNORM(float, float)
FUSEDOPS_LAYERNORM(half, half)
FUSEDOPS_LAYERNORM(half, float)

#if defined(__HAVE_BFLOAT__)
FUSEDOPS_LAYERNORM(bfloat, bfloat)
FUSEDOPS_LAYERNORM(bfloat, float)
#endif
