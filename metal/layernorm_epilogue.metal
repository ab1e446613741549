// fusedops Metal shaders: LayerNorm with its epilogue fused, forward and backward.
//
// forward:  s = x + residual (rounded to x's type; written out, it is the LayerNorm's input;
//           without a residual s = x and nothing is written),
//           v = (s - mean) * rstd * w + b         (LayerNorm as layernorm.metal, float32)
//           v = v * f,  f = 1 / (1 - p) where dropout keeps the element, else 0
//           out = act(v),  act in {identity, relu, gelu (erf)}
// backward: v recomputed from s, mean, rstd, w, b and f (the dropout mask is regenerated from
//           the seed, never stored);  g = dout * act'(v) * f
//           xhat = (s - mean) * rstd,  dx = (g w - (xhat * mean(xhat * g w) + mean(g w))) * rstd
//           (+ ds)
//           dw = sum over rows of g * xhat,  db = sum over rows of g
//
// dw/db in two deterministic stages as the LayerNorm ones: per-threadgroup float32 partials
// (threadgroup g owns rows g, g + G, ...), then fusedops_layernorm_dwdb_reduce (layernorm.metal).
//
// Dropout's numbers are Philox4x32-10 (common.metal, fusedops/_philox.py): one call serves the
// four columns col, col + W, col + 2W, col + 3W (W = 256). With dropout the host picks, where
// the pipeline allows whole groups of W threads, the Philox layout (FUSEDOPS_FLAG_PHILOX):
// thread t of a step covering 4W * (threads / W) columns holds the columns
// start + (t / W) * 4W + t % W + k * W, k < 4, so it makes one Philox call per step and the
// SIMD-group's loads of each k are consecutive. Otherwise (and without dropout) a thread holds
// FUSEDOPS_READS consecutive columns (vector loads where aligned) and, with dropout, makes one
// call per element.
//
// Kernel names: fusedops_layernorm_epilogue_{fwd,bwd}_{single,looped}_<a>_<b>, the LayerNorm
// type pairs (forward <x>_<out>, backward <s>_<dout>). See common.metal for the contract.

#include "common.metal"

// --- erf-based GELU (Metal has no erf) ------------------------------------------------------

// erfc(a) for a >= 1: exp(-a^2) * P(1 / (1 + a)), P fitted to erfc(a) exp(a^2) on [1, 10]
// (relative error a few float32 ulp; exp(-a^2) underflows before a = 10). a^2 is split into
// its float32 rounding and the rounding error, so the exponent stays accurate for large a.
inline float fusedops_erfc_tail(float a) {
  const float u = 1.0f / (1.0f + a);
  float p = 5.643721223e-01f;
  p = p * u - 2.328657150e+00f;
  p = p * u + 3.556948900e+00f;
  p = p * u - 2.261286974e+00f;
  p = p * u + 1.016231254e-01f;
  p = p * u + 2.235358208e-01f;
  p = p * u + 5.696200132e-01f;
  p = p * u + 5.639099479e-01f;
  p = p * u + 6.112032679e-06f;
  const float a2 = a * a;
  const float a2_err = fma(a, a, -a2);
  return a > 10.0f ? 0.0f : precise::exp(-a2) * (1.0f - a2_err) * p;
}

// erf(x) / x for |x| < 1, as a polynomial in x^2 (fitted; a few float32 ulp).
inline float fusedops_erf_small(float x2) {
  float p = -5.631418899e-04f;
  p = p * x2 + 4.917550832e-03f;
  p = p * x2 - 2.671131119e-02f;
  p = p * x2 + 1.128017977e-01f;
  p = p * x2 - 3.761232495e-01f;
  p = p * x2 + 1.128379107e+00f;
  return p;
}

// The standard normal CDF 0.5 * (1 + erf(v / sqrt(2))), accurate in the lower tail too.
inline float fusedops_normal_cdf(float v) {
  const float x = v * 0.70710678118654752f;
  const float a = fabs(x);
  if (a < 1.0f) {
    return 0.5f + 0.5f * (x * fusedops_erf_small(x * x));
  }
  const float tail = 0.5f * fusedops_erfc_tail(a);
  return x > 0.0f ? 1.0f - tail : tail;
}

