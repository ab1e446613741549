// fusedops Metal shaders: helpers shared by the kernel files (softmax, LayerNorm, RMSNorm,
// masked softmax, LayerNorm epilogue).
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
// softmax_masked.metal: a mask is bound / its rows allow vector loads / causal.
#define FUSEDOPS_FLAG_MASK 64
#define FUSEDOPS_FLAG_MASK_VEC 128
#define FUSEDOPS_FLAG_CAUSAL 256
// layernorm_epilogue.metal: a second summand (residual forward, ds backward) / dropout / the
// activation / write mean and rstd / the Philox thread layout (columns W apart).
#define FUSEDOPS_FLAG_ADD 512
#define FUSEDOPS_FLAG_DROPOUT 1024
#define FUSEDOPS_FLAG_RELU 2048
#define FUSEDOPS_FLAG_GELU 4096
#define FUSEDOPS_FLAG_STATS 8192
#define FUSEDOPS_FLAG_PHILOX 16384

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

// --- Dropout's random numbers --------------------------------------------------------------
// Philox4x32-10 with the counter layout of fusedops/_philox.py (the definition; every backend
// draws the same bits): element (row, col) of an (M, N) row view takes output
// q = (col / W) % 4 of the call with counter (g * W + i, row_lo, row_hi, 0), g = col / (4W),
// i = col % W, key = the 64-bit seed (lo, hi). So the four columns col, col + W, col + 2W,
// col + 3W (col % 4W < W) share one call.
#define FUSEDOPS_PHILOX_W 256

inline uint4 fusedops_philox4x32_10(uint4 c, uint2 k) {
  for (uint r = 0; r < 10; ++r) {
    if (r != 0) {
      k.x += 0x9E3779B9u;
      k.y += 0xBB67AE85u;
    }
    const uint hi0 = mulhi(0xD2511F53u, c.x);
    const uint lo0 = 0xD2511F53u * c.x;
    const uint hi1 = mulhi(0xCD9E8D57u, c.z);
    const uint lo1 = 0xCD9E8D57u * c.z;
    c = uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}

// The Philox key of a seed passed as a (64-bit, two's complement) long.
inline uint2 fusedops_philox_key(long seed) {
  const ulong s = ulong(seed);
  return uint2(uint(s), uint(s >> 32));
}

// The Philox call serving column `col` of row `row`.
inline uint4 fusedops_philox_call(uint col, ulong row, uint2 key) {
  const uint ctr = (col / (4 * FUSEDOPS_PHILOX_W)) * FUSEDOPS_PHILOX_W + col % FUSEDOPS_PHILOX_W;
  return fusedops_philox4x32_10(uint4(ctr, uint(row), uint(row >> 32), 0u), key);
}

// Dropout factors of READS columns of a row: f[k] = scale where column base + k * cs is kept
// (its number >= threshold), else 0. With cs == FUSEDOPS_PHILOX_W (and base % (4W) < W) the
// four columns share one Philox call; otherwise one call per column.
inline void fusedops_dropout_factors(ulong row, uint base, uint cs, uint2 key, uint threshold,
                                     float scale, thread float* f) {
  if (cs == FUSEDOPS_PHILOX_W) {
    const uint4 r = fusedops_philox_call(base, row, key);
    f[0] = r.x >= threshold ? scale : 0.0f;
    f[1] = r.y >= threshold ? scale : 0.0f;
    f[2] = r.z >= threshold ? scale : 0.0f;
    f[3] = r.w >= threshold ? scale : 0.0f;
  } else {
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      const uint col = base + k * cs;
      const uint4 r = fusedops_philox_call(col, row, key);
      const uint q = (col / FUSEDOPS_PHILOX_W) % 4;
      const uint bits = q == 0 ? r.x : (q == 1 ? r.y : (q == 2 ? r.z : r.w));
      f[k] = bits >= threshold ? scale : 0.0f;
    }
  }
}

#endif  // FUSEDOPS_COMMON_METAL
