// fbgemm's int8 GEMM by handle, for compiled code (lifeline/model/compiled.py).
//
// Dynamo cannot trace the TorchScript object that holds fbgemm's packed weights, so compiled
// code names a layer by an integer handle. Written in Python, the operator that maps the handle
// to the weights cost ~13 us a call (the dispatcher calling back into Python, then Python
// calling the dispatcher again): ~1 ms of a 11 ms decode step at batch 1. Here it is a table
// lookup.
#include <ATen/ATen.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <utility>

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

std::shared_mutex table_mutex;
std::unordered_map<int64_t, std::pair<Packed, bool>> table;

void register_gemm(int64_t handle, Packed packed, bool reduce_range) {
  std::unique_lock lock(table_mutex);
  table[handle] = {std::move(packed), reduce_range};
}

void unregister_gemm(int64_t handle) {
  std::unique_lock lock(table_mutex);
  table.erase(handle);
}

at::Tensor int8_linear(const at::Tensor& x, int64_t handle) {
  Packed packed;
  bool reduce_range;
  {
    std::shared_lock lock(table_mutex);
    auto it = table.find(handle);
    TORCH_CHECK(it != table.end(), "lifeline_ext::int8_linear: no int8 layer has handle ", handle);
    packed = it->second.first;
    reduce_range = it->second.second;
  }
  return packed->apply_dynamic(x, reduce_range);
}

}  // namespace

TORCH_LIBRARY(lifeline_ext, m) {
  m.def("register_gemm(int handle, __torch__.torch.classes.quantized.LinearPackedParamsBase packed, "
        "bool reduce_range) -> ()", register_gemm);
  m.def("unregister_gemm(int handle) -> ()", unregister_gemm);
  m.def("int8_linear(Tensor x, int handle) -> Tensor");
}

TORCH_LIBRARY_IMPL(lifeline_ext, CPU, m) {
  m.impl("int8_linear", int8_linear);
}
