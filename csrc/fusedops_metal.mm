// fusedops._metal_ext: the Metal kernels of metal/*.metal on PyTorch's MPS stream.
//
// * The shader source is embedded at build time (shaders_embedded.h, written by
//   csrc/embed_shaders.py) and compiled once, at first use, with newLibraryWithSource on
//   the MTLDevice that PyTorch's MPS backend uses (safe math, so infinities behave).
// * One compute pipeline state per kernel (op x variant x dtype pair), created lazily and
//   cached; the threadgroup size comes from its maxTotalThreadsPerThreadgroup.
// * Each call checks every argument first (TORCH_CHECK), allocates its outputs, and only then
//   encodes on at::mps::getCurrentMPSStream()'s compute encoder inside dispatch_sync on the
//   stream's serial queue, binding every tensor at storage_offset * element_size. No commit
//   or synchronize: the kernels are ordered with the surrounding torch ops by the stream.
//
// The host logic (kernel choice, geometry, argument order, flags) mirrors
// fusedops/metal.py, which the test-suite runs against the CPU emulation of the same shaders;
// tests/test_metal_backend.py checks that the constants below match metal.py.

#include <torch/extension.h>

#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>
#include <pybind11/stl.h>

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "shaders_embedded.h"

namespace {

// --- Host/shader contract (metal/common.metal, fusedops/metal.py) ----------------------------
constexpr int64_t kSimdWidth = 32;
constexpr int64_t kReads = 4;
constexpr int64_t kMaxThreads = 1024;
constexpr int64_t kMaxRowGroups = 65536;
constexpr int64_t kLnBwdPartialBudget = int64_t(1) << 22;
constexpr int64_t kLnBwdMinGroups = 32;
constexpr int64_t kLnBwdMaxGroups = 1024;
constexpr int64_t kReduceThreads = 256;

constexpr int64_t kFlagVec = 1;
constexpr int64_t kFlagWeight = 2;
constexpr int64_t kFlagBias = 4;
constexpr int64_t kFlagDx = 8;
constexpr int64_t kFlagDw = 16;
constexpr int64_t kFlagDb = 32;
constexpr int64_t kFlagMask = 64;
constexpr int64_t kFlagMaskVec = 128;
constexpr int64_t kFlagCausal = 256;
constexpr int64_t kFlagAdd = 512;
constexpr int64_t kFlagDropout = 1024;
constexpr int64_t kFlagRelu = 2048;
constexpr int64_t kFlagGelu = 4096;
constexpr int64_t kFlagStats = 8192;
constexpr int64_t kFlagPhilox = 16384;
constexpr int64_t kPhiloxW = 256;  // fusedops/_philox.py W: columns one Philox call serves apart

// --- Dispatch geometry (same functions as fusedops/metal.py) ---------------------------------
int64_t threadgroup_limit(int64_t max_threads) {
  return std::max(kSimdWidth, std::min(kMaxThreads, max_threads) / kSimdWidth * kSimdWidth);
}

int64_t single_row_limit(int64_t max_threads) { return kReads * threadgroup_limit(max_threads); }

int64_t row_threads(int64_t n_cols, int64_t max_threads) {
  const int64_t need = (n_cols + kReads - 1) / kReads;
  return std::min(threadgroup_limit(max_threads),
                  (need + kSimdWidth - 1) / kSimdWidth * kSimdWidth);
}

int64_t row_groups(int64_t n_rows) { return std::min(n_rows, kMaxRowGroups); }

int64_t layernorm_bwd_groups(int64_t n_rows, int64_t n_cols) {
  const int64_t budget =
      std::max(kLnBwdMinGroups, std::min(kLnBwdMaxGroups, kLnBwdPartialBudget / n_cols));
  return std::min(n_rows, budget);
}

int64_t reduce_threads(int64_t max_threads) {
  return std::min(kReduceThreads, threadgroup_limit(max_threads));
}

// LayerNorm epilogue with dropout: the Philox layout takes whole groups of kPhiloxW threads.
int64_t philox_threadgroup_limit(int64_t max_threads) {
  return threadgroup_limit(max_threads) / kPhiloxW * kPhiloxW;
}

int64_t philox_row_threads(int64_t n_cols, int64_t max_threads) {
  const int64_t per = kReads * kPhiloxW;
  return std::min(philox_threadgroup_limit(max_threads), (n_cols + per - 1) / per * kPhiloxW);
}

// --- Kernels -----------------------------------------------------------------------------------
enum Op {
  kSoftmaxFwd = 0,
  kSoftmaxBwd = 1,
  kLayerNormFwd = 2,
  kLayerNormBwd = 3,
  kRmsNormFwd = 4,
  kRmsNormBwd = 5,
  kSoftmaxMaskedBwd = 6,
  kLayerNormEpilogueFwd = 7,
  kLayerNormEpilogueBwd = 8,
  kNumOps = 9
};
const char* const kOpNames[kNumOps] = {
    "softmax_fwd",        "softmax_bwd",           "layernorm_fwd",
    "layernorm_bwd",      "rmsnorm_fwd",           "rmsnorm_bwd",
    "softmax_masked_bwd", "layernorm_epilogue_fwd", "layernorm_epilogue_bwd"};

const char* type_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "float";
    case at::kHalf:
      return "half";
    case at::kBFloat16:
      return "bfloat";
    default:
      return nullptr;
  }
}

int type_index(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return 0;
    case at::kHalf:
      return 1;
    case at::kBFloat16:
      return 2;
    default:
      return -1;
  }
}

struct Pipeline {
  id<MTLComputePipelineState> pso = nil;
  int64_t max_threads = 0;
};

class Library {
 public:
  static Library& get() {
    static Library* lib = new Library();  // never destroyed (outlives Python finalisation)
    return *lib;
  }

  // Compiles the embedded source once; throws (every time) if that failed.
  void ensure_compiled() {
    std::call_once(once_, [this] { compile(); });
    TORCH_CHECK(library_ != nil, "fusedops: compiling the Metal shaders failed: ", error_);
  }

  std::vector<std::string> function_names() {
    ensure_compiled();
    std::vector<std::string> out;
    @autoreleasepool {
      for (NSString* name in [library_ functionNames]) {
        out.emplace_back([name UTF8String]);
      }
    }
    return out;
  }

