// fusedops Metal shaders: row RMSNorm, forward and backward.
//
// forward:  rstd = 1 / sqrt(sum(x^2) / n + eps)    (0 when the float32 sum overflows, as torch)
//           y = (x * rstd) * w                      (w optional, float32)
// backward: xhat = x * rstd,  g = dy * w
//           dx = (g - xhat * mean(xhat * g)) * rstd
//           dw = sum over rows of dy * xhat
//
// dw is computed in two deterministic stages, as the LayerNorm dweight: each threadgroup of
// the backward kernel owns a fixed set of rows (row = threadgroup id + k * threadgroups) and
// writes float32 partial sums for its rows to partial[threadgroup, :]; the LayerNorm reduction
// kernel fusedops_layernorm_dwdb_reduce (flags = FLAG_DW) then sums the partials over
// threadgroups in a fixed order, one thread per column.
//
// Kernel names: fusedops_rmsnorm_{fwd,bwd}_{single,looped}_<a>_<b>, see the instantiations at
// the end. See common.metal for the host/shader contract.

#include "common.metal"

// rstd from a row's sum of squares. An infinite mean square (an inf in the row, or squares
// overflowing float32) gives rstd 0, as torch's rms_norm: the row's finite elements come out
// 0 and an inf NaN. (rsqrt(inf) is 0 by IEEE rules; written out so fast-math cannot change it.)
inline float fusedops_rms_rstd(float sum_sq, float inv_n, float eps) {
  const float ms = sum_sq * inv_n;
  return isinf(ms) ? 0.0f : precise::rsqrt(ms + eps);
}

// Forward, row held in registers.
template <typename T, typename U>
[[kernel]] void fusedops_rmsnorm_fwd_single(
    device const T* x [[buffer(0)]],
    device const float* weight [[buffer(1)]],
    device U* y [[buffer(2)]],
    device float* rstd_out [[buffer(3)]],
    constant long& n_rows [[buffer(4)]],
    constant long& n_cols [[buffer(5)]],
    constant long& x_stride [[buffer(6)]],
    constant float& eps [[buffer(7)]],
    constant long& flags [[buffer(8)]],
    uint tg_id [[threadgroup_position_in_grid]],
    uint n_tg [[threadgroups_per_grid]],
    uint lid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float shared[FUSEDOPS_SIMD_WIDTH];
  const uint n = uint(n_cols);
  const bool aligned = (flags & FUSEDOPS_FLAG_VEC) != 0;
  const uint i = lid * FUSEDOPS_READS;
  float wv[FUSEDOPS_READS] = {1.0f, 1.0f, 1.0f, 1.0f};
  if ((flags & FUSEDOPS_FLAG_WEIGHT) != 0) {
    fusedops_load(weight, i, n, aligned, wv, 0.0f);
  }
  const float inv_n = 1.0f / float(n);
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    float v[FUSEDOPS_READS];
    fusedops_load(x + row * x_stride, i, n, aligned, v, 0.0f);  // padding columns read 0
    float sq = 0.0f;
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      sq += v[k] * v[k];
    }
    const float rstd = fusedops_rms_rstd(fusedops_tg_sum(sq, shared, lane, sg, nsg), inv_n, eps);
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      v[k] = (v[k] * rstd) * wv[k];
    }
    fusedops_store(y + row * n, i, n, aligned, v);
    if (lid == 0) {
      rstd_out[row] = rstd;
    }
  }
}

// Forward for any n: pass 1 the sum of squares, pass 2 writes y.
template <typename T, typename U>
[[kernel]] void fusedops_rmsnorm_fwd_looped(
    device const T* x [[buffer(0)]],
    device const float* weight [[buffer(1)]],
    device U* y [[buffer(2)]],
    device float* rstd_out [[buffer(3)]],
    constant long& n_rows [[buffer(4)]],
    constant long& n_cols [[buffer(5)]],
    constant long& x_stride [[buffer(6)]],
    constant float& eps [[buffer(7)]],
    constant long& flags [[buffer(8)]],
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
  const uint step = n_threads * FUSEDOPS_READS;
  const float inv_n = 1.0f / float(n);
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    device const T* xr = x + row * x_stride;
    device U* yr = y + row * n;
    float acc = 0.0f;
    for (uint i = lid * FUSEDOPS_READS; i < n; i += step) {
      float v[FUSEDOPS_READS];
      fusedops_load(xr, i, n, aligned, v, 0.0f);
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        acc += v[k] * v[k];
      }
    }
    const float rstd = fusedops_rms_rstd(fusedops_tg_sum(acc, shared, lane, sg, nsg), inv_n, eps);
    for (uint i = lid * FUSEDOPS_READS; i < n; i += step) {
      float v[FUSEDOPS_READS];
      float wv[FUSEDOPS_READS] = {1.0f, 1.0f, 1.0f, 1.0f};
      fusedops_load(xr, i, n, aligned, v, 0.0f);
      if (has_w) {
        fusedops_load(weight, i, n, aligned, wv, 0.0f);
      }
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        v[k] = (v[k] * rstd) * wv[k];
      }
      fusedops_store(yr, i, n, aligned, v);
    }
    if (lid == 0) {
      rstd_out[row] = rstd;
    }
  }
}

