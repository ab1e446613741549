// Runtime of the Metal CPU emulation (see emu_runtime.h).
//
// Two ways to run the threads of a threadgroup, chosen per process with emu_set_mode():
//
// * fibers (default): every thread of the threadgroup is a user-space fiber (ucontext) on one
//   OS thread. A fiber runs until it reaches a barrier or a SIMD-group collective, then the
//   scheduler picks the next runnable fiber, in FIFO order or at random (seeded). Fast and
//   reproducible; a deadlock (some threads wait at a barrier that the others never reach) is
//   detected exactly.
// * threads: every thread of the threadgroup is an OS thread (a pool that persists across
//   launches), barriers are C++ atomics plus futex waits. This is the mode for
//   ThreadSanitizer: every happens-before edge is an acquire/release pair it understands.
//
// In both modes threadgroups run one after another (threadgroup memory is a function-local
// static, poisoned with 0xFF bytes before every threadgroup). Errors (deadlock, divergent
// barriers, emu::fail from the shim) are recorded once per launch; emu_run returns -1 and the
// message.
#include "emu_runtime.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#if defined(__SANITIZE_THREAD__)
#define EMU_HAVE_FIBERS 0
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define EMU_HAVE_FIBERS 0
#endif
#endif
#ifndef EMU_HAVE_FIBERS
#define EMU_HAVE_FIBERS 1
#endif

