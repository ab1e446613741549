// A generic replayed op behind a C++ autograd node: forward and backward launch recorded
// plans (replay.cpp), so a training call's backward never calls into Python.
//
// A spec describes one call signature of one op (made by fusedops/backends/triton/nodes.py):
// up to three inputs (x, then optional parameters) with what the plans were recorded for
// (presence, shape, dtype, 16-byte alignment, requires_grad); the forward's new tensors
// (the output first), whose slots follow the inputs'; which slots the backward keeps; the
// backward's new tensors, whose slots follow (dy, kept...); and, per input, which backward
// tensor is its gradient, in what dtype and shape. The entry refuses (returns None) any
// call whose tensors differ from the recorded ones, and the caller takes its Python path.

#include "plans.h"

#include <torch/csrc/autograd/custom_function.h>

#include <mutex>
#include <optional>
#include <vector>

namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr size_t kMaxInputs = 3;
constexpr size_t kMaxSlots = 16;

struct Input {
  bool present;
  std::vector<int64_t> shape;
  c10::ScalarType dtype;
  int64_t align;
  bool requires_grad;
};

struct Made {  // a new tensor; absent (address 0) where `present` is false
  bool present;
  std::vector<int64_t> shape;
  c10::ScalarType dtype;
};

struct Grad {  // input i's gradient: backward tensor `from` (-1: none) as `dtype`, `shape`
  int64_t from;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
};

struct Spec {
  int64_t fwd, bwd;
  std::vector<Input> inputs;
  std::vector<Made> fwd_made;  // [0]: the output
  std::vector<int64_t> kept;   // forward slots the backward reads
  std::vector<Made> bwd_made;
  std::vector<Grad> grads;     // one per input
  // create_graph=True: a Python callable (dy, kept, needs) -> gradients per input, in
  // differentiable torch ops; never released (specs live as long as the process).
  PyObject* differentiable;
};

constexpr size_t kMaxSpecs = 1 << 16;
std::vector<Spec> specs = fusedops_host::reserved_table<Spec>(kMaxSpecs);
std::mutex specs_mutex;

std::vector<Tensor> allocate(const std::vector<Made>& made, const Tensor& like,
                             uint64_t* ptrs) {
  std::vector<Tensor> out;
  out.reserve(made.size());
  for (size_t j = 0; j < made.size(); ++j) {
    const Made& m = made[j];
    out.push_back(m.present ? at::empty(m.shape, like.options().dtype(m.dtype)) : Tensor());
    ptrs[j] = fusedops_host::address(out.back());
  }
  return out;
}

// The backward under create_graph=True: the spec's Python callable, given dy, the kept tensors
// and which inputs need a gradient (absent ones: False), returns each input's gradient.
variable_list differentiable_backward(AutogradContext* ctx, const Spec& s,
                                      const std::vector<Tensor>& kept, const Tensor& dy) {
  TORCH_CHECK(s.differentiable != nullptr,
              "fusedops._host_ext: this op's backward is not differentiable (create_graph=True)");
  std::vector<bool> needs;
  size_t edge = 0;
  for (const Input& in : s.inputs) needs.push_back(in.present && ctx->needs_input_grad(edge++));
  pybind11::gil_scoped_acquire gil;
  const auto fn = pybind11::reinterpret_borrow<pybind11::object>(s.differentiable);
  const auto got = fn(dy, kept, needs).cast<std::vector<std::optional<Tensor>>>();
  TORCH_CHECK(got.size() == s.inputs.size(), "fusedops._host_ext: one gradient per input");
  variable_list out(kMaxInputs + 1);
  for (size_t i = 0; i < got.size(); ++i) {
    if (needs[i] && got[i].has_value()) out[i] = *got[i];
  }
  return out;
}

struct ReplayNode : public torch::autograd::Function<ReplayNode> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& a,
                        const std::optional<Tensor>& b, int64_t handle) {
    const Spec& s = specs[handle];
    const size_t n_in = s.inputs.size();
    const Tensor in[kMaxInputs] = {x, a.has_value() ? *a : Tensor(),
                                   b.has_value() ? *b : Tensor()};
    uint64_t ptrs[kMaxSlots] = {};
    for (size_t i = 0; i < n_in; ++i) ptrs[i] = fusedops_host::address(in[i]);
    std::vector<Tensor> made = allocate(s.fwd_made, x, ptrs + n_in);
    fusedops_host::run_plan(s.fwd, ptrs, x);
    std::vector<Tensor> kept;
    kept.reserve(s.kept.size());
    for (int64_t k : s.kept) {
      kept.push_back(k < static_cast<int64_t>(n_in) ? in[k] : made[k - n_in]);
    }
    ctx->save_for_backward(kept);
    ctx->saved_data["h"] = handle;
    return made[0];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Spec& s = specs[ctx->saved_data["h"].toInt()];
    const std::vector<Tensor> kept = ctx->get_saved_variables();
    if (at::GradMode::is_enabled()) return differentiable_backward(ctx, s, kept, grads[0]);
    const Made& y = s.fwd_made[0];
    Tensor dy = grads[0];
    // The plan was recorded for a contiguous, 16-byte aligned dy of y's dtype and shape.
    if (!dy.is_contiguous() || (fusedops_host::address(dy) & 15) != 0 ||
        dy.scalar_type() != y.dtype || dy.sizes() != c10::IntArrayRef(y.shape)) {
      dy = at::empty(y.shape, dy.options().dtype(y.dtype)).copy_(dy);
    }
    uint64_t ptrs[kMaxSlots] = {};
    ptrs[0] = fusedops_host::address(dy);
    for (size_t k = 0; k < kept.size(); ++k) ptrs[1 + k] = fusedops_host::address(kept[k]);
    std::vector<Tensor> made = allocate(s.bwd_made, dy, ptrs + 1 + kept.size());
    fusedops_host::run_plan(s.bwd, ptrs, dy);
    variable_list out(kMaxInputs + 1);  // one per forward argument
    size_t edge = 0;  // autograd's edges: the present inputs only
    for (size_t i = 0; i < s.grads.size(); ++i) {
      if (!s.inputs[i].present) continue;
      const Grad& g = s.grads[i];
      const bool needed = ctx->needs_input_grad(edge++);
      if (g.from < 0 || !needed) continue;
      Tensor t = made[g.from];
      if (t.scalar_type() != g.dtype) t = t.to(g.dtype);
      out[i] = t.view(g.shape);
    }
    return out;
  }
};

