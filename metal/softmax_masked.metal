// fusedops Metal shaders: scaled, masked, causal row softmax (attention scores), forward and
// backward.
//
// forward:  z = x * scale; a bool mask drops z (-inf) where it is false, a float mask is added
//           to z; causal drops column j of query row q (x's dim 2) when j > q;
//           y = exp(z - max z) / sum exp(z - max z) over the N columns; a row where nothing is
//           left (every z is -inf) comes out as zeros, not NaN.
// backward: dx = scale * y * (dy - sum(y * dy))
//
// x is (B, H, Q, N) contiguous, taken as M = B * H * Q rows of N columns (row = (b * H + h) * Q
// + q); y is contiguous. The mask is any (B, H, Q, N) view, read through its four element
// strides (0 on broadcast dims): vector loads where its column stride is 1 and every mask row
// start is aligned (FUSEDOPS_FLAG_MASK_VEC), scalar loads otherwise. Columns that causal drops
// are not read (neither x nor the mask).
//
// Kernel names: fusedops_softmax_masked_fwd_{single,looped}_<x>_<y>_<mask> with mask one of
// bool (a byte per element), the x type or float; fusedops_softmax_masked_bwd_{single,looped}_
// <y>_<dx>. Without a mask the host runs the _bool kernel without FUSEDOPS_FLAG_MASK. See
// common.metal for the host/shader contract.

#include "common.metal"

// A score with its mask value m applied: added (float masks) or kept where m != 0 (bool).
template <typename M>
inline float fusedops_masked_score(float z, float m) {
  return z + m;
}
template <>
inline float fusedops_masked_score<uchar>(float z, float m) {
  return m != 0.0f ? z : -INFINITY;
}

// The scores z of READS columns i.. of a row: x * scale, masked; columns at or past n_valid
// (the end of the row, or dropped by causal) are -inf and are not read.
template <typename T, typename M>
inline void fusedops_masked_scores(device const T* xr, device const M* mr, long m_col_stride,
                                   uint i, uint n_valid, bool x_vec, bool has_mask, bool m_vec,
                                   float scale, thread float* z) {
  fusedops_load(xr, i, n_valid, x_vec, z, 0.0f);
  float mv[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (has_mask) {
    if (m_vec) {
      fusedops_load(mr, i, n_valid, true, mv, 0.0f);
    } else {
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        mv[k] = (i + k < n_valid) ? float(mr[long(i + k) * m_col_stride]) : 0.0f;
      }
    }
  }
  for (uint k = 0; k < FUSEDOPS_READS; ++k) {
    const float zk = z[k] * scale;
    z[k] = (i + k < n_valid) ? (has_mask ? fusedops_masked_score<M>(zk, mv[k]) : zk) : -INFINITY;
  }
}

// exp(z - m), 0 for a dropped score (also when m is -inf: an empty row).
inline float fusedops_masked_exp(float z, float m) {
  return z == -INFINITY ? 0.0f : precise::exp(z - m);
}

// Where a row's mask starts, and how many of its columns are kept by causal.
struct fusedops_masked_row {
  long mask_offset;
  uint n_valid;
};

inline fusedops_masked_row fusedops_masked_row_of(ulong row, uint n, long n_heads,
                                                  long n_queries, long sb, long sh, long sq,
                                                  bool causal) {
  const ulong q = row % ulong(n_queries);
  const ulong bh = row / ulong(n_queries);
  fusedops_masked_row r;
  r.mask_offset = long(bh / ulong(n_heads)) * sb + long(bh % ulong(n_heads)) * sh + long(q) * sq;
  r.n_valid = (causal && q + 1 < ulong(n)) ? uint(q + 1) : n;
  return r;
}