namespace emu {
namespace {

struct Abort {};

enum Mode { kThreads = 0, kFibersFifo = 1, kFibersRandom = 2 };

int g_mode = EMU_HAVE_FIBERS ? kFibersFifo : kThreads;
uint64_t g_seed = 1;
int g_timeout_ms = 60000;
std::vector<std::pair<void*, std::size_t>> g_poison;
std::mutex g_launch_mu;  // one launch at a time
// threadgroup_barrier call sites that return at once (tests of the emulation's teeth: the
// shaders as if those barriers had been deleted): (file name without directory, line).
bool g_remove_all_barriers = false;
std::vector<std::pair<std::string, int>> g_removed_barriers;

const char* base_name(const char* path) {
  const char* slash = path ? std::strrchr(path, '/') : nullptr;
  return slash ? slash + 1 : (path ? path : "");
}

bool barrier_removed(const Site& s) {
  if (g_remove_all_barriers) {
    return true;
  }
  if (g_removed_barriers.empty()) {
    return false;
  }
  const char* name = base_name(s.file);
  for (const auto& r : g_removed_barriers) {
    if (r.second == s.line && r.first == name) {
      return true;
    }
  }
  return false;
}

void futex_wait(std::atomic<uint32_t>* addr, uint32_t expected, long ns) {
  timespec ts{ns / 1000000000L, ns % 1000000000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT_PRIVATE, expected, &ts,
          nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

std::string site_str(const Site& s) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s:%d", s.file ? s.file : "?", s.line);
  return buf;
}

bool same_site(const Site& a, const Site& b) {
  return a.line == b.line && a.kind == b.kind &&
         (a.file == b.file || (a.file && b.file && std::strcmp(a.file, b.file) == 0));
}

struct Launch;
struct ThreadState;
struct FiberScheduler;

// A reusable barrier for `count` participants. Before arriving, each participant records its
// call site; the last one to arrive checks that all sites agree.
struct Barrier {
  std::atomic<uint32_t> arrived{0};
  std::atomic<uint32_t> gen{0};
  uint32_t count = 0;
  std::vector<Site> sites;
  std::vector<int> waiters;  // fiber mode: fibers blocked here
  const char* what = "";
  // Thread mode: participants that left the kernel; a waiter seeing it > 0 is never released.
  std::atomic<int>* finished = nullptr;

  void init(uint32_t n, const char* name, std::atomic<int>* fin) {
    arrived.store(0, std::memory_order_relaxed);
    count = n;
    sites.assign(n, Site{nullptr, 0, 0});
    waiters.clear();
    waiters.reserve(n);
    what = name;
    finished = fin;
  }

  template <typename OnComplete>
  void wait(Launch* L, uint32_t index, Site site, OnComplete&& on_complete);

 private:
  template <typename OnComplete>
  void wait_threads(Launch* L, Site site, OnComplete&& on_complete);
  template <typename OnComplete>
  void wait_fibers(Launch* L, Site site, OnComplete&& on_complete);
  bool check_sites(Launch* L);
};

// Two slot sets used alternately: a lane writes set k % 2 for exchange k only after the
// rendezvous of exchange k - 1, which every lane reaches only after it finished reading the
// slots of exchange k - 2. So one rendezvous per exchange suffices.
struct SimdGroup {
  Barrier bar;
  alignas(16) unsigned char slots[2][kSimdWidth][kSlot];
  std::atomic<int> finished{0};
};

struct Launch {
  emu_thread_fn fn = nullptr;
  void* const* args = nullptr;
  int mode = kThreads;
  unsigned grid[3] = {1, 1, 1};
  unsigned tg[3] = {1, 1, 1};
  unsigned threads = 0;
  unsigned nsimd = 0;
  uint64_t ngroups = 0;
  Barrier tg_bar;
  Barrier group_bar;  // thread mode: between threadgroups
  std::unique_ptr<SimdGroup[]> simds;
  std::atomic<int> finished{0};
  std::atomic<bool> aborted{false};
  std::mutex err_mu;
  std::string err;
  FiberScheduler* sched = nullptr;

  void set_error(const std::string& msg) {
    {
      std::lock_guard<std::mutex> lock(err_mu);
      if (err.empty()) {
        err = msg;
      }
    }
    aborted.store(true, std::memory_order_release);
  }

  void reset_group_state() {
    finished.store(0, std::memory_order_relaxed);
    for (unsigned s = 0; s < nsimd; ++s) {
      simds[s].finished.store(0, std::memory_order_relaxed);
    }
  }
};

struct ThreadState {
  Launch* L = nullptr;
  uint32_t tid = 0;   // index in threadgroup
  uint32_t lane = 0;  // index in SIMD-group
  SimdGroup* simd = nullptr;
  uint32_t exchanges = 0;  // SIMD-group exchanges so far (slot set parity)
};

thread_local ThreadState* tls = nullptr;

void poison_all() {
  for (auto& r : g_poison) {
    std::memset(r.first, 0xFF, r.second);
  }
}

// Runs the kernel body of thread t for threadgroup g.
void run_kernel(ThreadState* t, uint64_t g) {
  Launch* L = t->L;
  Builtins b{};
  const unsigned tx = L->tg[0], ty = L->tg[1];
  b.threads_per_threadgroup = Dim3{L->tg[0], L->tg[1], L->tg[2]};
  b.threadgroups_per_grid = Dim3{L->grid[0], L->grid[1], L->grid[2]};
  b.threads_per_grid = Dim3{L->grid[0] * L->tg[0], L->grid[1] * L->tg[1], L->grid[2] * L->tg[2]};
  b.thread_index_in_threadgroup = t->tid;
  b.thread_position_in_threadgroup = Dim3{t->tid % tx, (t->tid / tx) % ty, t->tid / (tx * ty)};
  b.thread_index_in_simdgroup = t->lane;
  b.simdgroup_index_in_threadgroup = t->tid / kSimdWidth;
  b.simdgroups_per_threadgroup = L->nsimd;
  b.threads_per_simdgroup = kSimdWidth;
  const unsigned gx = unsigned(g % L->grid[0]);
  const unsigned gy = unsigned((g / L->grid[0]) % L->grid[1]);
  const unsigned gz = unsigned(g / (uint64_t(L->grid[0]) * L->grid[1]));
  b.threadgroup_position_in_grid = Dim3{gx, gy, gz};
  b.thread_position_in_grid = Dim3{gx * L->tg[0] + b.thread_position_in_threadgroup.x,
                                   gy * L->tg[1] + b.thread_position_in_threadgroup.y,
                                   gz * L->tg[2] + b.thread_position_in_threadgroup.z};
  L->fn(L->args, &b);
}

// Runs `body` and turns exceptions into launch errors. Returns false when unwound.
template <typename Body>
bool guarded(Launch* L, Body&& body) {
  try {
    body();
    return true;
  } catch (const Abort&) {
  } catch (const std::exception& e) {
    L->set_error(std::string("exception in kernel: ") + e.what());
  } catch (...) {
    L->set_error("unknown exception in kernel");
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// Fiber mode.

#if EMU_HAVE_FIBERS
constexpr std::size_t kFiberStack = 128 * 1024;

// Context switch. On x86-64 a minimal switch of the callee-saved registers (no signal-mask
// system call, unlike swapcontext); elsewhere ucontext.
#if defined(__x86_64__)
extern "C" void emu_ctx_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .type emu_ctx_switch,@function
emu_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_ctx_switch, .-emu_ctx_switch
)");

struct Context {
  void* sp = nullptr;
};
inline void ctx_switch(Context* save, Context* load) { emu_ctx_switch(&save->sp, load->sp); }
void fiber_trampoline();
inline void ctx_make(Context* c, char* stack, std::size_t size) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                                          // keeps the return slot 16-aligned
  *--sp = reinterpret_cast<void*>(&fiber_trampoline);       // "return address" of the switch
  for (int i = 0; i < 6; ++i) *--sp = nullptr;              // rbp rbx r12 r13 r14 r15
  uint32_t csr[2];
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(csr[0]), "=m"(csr[1]));
  *--sp = nullptr;
  std::memcpy(sp, csr, 8);                                  // mxcsr, x87 control word
  c->sp = sp;
}
#else
struct Context {
  ucontext_t uc;
};
inline void ctx_switch(Context* save, Context* load) { swapcontext(&save->uc, &load->uc); }
void fiber_trampoline();
inline void ctx_make(Context* c, char* stack, std::size_t size) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = stack;
  c->uc.uc_stack.ss_size = size;
  c->uc.uc_link = nullptr;
  makecontext(&c->uc, fiber_trampoline, 0);
}
#endif

struct Fiber {
  Context ctx;
  ThreadState* state = nullptr;
  bool done = false;
  bool blocked = false;
  Site waiting_at{nullptr, 0, 0};
};

// FIFO: fibers run in the order they became runnable (round robin).
// Random: the next fiber is drawn at random, with a bias for staying in the SIMD-group of the
// previous one: always while it has a runnable fiber for odd seeds ("run ahead": a SIMD-group
// runs until it blocks at a threadgroup barrier, the schedule that exposes a missing barrier
// between two uses of threadgroup memory), 3 times in 4 for even seeds (finer interleaving).
struct FiberScheduler {
  Launch* L = nullptr;
  std::vector<Fiber>* fibers = nullptr;
  Context main_ctx;
  std::vector<int> fifo;
  std::size_t head = 0;
  std::vector<std::vector<int>> by_sg;  // random mode: runnable fibers per SIMD-group
  std::size_t n_runnable = 0;
  int last_sg = -1;
  bool run_ahead = false;
  int current = -1;
  uint64_t rng = 1;
  uint64_t group = 0;