bool matches(const Input& want, const std::optional<Tensor>& t, const Tensor& x) {
  if (!t.has_value() || !t->defined()) return !want.present;
  return want.present && t->scalar_type() == want.dtype && t->is_contiguous() &&
         static_cast<int64_t>(fusedops_host::address(*t) & 15) == want.align &&
         t->requires_grad() == want.requires_grad && t->sizes() == c10::IntArrayRef(want.shape) &&
         t->device() == x.device() && !t->key_set().has(c10::DispatchKey::Python);
}

// The autograd entry: y with a ReplayNode, or None (an undefined tensor) where the call's
// tensors are not those the plans were recorded for, or autograd is off.
Tensor node(int64_t handle, const Tensor& x, const std::optional<Tensor>& a,
            const std::optional<Tensor>& b) {
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(specs.size()),
              "fusedops._host_ext: no node ", handle);
  const Spec& s = specs[handle];
  if (!at::GradMode::is_enabled() || !matches(s.inputs[0], x, x) ||
      (s.inputs.size() > 1 && !matches(s.inputs[1], a, x)) ||
      (s.inputs.size() > 2 && !matches(s.inputs[2], b, x))) {
    return Tensor();
  }
  return ReplayNode::apply(x, a, b, handle);
}

c10::ScalarType scalar_type(int64_t code) {
  TORCH_CHECK(code >= 0 && code < static_cast<int64_t>(c10::ScalarType::NumOptions),
              "fusedops._host_ext: no dtype ", code);
  return static_cast<c10::ScalarType>(code);
}

using MadeArg = std::tuple<bool, std::vector<int64_t>, int64_t>;

std::vector<Made> made_list(const std::vector<MadeArg>& args) {
  std::vector<Made> out;
  for (const auto& [present, shape, dtype] : args) {
    out.push_back({present, shape, scalar_type(dtype)});
  }
  return out;
}

// inputs: [(present, shape, dtype, align, requires_grad)]; fwd_made, bwd_made:
// [(present, shape, dtype)]; kept: forward slots; grads: [(from, dtype, shape)] per input.
// Dtypes are c10::ScalarType codes. differentiable: None, or the backward under
// create_graph=True (see differentiable_backward). Returns the handle, -1 where the table is
// full.
int64_t make_node(
    int64_t fwd, int64_t bwd,
    const std::vector<std::tuple<bool, std::vector<int64_t>, int64_t, int64_t, bool>>& inputs,
    const std::vector<MadeArg>& fwd_made, const std::vector<int64_t>& kept,
    const std::vector<MadeArg>& bwd_made,
    const std::vector<std::tuple<int64_t, int64_t, std::vector<int64_t>>>& grads,
    const pybind11::object& differentiable) {
  TORCH_CHECK(fusedops_host::plan_exists(fwd) && fusedops_host::plan_exists(bwd),
              "fusedops._host_ext: a node needs two registered plans");
  TORCH_CHECK(!inputs.empty() && inputs.size() <= kMaxInputs && grads.size() == inputs.size(),
              "fusedops._host_ext: one to three inputs, one gradient entry each");
  TORCH_CHECK(!fwd_made.empty() && std::get<0>(fwd_made[0]),
              "fusedops._host_ext: the forward makes its output first");
  TORCH_CHECK(inputs.size() + fwd_made.size() <= kMaxSlots &&
                  1 + kept.size() + bwd_made.size() <= kMaxSlots,
              "fusedops._host_ext: more than 16 slots");
  Spec s{fwd, bwd, {}, made_list(fwd_made), kept, made_list(bwd_made), {}, nullptr};
  for (const auto& [present, shape, dtype, align, rg] : inputs) {
    s.inputs.push_back({present, shape, scalar_type(dtype), align, rg});
  }
  for (int64_t k : kept) {
    TORCH_CHECK(k >= 0 && k < static_cast<int64_t>(inputs.size() + fwd_made.size()),
                "fusedops._host_ext: kept slot out of range");
  }
  for (const auto& [from, dtype, shape] : grads) {
    TORCH_CHECK(from < static_cast<int64_t>(bwd_made.size()) &&
                    (from < 0 || std::get<0>(bwd_made[from])),
                "fusedops._host_ext: a gradient names a tensor the backward does not make");
    s.grads.push_back({from, scalar_type(dtype), shape});
  }
  std::lock_guard<std::mutex> lock(specs_mutex);
  if (specs.size() >= kMaxSpecs) return -1;
  if (!differentiable.is_none()) s.differentiable = differentiable.inc_ref().ptr();
  specs.push_back(std::move(s));
  return static_cast<int64_t>(specs.size() - 1);
}

}  // namespace

namespace fusedops_host {

void register_nodes(pybind11::module& m) {
  m.def("make_node", &make_node, "Register a replayed op's spec; returns its handle");
  m.def("node", &node,
        "Run a registered replayed op on (x, a, b) behind a C++ autograd node (None: refused)");
}

}  // namespace fusedops_host