// Forward, row held in registers (threads * FUSEDOPS_READS >= n): reads x (and the mask) once,
// writes y once.
template <typename T, typename U, typename M>
[[kernel]] void fusedops_softmax_masked_fwd_single(
    device const T* x [[buffer(0)]],
    device const M* mask [[buffer(1)]],
    device U* y [[buffer(2)]],
    constant long& n_rows [[buffer(3)]],
    constant long& n_cols [[buffer(4)]],
    constant long& x_stride [[buffer(5)]],
    constant long& n_heads [[buffer(6)]],
    constant long& n_queries [[buffer(7)]],
    constant long& mask_stride_b [[buffer(8)]],
    constant long& mask_stride_h [[buffer(9)]],
    constant long& mask_stride_q [[buffer(10)]],
    constant long& mask_stride_n [[buffer(11)]],
    constant float& scale [[buffer(12)]],
    constant long& flags [[buffer(13)]],
    uint tg_id [[threadgroup_position_in_grid]],
    uint n_tg [[threadgroups_per_grid]],
    uint lid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float shared[FUSEDOPS_SIMD_WIDTH];
  const uint n = uint(n_cols);
  const bool aligned = (flags & FUSEDOPS_FLAG_VEC) != 0;
  const bool has_mask = (flags & FUSEDOPS_FLAG_MASK) != 0;
  const bool m_vec = (flags & FUSEDOPS_FLAG_MASK_VEC) != 0;
  const bool causal = (flags & FUSEDOPS_FLAG_CAUSAL) != 0;
  const uint i = lid * FUSEDOPS_READS;
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    const fusedops_masked_row r = fusedops_masked_row_of(
        row, n, n_heads, n_queries, mask_stride_b, mask_stride_h, mask_stride_q, causal);
    float z[FUSEDOPS_READS];
    fusedops_masked_scores(x + row * x_stride, mask + r.mask_offset, mask_stride_n, i, r.n_valid,
                           aligned, has_mask, m_vec, scale, z);
    float m = max(max(z[0], z[1]), max(z[2], z[3]));
    m = fusedops_tg_max(m, shared, lane, sg, nsg);
    float s = 0.0f;
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      z[k] = fusedops_masked_exp(z[k], m);
      s += z[k];
    }
    s = fusedops_tg_sum(s, shared, lane, sg, nsg);
    // s == 0 only when every score is -inf (the max scores 1 otherwise): the empty row.
    const float inv = s == 0.0f ? 0.0f : 1.0f / s;
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      z[k] *= inv;
    }
    fusedops_store(y + row * n, i, n, aligned, z);
  }
}

// Forward for any n: online (max, sum) in one read of the kept columns, then a second read to
// write y (zeros past the causal limit, without reading there).
template <typename T, typename U, typename M>
[[kernel]] void fusedops_softmax_masked_fwd_looped(
    device const T* x [[buffer(0)]],
    device const M* mask [[buffer(1)]],
    device U* y [[buffer(2)]],
    constant long& n_rows [[buffer(3)]],
    constant long& n_cols [[buffer(4)]],
    constant long& x_stride [[buffer(5)]],
    constant long& n_heads [[buffer(6)]],
    constant long& n_queries [[buffer(7)]],
    constant long& mask_stride_b [[buffer(8)]],
    constant long& mask_stride_h [[buffer(9)]],
    constant long& mask_stride_q [[buffer(10)]],
    constant long& mask_stride_n [[buffer(11)]],
    constant float& scale [[buffer(12)]],
    constant long& flags [[buffer(13)]],
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
  const bool has_mask = (flags & FUSEDOPS_FLAG_MASK) != 0;
  const bool m_vec = (flags & FUSEDOPS_FLAG_MASK_VEC) != 0;
  const bool causal = (flags & FUSEDOPS_FLAG_CAUSAL) != 0;
  const uint step = n_threads * FUSEDOPS_READS;
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    const fusedops_masked_row r = fusedops_masked_row_of(
        row, n, n_heads, n_queries, mask_stride_b, mask_stride_h, mask_stride_q, causal);
    device const T* xr = x + row * x_stride;
    device const M* mr = mask + r.mask_offset;
    device U* yr = y + row * n;
    float m = -INFINITY;
    float s = 0.0f;
    for (uint i = lid * FUSEDOPS_READS; i < r.n_valid; i += step) {
      float z[FUSEDOPS_READS];
      fusedops_masked_scores(xr, mr, mask_stride_n, i, r.n_valid, aligned, has_mask, m_vec,
                             scale, z);
      // A NaN stays sticky in m (max() would drop it), so the whole row comes out NaN as in
      // torch (see fusedops_softmax_fwd_looped).
      const bool nan = isnan(m) || isnan(z[0]) || isnan(z[1]) || isnan(z[2]) || isnan(z[3]);
      const float m_new = nan ? NAN : max(m, max(max(z[0], z[1]), max(z[2], z[3])));
      s = fusedops_rescale(s, m, m_new);
      if (m_new != -INFINITY) {
        for (uint k = 0; k < FUSEDOPS_READS; ++k) {
          s += fusedops_masked_exp(z[k], m_new);
        }
      }
      m = m_new;
    }
    const float2 ms = fusedops_tg_max_sum(m, s, shared, lane, sg, nsg);
    const float inv = ms.y == 0.0f ? 0.0f : 1.0f / ms.y;  // 0: the empty row
    for (uint i = lid * FUSEDOPS_READS; i < n; i += step) {
      float z[FUSEDOPS_READS];
      fusedops_masked_scores(xr, mr, mask_stride_n, i, r.n_valid, aligned, has_mask, m_vec,
                             scale, z);
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        z[k] = fusedops_masked_exp(z[k], ms.x) * inv;
      }
      fusedops_store(yr, i, n, aligned, z);
    }
  }
}