  uint64_t next_random() {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
  }

  bool random_mode() const { return L->mode == kFibersRandom; }

  void reset() {
    fifo.clear();
    head = 0;
    by_sg.assign(L->nsimd, {});
    n_runnable = 0;
    last_sg = -1;
  }

  bool has_runnable() const { return random_mode() ? n_runnable > 0 : head < fifo.size(); }

  int pick() {
    if (!random_mode()) {
      const int f = fifo[head++];
      if (head == fifo.size()) {
        fifo.clear();
        head = 0;
      }
      return f;
    }
    int sg = -1;
    if (last_sg >= 0 && !by_sg[last_sg].empty() && (run_ahead || next_random() % 4 != 0)) {
      sg = last_sg;
    } else {
      int nonempty = 0;
      for (auto& v : by_sg) nonempty += !v.empty();
      int k = int(next_random() % uint64_t(nonempty));
      for (int i = 0; i < int(by_sg.size()); ++i) {
        if (!by_sg[i].empty() && k-- == 0) {
          sg = i;
          break;
        }
      }
    }
    auto& v = by_sg[sg];
    const std::size_t i = std::size_t(next_random() % v.size());
    const int f = v[i];
    v[i] = v.back();
    v.pop_back();
    --n_runnable;
    last_sg = sg;
    return f;
  }

  void make_runnable(int f) {
    (*fibers)[f].blocked = false;
    if (random_mode()) {
      by_sg[f / kSimdWidth].push_back(f);
      ++n_runnable;
    } else {
      fifo.push_back(f);
    }
  }

  // Called from a fiber: hand control back to the scheduler.
  void switch_out() {
    Fiber& self = (*fibers)[current];
    ctx_switch(&self.ctx, &main_ctx);
    tls = self.state;
  }

  void block_current(Site site) {
    Fiber& self = (*fibers)[current];
    self.blocked = true;
    self.waiting_at = site;
    switch_out();
  }

  void yield_current() {
    make_runnable(current);
    switch_out();
  }

