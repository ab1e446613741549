// fusedops._host_ext: replayed Triton launches behind a C++ autograd node.
//
// A call signature that ran before has a recorded launch sequence (fusedops' replay plans):
// per launch, the compiled kernel's CUfunction, grid, block, shared memory and arguments,
// pointers given as (tensor slot, byte offset) and scalars as their bits. This extension holds
// such plans and launches them through the CUDA driver (cuLaunchKernel, resolved from
// libcuda at first use), and runs the attention softmax's forward and backward as a
// torch::autograd::Function, so a training step's backward never calls into Python.
// Which plans reach it, and the measurements behind it: docs/design.md, "Host path".

#include "plans.h"

#include <dlfcn.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#ifdef FUSEDOPS_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// CUresult cuLaunchKernel(CUfunction, gx, gy, gz, bx, by, bz, shmem, CUstream, params, extra)
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void*, void**, void**);

struct Arg {
  int32_t slot;     // >= 0: the pointer of tensor `slot` plus `bits`; -1: the scalar `bits`
  uint64_t bits;
};

struct Step {
  uint64_t function;
  unsigned grid[3];
  unsigned block;
  unsigned shared;
  std::vector<Arg> args;
};

using Plan = std::vector<Step>;

// Plans live as long as the process.
constexpr size_t kMaxPlans = 1 << 16;
std::vector<Plan> plans = fusedops_host::reserved_table<Plan>(kMaxPlans);
std::mutex plans_mutex;

bool dry_run = false;  // tests: record launches instead of making them
std::vector<std::vector<uint64_t>> dry_log;

LaunchFn driver_launch() {
  static LaunchFn fn = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    TORCH_CHECK(lib != nullptr, "fusedops._host_ext: libcuda.so.1 is not loadable");
    auto sym = reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
    TORCH_CHECK(sym != nullptr, "fusedops._host_ext: cuLaunchKernel not found in libcuda");
    return sym;
  }();
  return fn;
}

void* current_stream(const Tensor& t) {
#ifdef FUSEDOPS_WITH_CUDA
  return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
#else
  (void)t;
  TORCH_CHECK(false, "fusedops._host_ext was built without CUDA");
#endif
}

}  // namespace

namespace fusedops_host {

bool plan_exists(int64_t handle) {
  return handle >= 0 && handle < static_cast<int64_t>(plans.size());
}

void run_plan(int64_t handle, const uint64_t* ptrs, const Tensor& on) {
  const Plan& plan = plans[handle];
  // The kernels were loaded in the tensor's device's context: make it current.
  const c10::DeviceGuard guard(on.device());
  void* stream = dry_run ? nullptr : current_stream(on);
  for (const Step& step : plan) {
    const size_t n = step.args.size();
    uint64_t values[32];
    void* params[32];
    TORCH_CHECK(n <= 32, "fusedops._host_ext: more than 32 kernel parameters");
    for (size_t i = 0; i < n; ++i) {
      const Arg& a = step.args[i];
      values[i] = a.slot < 0 ? a.bits : ptrs[a.slot] + a.bits;
      params[i] = &values[i];
    }
    if (dry_run) {
      std::vector<uint64_t> entry = {step.function, step.grid[0], step.grid[1], step.grid[2],
                                     step.block, step.shared};
      entry.insert(entry.end(), values, values + n);
      dry_log.push_back(std::move(entry));
      continue;
    }
    int err = driver_launch()(reinterpret_cast<void*>(step.function), step.grid[0],
                              step.grid[1], step.grid[2], step.block, 1, 1, step.shared,
                              stream, params, nullptr);
    TORCH_CHECK(err == 0, "fusedops._host_ext: cuLaunchKernel failed with CUresult ", err);
  }
}

}  // namespace fusedops_host