  // The pipeline of `name`, or nullptr when the library has no such function (for example
  // the bfloat kernels on a Metal version without bfloat). Cached; thread-safe.
  const Pipeline* pipeline(const std::string& name) {
    ensure_compiled();
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(name);
    if (it != cache_.end()) {
      return it->second.pso == nil ? nullptr : &it->second;
    }
    Pipeline p;
    @autoreleasepool {
      NSString* ns_name = [NSString stringWithUTF8String:name.c_str()];
      id<MTLFunction> fn = [library_ newFunctionWithName:ns_name];
      if (fn != nil) {
        NSError* err = nil;
        p.pso = [device_ newComputePipelineStateWithFunction:fn error:&err];
        TORCH_CHECK(p.pso != nil, "fusedops: cannot create the Metal pipeline for ", name, ": ",
                    err ? [[err localizedDescription] UTF8String] : "unknown error");
        p.max_threads = int64_t([p.pso maxTotalThreadsPerThreadgroup]);
      }
    }
    auto& slot = cache_[name];
    slot = p;
    return slot.pso == nil ? nullptr : &slot;
  }

 private:
  void compile() {
    @autoreleasepool {
      device_ = at::mps::MPSDevice::getInstance()->device();
      if (device_ == nil) {
        error_ = "no Metal device";
        return;
      }
      MTLCompileOptions* options = [MTLCompileOptions new];
      // No fast math: the kernels rely on IEEE infinities (masked softmax rows).
#if defined(__MAC_OS_X_VERSION_MAX_ALLOWED) && __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
      if (@available(macOS 15.0, *)) {
        options.mathMode = MTLMathModeSafe;
        options.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsPrecise;
      } else
#endif
      {
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
        options.fastMathEnabled = NO;
#pragma clang diagnostic pop
      }
      NSError* err = nil;
      NSString* source = [NSString stringWithUTF8String:kFusedopsMetalSource];
      id<MTLLibrary> lib = [device_ newLibraryWithSource:source options:options error:&err];
      if (lib == nil) {
        error_ = err ? [[err localizedDescription] UTF8String] : "unknown error";
        return;
      }
      library_ = lib;
    }
  }

  std::once_flag once_;
  id<MTLDevice> device_ = nil;
  id<MTLLibrary> library_ = nil;
  std::string error_;
  std::mutex mu_;
  std::unordered_map<std::string, Pipeline> cache_;
};

// Per (op, first type, second type): the (single, looped) pipelines, resolved once.
struct RowKernels {
  const Pipeline* single = nullptr;
  const Pipeline* looped = nullptr;
};

const RowKernels* row_kernels(Op op, at::ScalarType a, at::ScalarType b) {
  static std::array<std::atomic<const RowKernels*>, kNumOps * 9> table{};
  const int ia = type_index(a), ib = type_index(b);
  if (ia < 0 || ib < 0) {
    return nullptr;
  }
  auto& slot = table[op * 9 + ia * 3 + ib];
  const RowKernels* k = slot.load(std::memory_order_acquire);
  if (k == nullptr) {
    auto* fresh = new RowKernels();  // one per slot at most (a lost race leaks a few bytes)
    const std::string suffix = std::string("_") + type_name(a) + "_" + type_name(b);
    const std::string base = std::string("fusedops_") + kOpNames[op];
    fresh->single = Library::get().pipeline(base + "_single" + suffix);
    fresh->looped = Library::get().pipeline(base + "_looped" + suffix);
    slot.store(fresh, std::memory_order_release);
    k = fresh;
  }
  return (k->single && k->looped) ? k : nullptr;
}

// The kernel for rows of n columns and its threadgroup size.
std::pair<const Pipeline*, int64_t> choose(const RowKernels& k, int64_t n) {
  if (n <= single_row_limit(k.single->max_threads)) {
    return {k.single, row_threads(n, k.single->max_threads)};
  }
  return {k.looped, threadgroup_limit(k.looped->max_threads)};
}

// Masked softmax forward, per (x type, y type, mask kind): mask kinds bool, float, half, bfloat.
int mask_index(const std::string& kind) {
  return kind == "bool" ? 0 : kind == "float" ? 1 : kind == "half" ? 2 : 3;
}

const RowKernels* masked_fwd_kernels(at::ScalarType a, at::ScalarType b,
                                     const std::string& kind) {
  static std::array<std::atomic<const RowKernels*>, 9 * 4> table{};
  const int ia = type_index(a), ib = type_index(b);
  if (ia < 0 || ib < 0) {
    return nullptr;
  }
  auto& slot = table[(ia * 3 + ib) * 4 + mask_index(kind)];
  const RowKernels* k = slot.load(std::memory_order_acquire);
  if (k == nullptr) {
    auto* fresh = new RowKernels();  // one per slot at most (a lost race leaks a few bytes)
    const std::string suffix =
        std::string("_") + type_name(a) + "_" + type_name(b) + "_" + kind;
    fresh->single = Library::get().pipeline("fusedops_softmax_masked_fwd_single" + suffix);
    fresh->looped = Library::get().pipeline("fusedops_softmax_masked_fwd_looped" + suffix);
    slot.store(fresh, std::memory_order_release);
    k = fresh;
  }
  return (k->single && k->looped) ? k : nullptr;
}

// LayerNorm epilogue: (kernel, threadgroup size, Philox layout). With dropout, the Philox
// layout wherever the pipelines allow whole groups of kPhiloxW threads.
std::tuple<const Pipeline*, int64_t, bool> choose_epilogue(const RowKernels& k, int64_t n,
                                                           bool dropout) {
  if (dropout) {
    const int64_t ls = philox_threadgroup_limit(k.single->max_threads);
    const int64_t ll = philox_threadgroup_limit(k.looped->max_threads);
    if (ls > 0 && ll > 0) {
      if (n <= kReads * ls) {
        return {k.single, philox_row_threads(n, k.single->max_threads), true};
      }
      return {k.looped, ll, true};
    }
  }
  auto [p, threads] = choose(k, n);
  return {p, threads, false};
}

// --- Argument checks -------------------------------------------------------------------------
void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_mps(), "fusedops metal: ", name, " must be an MPS tensor, got ",
              t.device());
  TORCH_CHECK(t.dim() == 2, "fusedops metal: ", name, " must be 2-D (rows, cols), got ",
              t.dim(), "-D");
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "fusedops metal: ", name,
              " must have unit column stride, got stride ", t.stride(1));
  TORCH_CHECK(t.size(0) <= 1 || t.stride(0) >= 0, "fusedops metal: ", name,
              " has a negative row stride");
  TORCH_CHECK(t.size(1) < (int64_t(1) << 31), "fusedops metal: ", name, " rows longer than 2^31");
  TORCH_CHECK(type_index(t.scalar_type()) >= 0, "fusedops metal: ", name,
              " must be float32, float16 or bfloat16, got ", t.scalar_type());
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK(a.device() == b.device(), "fusedops metal: ", name, " is on ", b.device(),
              ", expected ", a.device());
}