  // Runs one threadgroup to completion (or error).
  void run() {
    for (;;) {
      if (L->aborted.load(std::memory_order_relaxed)) {
        return;
      }
      if (!has_runnable()) {
        std::string blocked;
        int n_done = 0;
        for (auto& f : *fibers) {
          if (f.done) {
            ++n_done;
          } else if (blocked.empty()) {
            blocked = "thread " + std::to_string(f.state->tid) + " waits at " +
                      site_str(f.waiting_at);
          }
        }
        if (n_done == int(fibers->size())) {
          return;
        }
        L->set_error("deadlock in threadgroup " + std::to_string(group) + ": " + blocked +
                     ", " + std::to_string(n_done) +
                     " thread(s) already returned from the kernel");
        return;
      }
      current = pick();
      Fiber& f = (*fibers)[current];
      tls = f.state;
      ctx_switch(&main_ctx, &f.ctx);
      tls = nullptr;
    }
  }
};

FiberScheduler* t_sched = nullptr;  // the scheduler of the running launch

void fiber_trampoline() {
  FiberScheduler* s = t_sched;
  Fiber& f = (*s->fibers)[s->current];
  guarded(s->L, [&] { run_kernel(f.state, s->group); });
  f.done = true;
  ctx_switch(&f.ctx, &s->main_ctx);
  std::abort();  // never resumed
}

// Fiber stacks, reused by every launch; never freed.
std::vector<char*>* g_stacks = new std::vector<char*>();

bool run_fibers(Launch& L, std::vector<ThreadState>& states) {
  while (g_stacks->size() < L.threads) {
    g_stacks->push_back(new char[kFiberStack]);
  }
  FiberScheduler sched;
  sched.L = &L;
  sched.rng = g_seed * 0x9E3779B97F4A7C15ull + 1;
  sched.run_ahead = (g_seed & 1) != 0;
  std::vector<Fiber> view(L.threads);
  sched.fibers = &view;
  L.sched = &sched;
  t_sched = &sched;
  for (uint64_t g = 0; g < L.ngroups && !L.aborted.load(); ++g) {
    sched.group = g;
    sched.reset();
    if (g > 0) {
      poison_all();
    }
    for (unsigned i = 0; i < L.threads; ++i) {
      Fiber& f = view[i];
      f.state = &states[i];
      f.done = false;
      f.blocked = false;
      states[i].exchanges = 0;
      ctx_make(&f.ctx, (*g_stacks)[i], kFiberStack);
      sched.make_runnable(int(i));
    }
    L.tg_bar.init(L.threads, "threadgroup_barrier", nullptr);
    for (unsigned s = 0; s < L.nsimd; ++s) {
      L.simds[s].bar.init(L.simds[s].bar.count, "SIMD-group collective", nullptr);
    }
    sched.run();
  }
  t_sched = nullptr;
  L.sched = nullptr;
  return true;
}
#else
struct FiberScheduler {
  void block_current(Site) {}
  void yield_current() {}
  std::vector<int> waiters;
  int current = -1;
  void make_runnable(int) {}
};
bool run_fibers(Launch& L, std::vector<ThreadState>&) {
  L.set_error("fiber mode is not available in this build (ThreadSanitizer)");
  return false;
}
#endif

// ---------------------------------------------------------------------------------------------
// Barriers.

bool Barrier::check_sites(Launch* L) {
  for (uint32_t i = 1; i < count; ++i) {
    if (!same_site(sites[i], sites[0])) {
      L->set_error(std::string("divergent ") + what + ": participant 0 at " +
                   site_str(sites[0]) + ", participant " + std::to_string(i) + " at " +
                   site_str(sites[i]));
      return false;
    }
  }
  return true;
}

template <typename OnComplete>
void Barrier::wait(Launch* L, uint32_t index, Site site, OnComplete&& on_complete) {
  sites[index] = site;
  if (L->mode == kThreads) {
    wait_threads(L, site, on_complete);
  } else {
    wait_fibers(L, site, on_complete);
  }
  if (L->aborted.load(std::memory_order_acquire)) {
    throw Abort{};
  }
}

template <typename OnComplete>
void Barrier::wait_fibers(Launch* L, Site site, OnComplete&& on_complete) {
  FiberScheduler* s = L->sched;
  if (arrived.load(std::memory_order_relaxed) + 1 == count) {
    arrived.store(0, std::memory_order_relaxed);
    check_sites(L);
    on_complete();
    for (int w : waiters) {
      s->make_runnable(w);
    }
    waiters.clear();
    s->yield_current();
  } else {
    arrived.store(arrived.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    waiters.push_back(s->current);
    s->block_current(site);
  }
}

template <typename OnComplete>
void Barrier::wait_threads(Launch* L, Site site, OnComplete&& on_complete) {
  const uint32_t g = gen.load(std::memory_order_acquire);
  if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == count) {
    check_sites(L);
    on_complete();
    arrived.store(0, std::memory_order_relaxed);
    gen.fetch_add(1, std::memory_order_release);
    futex_wake_all(&gen);
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  while (gen.load(std::memory_order_acquire) == g) {
    if (L->aborted.load(std::memory_order_acquire)) {
      throw Abort{};
    }
    if (finished && finished->load(std::memory_order_acquire) > 0 &&
        gen.load(std::memory_order_acquire) == g) {
      L->set_error(std::string("deadlock: a thread returned from the kernel while others wait "
                               "at ") + what + " (" + site_str(site) + ")");
      throw Abort{};
    }
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::steady_clock::now() - t0)
                            .count();
    if (waited > g_timeout_ms) {
      L->set_error(std::string("timeout: ") + what + " at " + site_str(site) +
                   " never completed (divergent control flow?)");
      throw Abort{};
    }
    futex_wait(&gen, g, 50L * 1000 * 1000);
  }
}

// ---------------------------------------------------------------------------------------------
// Thread mode: a pool of OS threads that persists across launches. Worker i runs thread i of
// every threadgroup of the current launch; emu_run wakes the first `threads` workers and waits.

void thread_main(ThreadState* t) {
  tls = t;
  Launch* L = t->L;
  guarded(L, [&] {
    for (uint64_t g = 0; g < L->ngroups; ++g) {
      run_kernel(t, g);
      L->finished.fetch_add(1, std::memory_order_acq_rel);
      t->simd->finished.fetch_add(1, std::memory_order_acq_rel);
      L->group_bar.wait(L, t->tid, Site{"<end of threadgroup>", 0, 0}, [L] {
        L->reset_group_state();
        poison_all();
      });
    }
  });
  tls = nullptr;
}

struct Worker {
  pthread_t handle{};
  std::atomic<uint32_t> epoch{0};
  ThreadState* job = nullptr;
};

struct ThreadPool {
  std::mutex mu;
  std::vector<Worker*> workers;  // never destroyed: workers outlive static destruction
  std::atomic<uint32_t> done{0};
};
ThreadPool* g_threads = new ThreadPool();

void* worker_main(void* p) {
  Worker* w = static_cast<Worker*>(p);
  uint32_t seen = 0;
  for (;;) {
    uint32_t e;
    while ((e = w->epoch.load(std::memory_order_acquire)) == seen) {
      futex_wait(&w->epoch, seen, 1000L * 1000 * 1000);
    }
    seen = e;
    thread_main(w->job);
    g_threads->done.fetch_add(1, std::memory_order_acq_rel);
    futex_wake_all(&g_threads->done);
  }
  return nullptr;
}

bool run_threads(Launch& L, std::vector<ThreadState>& states, std::string* err) {
  ThreadPool& P = *g_threads;
  while (P.workers.size() < L.threads) {
    Worker* w = new Worker();
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 20);
    const int rc = pthread_create(&w->handle, &attr, worker_main, w);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
      delete w;
      *err = "pthread_create failed after " + std::to_string(P.workers.size()) + " threads";
      return false;
    }
    pthread_detach(w->handle);
    P.workers.push_back(w);
  }
  P.done.store(0, std::memory_order_relaxed);
  for (unsigned i = 0; i < L.threads; ++i) {
    Worker* w = P.workers[i];
    w->job = &states[i];
    w->epoch.fetch_add(1, std::memory_order_release);
    futex_wake_all(&w->epoch);
  }
  uint32_t d;
  while ((d = P.done.load(std::memory_order_acquire)) < L.threads) {
    futex_wait(&P.done, d, 1000L * 1000 * 1000);
  }
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Entry points used by the shim.

