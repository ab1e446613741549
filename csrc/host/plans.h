// Shared by the host extension's files: launch plans (replay.cpp) and what launches them.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace fusedops_host {

// Launch plan `handle` with the addresses `ptrs` (one per slot; 0 where absent), on the
// current stream of `on`'s device, under a guard for that device.
void run_plan(int64_t handle, const uint64_t* ptrs, const torch::Tensor& on);

// Whether `handle` names a registered plan.
bool plan_exists(int64_t handle);

inline uint64_t address(const torch::Tensor& t) {
  return t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0;
}

}  // namespace fusedops_host

namespace fusedops_host {

// Adds the generic replay node's functions (node.cpp) to the module.
void register_nodes(pybind11::module& m);

}  // namespace fusedops_host