inline float fusedops_activation(float v, long flags) {
  if ((flags & FUSEDOPS_FLAG_RELU) != 0) {
    return v < 0.0f ? 0.0f : v;  // a NaN stays NaN, as torch.relu
  }
  if ((flags & FUSEDOPS_FLAG_GELU) != 0) {
    return v * fusedops_normal_cdf(v);
  }
  return v;
}

// d act / dv (relu: 1 where v > 0; gelu: cdf + v * pdf).
inline float fusedops_activation_grad(float v, long flags) {
  if ((flags & FUSEDOPS_FLAG_RELU) != 0) {
    return v > 0.0f ? 1.0f : 0.0f;
  }
  return fusedops_normal_cdf(v) + v * (precise::exp(-0.5f * v * v) * 0.3989422804014327f);
}

// --- the thread's columns -------------------------------------------------------------------

// First column of thread lid in the step starting at column `start`; its columns are
// base + k * cs, k < FUSEDOPS_READS (cs = 1, or FUSEDOPS_PHILOX_W in the Philox layout).
inline uint fusedops_ep_base(uint start, uint lid, uint cs) {
  return cs == 1 ? start + lid * FUSEDOPS_READS
                 : start + (lid / FUSEDOPS_PHILOX_W) * (FUSEDOPS_READS * FUSEDOPS_PHILOX_W) +
                       lid % FUSEDOPS_PHILOX_W;
}

inline bool fusedops_ep_in(uint base, uint cs, uint k, uint n) {
  return base + k * cs < n;
}

template <typename T>
inline void fusedops_ep_load(device const T* row, uint base, uint cs, uint n, bool aligned,
                             thread float* v, float pad) {
  if (cs == 1) {
    fusedops_load(row, base, n, aligned, v, pad);
    return;
  }
  for (uint k = 0; k < FUSEDOPS_READS; ++k) {
    const uint c = base + k * cs;
    v[k] = c < n ? float(row[c]) : pad;
  }
}

template <typename T>
inline void fusedops_ep_store(device T* row, uint base, uint cs, uint n, bool aligned,
                              thread const float* v) {
  if (cs == 1) {
    fusedops_store(row, base, n, aligned, v);
    return;
  }
  for (uint k = 0; k < FUSEDOPS_READS; ++k) {
    const uint c = base + k * cs;
    if (c < n) {
      row[c] = T(v[k]);
    }
  }
}

// s = x (+ residual rounded to T) for the thread's columns; writes s when there is a residual.
template <typename T>
inline void fusedops_ep_sum(device const T* xr, device const T* rr, device T* sr, uint base,
                            uint cs, uint n, bool aligned, bool has_r, thread float* v) {
  fusedops_ep_load(xr, base, cs, n, aligned, v, 0.0f);
  if (has_r) {
    float rv[FUSEDOPS_READS];
    fusedops_ep_load(rr, base, cs, n, aligned, rv, 0.0f);
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      v[k] = float(T(v[k] + rv[k]));
    }
    fusedops_ep_store(sr, base, cs, n, aligned, v);
  }
}

// v -> act(v * f): the dropout factor (when on), then the activation.
inline void fusedops_ep_finish(ulong row, uint base, uint cs, uint2 key, uint threshold,
                               float keep_scale, long flags, thread float* v) {
  if ((flags & FUSEDOPS_FLAG_DROPOUT) != 0) {
    float f[FUSEDOPS_READS];
    fusedops_dropout_factors(row, base, cs, key, threshold, keep_scale, f);
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      v[k] *= f[k];
    }
  }
  for (uint k = 0; k < FUSEDOPS_READS; ++k) {
    v[k] = fusedops_activation(v[k], flags);
  }
}