void fail(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (tls) {
    tls->L->set_error(buf);
  }
  throw Abort{};
}

void threadgroup_barrier(Site site) {
  ThreadState* t = tls;
  if (!t) {
    fail("threadgroup_barrier outside a kernel");
  }
  if (barrier_removed(site)) {
    return;
  }
  site.kind = 1;
  t->L->tg_bar.wait(t->L, t->tid, site, [] {});
}

void simdgroup_barrier(Site site) {
  ThreadState* t = tls;
  site.kind = 2;
  t->simd->bar.wait(t->L, t->lane, site, [] {});
}

const unsigned char* simd_exchange_begin(const void* value, std::size_t size, Site site,
                                         int* lanes, int* lane) {
  ThreadState* t = tls;
  if (!t) {
    fail("SIMD-group function outside a kernel");
  }
  if (size > kSlot) {
    fail("SIMD-group function on a %zu-byte value (emulation supports up to %zu)", size, kSlot);
  }
  SimdGroup* s = t->simd;
  const uint32_t set = t->exchanges++ & 1u;
  std::memcpy(s->slots[set][t->lane], value, size);
  s->bar.wait(t->L, t->lane, site, [] {});
  *lanes = int(s->bar.count);
  *lane = int(t->lane);
  return &s->slots[set][0][0];
}