bool aligned(std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts) {
    if (t == nullptr) {
      continue;
    }
    if (t->storage_offset() % kReads != 0) {
      return false;
    }
    if (t->dim() == 2 && t->size(0) > 1 && t->stride(0) % kReads != 0) {
      return false;
    }
  }
  return true;
}

at::Tensor param_f32(const std::optional<at::Tensor>& p, const at::Tensor& x, int64_t n,
                     const char* name) {
  TORCH_CHECK(p->device() == x.device(), "fusedops metal: ", name, " is on ", p->device(),
              ", expected ", x.device());
  TORCH_CHECK(p->numel() == n, "fusedops metal: ", name, " must have ", n, " elements, got ",
              p->numel());
  TORCH_CHECK(p->is_floating_point(), "fusedops metal: ", name, " must be floating point");
  return p->reshape({-1}).to(at::kFloat).contiguous();
}

// --- Encoding ----------------------------------------------------------------------------------
// One argument of a launch: a tensor (bound at its storage offset), a 64-bit int or a float.
struct Arg {
  enum Kind { kBuffer, kInt64, kFloat32 } kind;
  at::Tensor tensor;
  int64_t i = 0;
  float f = 0.0f;
  static Arg Buf(const at::Tensor& t) { return Arg{kBuffer, t}; }
  static Arg Int(int64_t v) { return Arg{kInt64, at::Tensor(), v}; }
  static Arg Float(float v) { return Arg{kFloat32, at::Tensor(), 0, v}; }
};

inline id<MTLBuffer> buffer_of(const at::Tensor& t) {
  return (__bridge id<MTLBuffer>)(const_cast<void*>(t.storage().data()));
}

// Encodes one dispatch of `groups` threadgroups of `threads` threads on the current MPS
// stream. Argument i is bound to [[buffer(i)]]. Must only be called after all checks.
void encode(const Pipeline* p, const std::vector<Arg>& args, int64_t groups, int64_t threads) {
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  id<MTLComputePipelineState> pso = p->pso;
  const std::vector<Arg>* argv = &args;
  dispatch_sync(stream->queue(), ^() {
    @autoreleasepool {
      id<MTLComputeCommandEncoder> enc = stream->commandEncoder();
      [enc setComputePipelineState:pso];
      for (NSUInteger idx = 0; idx < argv->size(); ++idx) {
        const Arg& a = (*argv)[idx];
        switch (a.kind) {
          case Arg::kBuffer:
            [enc setBuffer:buffer_of(a.tensor)
                    offset:NSUInteger(a.tensor.storage_offset() * a.tensor.element_size())
                   atIndex:idx];
            break;
          case Arg::kInt64:
            [enc setBytes:&a.i length:sizeof(int64_t) atIndex:idx];
            break;
          case Arg::kFloat32:
            [enc setBytes:&a.f length:sizeof(float) atIndex:idx];
            break;
        }
      }
      [enc dispatchThreadgroups:MTLSizeMake(NSUInteger(groups), 1, 1)
          threadsPerThreadgroup:MTLSizeMake(NSUInteger(threads), 1, 1)];
    }
  });
}

at::Tensor empty_arg(const at::Tensor& like) {
  return at::empty({0}, like.options().dtype(at::kFloat));
}

// --- Ops ---------------------------------------------------------------------------------------
at::Tensor softmax_forward(const at::Tensor& x, at::ScalarType out_dtype) {
  check_rows(x, "x");
  TORCH_CHECK(type_index(out_dtype) >= 0, "fusedops metal: unsupported output dtype ", out_dtype);
  const RowKernels* k = row_kernels(kSoftmaxFwd, x.scalar_type(), out_dtype);
  TORCH_CHECK(k != nullptr, "fusedops metal: no softmax kernel for ", x.scalar_type(), " -> ",
              out_dtype);
  const int64_t m = x.size(0), n = x.size(1);
  at::Tensor y = at::empty({m, n}, x.options().dtype(out_dtype));
  if (m == 0 || n == 0) {
    return y;
  }
  auto [p, threads] = choose(*k, n);
  const int64_t flags = aligned({&x, &y}) ? kFlagVec : 0;
  encode(p,
         {Arg::Buf(x), Arg::Buf(y), Arg::Int(m), Arg::Int(n), Arg::Int(x.stride(0)),
          Arg::Int(flags)},
         row_groups(m), threads);
  return y;
}