// Backward, rows of y and dy held in registers.
template <typename T, typename U>
[[kernel]] void fusedops_softmax_masked_bwd_single(
    device const T* y [[buffer(0)]],
    device const T* dy [[buffer(1)]],
    device U* dx [[buffer(2)]],
    constant long& n_rows [[buffer(3)]],
    constant long& n_cols [[buffer(4)]],
    constant long& y_stride [[buffer(5)]],
    constant long& dy_stride [[buffer(6)]],
    constant float& scale [[buffer(7)]],
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
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    float yv[FUSEDOPS_READS];
    float gv[FUSEDOPS_READS];
    fusedops_load(y + row * y_stride, i, n, aligned, yv, 0.0f);
    fusedops_load(dy + row * dy_stride, i, n, aligned, gv, 0.0f);
    float dot = 0.0f;
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      dot += yv[k] * gv[k];
    }
    dot = fusedops_tg_sum(dot, shared, lane, sg, nsg);
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      yv[k] = (yv[k] * (gv[k] - dot)) * scale;
    }
    fusedops_store(dx + row * n, i, n, aligned, yv);
  }
}

// Backward for any n: one read of (y, dy) for the dot product, a second to write dx.
template <typename T, typename U>
[[kernel]] void fusedops_softmax_masked_bwd_looped(
    device const T* y [[buffer(0)]],
    device const T* dy [[buffer(1)]],
    device U* dx [[buffer(2)]],
    constant long& n_rows [[buffer(3)]],
    constant long& n_cols [[buffer(4)]],
    constant long& y_stride [[buffer(5)]],
    constant long& dy_stride [[buffer(6)]],
    constant float& scale [[buffer(7)]],
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
  const uint step = n_threads * FUSEDOPS_READS;
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    device const T* yr = y + row * y_stride;
    device const T* gr = dy + row * dy_stride;
    device U* dxr = dx + row * n;
    float dot = 0.0f;
    for (uint i = lid * FUSEDOPS_READS; i < n; i += step) {
      float yv[FUSEDOPS_READS];
      float gv[FUSEDOPS_READS];
      fusedops_load(yr, i, n, aligned, yv, 0.0f);
      fusedops_load(gr, i, n, aligned, gv, 0.0f);
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        dot += yv[k] * gv[k];
      }
    }
    dot = fusedops_tg_sum(dot, shared, lane, sg, nsg);
    for (uint i = lid * FUSEDOPS_READS; i < n; i += step) {
      float yv[FUSEDOPS_READS];
      float gv[FUSEDOPS_READS];
      fusedops_load(yr, i, n, aligned, yv, 0.0f);
      fusedops_load(gr, i, n, aligned, gv, 0.0f);
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        yv[k] = (yv[k] * (gv[k] - dot)) * scale;
      }
      fusedops_store(dxr, i, n, aligned, yv);
    }
  }
}