// g = dout * act'(v * f) * f from xhat (v = xhat * w + b), in place of gv.
inline void fusedops_ep_grad(ulong row, uint base, uint cs, uint2 key, uint threshold,
                             float keep_scale, long flags, thread const float* xhat,
                             thread const float* wv, thread const float* bv, thread float* gv) {
  const bool dropout = (flags & FUSEDOPS_FLAG_DROPOUT) != 0;
  const bool act = (flags & (FUSEDOPS_FLAG_RELU | FUSEDOPS_FLAG_GELU)) != 0;
  float f[FUSEDOPS_READS] = {1.0f, 1.0f, 1.0f, 1.0f};
  if (dropout) {
    fusedops_dropout_factors(row, base, cs, key, threshold, keep_scale, f);
  }
  for (uint k = 0; k < FUSEDOPS_READS; ++k) {
    if (act) {
      float v = xhat[k] * wv[k] + bv[k];
      if (dropout) {
        v *= f[k];
      }
      gv[k] *= fusedops_activation_grad(v, flags);
    }
    if (dropout) {
      gv[k] *= f[k];
    }
  }
}

// --- forward ----------------------------------------------------------------------------------

// Forward, row held in registers: reads x (and the residual) once, writes s and out once.
template <typename T, typename U>
[[kernel]] void fusedops_layernorm_epilogue_fwd_single(
    device const T* x [[buffer(0)]],
    device const T* residual [[buffer(1)]],
    device const float* weight [[buffer(2)]],
    device const float* bias [[buffer(3)]],
    device U* out [[buffer(4)]],
    device T* s_out [[buffer(5)]],
    device float* mean_out [[buffer(6)]],
    device float* rstd_out [[buffer(7)]],
    constant long& n_rows [[buffer(8)]],
    constant long& n_cols [[buffer(9)]],
    constant long& x_stride [[buffer(10)]],
    constant long& r_stride [[buffer(11)]],
    constant float& eps [[buffer(12)]],
    constant long& seed [[buffer(13)]],
    constant long& threshold [[buffer(14)]],
    constant float& keep_scale [[buffer(15)]],
    constant long& flags [[buffer(16)]],
    uint tg_id [[threadgroup_position_in_grid]],
    uint n_tg [[threadgroups_per_grid]],
    uint lid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float shared[FUSEDOPS_SIMD_WIDTH];
  const uint n = uint(n_cols);
  const bool aligned = (flags & FUSEDOPS_FLAG_VEC) != 0;
  const bool has_r = (flags & FUSEDOPS_FLAG_ADD) != 0;
  const uint cs = (flags & FUSEDOPS_FLAG_PHILOX) != 0 ? FUSEDOPS_PHILOX_W : 1;
  const uint base = fusedops_ep_base(0, lid, cs);
  const uint2 key = fusedops_philox_key(seed);
  float wv[FUSEDOPS_READS] = {1.0f, 1.0f, 1.0f, 1.0f};
  float bv[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
  if ((flags & FUSEDOPS_FLAG_WEIGHT) != 0) {
    fusedops_ep_load(weight, base, cs, n, aligned, wv, 0.0f);
  }
  if ((flags & FUSEDOPS_FLAG_BIAS) != 0) {
    fusedops_ep_load(bias, base, cs, n, aligned, bv, 0.0f);
  }
  const float inv_n = 1.0f / float(n);
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    device const T* xr = x + row * x_stride;
    device const T* rr = residual + row * r_stride;
    float v[FUSEDOPS_READS];
    fusedops_ep_sum(xr, rr, s_out + row * n, base, cs, n, aligned, has_r, v);
    // Mean about the row's first element s[0] (see fusedops_layernorm_fwd_single), computed
    // here rather than read back from s_out, which another thread writes.
    const float x0 = has_r ? float(T(float(xr[0]) + float(rr[0]))) : float(xr[0]);
    float part = 0.0f;
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      part += fusedops_ep_in(base, cs, k, n) ? v[k] - x0 : 0.0f;
    }
    const float mean = x0 + fusedops_tg_sum(part, shared, lane, sg, nsg) * inv_n;
    float sq = 0.0f;
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      v[k] = fusedops_ep_in(base, cs, k, n) ? v[k] - mean : 0.0f;
      sq += v[k] * v[k];
    }
    const float rstd = precise::rsqrt(fusedops_tg_sum(sq, shared, lane, sg, nsg) * inv_n + eps);
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      v[k] = v[k] * rstd * wv[k] + bv[k];
    }
    fusedops_ep_finish(row, base, cs, key, uint(threshold), keep_scale, flags, v);
    fusedops_ep_store(out + row * n, base, cs, n, aligned, v);
    if (lid == 0 && (flags & FUSEDOPS_FLAG_STATS) != 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

// Forward for any n: pass 1 s (written) and the mean, pass 2 the variance (re-reading s, which
// this thread wrote itself, or x), pass 3 writes out.
template <typename T, typename U>
[[kernel]] void fusedops_layernorm_epilogue_fwd_looped(
    device const T* x [[buffer(0)]],
    device const T* residual [[buffer(1)]],
    device const float* weight [[buffer(2)]],
    device const float* bias [[buffer(3)]],
    device U* out [[buffer(4)]],
    device T* s_out [[buffer(5)]],
    device float* mean_out [[buffer(6)]],
    device float* rstd_out [[buffer(7)]],
    constant long& n_rows [[buffer(8)]],
    constant long& n_cols [[buffer(9)]],
    constant long& x_stride [[buffer(10)]],
    constant long& r_stride [[buffer(11)]],
    constant float& eps [[buffer(12)]],
    constant long& seed [[buffer(13)]],
    constant long& threshold [[buffer(14)]],
    constant float& keep_scale [[buffer(15)]],
    constant long& flags [[buffer(16)]],
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
  const bool has_r = (flags & FUSEDOPS_FLAG_ADD) != 0;
  const bool has_w = (flags & FUSEDOPS_FLAG_WEIGHT) != 0;
  const bool has_b = (flags & FUSEDOPS_FLAG_BIAS) != 0;
  const uint cs = (flags & FUSEDOPS_FLAG_PHILOX) != 0 ? FUSEDOPS_PHILOX_W : 1;
  const uint step = n_threads * FUSEDOPS_READS;
  const uint2 key = fusedops_philox_key(seed);
  const float inv_n = 1.0f / float(n);
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    device const T* xr = x + row * x_stride;
    device const T* rr = residual + row * r_stride;
    device T* sr = s_out + row * n;
    // The LayerNorm input as re-read by passes 2 and 3: s (this thread's own writes) or x.
    device const T* lr = has_r ? sr : xr;
    const float x0 = has_r ? float(T(float(xr[0]) + float(rr[0]))) : float(xr[0]);
    float acc = 0.0f;
    for (uint start = 0; start < n; start += step) {
      const uint base = fusedops_ep_base(start, lid, cs);
      float v[FUSEDOPS_READS];
      fusedops_ep_sum(xr, rr, sr, base, cs, n, aligned, has_r, v);
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        acc += fusedops_ep_in(base, cs, k, n) ? v[k] - x0 : 0.0f;
      }
    }
    const float mean = x0 + fusedops_tg_sum(acc, shared, lane, sg, nsg) * inv_n;
    acc = 0.0f;
    for (uint start = 0; start < n; start += step) {
      const uint base = fusedops_ep_base(start, lid, cs);
      float v[FUSEDOPS_READS];
      fusedops_ep_load(lr, base, cs, n, aligned, v, 0.0f);
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        const float d = fusedops_ep_in(base, cs, k, n) ? v[k] - mean : 0.0f;
        acc += d * d;
      }
    }
    const float rstd = precise::rsqrt(fusedops_tg_sum(acc, shared, lane, sg, nsg) * inv_n + eps);
    for (uint start = 0; start < n; start += step) {
      const uint base = fusedops_ep_base(start, lid, cs);
      float v[FUSEDOPS_READS];
      float wv[FUSEDOPS_READS] = {1.0f, 1.0f, 1.0f, 1.0f};
      float bv[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
      fusedops_ep_load(lr, base, cs, n, aligned, v, 0.0f);
      if (has_w) {
        fusedops_ep_load(weight, base, cs, n, aligned, wv, 0.0f);
      }
      if (has_b) {
        fusedops_ep_load(bias, base, cs, n, aligned, bv, 0.0f);
      }
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        v[k] = (v[k] - mean) * rstd * wv[k] + bv[k];
      }
      fusedops_ep_finish(row, base, cs, key, uint(threshold), keep_scale, flags, v);
      fusedops_ep_store(out + row * n, base, cs, n, aligned, v);
    }
    if (lid == 0 && (flags & FUSEDOPS_FLAG_STATS) != 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

// --- backward ---------------------------------------------------------------------------------

// Backward, rows held in registers; this threadgroup's dw/db partials stay in registers across
// its rows and are written once at the end.
template <typename T, typename G>
[[kernel]] void fusedops_layernorm_epilogue_bwd_single(
    device const G* dout [[buffer(0)]],
    device const T* ds [[buffer(1)]],
    device const T* s [[buffer(2)]],
    device const float* weight [[buffer(3)]],
    device const float* bias [[buffer(4)]],
    device const float* mean [[buffer(5)]],
    device const float* rstd [[buffer(6)]],
    device T* dx [[buffer(7)]],
    device float* dw_partial [[buffer(8)]],
    device float* db_partial [[buffer(9)]],
    constant long& n_rows [[buffer(10)]],
    constant long& n_cols [[buffer(11)]],
    constant long& dout_stride [[buffer(12)]],
    constant long& ds_stride [[buffer(13)]],
    constant long& s_stride [[buffer(14)]],
    constant long& seed [[buffer(15)]],
    constant long& threshold [[buffer(16)]],
    constant float& keep_scale [[buffer(17)]],
    constant long& flags [[buffer(18)]],
    uint tg_id [[threadgroup_position_in_grid]],
    uint n_tg [[threadgroups_per_grid]],
    uint lid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]]) {
  threadgroup float2 shared[FUSEDOPS_SIMD_WIDTH];
  const uint n = uint(n_cols);
  const bool aligned = (flags & FUSEDOPS_FLAG_VEC) != 0;
  const bool has_ds = (flags & FUSEDOPS_FLAG_ADD) != 0;
  const bool need_dx = (flags & FUSEDOPS_FLAG_DX) != 0;
  const bool need_dw = (flags & FUSEDOPS_FLAG_DW) != 0;
  const bool need_db = (flags & FUSEDOPS_FLAG_DB) != 0;
  const uint cs = (flags & FUSEDOPS_FLAG_PHILOX) != 0 ? FUSEDOPS_PHILOX_W : 1;
  const uint base = fusedops_ep_base(0, lid, cs);
  const uint2 key = fusedops_philox_key(seed);
  const float inv_n = 1.0f / float(n);
  float wv[FUSEDOPS_READS] = {1.0f, 1.0f, 1.0f, 1.0f};
  float bv[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
  if ((flags & FUSEDOPS_FLAG_WEIGHT) != 0) {
    fusedops_ep_load(weight, base, cs, n, aligned, wv, 0.0f);
  }
  if ((flags & FUSEDOPS_FLAG_BIAS) != 0) {
    fusedops_ep_load(bias, base, cs, n, aligned, bv, 0.0f);
  }
  float dw_acc[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
  float db_acc[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    float xv[FUSEDOPS_READS];
    float gv[FUSEDOPS_READS];
    fusedops_ep_load(s + row * s_stride, base, cs, n, aligned, xv, 0.0f);
    fusedops_ep_load(dout + row * dout_stride, base, cs, n, aligned, gv, 0.0f);
    const float mu = mean[row];
    const float rs = rstd[row];
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      xv[k] = (xv[k] - mu) * rs;  // xhat (padding columns have g == 0)
    }
    fusedops_ep_grad(row, base, cs, key, uint(threshold), keep_scale, flags, xv, wv, bv, gv);
    float c1 = 0.0f;
    float c2 = 0.0f;
    for (uint k = 0; k < FUSEDOPS_READS; ++k) {
      const float wg = gv[k] * wv[k];
      c1 += xv[k] * wg;
      c2 += wg;
      dw_acc[k] += gv[k] * xv[k];
      db_acc[k] += gv[k];
    }
    if (need_dx) {
      const float2 c = fusedops_tg_sum(float2(c1, c2), shared, lane, sg, nsg) * inv_n;
      float dv[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (has_ds) {
        fusedops_ep_load(ds + row * ds_stride, base, cs, n, aligned, dv, 0.0f);
      }
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        xv[k] = (gv[k] * wv[k] - (xv[k] * c.x + c.y)) * rs + dv[k];
      }
      fusedops_ep_store(dx + row * n, base, cs, n, aligned, xv);
    }
  }
  const bool part_aligned = (n % FUSEDOPS_READS) == 0;
  if (need_dw) {
    fusedops_ep_store(dw_partial + ulong(tg_id) * n, base, cs, n, part_aligned, dw_acc);
  }
  if (need_db) {
    fusedops_ep_store(db_partial + ulong(tg_id) * n, base, cs, n, part_aligned, db_acc);
  }
}

// Backward for any n: pass 1 the two row sums and this threadgroup's dw/db partials (each
// thread always owns the same columns, so the read-modify-write of its partials is race-free);
// pass 2 writes dx (recomputing g, the dropout mask included).
template <typename T, typename G>
[[kernel]] void fusedops_layernorm_epilogue_bwd_looped(
    device const G* dout [[buffer(0)]],
    device const T* ds [[buffer(1)]],
    device const T* s [[buffer(2)]],
    device const float* weight [[buffer(3)]],
    device const float* bias [[buffer(4)]],
    device const float* mean [[buffer(5)]],
    device const float* rstd [[buffer(6)]],
    device T* dx [[buffer(7)]],
    device float* dw_partial [[buffer(8)]],
    device float* db_partial [[buffer(9)]],
    constant long& n_rows [[buffer(10)]],
    constant long& n_cols [[buffer(11)]],
    constant long& dout_stride [[buffer(12)]],
    constant long& ds_stride [[buffer(13)]],
    constant long& s_stride [[buffer(14)]],
    constant long& seed [[buffer(15)]],
    constant long& threshold [[buffer(16)]],
    constant float& keep_scale [[buffer(17)]],
    constant long& flags [[buffer(18)]],
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
  const bool has_b = (flags & FUSEDOPS_FLAG_BIAS) != 0;
  const bool has_ds = (flags & FUSEDOPS_FLAG_ADD) != 0;
  const bool need_dx = (flags & FUSEDOPS_FLAG_DX) != 0;
  const bool need_dw = (flags & FUSEDOPS_FLAG_DW) != 0;
  const bool need_db = (flags & FUSEDOPS_FLAG_DB) != 0;
  const bool part_aligned = (n % FUSEDOPS_READS) == 0;
  const uint cs = (flags & FUSEDOPS_FLAG_PHILOX) != 0 ? FUSEDOPS_PHILOX_W : 1;
  const uint step = n_threads * FUSEDOPS_READS;
  const uint2 key = fusedops_philox_key(seed);
  const float inv_n = 1.0f / float(n);
  device float* dwp = dw_partial + ulong(tg_id) * n;
  device float* dbp = db_partial + ulong(tg_id) * n;
  for (ulong row = tg_id; row < ulong(n_rows); row += n_tg) {
    device const T* sr = s + row * s_stride;
    device const G* gr = dout + row * dout_stride;
    const bool first = row == ulong(tg_id);
    const float mu = mean[row];
    const float rs = rstd[row];
    float c1 = 0.0f;
    float c2 = 0.0f;
    for (uint start = 0; start < n; start += step) {
      const uint base = fusedops_ep_base(start, lid, cs);
      float xv[FUSEDOPS_READS];
      float gv[FUSEDOPS_READS];
      float wv[FUSEDOPS_READS] = {1.0f, 1.0f, 1.0f, 1.0f};
      float bv[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
      fusedops_ep_load(sr, base, cs, n, aligned, xv, 0.0f);
      fusedops_ep_load(gr, base, cs, n, aligned, gv, 0.0f);
      if (has_w) {
        fusedops_ep_load(weight, base, cs, n, aligned, wv, 0.0f);
      }
      if (has_b) {
        fusedops_ep_load(bias, base, cs, n, aligned, bv, 0.0f);
      }
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        xv[k] = (xv[k] - mu) * rs;
      }
      fusedops_ep_grad(row, base, cs, key, uint(threshold), keep_scale, flags, xv, wv, bv, gv);
      for (uint k = 0; k < FUSEDOPS_READS; ++k) {
        const float wg = gv[k] * wv[k];
        c1 += xv[k] * wg;
        c2 += wg;
      }
      if (need_dw) {
        float p[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (!first) {
          fusedops_ep_load(dwp, base, cs, n, part_aligned, p, 0.0f);
        }
        for (uint k = 0; k < FUSEDOPS_READS; ++k) {
          p[k] += gv[k] * xv[k];
        }
        fusedops_ep_store(dwp, base, cs, n, part_aligned, p);
      }
      if (need_db) {
        float p[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (!first) {
          fusedops_ep_load(dbp, base, cs, n, part_aligned, p, 0.0f);
        }
        for (uint k = 0; k < FUSEDOPS_READS; ++k) {
          p[k] += gv[k];
        }
        fusedops_ep_store(dbp, base, cs, n, part_aligned, p);
      }
    }
    if (need_dx) {
      const float2 c = fusedops_tg_sum(float2(c1, c2), shared, lane, sg, nsg) * inv_n;
      for (uint start = 0; start < n; start += step) {
        const uint base = fusedops_ep_base(start, lid, cs);
        float xv[FUSEDOPS_READS];
        float gv[FUSEDOPS_READS];
        float wv[FUSEDOPS_READS] = {1.0f, 1.0f, 1.0f, 1.0f};
        float bv[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
        float dv[FUSEDOPS_READS] = {0.0f, 0.0f, 0.0f, 0.0f};
        fusedops_ep_load(sr, base, cs, n, aligned, xv, 0.0f);
        fusedops_ep_load(gr, base, cs, n, aligned, gv, 0.0f);
        if (has_w) {
          fusedops_ep_load(weight, base, cs, n, aligned, wv, 0.0f);
        }
        if (has_b) {
          fusedops_ep_load(bias, base, cs, n, aligned, bv, 0.0f);
        }
        if (has_ds) {
          fusedops_ep_load(ds + row * ds_stride, base, cs, n, aligned, dv, 0.0f);
        }
        for (uint k = 0; k < FUSEDOPS_READS; ++k) {
          xv[k] = (xv[k] - mu) * rs;
        }
        fusedops_ep_grad(row, base, cs, key, uint(threshold), keep_scale, flags, xv, wv, bv,
                         gv);
        for (uint k = 0; k < FUSEDOPS_READS; ++k) {
          xv[k] = (gv[k] * wv[k] - (xv[k] * c.x + c.y)) * rs + dv[k];
        }
        fusedops_ep_store(dx + row * n, base, cs, n, aligned, xv);
      }
    }
  }
}

// Instantiations: the LayerNorm type pairs. Forward <x>_<out>: same dtype, or half/bfloat x
// with float out. Backward <s>_<dout>: dx has s's dtype.
#define FUSEDOPS_LN_EPILOGUE_KERNEL(KERNEL, A, B)                               \
  template [[host_name("fusedops_" #KERNEL "_" #A "_" #B)]] [[kernel]]         \
  decltype(fusedops_##KERNEL<A, B>) fusedops_##KERNEL<A, B>;

#define FUSEDOPS_LN_EPILOGUE(A, B)                                   \
  FUSEDOPS_LN_EPILOGUE_KERNEL(layernorm_epilogue_fwd_single, A, B)   \
  FUSEDOPS_LN_EPILOGUE_KERNEL(layernorm_epilogue_fwd_looped, A, B)   \
  FUSEDOPS_LN_EPILOGUE_KERNEL(layernorm_epilogue_bwd_single, A, B)   \
  FUSEDOPS_LN_EPILOGUE_KERNEL(layernorm_epilogue_bwd_looped, A, B)

FUSEDOPS_LN_EPILOGUE(float, float)
FUSEDOPS_LN_EPILOGUE(half, half)
FUSEDOPS_LN_EPILOGUE(half, float)

#if defined(__HAVE_BFLOAT__)
FUSEDOPS_LN_EPILOGUE(bfloat, bfloat)
FUSEDOPS_LN_EPILOGUE(bfloat, float)
#endif