at::Tensor softmax_backward(const at::Tensor& y, const at::Tensor& dy_in,
                            at::ScalarType out_dtype) {
  check_rows(y, "y");
  check_rows(dy_in, "dy");
  check_same(y, dy_in, "dy");
  TORCH_CHECK(dy_in.sizes() == y.sizes(), "fusedops metal: dy has shape ", dy_in.sizes(),
              ", expected ", y.sizes());
  TORCH_CHECK(type_index(out_dtype) >= 0, "fusedops metal: unsupported output dtype ", out_dtype);
  const RowKernels* k = row_kernels(kSoftmaxBwd, y.scalar_type(), out_dtype);
  TORCH_CHECK(k != nullptr, "fusedops metal: no softmax backward kernel for ", y.scalar_type(),
              " -> ", out_dtype);
  const at::Tensor dy = dy_in.scalar_type() == y.scalar_type() ? dy_in : dy_in.to(y.scalar_type());
  const int64_t m = y.size(0), n = y.size(1);
  at::Tensor dx = at::empty({m, n}, y.options().dtype(out_dtype));
  if (m == 0 || n == 0) {
    return dx;
  }
  auto [p, threads] = choose(*k, n);
  const int64_t flags = aligned({&y, &dy, &dx}) ? kFlagVec : 0;
  encode(p,
         {Arg::Buf(y), Arg::Buf(dy), Arg::Buf(dx), Arg::Int(m), Arg::Int(n),
          Arg::Int(y.stride(0)), Arg::Int(dy.stride(0)), Arg::Int(flags)},
         row_groups(m), threads);
  return dx;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, at::ScalarType out_dtype) {
  check_rows(x, "x");
  TORCH_CHECK(type_index(out_dtype) >= 0, "fusedops metal: unsupported output dtype ", out_dtype);
  const RowKernels* k = row_kernels(kLayerNormFwd, x.scalar_type(), out_dtype);
  TORCH_CHECK(k != nullptr, "fusedops metal: no LayerNorm kernel for ", x.scalar_type(), " -> ",
              out_dtype);
  const int64_t m = x.size(0), n = x.size(1);
  std::optional<at::Tensor> w, b;
  if (weight.has_value() && weight->defined()) {
    w = param_f32(weight, x, n, "weight");
  }
  if (bias.has_value() && bias->defined()) {
    b = param_f32(bias, x, n, "bias");
  }
  at::Tensor y = at::empty({m, n}, x.options().dtype(out_dtype));
  at::Tensor mean = at::empty({m}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({m}, x.options().dtype(at::kFloat));
  if (m == 0 || n == 0) {
    return {y, mean, rstd};
  }
  int64_t flags = (w ? kFlagWeight : 0) | (b ? kFlagBias : 0);
  if (aligned({&x, &y, w ? &*w : nullptr, b ? &*b : nullptr})) {
    flags |= kFlagVec;
  }
  auto [p, threads] = choose(*k, n);
  const at::Tensor none = empty_arg(x);
  encode(p,
         {Arg::Buf(x), Arg::Buf(w ? *w : none), Arg::Buf(b ? *b : none), Arg::Buf(y),
          Arg::Buf(mean), Arg::Buf(rstd), Arg::Int(m), Arg::Int(n), Arg::Int(x.stride(0)),
          Arg::Float(float(eps)), Arg::Int(flags)},
         row_groups(m), threads);
  return {y, mean, rstd};
}

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
layernorm_backward(const at::Tensor& dy, const at::Tensor& x,
                   const std::optional<at::Tensor>& weight, const at::Tensor& mean_in,
                   const at::Tensor& rstd_in, bool need_dx, bool need_dw, bool need_db) {
  check_rows(x, "x");
  check_rows(dy, "dy");
  check_same(x, dy, "dy");
  check_same(x, mean_in, "mean");
  check_same(x, rstd_in, "rstd");
  TORCH_CHECK(dy.sizes() == x.sizes(), "fusedops metal: dy has shape ", dy.sizes(),
              ", expected ", x.sizes());
  const int64_t m = x.size(0), n = x.size(1);
  TORCH_CHECK(mean_in.numel() == m && rstd_in.numel() == m, "fusedops metal: mean and rstd "
              "must have ", m, " elements");
  const RowKernels* k = row_kernels(kLayerNormBwd, x.scalar_type(), dy.scalar_type());
  TORCH_CHECK(k != nullptr, "fusedops metal: no LayerNorm backward kernel for x ",
              x.scalar_type(), ", dy ", dy.scalar_type());
  std::optional<at::Tensor> w;
  if (weight.has_value() && weight->defined()) {
    w = param_f32(weight, x, n, "weight");
  }
  const Pipeline* reduce = nullptr;
  if (need_dw || need_db) {
    reduce = Library::get().pipeline("fusedops_layernorm_dwdb_reduce");
    TORCH_CHECK(reduce != nullptr, "fusedops metal: missing fusedops_layernorm_dwdb_reduce");
  }
  const auto f32 = x.options().dtype(at::kFloat);
  std::optional<at::Tensor> dx, dw, db;
  if (need_dx) {
    dx = at::empty({m, n}, x.options());
  }
  if (need_dw) {
    dw = m == 0 ? at::zeros({n}, f32) : at::empty({n}, f32);
  }
  if (need_db) {
    db = m == 0 ? at::zeros({n}, f32) : at::empty({n}, f32);
  }
  if (m == 0 || n == 0 || !(need_dx || need_dw || need_db)) {
    return {dx, dw, db};
  }
  const at::Tensor mean = mean_in.reshape({-1}).to(at::kFloat).contiguous();
  const at::Tensor rstd = rstd_in.reshape({-1}).to(at::kFloat).contiguous();
  const int64_t groups = layernorm_bwd_groups(m, n);
  std::optional<at::Tensor> dwp, dbp;
  if (need_dw) {
    dwp = at::empty({groups, n}, f32);
  }
  if (need_db) {
    dbp = at::empty({groups, n}, f32);
  }
  int64_t flags = (w ? kFlagWeight : 0) | (need_dx ? kFlagDx : 0) | (need_dw ? kFlagDw : 0) |
                  (need_db ? kFlagDb : 0);
  if (aligned({&x, &dy, w ? &*w : nullptr, dx ? &*dx : nullptr})) {
    flags |= kFlagVec;
  }
  auto [p, threads] = choose(*k, n);
  const at::Tensor none = empty_arg(x);
  encode(p,
         {Arg::Buf(dy), Arg::Buf(x), Arg::Buf(w ? *w : none), Arg::Buf(mean), Arg::Buf(rstd),
          Arg::Buf(dx ? *dx : none), Arg::Buf(dwp ? *dwp : none), Arg::Buf(dbp ? *dbp : none),
          Arg::Int(m), Arg::Int(n), Arg::Int(dy.stride(0)), Arg::Int(x.stride(0)),
          Arg::Int(flags)},
         groups, threads);
  if (reduce != nullptr) {
    const int64_t rt = reduce_threads(reduce->max_threads);
    encode(reduce,
           {Arg::Buf(dwp ? *dwp : none), Arg::Buf(dbp ? *dbp : none),
            Arg::Buf(dw ? *dw : none), Arg::Buf(db ? *db : none), Arg::Int(groups), Arg::Int(n),
            Arg::Int(flags & (kFlagDw | kFlagDb))},
           (n + rt - 1) / rt, rt);
  }
  return {dx, dw, db};
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_forward(const at::Tensor& x,
                                                   const std::optional<at::Tensor>& weight,
                                                   double eps, at::ScalarType out_dtype) {
  check_rows(x, "x");
  TORCH_CHECK(type_index(out_dtype) >= 0, "fusedops metal: unsupported output dtype ", out_dtype);
  const RowKernels* k = row_kernels(kRmsNormFwd, x.scalar_type(), out_dtype);
  TORCH_CHECK(k != nullptr, "fusedops metal: no RMSNorm kernel for ", x.scalar_type(), " -> ",
              out_dtype);
  const int64_t m = x.size(0), n = x.size(1);
  std::optional<at::Tensor> w;
  if (weight.has_value() && weight->defined()) {
    w = param_f32(weight, x, n, "weight");
  }
  at::Tensor y = at::empty({m, n}, x.options().dtype(out_dtype));
  at::Tensor rstd = at::empty({m}, x.options().dtype(at::kFloat));
  if (m == 0 || n == 0) {
    return {y, rstd};
  }
  int64_t flags = w ? kFlagWeight : 0;
  if (aligned({&x, &y, w ? &*w : nullptr})) {
    flags |= kFlagVec;
  }
  auto [p, threads] = choose(*k, n);
  const at::Tensor none = empty_arg(x);
  encode(p,
         {Arg::Buf(x), Arg::Buf(w ? *w : none), Arg::Buf(y), Arg::Buf(rstd), Arg::Int(m),
          Arg::Int(n), Arg::Int(x.stride(0)), Arg::Float(float(eps)), Arg::Int(flags)},
         row_groups(m), threads);
  return {y, rstd};
}

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> rmsnorm_backward(
    const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const at::Tensor& rstd_in, bool need_dx, bool need_dw) {
  check_rows(x, "x");
  check_rows(dy, "dy");
  check_same(x, dy, "dy");
  check_same(x, rstd_in, "rstd");
  TORCH_CHECK(dy.sizes() == x.sizes(), "fusedops metal: dy has shape ", dy.sizes(),
              ", expected ", x.sizes());
  const int64_t m = x.size(0), n = x.size(1);
  TORCH_CHECK(rstd_in.numel() == m, "fusedops metal: rstd must have ", m, " elements");
  const RowKernels* k = row_kernels(kRmsNormBwd, x.scalar_type(), dy.scalar_type());
  TORCH_CHECK(k != nullptr, "fusedops metal: no RMSNorm backward kernel for x ",
              x.scalar_type(), ", dy ", dy.scalar_type());
  std::optional<at::Tensor> w;
  if (weight.has_value() && weight->defined()) {
    w = param_f32(weight, x, n, "weight");
  }
  // Stage 2 of dweight: the LayerNorm reduction kernel, dweight only.
  const Pipeline* reduce = nullptr;
  if (need_dw) {
    reduce = Library::get().pipeline("fusedops_layernorm_dwdb_reduce");
    TORCH_CHECK(reduce != nullptr, "fusedops metal: missing fusedops_layernorm_dwdb_reduce");
  }
  const auto f32 = x.options().dtype(at::kFloat);
  std::optional<at::Tensor> dx, dw;
  if (need_dx) {
    dx = at::empty({m, n}, x.options());
  }
  if (need_dw) {
    dw = m == 0 ? at::zeros({n}, f32) : at::empty({n}, f32);
  }
  if (m == 0 || n == 0 || !(need_dx || need_dw)) {
    return {dx, dw};
  }
  const at::Tensor rstd = rstd_in.reshape({-1}).to(at::kFloat).contiguous();
  const int64_t groups = layernorm_bwd_groups(m, n);
  std::optional<at::Tensor> dwp;
  if (need_dw) {
    dwp = at::empty({groups, n}, f32);
  }
  int64_t flags = (w ? kFlagWeight : 0) | (need_dx ? kFlagDx : 0) | (need_dw ? kFlagDw : 0);
  if (aligned({&x, &dy, w ? &*w : nullptr, dx ? &*dx : nullptr})) {
    flags |= kFlagVec;
  }
  auto [p, threads] = choose(*k, n);
  const at::Tensor none = empty_arg(x);
  encode(p,
         {Arg::Buf(dy), Arg::Buf(x), Arg::Buf(w ? *w : none), Arg::Buf(rstd),
          Arg::Buf(dx ? *dx : none), Arg::Buf(dwp ? *dwp : none), Arg::Int(m), Arg::Int(n),
          Arg::Int(dy.stride(0)), Arg::Int(x.stride(0)), Arg::Int(flags)},
         groups, threads);
  if (reduce != nullptr) {
    const int64_t rt = reduce_threads(reduce->max_threads);
    encode(reduce,
           {Arg::Buf(*dwp), Arg::Buf(none), Arg::Buf(*dw), Arg::Buf(none), Arg::Int(groups),
            Arg::Int(n), Arg::Int(kFlagDw)},
           (n + rt - 1) / rt, rt);
  }
  return {dx, dw};
}

// --- Masked softmax ------------------------------------------------------------------------------
// The kernel's mask type: "bool", x's type, or "float" (any other dtype, converted).
std::string mask_kind(const std::optional<at::Tensor>& mask, at::ScalarType x) {
  if (!mask.has_value() || !mask->defined() || mask->scalar_type() == at::kBool) {
    return "bool";  // without a mask: the bool kernel, kFlagMask off
  }
  const char* name = type_name(mask->scalar_type());
  return (name != nullptr && mask->scalar_type() == x) ? name : "float";
}

// `mask` converted to `dtype` without materialising its broadcast (stride-0) dims.
at::Tensor compact_to(const at::Tensor& mask, at::ScalarType dtype) {
  at::Tensor base = mask;
  for (int64_t d = 0; d < mask.dim(); ++d) {
    if (mask.stride(d) == 0 && mask.size(d) > 1) {
      base = base.narrow(d, 0, 1);
    }
  }
  return base.to(dtype).expand(mask.sizes());
}

at::Tensor rows_of(const at::Tensor& t) {
  return (t.size(1) <= 1 || t.stride(1) == 1) ? t : t.contiguous();
}

at::Tensor softmax_masked_forward(const at::Tensor& x, const std::optional<at::Tensor>& mask_in,
                                  double scale, bool causal, at::ScalarType out_dtype) {
  TORCH_CHECK(x.device().is_mps(), "fusedops metal: x must be an MPS tensor, got ", x.device());
  TORCH_CHECK(x.dim() == 4, "fusedops metal: x must be (B, H, Q, N), got ", x.dim(), "-D");
  TORCH_CHECK(type_index(x.scalar_type()) >= 0, "fusedops metal: x must be float32, float16 or "
              "bfloat16, got ", x.scalar_type());
  TORCH_CHECK(type_index(out_dtype) >= 0, "fusedops metal: unsupported output dtype ", out_dtype);
  TORCH_CHECK(x.size(3) < (int64_t(1) << 31), "fusedops metal: rows longer than 2^31");
  const bool has_mask = mask_in.has_value() && mask_in->defined();
  if (has_mask) {
    check_same(x, *mask_in, "mask");
    TORCH_CHECK(mask_in->scalar_type() == at::kBool || mask_in->is_floating_point(),
                "fusedops metal: mask must be bool or floating point, got ",
                mask_in->scalar_type());
  }
  const std::string kind = mask_kind(mask_in, x.scalar_type());
  const RowKernels* k = masked_fwd_kernels(x.scalar_type(), out_dtype, kind);
  TORCH_CHECK(k != nullptr, "fusedops metal: no masked softmax kernel for ", x.scalar_type(),
              " -> ", out_dtype, " with a ", kind, " mask");
  at::Tensor mk;
  std::array<int64_t, 4> st = {0, 0, 0, 0};
  int64_t flags = causal ? kFlagCausal : 0;
  if (has_mask) {
    mk = mask_in->expand(x.sizes());  // throws unless the mask broadcasts to x
    const at::ScalarType want =
        kind == "bool" ? at::kBool : (kind == "float" ? at::kFloat : x.scalar_type());
    if (mk.scalar_type() != want) {
      mk = compact_to(mk, want);
    }
    // A size-1 dim is only ever indexed at 0: its stride does not matter.
    for (int d = 0; d < 4; ++d) {
      st[d] = mk.size(d) == 1 ? 0 : mk.stride(d);
    }
    flags |= kFlagMask;
    if (st[3] == 1 && mk.storage_offset() % kReads == 0 && st[0] % kReads == 0 &&
        st[1] % kReads == 0 && st[2] % kReads == 0) {
      flags |= kFlagMaskVec;
    }
  }
  const int64_t heads = x.size(1), queries = x.size(2), n = x.size(3);
  const int64_t m = x.size(0) * heads * queries;
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_dtype));
  if (m == 0 || n == 0) {
    return y;
  }
  const at::Tensor x2 = rows_of(x.reshape({m, n}));
  const at::Tensor y2 = y.view({m, n});
  if (aligned({&x2, &y2})) {
    flags |= kFlagVec;
  }
  if (!has_mask) {
    mk = empty_arg(x);
  }
  auto [p, threads] = choose(*k, n);
  encode(p,
         {Arg::Buf(x2), Arg::Buf(mk), Arg::Buf(y2), Arg::Int(m), Arg::Int(n),
          Arg::Int(x2.stride(0)), Arg::Int(heads), Arg::Int(queries), Arg::Int(st[0]),
          Arg::Int(st[1]), Arg::Int(st[2]), Arg::Int(st[3]), Arg::Float(float(scale)),
          Arg::Int(flags)},
         row_groups(m), threads);
  return y;
}