// Instantiations. Forward <x>_<y>_<mask>: the softmax forward pairs, each with a bool mask
// (uchar storage, torch.bool), a mask of x's type and a float mask (other mask dtypes are
// converted to float by the host). Backward <y>_<dx>: the softmax backward pairs, plus half /
// bfloat y with float dx (the float32 gradient of a float mask).
#define FUSEDOPS_SOFTMAX_MASKED_FWD_KERNEL(KERNEL, A, B, M, MN)                          \
  template [[host_name("fusedops_" #KERNEL "_" #A "_" #B "_" #MN)]] [[kernel]]          \
  decltype(fusedops_##KERNEL<A, B, M>) fusedops_##KERNEL<A, B, M>;

#define FUSEDOPS_SOFTMAX_MASKED_FWD_MASK(A, B, M, MN)                             \
  FUSEDOPS_SOFTMAX_MASKED_FWD_KERNEL(softmax_masked_fwd_single, A, B, M, MN)      \
  FUSEDOPS_SOFTMAX_MASKED_FWD_KERNEL(softmax_masked_fwd_looped, A, B, M, MN)

#define FUSEDOPS_SOFTMAX_MASKED_BWD_KERNEL(KERNEL, A, B)                        \
  template [[host_name("fusedops_" #KERNEL "_" #A "_" #B)]] [[kernel]]         \
  decltype(fusedops_##KERNEL<A, B>) fusedops_##KERNEL<A, B>;

#define FUSEDOPS_SOFTMAX_MASKED_BWD(A, B)                        \
  FUSEDOPS_SOFTMAX_MASKED_BWD_KERNEL(softmax_masked_bwd_single, A, B) \
  FUSEDOPS_SOFTMAX_MASKED_BWD_KERNEL(softmax_masked_bwd_looped, A, B)

FUSEDOPS_SOFTMAX_MASKED_FWD_MASK(float, float, uchar, bool)
FUSEDOPS_SOFTMAX_MASKED_FWD_MASK(float, float, float, float)
FUSEDOPS_SOFTMAX_MASKED_FWD_MASK(half, half, uchar, bool)
FUSEDOPS_SOFTMAX_MASKED_FWD_MASK(half, half, half, half)
FUSEDOPS_SOFTMAX_MASKED_FWD_MASK(half, half, float, float)
FUSEDOPS_SOFTMAX_MASKED_FWD_MASK(half, float, uchar, bool)
FUSEDOPS_SOFTMAX_MASKED_FWD_MASK(half, float, half, half)
FUSEDOPS_SOFTMAX_MASKED_FWD_MASK(half, float, float, float)
FUSEDOPS_SOFTMAX_MASKED_BWD(float, float)
FUSEDOPS_SOFTMAX_MASKED_BWD(half, half)
FUSEDOPS_SOFTMAX_MASKED_BWD(float, half)
FUSEDOPS_SOFTMAX_MASKED_BWD(half, float)

#if defined(__HAVE_BFLOAT__)
FUSEDOPS_SOFTMAX_MASKED_FWD_MASK(bfloat, bfloat, uchar, bool)
FUSEDOPS_SOFTMAX_MASKED_FWD_MASK(bfloat, bfloat, bfloat, bfloat)
FUSEDOPS_SOFTMAX_MASKED_FWD_MASK(bfloat, bfloat, float, float)
FUSEDOPS_SOFTMAX_MASKED_FWD_MASK(bfloat, float, uchar, bool)
FUSEDOPS_SOFTMAX_MASKED_FWD_MASK(bfloat, float, bfloat, bfloat)
FUSEDOPS_SOFTMAX_MASKED_FWD_MASK(bfloat, float, float, float)
FUSEDOPS_SOFTMAX_MASKED_BWD(bfloat, bfloat)
FUSEDOPS_SOFTMAX_MASKED_BWD(float, bfloat)
FUSEDOPS_SOFTMAX_MASKED_BWD(bfloat, float)
#endif
