// fusedops Metal shaders: helpers shared by softmax.metal and layernorm.metal.
//
// This file is #included by the kernel files. The host (csrc/fusedops_metal.mm and
// fusedops/metal.py) inlines it before handing the source to newLibraryWithSource /
// torch.mps.compile_shader; the CPU emulation (tests/metal_emu) and `xcrun metal -c`
// resolve the include through -I metal/.
//
// Host/shader contract (mirrored in fusedops/metal.py and csrc/fusedops_metal.mm, and
// checked by tests/test_metal_emulation.py):
//   * one threadgroup per row; threadgroups stride over rows when there are more rows than
//     threadgroups (grid capped by the host);
//   * the threadgroup size is a multiple of FUSEDOPS_SIMD_WIDTH;
//   * "single" kernels hold a row in registers: FUSEDOPS_READS consecutive columns per thread,
//     so they need threads * FUSEDOPS_READS >= n_cols; "looped" kernels take any n_cols;
//   * every integer scalar is a 64-bit `long` in a constant buffer (what
//     torch.mps.compile_shader passes for a Python int), floats are 32-bit;
//   * FUSEDOPS_FLAG_VEC is set by the host only when every row start of every row-major
//     array of the launch is aligned to FUSEDOPS_READS elements (then aligned vector loads
//     and stores are used, with a scalar tail at the end of the row).
//
// Keep this file ASCII: PyTorch hands shader source to Metal as an ASCII string.

#ifndef FUSEDOPS_COMMON_METAL
#define FUSEDOPS_COMMON_METAL

#include <metal_stdlib>
using namespace metal;

#define FUSEDOPS_SIMD_WIDTH 32
#define FUSEDOPS_READS 4

#define FUSEDOPS_FLAG_VEC 1
#define FUSEDOPS_FLAG_WEIGHT 2
#define FUSEDOPS_FLAG_BIAS 4
#define FUSEDOPS_FLAG_DX 8
#define FUSEDOPS_FLAG_DW 16
#define FUSEDOPS_FLAG_DB 32

// Reads FUSEDOPS_READS consecutive elements of `row` starting at column i into v (as float);
// columns at or past n read as `pad`.
template <typename T>
inline void fusedops_load(device const T* row, uint i, uint n, bool aligned, thread float* v,
                          float pad) {
  if (aligned && i + FUSEDOPS_READS <= n) {
    const vec<T, 4> t = *reinterpret_cast<device const vec<T, 4>*>(row + i);
    v[0] = float(t.x);
    v[1] = float(t.y);
    v[2] = float(t.z);
    v[3] = float(t.w);
  } else {
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      v[k] = (i + k < n) ? float(row[i + k]) : pad;
    }
  }
}

// Writes the in-range part of v to row[i .. i + FUSEDOPS_READS).
template <typename T>
inline void fusedops_store(device T* row, uint i, uint n, bool aligned, thread const float* v) {
  if (aligned && i + FUSEDOPS_READS <= n) {
    *reinterpret_cast<device vec<T, 4>*>(row + i) = vec<T, 4>(T(v[0]), T(v[1]), T(v[2]), T(v[3]));
  } else {
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      if (i + k < n) {
        row[i + k] = T(v[k]);
      }
    }
  }
}

// Threadgroup-wide sums and maxima in two levels: simd_sum / simd_max inside each SIMD-group,
// then one value per SIMD-group through a 32-entry threadgroup array, reduced again by every
// SIMD-group so that all threads get the result. The trailing barrier lets the caller reuse
// `shared` right away. `nsg` is uniform, so the early return keeps the barriers uniform.
// TG is deduced as a `threadgroup V*`.
template <typename V, typename TG>
inline V fusedops_tg_sum(V v, TG shared, uint lane, uint sg, uint nsg) {
  v = simd_sum(v);
  if (nsg == 1) {
    return v;
  }
  if (lane == 0) {
    shared[sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  v = (lane < nsg) ? shared[lane] : V(0.0f);
  v = simd_sum(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return v;
}

template <typename TG>
inline float fusedops_tg_max(float v, TG shared, uint lane, uint sg, uint nsg) {
  v = simd_max(v);
  if (nsg == 1) {
    return v;
  }
  if (lane == 0) {
    shared[sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  v = (lane < nsg) ? shared[lane] : -INFINITY;
  v = simd_max(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return v;
}

// s was accumulated relative to max m; rescale it to the new max m_new >= m.
// An empty partial (m == -inf) contributes nothing, even when m_new is also -inf.
inline float fusedops_rescale(float s, float m, float m_new) {
  // A NaN sum stays NaN even where the (NaN-ignoring) max reads -inf: a NaN anywhere in a row
  // makes the whole row NaN, as in torch.
  return (m == -INFINITY) ? (isnan(s) ? s : 0.0f) : s * precise::exp(m - m_new);
}

// Combined (max, sum of exp(x - max)) reduction for the online softmax: one pass through
// the 32-entry threadgroup array of (max, sum) pairs. Returns (row max, row sum).
template <typename TG>
inline float2 fusedops_tg_max_sum(float m, float s, TG shared, uint lane, uint sg, uint nsg) {
  float mm = simd_max(m);
  s = simd_sum(fusedops_rescale(s, m, mm));
  if (nsg == 1) {
    return float2(mm, s);
  }
  if (lane == 0) {
    shared[sg] = float2(mm, s);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float2 p = (lane < nsg) ? shared[lane] : float2(-INFINITY, 0.0f);
  mm = simd_max(p.x);
  s = simd_sum(fusedops_rescale(p.y, p.x, mm));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return float2(mm, s);
}

#endif  // FUSEDOPS_COMMON_METAL
