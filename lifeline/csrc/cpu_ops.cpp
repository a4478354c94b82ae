// CPU operators in C++ (built on first use by lifeline/model/native.py).
//
// lifeline_ext::int8_linear: fbgemm's int8 GEMM by handle, for compiled code
// (lifeline/model/compiled.py). Dynamo cannot trace the TorchScript object that holds fbgemm's packed weights, so compiled
// code names a layer by an integer handle, held in a tensor. Written in Python, the operator that maps the handle
// to the weights cost ~13 us a call (the dispatcher calling back into Python, then Python
// calling the dispatcher again): ~1 ms of a 11 ms decode step at batch 1. Here it is a table
// lookup.
#include <ATen/ATen.h>
#include <ATen/native/quantized/PackedParams.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <unordered_map>
#include <utility>
#include <vector>

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

// The handle is a one-element int64 tensor the layer holds (a graph input, not a constant, so
// a graph cached on disk serves any model of the same shape); out_features is for the shape.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& handle_t, int64_t out_features) {
  TORCH_CHECK(handle_t.scalar_type() == at::kLong && handle_t.numel() == 1 && handle_t.is_cpu(),
              "lifeline_ext::int8_linear: the handle is a one-element int64 CPU tensor");
  const int64_t handle = *handle_t.const_data_ptr<int64_t>();
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

// lifeline_ext::decode_attention: one query token per sequence against its context, read
// from the paged cache where it lies. PyTorch's path copies every context's keys and values
// into a padded tensor first (index_select) and then runs its flash kernel, whose setup
// dominates at one query: ~115 us a layer at one 150-token context, where the arithmetic is
// ~150k multiply-adds.
//
// q [D, H, hd] float32; k_cache, v_cache [S, KVH, hd] float32, bfloat16 or float16 (the KV
// cache's format: each element widened to float32 as it is read); slots [D, L] (int64, cache
// slot of each context position, padded); mask [D, L] (0 or -inf, additive: padding and
// sliding window), float32; all contiguous. Returns [D, H, hd] float32.
// A cached row widened to float32 in `buf` (a 16-bit cache), or the row itself (float32).
inline const float* widen_row(const float* src, float*, int64_t) { return src; }
inline const float* widen_row(const c10::BFloat16* src, float* buf, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {  // the top 16 bits of a float32: a shift, vectorized
    const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
    float f;
    std::memcpy(&f, &wide, sizeof f);
    buf[i] = f;
  }
  return buf;
}
inline const float* widen_row(const c10::Half* src, float* buf, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  const __m128i* halves = reinterpret_cast<const __m128i*>(src);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(halves + i / 8)));
#endif
  for (; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}

template <typename T>
void decode_attention_impl(const float* qp, const T* kp, const T* vp, const int64_t* sp,
                           const float* mp, float* op, int64_t D, int64_t H, int64_t hd,
                           int64_t KVH, int64_t L, float s) {
  const int64_t group = H / KVH;
  std::vector<float> scores(group * L);
  std::vector<float> acc(group * hd);
  std::vector<float> row(hd);
  for (int64_t item = 0; item < D * KVH; ++item) {
    const int64_t d = item / KVH, g = item % KVH;
    const int64_t* srow = sp + d * L;
    const float* mrow = mp + d * L;
    const float* qg = qp + (d * H + g * group) * hd;
    for (int64_t l = 0; l < L; ++l) {
      const float* k = widen_row(kp + (srow[l] * KVH + g) * hd, row.data(), hd);
      for (int64_t h = 0; h < group; ++h) {  // padding reads slot 0: finite, then -inf
        const float* qh = qg + h * hd;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < hd; ++i) dot += qh[i] * k[i];
        scores[h * L + l] = dot * s + mrow[l];
      }
    }
    for (int64_t h = 0; h < group; ++h) {
      float* sc = scores.data() + h * L;
      const float top = *std::max_element(sc, sc + L);
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t l = 0; l < L; ++l) {  // exp(-inf) = 0: vectorized (libmvec), no branch
        sc[l] = std::exp(sc[l] - top);
        total += sc[l];
      }
      const float inv = 1.f / total;
      for (int64_t l = 0; l < L; ++l) sc[l] *= inv;
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t l = 0; l < L; ++l) {
      const float* v = nullptr;
      for (int64_t h = 0; h < group; ++h) {
        const float p = scores[h * L + l];
        if (p == 0.f) continue;
        if (v == nullptr) v = widen_row(vp + (srow[l] * KVH + g) * hd, row.data(), hd);
        float* a = acc.data() + h * hd;
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) a[i] += p * v[i];
      }
    }
    std::copy(acc.begin(), acc.end(), op + (d * H + g * group) * hd);
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots,
                            const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: q [D, H, hd], caches [S, KVH, hd]");
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && mask.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == kv_type &&
                  (kv_type == at::kFloat || kv_type == at::kBFloat16 || kv_type == at::kHalf),
              "decode_attention: float32 q and mask; float32, bfloat16 or float16 caches");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && mask.sizes() == slots.sizes(),
              "decode_attention: slots [D, L] int64, mask [D, L]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: caches must be contiguous");
  const int64_t D = q.size(0), H = q.size(1), hd = q.size(2), KVH = k_cache.size(1);
  const int64_t L = slots.size(1);
  TORCH_CHECK(k_cache.size(2) == hd && H % KVH == 0 && slots.size(0) == D, "decode_attention: shapes");
  auto qc = q.contiguous();
  auto sc = slots.contiguous();
  auto mc = mask.contiguous();
  auto out = at::empty_like(qc);
  const float s = static_cast<float>(scale);
  // One thread: built with -fopenmp (for at::parallel_for), the library slowed PyTorch's own
  // parallel kernels in the same process ~7x (index_select + SDPA at 8 x 176 slots: 134 ->
  // 928 us), so the caller sends only small batches here (attention.NATIVE_DECODE_MAX).
  const float* qp = qc.data_ptr<float>();
  const int64_t* sp = sc.data_ptr<int64_t>();
  const float* mp = mc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (kv_type == at::kFloat) {
    decode_attention_impl(qp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), sp, mp, op,
                          D, H, hd, KVH, L, s);
  } else if (kv_type == at::kBFloat16) {
    decode_attention_impl(qp, k_cache.data_ptr<c10::BFloat16>(),
                          v_cache.data_ptr<c10::BFloat16>(), sp, mp, op, D, H, hd, KVH, L, s);
  } else {
    decode_attention_impl(qp, k_cache.data_ptr<c10::Half>(), v_cache.data_ptr<c10::Half>(), sp,
                          mp, op, D, H, hd, KVH, L, s);
  }
  return out;
}


