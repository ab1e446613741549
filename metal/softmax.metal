// fusedops Metal shaders: row softmax, forward and backward.
//
// y  = exp(x - max(x)) / sum(exp(x - max(x)))          over each row of n columns
// dx = y * (dy - sum(y * dy))
//
// Kernel names: fusedops_softmax_{fwd,bwd}_{single,looped}_<in>_<out>, see the instantiations
// at the end. Arithmetic is float32 for every storage type. See common.metal for the
// host/shader contract (geometry, flags, argument types).

#include "common.metal"

// Forward, row held in registers (threads * FUSEDOPS_READS >= n): reads x once, writes y once.
template <typename T, typename U>
[[kernel]] void fusedops_softmax_fwd_single(
    device const T* x [[buffer(0)]],
    device U* y [[buffer(1)]],
    constant long& n_rows [[buffer(2)]],
    constant long& n_cols [[buffer(3)]],
    constant long& x_stride [[buffer(4)]],
    constant long& flags [[buffer(5)]],
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
    device const T* xr = x + row * x_stride;
    device U* yr = y + row * n;
    float v[FUSEDOPS_READS];
    fusedops_load(xr, i, n, aligned, v, -INFINITY);
    float m = max(max(v[0], v[1]), max(v[2], v[3]));
    m = fusedops_tg_max(m, shared, lane, sg, nsg);
    float s = 0.0f;
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      v[k] = precise::exp(v[k] - m);
      s += (i + k < n) ? v[k] : 0.0f;
    }
    s = fusedops_tg_sum(s, shared, lane, sg, nsg);
    const float inv = 1.0f / s;
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      v[k] *= inv;
    }
    fusedops_store(yr, i, n, aligned, v);
  }
}

// Forward for any n: online (max, sum) in one read, then a second read to write y.
template <typename T, typename U>
[[kernel]] void fusedops_softmax_fwd_looped(
    device const T* x [[buffer(0)]],
    device U* y [[buffer(1)]],
    constant long& n_rows [[buffer(2)]],
    constant long& n_cols [[buffer(3)]],
    constant long& x_stride [[buffer(4)]],
    constant long& flags [[buffer(5)]],
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
  const uint step = n_threads * FUSEDOPS_READS;
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    device const T* xr = x + row * x_stride;
    device U* yr = y + row * n;
    float m = -INFINITY;
    float s = 0.0f;
    for (uint i = lid * FUSEDOPS_READS; i < n; i += step) {
      float v[FUSEDOPS_READS];
      fusedops_load(xr, i, n, aligned, v, -INFINITY);
      // max() returns the other operand for a NaN: keep a NaN sticky in m so the whole row
      // comes out NaN, as in torch (also when the NaN arrives while m is still -inf).
      const bool nan = isnan(m) || isnan(v[0]) || isnan(v[1]) || isnan(v[2]) || isnan(v[3]);
      const float m_new = nan ? NAN : max(m, max(max(v[0], v[1]), max(v[2], v[3])));
      s = fusedops_rescale(s, m, m_new);
      if (m_new != -INFINITY) {
        for (uint k = 0; k < FUSEDOPS_READS; ++k) {
          s += precise::exp(v[k] - m_new);
        }
      }
      m = m_new;
    }
    const float2 ms = fusedops_tg_max_sum(m, s, shared, lane, sg, nsg);
    const float inv = 1.0f / ms.y;
    for (uint i = lid * FUSEDOPS_READS; i < n; i += step) {
      float v[FUSEDOPS_READS];
      fusedops_load(xr, i, n, aligned, v, -INFINITY);
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        v[k] = precise::exp(v[k] - ms.x) * inv;
      }
      fusedops_store(yr, i, n, aligned, v);
    }
  }
}

// Backward, rows of y and dy held in registers.
template <typename T, typename U>
[[kernel]] void fusedops_softmax_bwd_single(
    device const T* y [[buffer(0)]],
    device const T* dy [[buffer(1)]],
    device U* dx [[buffer(2)]],
    constant long& n_rows [[buffer(3)]],
    constant long& n_cols [[buffer(4)]],
    constant long& y_stride [[buffer(5)]],
    constant long& dy_stride [[buffer(6)]],
    constant long& flags [[buffer(7)]],
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
      yv[k] = yv[k] * (gv[k] - dot);
    }
    fusedops_store(dx + row * n, i, n, aligned, yv);
  }
}

// Backward for any n: one read of (y, dy) for the dot product, a second to write dx.
template <typename T, typename U>
[[kernel]] void fusedops_softmax_bwd_looped(
    device const T* y [[buffer(0)]],
    device const T* dy [[buffer(1)]],
    device U* dx [[buffer(2)]],
    constant long& n_rows [[buffer(3)]],
    constant long& n_cols [[buffer(4)]],
    constant long& y_stride [[buffer(5)]],
    constant long& dy_stride [[buffer(6)]],
    constant long& flags [[buffer(7)]],
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
        yv[k] = yv[k] * (gv[k] - dot);
      }
      fusedops_store(dxr, i, n, aligned, yv);
    }
  }
}

// Instantiations: <in>_<out>. Forward: in == out, or half/bfloat in with float out
// (softmax(x, dtype=torch.float32)). Backward: <y/dy>_<dx>, dx in the forward input dtype.
#define FUSEDOPS_SOFTMAX_KERNEL(KERNEL, A, B)                                   \
  template [[host_name("fusedops_" #KERNEL "_" #A "_" #B)]] [[kernel]]         \
  decltype(fusedops_##KERNEL<A, B>) fusedops_##KERNEL<A, B>;

#define FUSEDOPS_SOFTMAX_FWD(A, B)                  \
  FUSEDOPS_SOFTMAX_KERNEL(softmax_fwd_single, A, B) \
  FUSEDOPS_SOFTMAX_KERNEL(softmax_fwd_looped, A, B)

#define FUSEDOPS_SOFTMAX_BWD(A, B)                  \
  FUSEDOPS_SOFTMAX_KERNEL(softmax_bwd_single, A, B) \
  FUSEDOPS_SOFTMAX_KERNEL(softmax_bwd_looped, A, B)

FUSEDOPS_SOFTMAX_FWD(float, float)
FUSEDOPS_SOFTMAX_FWD(half, half)
FUSEDOPS_SOFTMAX_FWD(half, float)
FUSEDOPS_SOFTMAX_BWD(float, float)
FUSEDOPS_SOFTMAX_BWD(half, half)
FUSEDOPS_SOFTMAX_BWD(float, half)

#if defined(__HAVE_BFLOAT__)
FUSEDOPS_SOFTMAX_FWD(bfloat, bfloat)
FUSEDOPS_SOFTMAX_FWD(bfloat, float)
FUSEDOPS_SOFTMAX_BWD(bfloat, bfloat)
FUSEDOPS_SOFTMAX_BWD(float, bfloat)
#endif