at::Tensor softmax_masked_backward(const at::Tensor& y_in, const at::Tensor& dy_in, double scale,
                                   at::ScalarType out_dtype) {
  check_rows(y_in, "y");
  check_rows(dy_in, "dy");
  check_same(y_in, dy_in, "dy");
  TORCH_CHECK(dy_in.sizes() == y_in.sizes(), "fusedops metal: dy has shape ", dy_in.sizes(),
              ", expected ", y_in.sizes());
  TORCH_CHECK(type_index(out_dtype) >= 0, "fusedops metal: unsupported output dtype ", out_dtype);
  const RowKernels* k = row_kernels(kSoftmaxMaskedBwd, y_in.scalar_type(), out_dtype);
  TORCH_CHECK(k != nullptr, "fusedops metal: no masked softmax backward kernel for ",
              y_in.scalar_type(), " -> ", out_dtype);
  const int64_t m = y_in.size(0), n = y_in.size(1);
  at::Tensor dx = at::empty({m, n}, y_in.options().dtype(out_dtype));
  if (m == 0 || n == 0) {
    return dx;
  }
  const at::Tensor y = y_in;
  const at::Tensor dy = dy_in.scalar_type() == y.scalar_type() ? dy_in : dy_in.to(y.scalar_type());
  auto [p, threads] = choose(*k, n);
  const int64_t flags = aligned({&y, &dy, &dx}) ? kFlagVec : 0;
  encode(p,
         {Arg::Buf(y), Arg::Buf(dy), Arg::Buf(dx), Arg::Int(m), Arg::Int(n),
          Arg::Int(y.stride(0)), Arg::Int(dy.stride(0)), Arg::Float(float(scale)),
          Arg::Int(flags)},
         row_groups(m), threads);
  return dx;
}

