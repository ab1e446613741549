// Routed calls: a public call below its op's size rule is torch's own op, reached from C++.
//
// fusedops.ops._route hands the entry points below to the public ops, which call them first.
// Each returns torch's result for a plain call (exact torch.Tensor arguments or parameters, no
// __torch_function__ mode, arguments torch reads as given, the size below the rule that
// fusedops._dispatch.SIZE_RULES holds for the call's device, dtype and grad need). Anything
// else (a larger call, a rule not made yet, other argument types, an error) returns None: the
// Python path then decides, checks and names the argument. This skips torch's Python argument
// parser and fusedops' Python checks: docs/design.md, "Host path".

#include "plans.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace {

using torch::Tensor;

enum Op { SOFTMAX = 0, LAYERNORM, RMSNORM, EPILOGUE, OPS };

// SIZE_RULES' tables (emptied in place, never replaced) and torch.nn.Parameter; set once by
// route_tables, kept for the process's life.
PyObject* rules[OPS] = {};
PyObject* parameter_type = nullptr;
PyObject* cpu_key = nullptr;

// The tensor an argument holds where it is a plain one: an exact torch.Tensor, or for
// parameters also an exact nn.Parameter (whose __torch_function__ is torch's disabled one).
const Tensor* plain(PyObject* obj, bool param) {
  if (THPVariable_CheckExact(obj) ||
      (param && parameter_type != nullptr && Py_TYPE(obj) == (PyTypeObject*)parameter_type)) {
    return &THPVariable_Unpack(obj);
  }
  return nullptr;
}

// An optional parameter of x's dtype: false where it is anything else.
bool param_like(PyObject* obj, const Tensor& x, std::optional<Tensor>& out) {
  if (obj == Py_None) return true;
  const Tensor* p = plain(obj, true);
  if (p == nullptr || p->scalar_type() != x.scalar_type()) return false;
  out = *p;
  return true;
}

bool exact_int(PyObject* obj, int64_t& out) {
  if (!PyLong_CheckExact(obj)) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (overflow != 0 || (out == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// An eps torch reads as fusedops does: a float >= 0 (not NaN).
bool plain_eps(PyObject* obj, double& out) {
  if (!PyFloat_CheckExact(obj)) return false;
  out = PyFloat_AS_DOUBLE(obj);
  return out >= 0.0;
}

// A normalized_shape given as an int, or a tuple (torch.Size included) or list of ints.
bool plain_shape(PyObject* obj, std::vector<int64_t>& out) {
  int64_t v = 0;
  if (exact_int(obj, v)) {
    out.push_back(v);
    return true;
  }
  if (!PyTuple_Check(obj) && !PyList_Check(obj)) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
  PyObject** items = PySequence_Fast_ITEMS(obj);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!exact_int(items[i], v)) return false;
    out.push_back(v);
  }
  return true;
}

// Whether a call on x is below op's size rule. The key is the one the Python ops build:
// (True for CUDA or "cpu", dtype, grad); other devices and rules not made yet answer false.
bool below_rule(Op op, const Tensor& x, bool grad) {
  PyObject* device;
  switch (x.device().type()) {
    case c10::DeviceType::CUDA: device = Py_True; break;
    case c10::DeviceType::CPU: device = cpu_key; break;
    default: return false;
  }
  if (rules[op] == nullptr) return false;
  PyObject* key = PyTuple_Pack(3, device, (PyObject*)torch::getTHPDtype(x.scalar_type()),
                               grad ? Py_True : Py_False);
  if (key == nullptr) {
    PyErr_Clear();
    return false;
  }
  PyObject* below = PyDict_GetItemWithError(rules[op], key);  // borrowed
  Py_DECREF(key);
  if (below == nullptr) {
    PyErr_Clear();
    return false;
  }
  const int64_t n = x.numel();
  if (PyFloat_CheckExact(below)) return static_cast<double>(n) < PyFloat_AS_DOUBLE(below);
  int64_t b = 0;
  return exact_int(below, b) && n < b;
}

bool no_mode() { return !at::impl::torch_function_mode_enabled(); }

// Runs torch's op without the GIL, as torch's own bindings do; None where it raised (the Python
// path raises it again, naming the argument).
template <class F>
PyObject* native(F&& op) {
  Tensor y;
  try {
    pybind11::gil_scoped_release no_gil;
    y = op();
  } catch (const std::exception&) {
    Py_RETURN_NONE;
  }
  return THPVariable_Wrap(std::move(y));
}

// route_softmax(x, dim, dtype, scale, mask, causal): fused_softmax's arguments.
PyObject* route_softmax(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6 || args[3] != Py_None || args[4] != Py_None || args[5] != Py_False) {
    Py_RETURN_NONE;
  }
  const Tensor* x = plain(args[0], false);
  int64_t dim = 0;
  if (x == nullptr || !exact_int(args[1], dim) || !no_mode()) Py_RETURN_NONE;
  std::optional<at::ScalarType> dtype;
  if (args[2] != Py_None) {
    if (!THPDtype_Check(args[2])) Py_RETURN_NONE;
    dtype = reinterpret_cast<THPDtype*>(args[2])->scalar_type;
  }
  if (!below_rule(SOFTMAX, *x, x->requires_grad() && at::GradMode::is_enabled())) {
    Py_RETURN_NONE;
  }
  return native([&] { return at::softmax(*x, dim, dtype); });
}