// lifeline_ext::paged_attention: the compiled forward's attention operator (lifeline/model/layers/
// attention.py) with a decode-only step's work in C++. Written in Python (lifeline::paged_attention),
// each layer's call cost ~45 us around a ~35 us kernel (the dispatcher calling back into Python,
// the forward context read, the KV write and the mask looked up): ~1.3 ms of SmolLM2's ~10.6 ms
// step. The runner sets the step once (`set_decode_step`: the pools, the new tokens' slots, the
// decode contexts' slots and masks, for full and sliding-window layers); a layer then writes its
// keys and values and runs `decode_attention` here. Any other step (a prefill chunk, a large
// batch, no step set) goes to the Python operator through the dispatcher, unchanged.
struct DecodeStep {
  bool active = false;
  std::vector<at::Tensor> caches;  // layer i: caches[2 i] (K), caches[2 i + 1] (V)
  at::Tensor slot_mapping, decode_slots, mask;        // full-attention layers
  at::Tensor w_slot_mapping, w_decode_slots, w_mask;  // sliding-window layers
  int64_t window = -1;
};
thread_local DecodeStep decode_step;  // the engine's thread runs the step it sets

void set_decode_step(std::vector<at::Tensor> caches, at::Tensor slot_mapping,
                     at::Tensor decode_slots, at::Tensor mask, at::Tensor w_slot_mapping,
                     at::Tensor w_decode_slots, at::Tensor w_mask, int64_t window) {
  TORCH_CHECK(caches.size() % 2 == 0, "set_decode_step: K and V pools per layer");
  DecodeStep s;
  s.caches = std::move(caches);
  s.slot_mapping = std::move(slot_mapping);
  s.decode_slots = std::move(decode_slots);
  s.mask = std::move(mask);
  s.w_slot_mapping = std::move(w_slot_mapping);
  s.w_decode_slots = std::move(w_decode_slots);
  s.w_mask = std::move(w_mask);
  s.window = window;
  s.active = true;
  decode_step = std::move(s);
}

void clear_decode_step() { decode_step = DecodeStep(); }

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           int64_t layer, double scale, std::optional<int64_t> window) {
  const DecodeStep& s = decode_step;
  if (s.active && layer >= 0 && 2 * layer + 1 < static_cast<int64_t>(s.caches.size()) &&
      (!window.has_value() || *window == s.window) && q.scalar_type() == at::kFloat) {
    const bool w = window.has_value();
    const at::Tensor& kc = s.caches[2 * layer];
    const at::Tensor& vc = s.caches[2 * layer + 1];
    const at::Tensor& slots = w ? s.w_slot_mapping : s.slot_mapping;
    kc.index_copy_(0, slots, k.to(kc.scalar_type()));
    vc.index_copy_(0, slots, v.to(vc.scalar_type()));
    return decode_attention(q, kc, vc, w ? s.w_decode_slots : s.decode_slots, w ? s.w_mask : s.mask,
                            scale);
  }
  static const auto python_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("lifeline::paged_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                            double, std::optional<int64_t>)>();
  return python_op.call(q, k, v, layer, scale, window);
}

}  // namespace

TORCH_LIBRARY(lifeline_ext, m) {
  m.def("register_gemm(int handle, __torch__.torch.classes.quantized.LinearPackedParamsBase packed, "
        "bool reduce_range) -> ()", register_gemm);
  m.def("unregister_gemm(int handle) -> ()", unregister_gemm);
  m.def("int8_linear(Tensor x, Tensor handle, int out_features) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor mask, "
        "float scale) -> Tensor");
  m.def("set_decode_step(Tensor[] caches, Tensor slot_mapping, Tensor decode_slots, Tensor mask, "
        "Tensor w_slot_mapping, Tensor w_decode_slots, Tensor w_mask, int window) -> ()",
        set_decode_step);
  m.def("clear_decode_step() -> ()", clear_decode_step);
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, int layer, float scale, int? window) -> Tensor");
}

TORCH_LIBRARY_IMPL(lifeline_ext, CPU, m) {
  m.impl("int8_linear", int8_linear);
  m.impl("decode_attention", decode_attention);
  m.impl("paged_attention", paged_attention);
}