// --- LayerNorm epilogue --------------------------------------------------------------------------
struct Epilogue {
  int64_t flags = 0;      // kFlagDropout, kFlagRelu, kFlagGelu
  int64_t threshold = 0;  // keep an element when its Philox number is >= this
  float keep_scale = 1.0f;
};

// fusedops/_philox.py dropout_threshold and the activation flag.
Epilogue epilogue_of(double dropout_p, const std::optional<std::string>& activation) {
  Epilogue e;
  if (activation.has_value()) {
    TORCH_CHECK(*activation == "relu" || *activation == "gelu",
                "fusedops metal: activation must be None, 'relu' or 'gelu', got ", *activation);
    e.flags |= *activation == "relu" ? kFlagRelu : kFlagGelu;
  }
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0,
              "fusedops metal: dropout_p must be in [0, 1) here, got ", dropout_p);
  if (dropout_p != 0.0) {
    e.flags |= kFlagDropout;
    e.threshold = std::min<int64_t>(int64_t(dropout_p * 4294967296.0), int64_t(0xffffffff));
    e.keep_scale = float(1.0 / (1.0 - dropout_p));
  }
  return e;
}

std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>,
           std::optional<at::Tensor>>
layernorm_epilogue_forward(const at::Tensor& x_in, const std::optional<at::Tensor>& residual_in,
                           const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, double eps,
                           at::ScalarType out_dtype, double dropout_p, int64_t seed,
                           const std::optional<std::string>& activation, bool need_stats) {
  check_rows(x_in, "x");
  TORCH_CHECK(type_index(out_dtype) >= 0, "fusedops metal: unsupported output dtype ", out_dtype);
  const bool has_r = residual_in.has_value() && residual_in->defined();
  if (has_r) {
    check_rows(*residual_in, "residual");
    check_same(x_in, *residual_in, "residual");
    TORCH_CHECK(residual_in->sizes() == x_in.sizes() &&
                    residual_in->scalar_type() == x_in.scalar_type(),
                "fusedops metal: residual must have x's shape and dtype");
  }
  const Epilogue e = epilogue_of(dropout_p, activation);
  const RowKernels* k = row_kernels(kLayerNormEpilogueFwd, x_in.scalar_type(), out_dtype);
  TORCH_CHECK(k != nullptr, "fusedops metal: no LayerNorm epilogue kernel for ",
              x_in.scalar_type(), " -> ", out_dtype);
  const int64_t m = x_in.size(0), n = x_in.size(1);
  std::optional<at::Tensor> w, b, s, mean, rstd;
  if (weight.has_value() && weight->defined()) {
    w = param_f32(weight, x_in, n, "weight");
  }
  if (bias.has_value() && bias->defined()) {
    b = param_f32(bias, x_in, n, "bias");
  }
  at::Tensor out = at::empty({m, n}, x_in.options().dtype(out_dtype));
  if (has_r) {
    s = at::empty({m, n}, x_in.options());
  }
  if (need_stats) {
    // The statistics of empty rows are NaN, as the reference's.
    const auto f32 = x_in.options().dtype(at::kFloat);
    mean = n == 0 ? at::full({m}, NAN, f32) : at::empty({m}, f32);
    rstd = n == 0 ? at::full({m}, NAN, f32) : at::empty({m}, f32);
  }
  if (m == 0 || n == 0) {
    return {out, s, mean, rstd};
  }
  const at::Tensor x = rows_of(x_in);
  const at::Tensor r = has_r ? rows_of(*residual_in) : empty_arg(x_in);
  int64_t flags = e.flags | (w ? kFlagWeight : 0) | (b ? kFlagBias : 0) |
                  (has_r ? kFlagAdd : 0) | (need_stats ? kFlagStats : 0);
  auto [p, threads, philox] = choose_epilogue(*k, n, (e.flags & kFlagDropout) != 0);
  if (philox) {
    flags |= kFlagPhilox;
  } else if (aligned({&x, &out, has_r ? &r : nullptr, s ? &*s : nullptr, w ? &*w : nullptr,
                      b ? &*b : nullptr})) {
    flags |= kFlagVec;
  }
  const at::Tensor none = empty_arg(x_in);
  encode(p,
         {Arg::Buf(x), Arg::Buf(r), Arg::Buf(w ? *w : none), Arg::Buf(b ? *b : none),
          Arg::Buf(out), Arg::Buf(s ? *s : none), Arg::Buf(mean ? *mean : none),
          Arg::Buf(rstd ? *rstd : none), Arg::Int(m), Arg::Int(n), Arg::Int(x.stride(0)),
          Arg::Int(has_r ? r.stride(0) : 0), Arg::Float(float(eps)), Arg::Int(seed),
          Arg::Int(e.threshold), Arg::Float(e.keep_scale), Arg::Int(flags)},
         row_groups(m), threads);
  return {out, s, mean, rstd};
}

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
layernorm_epilogue_backward(const at::Tensor& dout_in, const std::optional<at::Tensor>& ds_in,
                            const at::Tensor& s_in, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& mean_in,
                            const at::Tensor& rstd_in, double dropout_p, int64_t seed,
                            const std::optional<std::string>& activation, bool need_dx,
                            bool need_dw, bool need_db) {
  check_rows(s_in, "s");
  check_rows(dout_in, "dout");
  check_same(s_in, dout_in, "dout");
  check_same(s_in, mean_in, "mean");
  check_same(s_in, rstd_in, "rstd");
  TORCH_CHECK(dout_in.sizes() == s_in.sizes(), "fusedops metal: dout has shape ",
              dout_in.sizes(), ", expected ", s_in.sizes());
  const int64_t m = s_in.size(0), n = s_in.size(1);
  TORCH_CHECK(mean_in.numel() == m && rstd_in.numel() == m, "fusedops metal: mean and rstd "
              "must have ", m, " elements");
  const bool has_ds = need_dx && ds_in.has_value() && ds_in->defined();
  if (has_ds) {
    check_rows(*ds_in, "ds");
    check_same(s_in, *ds_in, "ds");
    TORCH_CHECK(ds_in->sizes() == s_in.sizes(), "fusedops metal: ds has shape ",
                ds_in->sizes(), ", expected ", s_in.sizes());
  }
  const Epilogue e = epilogue_of(dropout_p, activation);
  const RowKernels* k = row_kernels(kLayerNormEpilogueBwd, s_in.scalar_type(),
                                    dout_in.scalar_type());
  TORCH_CHECK(k != nullptr, "fusedops metal: no LayerNorm epilogue backward kernel for s ",
              s_in.scalar_type(), ", dout ", dout_in.scalar_type());
  std::optional<at::Tensor> w, b;
  if (weight.has_value() && weight->defined()) {
    w = param_f32(weight, s_in, n, "weight");
  }
  // The bias only enters through the activation's input.
  if ((e.flags & (kFlagRelu | kFlagGelu)) != 0 && bias.has_value() && bias->defined()) {
    b = param_f32(bias, s_in, n, "bias");
  }
  const Pipeline* reduce = nullptr;
  if (need_dw || need_db) {
    reduce = Library::get().pipeline("fusedops_layernorm_dwdb_reduce");
    TORCH_CHECK(reduce != nullptr, "fusedops metal: missing fusedops_layernorm_dwdb_reduce");
  }
  const auto f32 = s_in.options().dtype(at::kFloat);
  std::optional<at::Tensor> dx, dw, db;
  if (need_dx) {
    dx = at::empty({m, n}, s_in.options());
  }
  if (need_dw) {
    dw = m == 0 ? at::zeros({n}, f32) : at::empty({n}, f32);
  }
  if (need_db) {
    db = m == 0 ? at::zeros({n}, f32) : at::empty({n}, f32);
  }
  if (m == 0 || n == 0 || !(need_dx || need_dw || need_db)) {
    return {dx, dw, db};
  }
  const at::Tensor s = rows_of(s_in);
  const at::Tensor dout = rows_of(dout_in);
  const at::Tensor ds =
      has_ds ? rows_of(ds_in->scalar_type() == s.scalar_type() ? *ds_in
                                                                : ds_in->to(s.scalar_type()))
             : empty_arg(s_in);
  const at::Tensor mean = mean_in.reshape({-1}).to(at::kFloat).contiguous();
  const at::Tensor rstd = rstd_in.reshape({-1}).to(at::kFloat).contiguous();
  const int64_t groups = layernorm_bwd_groups(m, n);
  std::optional<at::Tensor> dwp, dbp;
  if (need_dw) {
    dwp = at::empty({groups, n}, f32);
  }
  if (need_db) {
    dbp = at::empty({groups, n}, f32);
  }
  int64_t flags = e.flags | (w ? kFlagWeight : 0) | (b ? kFlagBias : 0) |
                  (has_ds ? kFlagAdd : 0) | (need_dx ? kFlagDx : 0) | (need_dw ? kFlagDw : 0) |
                  (need_db ? kFlagDb : 0);
  auto [p, threads, philox] = choose_epilogue(*k, n, (e.flags & kFlagDropout) != 0);
  if (philox) {
    flags |= kFlagPhilox;
  } else if (aligned({&s, &dout, has_ds ? &ds : nullptr, w ? &*w : nullptr, b ? &*b : nullptr,
                      dx ? &*dx : nullptr})) {
    flags |= kFlagVec;
  }
  const at::Tensor none = empty_arg(s_in);
  encode(p,
         {Arg::Buf(dout), Arg::Buf(ds), Arg::Buf(s), Arg::Buf(w ? *w : none),
          Arg::Buf(b ? *b : none), Arg::Buf(mean), Arg::Buf(rstd), Arg::Buf(dx ? *dx : none),
          Arg::Buf(dwp ? *dwp : none), Arg::Buf(dbp ? *dbp : none), Arg::Int(m), Arg::Int(n),
          Arg::Int(dout.stride(0)), Arg::Int(has_ds ? ds.stride(0) : 0), Arg::Int(s.stride(0)),
          Arg::Int(seed), Arg::Int(e.threshold), Arg::Float(e.keep_scale), Arg::Int(flags)},
         groups, threads);
  if (reduce != nullptr) {
    const int64_t rt = reduce_threads(reduce->max_threads);
    encode(reduce,
           {Arg::Buf(dwp ? *dwp : none), Arg::Buf(dbp ? *dbp : none),
            Arg::Buf(dw ? *dw : none), Arg::Buf(db ? *db : none), Arg::Int(groups), Arg::Int(n),
            Arg::Int(flags & (kFlagDw | kFlagDb))},
           (n + rt - 1) / rt, rt);
  }
  return {dx, dw, db};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fusedops Metal kernels (softmax, LayerNorm, RMSNorm, masked softmax, LayerNorm "
          "epilogue) on PyTorch's MPS stream";
  m.def("initialize", [] { Library::get().ensure_compiled(); },
        "Compile the embedded shaders (once); raises if Metal rejects them.");
  m.def("kernel_names", [] { return Library::get().function_names(); },
        "Names of the kernels in the compiled library.");
  m.def("source_sha256", [] { return std::string(kFusedopsMetalSourceSha256); });
  m.def("constants", [] {
    return std::map<std::string, int64_t>{
        {"SIMD_WIDTH", kSimdWidth},
        {"READS", kReads},
        {"MAX_THREADS", kMaxThreads},
        {"MAX_ROW_GROUPS", kMaxRowGroups},
        {"LN_BWD_PARTIAL_BUDGET", kLnBwdPartialBudget},
        {"LN_BWD_MIN_GROUPS", kLnBwdMinGroups},
        {"LN_BWD_MAX_GROUPS", kLnBwdMaxGroups},
        {"REDUCE_THREADS", kReduceThreads},
        {"FLAG_VEC", kFlagVec},
        {"FLAG_WEIGHT", kFlagWeight},
        {"FLAG_BIAS", kFlagBias},
        {"FLAG_DX", kFlagDx},
        {"FLAG_DW", kFlagDw},
        {"FLAG_DB", kFlagDb},
        {"FLAG_MASK", kFlagMask},
        {"FLAG_MASK_VEC", kFlagMaskVec},
        {"FLAG_CAUSAL", kFlagCausal},
        {"FLAG_ADD", kFlagAdd},
        {"FLAG_DROPOUT", kFlagDropout},
        {"FLAG_RELU", kFlagRelu},
        {"FLAG_GELU", kFlagGelu},
        {"FLAG_STATS", kFlagStats},
        {"FLAG_PHILOX", kFlagPhilox},
        {"PHILOX_W", kPhiloxW},
    };
  });
  m.def("softmax_forward", &softmax_forward, py::arg("x"), py::arg("out_dtype"));
  m.def("softmax_backward", &softmax_backward, py::arg("y"), py::arg("dy"), py::arg("out_dtype"));
  m.def("layernorm_forward", &layernorm_forward, py::arg("x"), py::arg("weight"),
        py::arg("bias"), py::arg("eps"), py::arg("out_dtype"));
  m.def("layernorm_backward", &layernorm_backward, py::arg("dy"), py::arg("x"),
        py::arg("weight"), py::arg("mean"), py::arg("rstd"), py::arg("need_dx"),
        py::arg("need_dw"), py::arg("need_db"));
  m.def("rmsnorm_forward", &rmsnorm_forward, py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::arg("out_dtype"));
  m.def("rmsnorm_backward", &rmsnorm_backward, py::arg("dy"), py::arg("x"), py::arg("weight"),
        py::arg("rstd"), py::arg("need_dx"), py::arg("need_dw"));
  m.def("softmax_masked_forward", &softmax_masked_forward, py::arg("x"), py::arg("mask"),
        py::arg("scale"), py::arg("causal"), py::arg("out_dtype"));
  m.def("softmax_masked_backward", &softmax_masked_backward, py::arg("y"), py::arg("dy"),
        py::arg("scale"), py::arg("out_dtype"));
  m.def("layernorm_epilogue_forward", &layernorm_epilogue_forward, py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("bias"), py::arg("eps"),
        py::arg("out_dtype"), py::arg("dropout_p"), py::arg("seed"), py::arg("activation"),
        py::arg("need_stats"));
  m.def("layernorm_epilogue_backward", &layernorm_epilogue_backward, py::arg("dout"),
        py::arg("ds"), py::arg("s"), py::arg("weight"), py::arg("bias"), py::arg("mean"),
        py::arg("rstd"), py::arg("dropout_p"), py::arg("seed"), py::arg("activation"),
        py::arg("need_dx"), py::arg("need_dw"), py::arg("need_db"));
}
