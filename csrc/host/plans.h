// Shared by the host extension's files: launch plans (replay.cpp) and what launches them.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace fusedops_host {

// Launch plan `handle` with the addresses `ptrs` (one per slot; 0 where absent), on the
// current stream of `on`'s device, under a guard for that device.
void run_plan(int64_t handle, const uint64_t* ptrs, const torch::Tensor& on);

// Whether `handle` names a registered plan.
bool plan_exists(int64_t handle);

// A table for `n` entries that never reallocates: handles are indices, so a backward reading an
// entry on autograd's device thread needs no lock while another thread appends.
template <class T>
std::vector<T> reserved_table(size_t n) {
  std::vector<T> v;
  v.reserve(n);
  return v;
}

inline uint64_t address(const torch::Tensor& t) {
  return t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0;
}

}  // namespace fusedops_host

namespace fusedops_host {

// Adds the generic replay node's functions (node.cpp) to the module.
void register_nodes(pybind11::module& m);

// Adds the routed calls' entry points (route.cpp) to the module.
void register_routes(pybind11::module& m);

}  // namespace fusedops_host
