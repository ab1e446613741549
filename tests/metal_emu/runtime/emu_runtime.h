// CPU emulation of Metal compute dispatch: the interface between the metal_stdlib shim, the
// generated kernel wrappers and the threading runtime (emu_runtime.cpp).
//
// The threads of a threadgroup run concurrently, as fibers or as OS threads (see
// emu_runtime.cpp); threadgroups run one after another (threadgroup memory is a function-local
// static, poisoned before every threadgroup). threadgroup_barrier is a real barrier across the
// threadgroup's threads and every SIMD-group collective is a rendezvous of its (up to 32)
// lanes, so a missing barrier or a race changes results (and, with OS threads, is visible to
// ThreadSanitizer).
#pragma once

#include <cstddef>
#include <cstdint>

namespace emu {

struct Dim3 {
  unsigned x, y, z;
};

// Values of the kernel built-ins for one thread.
struct Builtins {
  Dim3 thread_position_in_grid;
  Dim3 thread_position_in_threadgroup;
  Dim3 threadgroup_position_in_grid;
  Dim3 threads_per_threadgroup;
  Dim3 threadgroups_per_grid;
  Dim3 threads_per_grid;
  unsigned thread_index_in_threadgroup;
  unsigned thread_index_in_simdgroup;
  unsigned simdgroup_index_in_threadgroup;
  unsigned simdgroups_per_threadgroup;
  unsigned threads_per_simdgroup;
};

constexpr int kSimdWidth = 32;
constexpr std::size_t kSlot = 32;  // bytes per lane in a SIMD-group exchange

// A call site, used to detect threads that meet at different barriers/collectives.
struct Site {
  const char* file;
  int line;
  int kind;
};

// Reports an error for the whole launch and unwinds the calling thread.
[[noreturn]] void fail(const char* fmt, ...);

void threadgroup_barrier(Site site);
void simdgroup_barrier(Site site);

// SIMD-group exchange: stores `size` bytes of `value` into this lane's slot, waits for every
// lane of the SIMD-group, and returns the slots (lane i at offset i * kSlot). *lanes receives
// the number of lanes, *lane this thread's lane. The caller must then call simd_exchange_end(),
// which waits again so that no lane overwrites its slot before all lanes have read it.
const unsigned char* simd_exchange_begin(const void* value, std::size_t size, Site site,
                                         int* lanes, int* lane);
void simd_exchange_end();

}  // namespace emu

extern "C" {
typedef void (*emu_thread_fn)(void* const* args, const emu::Builtins* b);

// Runs `fn` for every thread of a grid of grid[0]*grid[1]*grid[2] threadgroups of
// tg[0]*tg[1]*tg[2] threads. Returns 0, or -1 with a message in err.
int emu_run(emu_thread_fn fn, void* const* args, const unsigned* grid, const unsigned* tg,
            char* err, int errlen);

// Regions (threadgroup variables) filled with 0xFF bytes before every threadgroup.
void emu_set_poison(void* const* addrs, const std::size_t* sizes, int n);

// Barrier wait limit in milliseconds before a launch is declared deadlocked (thread mode).
void emu_set_timeout_ms(int ms);

// 0: OS threads, 1: fibers in FIFO order, 2: fibers in a random order drawn from `seed`.
// Returns -1 when the mode is not available (fibers under ThreadSanitizer).
int emu_set_mode(int mode, unsigned long long seed);
int emu_get_mode();

// threadgroup_barrier calls at these sites (file name, line) return at once, as if deleted
// from the shader; n = 0 restores every barrier, n < 0 removes all of them.
void emu_remove_barriers(const char* const* files, const int* lines, int n);
}