// Backward, rows of x and dy held in registers; this threadgroup's dw partials stay in
// registers across its rows and are written once at the end.
template <typename T, typename G>
[[kernel]] void fusedops_rmsnorm_bwd_single(
    device const G* dy [[buffer(0)]],
    device const T* x [[buffer(1)]],
    device const float* weight [[buffer(2)]],
    device const float* rstd [[buffer(3)]],
    device T* dx [[buffer(4)]],
    device float* dw_partial [[buffer(5)]],
    constant long& n_rows [[buffer(6)]],
    constant long& n_cols [[buffer(7)]],
    constant long& dy_stride [[buffer(8)]],
    constant long& x_stride [[buffer(9)]],
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
  const bool need_dx = (flags & FUSEDOPS_FLAG_DX) != 0;
  const bool need_dw = (flags & FUSEDOPS_FLAG_DW) != 0;
  const uint i = lid * FUSEDOPS_READS;
  const float inv_n = 1.0f / float(n);
  float wv[FUSEDOPS_READS] = {1.0f, 1.0f, 1.0f, 1.0f};
  if ((flags & FUSEDOPS_FLAG_WEIGHT) != 0) {
    fusedops_load(weight, i, n, aligned, wv, 0.0f);
  }
  float dw_acc[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    float xv[FUSEDOPS_READS];
    float gv[FUSEDOPS_READS];
    fusedops_load(x + row * x_stride, i, n, aligned, xv, 0.0f);
    fusedops_load(dy + row * dy_stride, i, n, aligned, gv, 0.0f);
    const float rs = rstd[row];
    float c = 0.0f;
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      xv[k] = xv[k] * rs;  // xhat (padding columns have gv == 0)
      c += xv[k] * (gv[k] * wv[k]);
      dw_acc[k] += gv[k] * xv[k];
    }
    if (need_dx) {
      c = fusedops_tg_sum(c, shared, lane, sg, nsg) * inv_n;
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        xv[k] = (gv[k] * wv[k] - xv[k] * c) * rs;
      }
      fusedops_store(dx + row * n, i, n, aligned, xv);
    }
  }
  if (need_dw) {
    fusedops_store(dw_partial + ulong(tg_id) * n, i, n, (n % FUSEDOPS_READS) == 0, dw_acc);
  }
}

// Backward for any n: pass 1 accumulates the row sum and this threadgroup's dw partials (each
// thread always owns the same columns, so the read-modify-write of its partials is
// race-free); pass 2 writes dx.
template <typename T, typename G>
[[kernel]] void fusedops_rmsnorm_bwd_looped(
    device const G* dy [[buffer(0)]],
    device const T* x [[buffer(1)]],
    device const float* weight [[buffer(2)]],
    device const float* rstd [[buffer(3)]],
    device T* dx [[buffer(4)]],
    device float* dw_partial [[buffer(5)]],
    constant long& n_rows [[buffer(6)]],
    constant long& n_cols [[buffer(7)]],
    constant long& dy_stride [[buffer(8)]],
    constant long& x_stride [[buffer(9)]],
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
  const bool need_dx = (flags & FUSEDOPS_FLAG_DX) != 0;
  const bool need_dw = (flags & FUSEDOPS_FLAG_DW) != 0;
  const bool part_aligned = (n % FUSEDOPS_READS) == 0;
  const uint step = n_threads * FUSEDOPS_READS;
  const float inv_n = 1.0f / float(n);
  device float* dwp = dw_partial + ulong(tg_id) * n;
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    device const T* xr = x + row * x_stride;
    device const G* gr = dy + row * dy_stride;
    const bool first = row == ulong(tg_id);
    const float rs = rstd[row];
    float c = 0.0f;
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
        xv[k] = xv[k] * rs;
        c += xv[k] * (gv[k] * wv[k]);
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
    }
    if (need_dx) {
      c = fusedops_tg_sum(c, shared, lane, sg, nsg) * inv_n;
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
          xv[k] = (gv[k] * wv[k] - (xv[k] * rs) * c) * rs;
        }
        fusedops_store(dx + row * n, i, n, aligned, xv);
      }
    }
  }
}

// Instantiations: the LayerNorm type pairs. Forward <x>_<y>: same dtype, or half/bfloat x with
// float y. Backward <x>_<dy>: dx has x's dtype.
#define FUSEDOPS_RMSNORM_KERNEL(KERNEL, A, B)                                   \
  template [[host_name("fusedops_" #KERNEL "_" #A "_" #B)]] [[kernel]]         \
  decltype(fusedops_##KERNEL<A, B>) fusedops_##KERNEL<A, B>;

#define FUSEDOPS_RMSNORM(A, B)                        \
  FUSEDOPS_RMSNORM_KERNEL(rmsnorm_fwd_single, A, B) \
  FUSEDOPS_RMSNORM_KERNEL(rmsnorm_fwd_looped, A, B) \
  FUSEDOPS_RMSNORM_KERNEL(rmsnorm_bwd_single, A, B) \
  FUSEDOPS_RMSNORM_KERNEL(rmsnorm_bwd_looped, A, B)

FUSEDOPS_RMSNORM(float, float)
FUSEDOPS_RMSNORM(half, half)
FUSEDOPS_RMSNORM(half, float)

#if defined(__HAVE_BFLOAT__)
FUSEDOPS_RMSNORM(bfloat, bfloat)
FUSEDOPS_RMSNORM(bfloat, float)
#endif
