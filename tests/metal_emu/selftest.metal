// Kernels that exercise the emulation itself (tests/test_metal_emu_shim.py): built-ins,
// SIMD-group functions, barriers, threadgroup memory, vector and 16-bit types, and kernels
// that are wrong on purpose (the emulation must report them).
#include <metal_stdlib>
using namespace metal;

// out[tid * 8 + k]: the built-ins of every thread of a 2-D grid of 2-D threadgroups.
kernel void selftest_builtins(
    device uint* out [[buffer(0)]],
    uint2 tpig [[thread_position_in_grid]],
    uint2 tpitg [[thread_position_in_threadgroup]],
    uint2 tgpig [[threadgroup_position_in_grid]],
    uint2 tptg [[threads_per_threadgroup]],
    uint2 tgpg [[threadgroups_per_grid]],
    uint tiitg [[thread_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]],
    ushort sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]],
    uint width [[threads_per_simdgroup]]) {
  const uint gid = tgpig.x + tgpig.y * tgpg.x;
  const uint tid = (gid * tptg.x * tptg.y) + tiitg;
  device uint* o = out + tid * 10;
  o[0] = tpig.x;
  o[1] = tpig.y;
  o[2] = tpitg.x;
  o[3] = tpitg.y;
  o[4] = tgpig.x;
  o[5] = tgpig.y;
  o[6] = lane;
  o[7] = sg;
  o[8] = nsg;
  o[9] = width;
}

// One row of `in` per threadgroup; out[row * 16 * n + j * n + tid]: result j of thread tid.
kernel void selftest_simd(
    device const float* in [[buffer(0)]],
    device float* out [[buffer(1)]],
    constant long& delta [[buffer(2)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint n [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const float v = in[tg * n + tid];
  device float* o = out + tg * 16 * n + tid;
  const ushort d = ushort(delta);
  o[0 * n] = simd_sum(v);
  o[1 * n] = simd_max(v);
  o[2 * n] = simd_min(v);
  o[3 * n] = simd_prefix_inclusive_sum(v);
  o[4 * n] = simd_prefix_exclusive_sum(v);
  o[5 * n] = simd_shuffle_down(v, d);
  o[6 * n] = simd_shuffle_up(v, d);
  o[7 * n] = simd_shuffle_xor(v, d);
  o[8 * n] = simd_broadcast(v, d);
  o[9 * n] = simd_shuffle(v, ushort((lane * 7) % 8));
  o[10 * n] = simd_shuffle_rotate_down(v, d);
  o[11 * n] = simd_shuffle_rotate_up(v, d);
  o[12 * n] = simd_broadcast_first(v);
  o[13 * n] = simd_product(v);
  o[14 * n] = simd_all(v > 0.0f) ? 1.0f : 0.0f;
  o[15 * n] = simd_any(v > 0.0f) ? 1.0f : 0.0f;
}

// Threadgroup memory across a barrier: out[i] = in[(i + 1) % n] within each threadgroup,
// repeated `rounds` times with the array reused (needs both barriers).
kernel void selftest_rotate(
    device const float* in [[buffer(0)]],
    device float* out [[buffer(1)]],
    constant long& rounds [[buffer(2)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint n [[threads_per_threadgroup]]) {
  threadgroup float shared[1024];
  float v = in[tg * n + tid];
  for (long r = 0; r < rounds; ++r) {
    shared[tid] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    v = shared[(tid + 1) % n];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tg * n + tid] = v;
}

// The same without the barriers: a race.
kernel void selftest_rotate_racy(
    device const float* in [[buffer(0)]],
    device float* out [[buffer(1)]],
    constant long& rounds [[buffer(2)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint n [[threads_per_threadgroup]]) {
  threadgroup float shared[1024];
  float v = in[tg * n + tid];
  for (long r = 0; r < rounds; ++r) {
    shared[tid] = v;
    v = shared[(tid + 1) % n];
  }
  out[tg * n + tid] = v;
}

// Reads threadgroup memory nobody wrote (write_at is out of range): poison (NaN) in the
// emulation.
kernel void selftest_uninitialized(
    device float* out [[buffer(0)]],
    constant long& write_at [[buffer(1)]],
    uint tid [[thread_position_in_threadgroup]]) {
  threadgroup float shared[64];
  if (long(tid) == write_at) {
    shared[tid] = 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = shared[tid];
}

// Returns early, then the others wait at a barrier forever.
kernel void selftest_early_return(
    device float* out [[buffer(0)]],
    uint tid [[thread_position_in_threadgroup]]) {
  if (tid == 3) {
    return;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = 1.0f;
}

// Threads meet at different barriers.
kernel void selftest_divergent_barrier(
    device float* out [[buffer(0)]],
    uint tid [[thread_position_in_threadgroup]]) {
  if (tid < 16) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = 1.0f;
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = 2.0f;
  }
}

// Lanes of one SIMD-group call different collectives.
kernel void selftest_divergent_simd(
    device float* out [[buffer(0)]],
    uint lane [[thread_index_in_simdgroup]]) {
  out[lane] = (lane < 8) ? simd_sum(1.0f) : simd_max(1.0f);
}

// Vector types, 16-bit types and conversions: out[i] = f(in[i]) per element.
kernel void selftest_types(
    device const float4* in [[buffer(0)]],
    device half4* out_half [[buffer(1)]],
    device bfloat4* out_bfloat [[buffer(2)]],
    device float4* out_float [[buffer(3)]],
    uint i [[thread_position_in_grid]]) {
  const float4 v = in[i];
  out_half[i] = half4(v);
  out_bfloat[i] = bfloat4(v);
  const float4 w = v * 2.0f + float4(1.0f, 2.0f, 3.0f, 4.0f);
  out_float[i] = float4(max(w.x, w.y), min(w.z, w.w), precise::exp(v.x) - exp(v.x),
                        rsqrt(4.0f));
}