// route_layer_norm(x, normalized_shape, weight, bias, eps, residual, dropout_p, activation,
// training): fused_layernorm's arguments. With a residual, (layer_norm(x + residual), x +
// residual) as the epilogue returns them.
PyObject* route_layer_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 9 || args[7] != Py_None || (args[8] != Py_True && args[8] != Py_False)) {
    Py_RETURN_NONE;
  }
  int64_t p_int = 1;  // dropout_p: 0.0 or 0 (as the Python path reads it)
  if (!(PyFloat_CheckExact(args[6]) && PyFloat_AS_DOUBLE(args[6]) == 0.0) &&
      !(exact_int(args[6], p_int) && p_int == 0)) {
    Py_RETURN_NONE;
  }
  const Tensor* x = plain(args[0], false);
  std::vector<int64_t> shape;
  std::optional<Tensor> weight, bias;
  double eps = 0.0;
  if (x == nullptr || !plain_shape(args[1], shape) || !param_like(args[2], *x, weight) ||
      !param_like(args[3], *x, bias) || !plain_eps(args[4], eps) || !no_mode()) {
    Py_RETURN_NONE;
  }
  bool grad = at::GradMode::is_enabled() &&
              (x->requires_grad() || (weight && weight->requires_grad()) ||
               (bias && bias->requires_grad()));
  if (args[5] == Py_None) {
    if (!below_rule(LAYERNORM, *x, grad)) Py_RETURN_NONE;
    return native([&] { return at::layer_norm(*x, shape, weight, bias, eps, true); });
  }
  const Tensor* residual = plain(args[5], false);
  if (residual == nullptr || residual->scalar_type() != x->scalar_type() ||
      residual->sizes() != x->sizes()) {
    Py_RETURN_NONE;
  }
  grad = grad || (at::GradMode::is_enabled() && residual->requires_grad());
  if (!below_rule(EPILOGUE, *x, grad)) Py_RETURN_NONE;
  Tensor s, y;
  try {
    pybind11::gil_scoped_release no_gil;
    s = at::add(*x, *residual);
    y = at::layer_norm(s, shape, weight, bias, eps, true);
  } catch (const std::exception&) {
    Py_RETURN_NONE;
  }
  PyObject* out = PyTuple_New(2);
  if (out == nullptr) return nullptr;
  PyTuple_SET_ITEM(out, 0, THPVariable_Wrap(std::move(y)));
  PyTuple_SET_ITEM(out, 1, THPVariable_Wrap(std::move(s)));
  return out;
}

// route_rms_norm(x, normalized_shape, weight, eps): fused_rmsnorm's arguments.
PyObject* route_rms_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) Py_RETURN_NONE;
  const Tensor* x = plain(args[0], false);
  std::vector<int64_t> shape;
  std::optional<Tensor> weight;
  std::optional<double> eps;
  if (args[3] != Py_None) {
    double e = 0.0;
    if (!plain_eps(args[3], e)) Py_RETURN_NONE;
    eps = e;
  }
  if (x == nullptr || !plain_shape(args[1], shape) || !param_like(args[2], *x, weight) ||
      !no_mode()) {
    Py_RETURN_NONE;
  }
  bool grad = at::GradMode::is_enabled() &&
              (x->requires_grad() || (weight && weight->requires_grad()));
  if (!below_rule(RMSNORM, *x, grad)) Py_RETURN_NONE;
  return native([&] { return at::rms_norm(*x, shape, weight, eps); });
}

PyMethodDef route_methods[] = {
    {"route_softmax", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(route_softmax)),
     METH_FASTCALL, "fused_softmax's arguments -> torch's result below the size rule, or None"},
    {"route_layer_norm",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(route_layer_norm)),
     METH_FASTCALL, "fused_layernorm's arguments -> torch's result below the size rule, or None"},
    {"route_rms_norm",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(route_rms_norm)),
     METH_FASTCALL, "fused_rmsnorm's arguments -> torch's result below the size rule, or None"},
    {nullptr, nullptr, 0, nullptr}};

void route_tables(pybind11::dict softmax, pybind11::dict layernorm, pybind11::dict rmsnorm,
                  pybind11::dict epilogue, pybind11::object parameter) {
  pybind11::dict tables[OPS] = {softmax, layernorm, rmsnorm, epilogue};
  for (int op = 0; op < OPS; ++op) {
    PyObject* old = rules[op];
    rules[op] = tables[op].release().ptr();
    Py_XDECREF(old);
  }
  PyObject* old = parameter_type;
  parameter_type = parameter.release().ptr();
  Py_XDECREF(old);
  if (cpu_key == nullptr) cpu_key = PyUnicode_InternFromString("cpu");
}

}  // namespace

namespace fusedops_host {

void register_routes(pybind11::module& m) {
  if (PyModule_AddFunctions(m.ptr(), route_methods) != 0) throw pybind11::error_already_set();
  m.def("route_tables", &route_tables,
        "The size-rule tables (softmax, layernorm, rmsnorm, layernorm_epilogue) and "
        "torch.nn.Parameter the route_* entry points read");
}

}  // namespace fusedops_host