namespace {

using fusedops_host::address;
using fusedops_host::run_plan;

// softmax(x * scale + mask) through recorded plans: the forward plan takes slots
// (x, mask, y), the backward plan (y, dy, dx); scale and the rest are in the plans.
struct MaskedSoftmax : public torch::autograd::Function<MaskedSoftmax> {
  // (The mask as an optional: never a differentiable input, and it may be absent.)
  static Tensor forward(AutogradContext* ctx, const Tensor& x,
                        const std::optional<Tensor>& mask, int64_t fwd, int64_t bwd,
                        double scale) {
    Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
    const uint64_t ptrs[3] = {address(x), mask.has_value() ? address(*mask) : 0, address(y)};
    run_plan(fwd, ptrs, x);
    ctx->save_for_backward({y});
    ctx->saved_data["bwd"] = bwd;
    ctx->saved_data["scale"] = scale;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Tensor y = ctx->get_saved_variables()[0];
    Tensor dy = grads[0];
    if (at::GradMode::is_enabled()) {
      // create_graph=True: dx = scale * y * (dy - sum(dy * y)) in ATen ops on the saved
      // output, so second derivatives see y (as the Python Function's backward does).
      const auto acc = y.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
      const Tensor yf = y.to(acc), dyf = dy.to(acc);
      const Tensor dz = yf * (dyf - (dyf * yf).sum(-1, /*keepdim=*/true));
      return {(dz * ctx->saved_data["scale"].toDouble()).to(y.scalar_type()), Tensor(),
              Tensor(), Tensor(), Tensor()};
    }
    // The plan was recorded for a contiguous, 16-byte aligned dy of y's dtype.
    if (!dy.is_contiguous() || (address(dy) & 15) != 0 || dy.scalar_type() != y.scalar_type()) {
      dy = at::empty_like(y, at::MemoryFormat::Contiguous).copy_(dy);
    }
    Tensor dx = at::empty_like(y, at::MemoryFormat::Contiguous);
    const uint64_t ptrs[3] = {address(y), address(dy), address(dx)};
    run_plan(ctx->saved_data["bwd"].toInt(), ptrs, y);
    return {dx, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// The autograd entry: None (an undefined tensor) where the tensors are not what the plans
// were recorded for (x not contiguous, an address at another 16-byte alignment, the mask on
// another device), and the caller takes its general path.
// (Plan arguments first: Python binds them once with functools.partial. `scale` is the one
// the plans were recorded with, for a backward that must be differentiable.)
Tensor masked_softmax(int64_t fwd, int64_t bwd, int64_t x_align, int64_t mask_align,
                      double scale, const Tensor& x, const std::optional<Tensor>& mask) {
  if (!x.is_contiguous() || static_cast<int64_t>(address(x) & 15) != x_align) return Tensor();
  if (mask.has_value() && (static_cast<int64_t>(address(*mask) & 15) != mask_align ||
                          mask->device() != x.device())) {
    return Tensor();
  }
  return MaskedSoftmax::apply(x, mask, fwd, bwd, scale);
}

// steps: [(function, (gx, gy, gz), block, shared, [(slot, bits), ...]), ...]
int64_t make_plan(const std::vector<std::tuple<uint64_t, std::vector<int64_t>, int64_t, int64_t,
                                               std::vector<std::tuple<int64_t, uint64_t>>>>&
                      steps) {
  Plan plan;
  for (const auto& [function, grid, block, shared, args] : steps) {
    TORCH_CHECK(grid.size() == 3, "fusedops._host_ext: a grid has three dimensions");
    TORCH_CHECK(args.size() <= 32, "fusedops._host_ext: more than 32 kernel parameters");
    Step s{function, {static_cast<unsigned>(grid[0]), static_cast<unsigned>(grid[1]),
                      static_cast<unsigned>(grid[2])},
           static_cast<unsigned>(block), static_cast<unsigned>(shared), {}};
    for (const auto& [slot, bits] : args) {
      s.args.push_back({static_cast<int32_t>(slot), bits});
    }
    plan.push_back(std::move(s));
  }
  std::lock_guard<std::mutex> lock(plans_mutex);
  if (plans.size() >= kMaxPlans) return -1;  // the caller keeps its Python path
  plans.push_back(std::move(plan));
  return static_cast<int64_t>(plans.size() - 1);
}

// Launch a plan with these tensors in its slots (None: address 0); for tests and tools.
void run(int64_t handle, const std::vector<std::optional<Tensor>>& tensors) {
  TORCH_CHECK(fusedops_host::plan_exists(handle), "fusedops._host_ext: no plan ", handle);
  TORCH_CHECK(!tensors.empty() && tensors[0].has_value(), "the first slot must hold a tensor");
  std::vector<uint64_t> ptrs;
  for (const auto& t : tensors) ptrs.push_back(t.has_value() ? address(*t) : 0);
  run_plan(handle, ptrs.data(), *tensors[0]);
}

void set_dry_run(bool on) {
  dry_run = on;
  dry_log.clear();
}

std::vector<std::vector<uint64_t>> take_dry_log() {
  auto out = std::move(dry_log);
  dry_log.clear();
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fusedops' C++ host path: replayed Triton launches behind autograd nodes";
  m.def("make_plan", &make_plan, "Register a launch plan; returns its handle");
  m.def("run", &run, "Launch a plan with the given tensors in its slots");
  m.def("masked_softmax", &masked_softmax,
        "softmax(x * scale + mask) from its forward and backward plans (None: not applicable)");
  fusedops_host::register_nodes(m);
  fusedops_host::register_routes(m);
  m.def("set_dry_run", &set_dry_run, "Tests: record launches instead of making them");
  m.def("take_dry_log", &take_dry_log, "Tests: the launches recorded since set_dry_run");
#ifdef FUSEDOPS_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
}