void simd_exchange_end() {}

}  // namespace emu

using namespace emu;

extern "C" {

void emu_set_poison(void* const* addrs, const std::size_t* sizes, int n) {
  g_poison.clear();
  for (int i = 0; i < n; ++i) {
    g_poison.emplace_back(addrs[i], sizes[i]);
  }
}

void emu_set_timeout_ms(int ms) { g_timeout_ms = ms; }

int emu_set_mode(int mode, unsigned long long seed) {
  if (mode < kThreads || mode > kFibersRandom) {
    return -1;
  }
  if (mode != kThreads && !EMU_HAVE_FIBERS) {
    return -1;
  }
  g_mode = mode;
  g_seed = seed;
  return 0;
}

int emu_get_mode() { return g_mode; }

void emu_remove_barriers(const char* const* files, const int* lines, int n) {
  std::lock_guard<std::mutex> lock(g_launch_mu);
  g_remove_all_barriers = n < 0;
  g_removed_barriers.clear();
  for (int i = 0; i < n; ++i) {
    g_removed_barriers.emplace_back(base_name(files[i]), lines[i]);
  }
}

int emu_run(emu_thread_fn fn, void* const* args, const unsigned* grid, const unsigned* tg,
            char* err, int errlen) {
  std::lock_guard<std::mutex> lock(g_launch_mu);
  auto report = [&](const std::string& msg) {
    if (err && errlen > 0) {
      std::snprintf(err, std::size_t(errlen), "%s", msg.c_str());
    }
    return -1;
  };
  Launch L;
  L.fn = fn;
  L.args = args;
  L.mode = g_mode;
  for (int d = 0; d < 3; ++d) {
    L.grid[d] = grid[d];
    L.tg[d] = tg[d];
    if (grid[d] == 0 || tg[d] == 0) {
      return report("empty grid or threadgroup");
    }
  }
  L.threads = tg[0] * tg[1] * tg[2];
  if (L.threads > 1024) {
    return report("threadgroup of " + std::to_string(L.threads) + " threads exceeds 1024");
  }
  L.ngroups = uint64_t(grid[0]) * grid[1] * grid[2];
  L.nsimd = (L.threads + kSimdWidth - 1) / kSimdWidth;
  L.tg_bar.init(L.threads, "threadgroup_barrier", &L.finished);
  L.group_bar.init(L.threads, "end-of-threadgroup barrier", nullptr);
  L.simds.reset(new SimdGroup[L.nsimd]);
  for (unsigned s = 0; s < L.nsimd; ++s) {
    const unsigned lanes = std::min<unsigned>(kSimdWidth, L.threads - s * kSimdWidth);
    L.simds[s].bar.init(lanes, "SIMD-group collective", &L.simds[s].finished);
  }
  poison_all();
  std::vector<ThreadState> states(L.threads);
  for (unsigned i = 0; i < L.threads; ++i) {
    states[i].L = &L;
    states[i].tid = i;
    states[i].lane = i % kSimdWidth;
    states[i].simd = &L.simds[i / kSimdWidth];
  }
  std::string run_err;
  const bool ok = L.mode == kThreads ? run_threads(L, states, &run_err) : run_fibers(L, states);
  if (!ok && !run_err.empty()) {
    return report(run_err);
  }
  if (L.aborted.load()) {
    return report(L.err.empty() ? std::string("aborted") : L.err);
  }
  return 0;
}

}  // extern "C"
