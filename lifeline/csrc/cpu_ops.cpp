// CPU operators in C++ (built on first use by lifeline/model/native.py).
//
// lifeline_ext::int8_linear: fbgemm's int8 GEMM by handle, for compiled code
// (lifeline/model/compiled.py). Dynamo cannot trace the TorchScript object that holds fbgemm's packed weights, so compiled
// code names a layer by an integer handle, held in a tensor. Written in Python, the operator that maps the handle
// to the weights cost ~13 us a call (the dispatcher calling back into Python, then Python
// calling the dispatcher again): ~1 ms of a 11 ms decode step at batch 1. Here it is a table
// lookup.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/quantized/PackedParams.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__AVX__) || defined(__SSE__)
#include <immintrin.h>
#endif
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <type_traits>
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

// exp(x) for each x[i] in place, vectorized by the compiler (std::exp is not, without
// -ffast-math): exp(x) = 2^n exp(r), n = round(x log2 e), r = x - n ln 2 (split in two parts
// for exactness), exp(r) on |r| <= ln2/2 by its Taylor polynomial to degree 7 (relative error
// below 2e-7, as libm's within a float32 ulp or two); x below -87.3 (a masked score, -inf) gives
// exactly 0.
inline void exp_inplace(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float c = std::min(std::max(v, -87.3f), 88.f);
    const float k = std::floor(c * 1.44269504088896341f + 0.5f);
    const float r = (c - k * 0.693145751953125f) - k * 1.42860682030941723e-6f;
    float p = 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const float two_k = __builtin_bit_cast(float, (static_cast<int32_t>(k) + 127) << 23);
    x[i] = v < -87.3f ? 0.f : p * two_k;
  }
}

// Each head's n scores of a chunk (scores [group, n]) to exp(score - m) in place, with their
// maximum m and sum; a chunk whose every position is masked gives m = -inf, sum 0, all 0.
inline void chunk_softmax(float* scores, int64_t group, int64_t n, float* m, float* sum) {
  for (int64_t h = 0; h < group; ++h) {
    float* sc = scores + h * n;
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int64_t l = 0; l < n; ++l) top = std::max(top, sc[l]);
    m[h] = top;
    if (top == -INFINITY) {  // every position of the chunk masked
      sum[h] = 0.f;
      std::fill(sc, sc + n, 0.f);
      continue;
    }
#pragma omp simd
    for (int64_t l = 0; l < n; ++l) sc[l] -= top;
    exp_inplace(sc, n);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t l = 0; l < n; ++l) total += sc[l];
    sum[h] = total;
  }
}

// One chunk [l0, l1) of one sequence's context for the `group` query heads sharing KV head g:
// its scores' maximum per head (m), the sum of exp(score - m) (sum) and the exp-weighted sum of
// its values (acc [group, hd]); the chunks of a context are merged after (flash decoding).
template <typename T>
void attend_chunk(const float* qg, const T* kp, const T* vp, const int64_t* srow,
                  const float* mrow, int64_t l0, int64_t l1, int64_t KVH, int64_t g,
                  int64_t group, int64_t hd, float s, float* m, float* sum, float* acc) {
  const int64_t n = l1 - l0;
  std::vector<float> scores(group * n), row(hd);
  for (int64_t l = l0; l < l1; ++l) {
    const float* k = widen_row(kp + (srow[l] * KVH + g) * hd, row.data(), hd);
    for (int64_t h = 0; h < group; ++h) {  // padding reads slot 0: finite, then -inf
      const float* qh = qg + h * hd;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < hd; ++i) dot += qh[i] * k[i];
      scores[h * n + (l - l0)] = dot * s + mrow[l];
    }
  }
  chunk_softmax(scores.data(), group, n, m, sum);
  std::fill(acc, acc + group * hd, 0.f);
  for (int64_t l = l0; l < l1; ++l) {
    const float* v = nullptr;
    for (int64_t h = 0; h < group; ++h) {
      const float p = scores[h * n + (l - l0)];
      if (p == 0.f) continue;
      if (v == nullptr) v = widen_row(vp + (srow[l] * KVH + g) * hd, row.data(), hd);
      float* a = acc + h * hd;
#pragma omp simd
      for (int64_t i = 0; i < hd; ++i) a[i] += p * v[i];
    }
  }
}

// The same chunk with the row read as whole vectors (AVX-512 or AVX2: this library is built
// for the machine it runs on), for head sizes that are a multiple of the vector: each key row
// widened once into registers and dotted with every query head of the group, and the rows of
// the next positions prefetched (the context's rows are scattered over the pool: a kernel that
// waits on each row runs at a fraction of the memory's speed).
#if defined(__AVX512F__)
struct Vec {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load(const c10::BFloat16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static void sum8(const V* a, float* out) {  // out[p] = sum(a[p])
    for (int p = 0; p < 8; ++p) out[p] = sum(a[p]);
  }
};
#define LIFELINE_VEC_ATTENTION 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Vec {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V load(const c10::BFloat16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static float sum(V v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
  }
  // out[p] = sum(a[p]) for eight vectors at once, each added in `sum`'s order (the same
  // values, bit for bit): both halves of each added, then four at a time transposed so that
  // (x0 + x2) + (x1 + x3) is one vertical add per lane.
  static void sum8(const V* a, float* out) {
    for (int b = 0; b < 2; ++b) {
      __m128 r[4];
      for (int i = 0; i < 4; ++i)
        r[i] = _mm_add_ps(_mm256_castps256_ps128(a[4 * b + i]), _mm256_extractf128_ps(a[4 * b + i], 1));
      _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);
      _mm_storeu_ps(out + 4 * b, _mm_add_ps(_mm_add_ps(r[0], r[2]), _mm_add_ps(r[1], r[3])));
    }
  }
};
#define LIFELINE_VEC_ATTENTION 1
#else
struct Vec {  // one float a "vector": the portable build of the prefill kernel below
  using V = float;
  static constexpr int W = 1;
  static V zero() { return 0.f; }
  static V load(const float* p) { return *p; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V add(V a, V b) { return a + b; }
  static V set1(float x) { return x; }
  static void store(float* p, V v) { *p = v; }
};
#endif

#ifdef LIFELINE_VEC_ATTENTION
constexpr int64_t PREFETCH_AHEAD = 8;  // positions

template <typename T>
inline void prefetch_row(const T* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T0);
}

// Positions a tile holds: their rows widened to float32 once, into a buffer that stays in L1,
// then dotted with each query head (eight sums reduced at once, `Vec::sum8`) and, for the
// values, accumulated into each head's output kept in registers across the tile.
constexpr int64_t TILE = 8;

template <typename T, int NV>
void attend_chunk_vec(const float* qg, const T* kp, const T* vp, const int64_t* srow,
                      const float* mrow, int64_t l0, int64_t l1, int64_t KVH, int64_t g,
                      int64_t group, float s, float* m, float* sum, float* acc) {
  using V = typename Vec::V;
  constexpr int64_t W = Vec::W, hd = NV * W;
  constexpr int64_t row_bytes = hd * sizeof(T);
  constexpr int C = NV < 8 ? NV : 8;  // vectors of a head's output held in registers at once
  static_assert(NV % C == 0, "head size");
  const int64_t n = l1 - l0;
  thread_local std::vector<float> scores_buf, tile_buf;  // grown, never freed: no allocation a call
  if (static_cast<int64_t>(scores_buf.size()) < group * n) scores_buf.resize(group * n);
  if (tile_buf.size() < static_cast<size_t>(TILE * hd)) tile_buf.resize(TILE * hd);
  float* scores = scores_buf.data();
  float* tile = tile_buf.data();
  auto row = [&](const T* pool, int64_t l) { return pool + (srow[l] * KVH + g) * hd; };
  auto widen = [&](const T* src, float* dst) {
    for (int j = 0; j < NV; ++j) Vec::store(dst + j * W, Vec::load(src + j * W));
  };
  for (int64_t l = l0; l < std::min(l1, l0 + PREFETCH_AHEAD); ++l) prefetch_row(row(kp, l), row_bytes);
  for (int64_t t0 = l0; t0 < l1; t0 += TILE) {
    const int64_t nt = std::min(TILE, l1 - t0);
    for (int64_t p = 0; p < nt; ++p) {
      if (t0 + p + PREFETCH_AHEAD < l1) prefetch_row(row(kp, t0 + p + PREFETCH_AHEAD), row_bytes);
      widen(row(kp, t0 + p), tile + p * hd);
    }
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = qg + h * hd;
      V dots[TILE];
      for (int64_t p = 0; p < TILE; ++p) {
        const float* kr = tile + p * hd;
        V a0 = Vec::zero(), a1 = Vec::zero();
        if (p < nt) {
          for (int j = 0; j + 1 < NV; j += 2) {
            a0 = Vec::fma(Vec::load(qh + j * W), Vec::load(kr + j * W), a0);
            a1 = Vec::fma(Vec::load(qh + (j + 1) * W), Vec::load(kr + (j + 1) * W), a1);
          }
          if (NV % 2) a0 = Vec::fma(Vec::load(qh + (NV - 1) * W), Vec::load(kr + (NV - 1) * W), a0);
        }
        dots[p] = Vec::add(a0, a1);
      }
      float dot[TILE];
      Vec::sum8(dots, dot);
      for (int64_t p = 0; p < nt; ++p) scores[h * n + (t0 - l0) + p] = dot[p] * s + mrow[t0 + p];
    }
  }
  for (int64_t l = l0; l < std::min(l1, l0 + PREFETCH_AHEAD); ++l) prefetch_row(row(vp, l), row_bytes);
  chunk_softmax(scores, group, n, m, sum);
  std::fill(acc, acc + group * hd, 0.f);
  for (int64_t t0 = l0; t0 < l1; t0 += TILE) {
    const int64_t nt = std::min(TILE, l1 - t0);
    int64_t used[TILE];  // the tile's positions some head weighs: masked positions weigh
    int nu = 0;          // exactly 0 (exp_inplace) and their rows (padding's slot 0, an
    for (int64_t p = 0; p < nt; ++p) {  // overflowed 16-bit value) are never read
      const int64_t l = t0 + p;
      if (l + PREFETCH_AHEAD < l1) prefetch_row(row(vp, l + PREFETCH_AHEAD), row_bytes);
      bool weighed = false;
      for (int64_t h = 0; h < group; ++h) weighed |= scores[h * n + (l - l0)] != 0.f;
      if (!weighed) continue;
      widen(row(vp, l), tile + nu * hd);
      used[nu++] = l - l0;
    }
    for (int64_t h = 0; h < group; ++h) {
      float* a = acc + h * hd;
      const float* sc = scores + h * n;
      for (int c0 = 0; c0 < NV; c0 += C) {
        V r[C];
        for (int j = 0; j < C; ++j) r[j] = Vec::load(a + (c0 + j) * W);
        for (int u = 0; u < nu; ++u) {  // in position order, as one position at a time
          const V p = Vec::set1(sc[used[u]]);
          const float* vr = tile + u * hd + c0 * W;
          for (int j = 0; j < C; ++j) r[j] = Vec::fma(p, Vec::load(vr + j * W), r[j]);
        }
        for (int j = 0; j < C; ++j) Vec::store(a + (c0 + j) * W, r[j]);
      }
    }
  }
}
#endif

// The chunk by the vector kernel where the head size has one (64, 128, 256 values), else by
// the portable one.
template <typename T>
void attend(const float* qg, const T* kp, const T* vp, const int64_t* srow, const float* mrow,
            int64_t l0, int64_t l1, int64_t KVH, int64_t g, int64_t group, int64_t hd, float s,
            float* m, float* sum, float* acc) {
#ifdef LIFELINE_VEC_ATTENTION
  switch (hd) {  // vectors a row: 4, 8, 16 with AVX-512; 8, 16, 32 with AVX2
    case 64:
      return attend_chunk_vec<T, 64 / Vec::W>(qg, kp, vp, srow, mrow, l0, l1, KVH, g, group, s,
                                              m, sum, acc);
    case 128:
      return attend_chunk_vec<T, 128 / Vec::W>(qg, kp, vp, srow, mrow, l0, l1, KVH, g, group, s,
                                               m, sum, acc);
    case 256:
      return attend_chunk_vec<T, 256 / Vec::W>(qg, kp, vp, srow, mrow, l0, l1, KVH, g, group, s,
                                               m, sum, acc);
  }
#endif
  attend_chunk(qg, kp, vp, srow, mrow, l0, l1, KVH, g, group, hd, s, m, sum, acc);
}

// Positions a chunk holds at least: below it, a chunk's setup and merge cost more than a
// second thread saves.
constexpr int64_t CHUNK_MIN = 64;

template <typename T>
void decode_attention_impl(const float* qp, const T* kp, const T* vp, const int64_t* sp,
                           const float* mp, float* op, int64_t D, int64_t H, int64_t hd,
                           int64_t KVH, int64_t L, float s) {
  const int64_t group = H / KVH, items = D * KVH;
  // Split each context into chunks so that both threads have work even for one sequence of
  // few KV heads (SmolLM2: 3): the (sequence, KV head, chunk) units run in parallel.
  const int64_t threads = at::get_num_threads();
  int64_t chunks = 1;
  while (items * chunks < 2 * threads && L / (2 * chunks) >= CHUNK_MIN) chunks *= 2;
  const int64_t span = (L + chunks - 1) / chunks;
  const int64_t units = items * chunks;
  std::vector<float> m(units * group), sum(units * group), acc(units * group * hd);
  auto run = [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t item = u / chunks, c = u % chunks;
      const int64_t d = item / KVH, g = item % KVH;
      const int64_t l0 = c * span, l1 = std::min(L, l0 + span);
      float* mu = m.data() + u * group;
      float* su = sum.data() + u * group;
      float* au = acc.data() + u * group * hd;
      if (l0 >= l1) {
        std::fill(mu, mu + group, -INFINITY);
        std::fill(su, su + group, 0.f);
        std::fill(au, au + group * hd, 0.f);
        continue;
      }
      attend(qp + (d * H + g * group) * hd, kp, vp, sp + d * L, mp + d * L, l0, l1, KVH, g, group,
             hd, s, mu, su, au);
    }
  };
  if (units > 1 && L * items >= 2 * CHUNK_MIN)
    at::parallel_for(0, units, 1, run);
  else
    run(0, units);
  for (int64_t item = 0; item < items; ++item) {  // merge each context's chunks
    const int64_t d = item / KVH, g = item % KVH;
    for (int64_t h = 0; h < group; ++h) {
      float top = -INFINITY;
      for (int64_t c = 0; c < chunks; ++c) top = std::max(top, m[(item * chunks + c) * group + h]);
      float* o = op + (d * H + g * group + h) * hd;
      std::fill(o, o + hd, 0.f);
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t u = item * chunks + c;
        if (m[u * group + h] == -INFINITY) continue;
        const float w = std::exp(m[u * group + h] - top);  // 1 for the top chunk
        total += w * sum[u * group + h];
        const float* a = acc.data() + (u * group + h) * hd;
#pragma omp simd
        for (int64_t i = 0; i < hd; ++i) o[i] += w * a[i];
      }
      const float inv = 1.f / total;
#pragma omp simd
      for (int64_t i = 0; i < hd; ++i) o[i] *= inv;
    }
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
  // Batches up to attention.NATIVE_DECODE_MAX come here; larger ones go to PyTorch's SDPA.
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


// lifeline_ext::prefill_attention: a prefill chunk's causal attention (within a sliding window
// where given), flash style (Dao et al.), with the query heads that share a KV head stacked into
// one block of rows, so that each key and value row read serves all of them and the products are
// register-tiled GEMMs rather than one head's dots at a time. q [T, H, hd] holds the chunk's
// queries, at context positions L - T .. L - 1; k, v [L, KVH, hd] the whole context's keys and
// values (the chunk's own last). A query at position p sees the keys at positions j <= p, and
// with a window w only those with j > p - w (transformers' and lifeline.model.layers.attention's
// masks). All float32. Returns [T, H, hd].

// Query positions a block holds: about 192 stacked rows whatever the group's size.
inline int64_t prefill_block_rows(int64_t group) { return std::max<int64_t>(4, 192 / group); }
constexpr int64_t PREFILL_KEYS = 64;  // keys a block: a multiple of 2 vectors on every build
constexpr int PREFILL_MR = 6;         // rows a register tile
constexpr int64_t PREFILL_DIMS = 32;  // dimensions a partial sum of the scores

// S[r, c .. c + 2W) = Q[r] . Kt[:, c .. c + 2W) for MR rows: Q [MR, hd] (row stride hd), Kt
// [hd, ldk] (the key block transposed), S row stride lds.
template <int MR>
inline void qk_tile(const float* Q, int64_t hd, const float* Kt, int64_t ldk, float* S,
                    int64_t lds) {
  using V = typename Vec::V;
  constexpr int W = Vec::W;
  V acc[MR][2];
  // summed 32 dimensions at a time, the partial sums then added: a head of 256 dimensions
  // rounds about as SDPA's blocked products do, not as one running sum of 256 terms
  for (int64_t d0 = 0; d0 < hd; d0 += PREFILL_DIMS) {
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = Vec::zero();
    for (int64_t d = d0; d < std::min(hd, d0 + PREFILL_DIMS); ++d) {
      const V b0 = Vec::load(Kt + d * ldk), b1 = Vec::load(Kt + d * ldk + W);
      for (int r = 0; r < MR; ++r) {
        const V a = Vec::set1(Q[r * hd + d]);
        acc[r][0] = Vec::fma(a, b0, acc[r][0]);
        acc[r][1] = Vec::fma(a, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      if (d0 > 0) {
        acc[r][0] = Vec::add(acc[r][0], Vec::load(S + r * lds));
        acc[r][1] = Vec::add(acc[r][1], Vec::load(S + r * lds + W));
      }
      Vec::store(S + r * lds, acc[r][0]);
      Vec::store(S + r * lds + W, acc[r][1]);
    }
  }
}

// O[r, c .. c + 2W) += sum over the block's n keys of P[r, j] V[j, c .. c + 2W) for MR rows:
// P row stride lds, V rows `ldv` apart, O row stride hd.
template <int MR>
inline void pv_tile(const float* P, int64_t lds, const float* Vr, int64_t ldv, int64_t n,
                    float* O, int64_t hd) {
  using V = typename Vec::V;
  constexpr int W = Vec::W;
  V acc[MR][2];
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = Vec::load(O + r * hd);
    acc[r][1] = Vec::load(O + r * hd + W);
  }
  for (int64_t j = 0; j < n; ++j) {
    const V b0 = Vec::load(Vr + j * ldv), b1 = Vec::load(Vr + j * ldv + W);
    for (int r = 0; r < MR; ++r) {
      const V p = Vec::set1(P[r * lds + j]);
      acc[r][0] = Vec::fma(p, b0, acc[r][0]);
      acc[r][1] = Vec::fma(p, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    Vec::store(O + r * hd, acc[r][0]);
    Vec::store(O + r * hd + W, acc[r][1]);
  }
}

// f(std::integral_constant<int, rows>{}) for 1 <= rows <= PREFILL_MR: a tile's row count as a
// template argument, the last tile of a block being shorter.
template <typename F>
inline void with_rows(int rows, F&& f) {
  static_assert(PREFILL_MR == 6, "one case per row count below");
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    default: return f(std::integral_constant<int, PREFILL_MR>{});
  }
}

void prefill_attention_impl(const float* qp, const float* kp, const float* vp, float* op,
                            int64_t T, int64_t L, int64_t H, int64_t KVH, int64_t hd, float scale,
                            int64_t window) {
  constexpr int64_t BK = PREFILL_KEYS;
  const int64_t group = H / KVH, BQ = prefill_block_rows(group);
  const int64_t blocks = (T + BQ - 1) / BQ, units = blocks * KVH;
  const int64_t first = L - T;  // the chunk's first query position
  const int64_t kv_row = KVH * hd;
  // each KV head's keys transposed once, a block at a time: [KVH, key blocks, hd, BK], the
  // columns past L zero
  const int64_t kblocks = (L + BK - 1) / BK;
  std::vector<float> kt_all(KVH * kblocks * hd * BK);
  auto transpose = [&](int64_t x0, int64_t x1) {
    for (int64_t x = x0; x < x1; ++x) {
      const int64_t g = x / kblocks, j0 = (x % kblocks) * BK;
      float* Kt = kt_all.data() + x * hd * BK;
      for (int64_t j = 0; j < BK; ++j) {
        if (j0 + j < L) {
          const float* kr = kp + (j0 + j) * kv_row + g * hd;
          for (int64_t d = 0; d < hd; ++d) Kt[d * BK + j] = kr[d];
        } else {
          for (int64_t d = 0; d < hd; ++d) Kt[d * BK + j] = 0.f;
        }
      }
    }
  };
  if (KVH * kblocks > 1 && T * L >= 4096)
    at::parallel_for(0, KVH * kblocks, 1, transpose);
  else
    transpose(0, KVH * kblocks);
  auto unit = [&](int64_t u) {
    // blocks taken from both ends in turn (a late block sees more keys), so that the
    // contiguous ranges parallel_for hands each thread weigh about the same
    const int64_t i = u / KVH, g = u % KVH;
    const int64_t b = i % 2 == 0 ? i / 2 : blocks - 1 - i / 2;
    const int64_t t0 = b * BQ, t1 = std::min(T, t0 + BQ), nq = t1 - t0;
    const int64_t R = nq * group;  // row r: query t0 + r / group, head g * group + r % group
    thread_local std::vector<float> qbuf, sbuf, obuf, mbuf, lbuf;
    qbuf.resize(R * hd);
    sbuf.resize(R * BK);
    obuf.resize(R * hd);
    mbuf.resize(R);
    lbuf.resize(R);
    float *Q = qbuf.data(), *S = sbuf.data(), *O = obuf.data();
    float *m = mbuf.data(), *l = lbuf.data();
    for (int64_t r = 0; r < R; ++r) {
      const float* src = qp + ((t0 + r / group) * H + g * group + r % group) * hd;
      for (int64_t d = 0; d < hd; ++d) Q[r * hd + d] = src[d] * scale;
    }
    std::fill(O, O + R * hd, 0.f);
    std::fill(m, m + R, -INFINITY);
    std::fill(l, l + R, 0.f);
    const int64_t p0 = first + t0, p1 = first + t1 - 1;  // the block's first and last positions
    const int64_t lo = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0;
    for (int64_t j0 = lo - lo % BK; j0 <= p1; j0 += BK) {
      const int64_t n = std::min(BK, p1 + 1 - j0);
      const float* Kt = kt_all.data() + (g * kblocks + j0 / BK) * hd * BK;
      for (int64_t r = 0; r < R; r += PREFILL_MR) {
        const int rows = static_cast<int>(std::min<int64_t>(PREFILL_MR, R - r));
        with_rows(rows, [&](auto mr) {
          for (int64_t c = 0; c < BK; c += 2 * Vec::W)
            qk_tile<decltype(mr)::value>(Q + r * hd, hd, Kt + c, BK, S + r * BK + c, BK);
        });
      }
      // the mask (positions past the query, before its window, past the context), then each
      // row's running maximum and sum, and its output so far rescaled (online softmax)
      const bool edge = j0 + BK - 1 > p0 || (window > 0 && j0 <= p1 - window) || n < BK;
      for (int64_t r = 0; r < R; ++r) {
        float* sr = S + r * BK;
        const int64_t p = first + t0 + r / group;
        int64_t a = 0, z = n;  // the keys [a, z) row r sees in this block
        if (edge) {
          z = std::min<int64_t>(n, p + 1 - j0);
          if (window > 0) a = std::max<int64_t>(0, p - window + 1 - j0);
          if (a >= z) {  // none: the row's state stays as it is
            std::fill(sr, sr + BK, 0.f);
            continue;
          }
          std::fill(sr, sr + a, -INFINITY);
          std::fill(sr + z, sr + BK, -INFINITY);
        }
        float top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int64_t j = a; j < z; ++j) top = std::max(top, sr[j]);
        const float m_new = std::max(m[r], top);
        const float alpha = m[r] == -INFINITY ? 0.f : std::exp(m[r] - m_new);
#pragma omp simd
        for (int64_t j = 0; j < BK; ++j) sr[j] -= m_new;
        exp_inplace(sr, BK);  // -inf to exactly 0
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = a; j < z; ++j) total += sr[j];
        l[r] = l[r] * alpha + total;
        m[r] = m_new;
        if (alpha != 1.f) {
          float* orow = O + r * hd;
          for (int64_t d = 0; d < hd; ++d) orow[d] *= alpha;
        }
      }
      const float* Vb = vp + j0 * kv_row + g * hd;
      for (int64_t r = 0; r < R; r += PREFILL_MR) {
        const int rows = static_cast<int>(std::min<int64_t>(PREFILL_MR, R - r));
        with_rows(rows, [&](auto mr) {
          for (int64_t c = 0; c < hd; c += 2 * Vec::W)
            pv_tile<decltype(mr)::value>(S + r * BK, BK, Vb + c, kv_row, n, O + r * hd + c, hd);
        });
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      float* dst = op + ((t0 + r / group) * H + g * group + r % group) * hd;
      const float inv = 1.f / l[r];
      for (int64_t d = 0; d < hd; ++d) dst[d] = O[r * hd + d] * inv;
    }
  };
  if (units > 1 && T * L >= 4096)
    at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) unit(u);
    });
  else
    for (int64_t u = 0; u < units; ++u) unit(u);
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
              "prefill_attention: q [T, H, hd], k and v [L, KVH, hd]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "prefill_attention: float32 q, k and v");
  const int64_t T = q.size(0), H = q.size(1), hd = q.size(2), L = k.size(0), KVH = k.size(1);
  TORCH_CHECK(k.size(2) == hd && KVH > 0 && H % KVH == 0 && T <= L,
              "prefill_attention: shapes");
  TORCH_CHECK(hd % (2 * Vec::W) == 0, "prefill_attention: head size ", hd,
              " is not a multiple of ", 2 * Vec::W);
  auto qc = q.contiguous();
  auto kc = k.contiguous();
  auto vc = v.contiguous();
  auto out = at::empty_like(qc);
  if (T == 0) return out;
  prefill_attention_impl(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                         out.data_ptr<float>(), T, L, H, KVH, hd, static_cast<float>(scale),
                         window);
  return out;
}

// The head sizes `prefill_attention` takes are the multiples of this.
int64_t prefill_attention_head_multiple() { return 2 * Vec::W; }

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

// Each new token's keys (or values) `x` [D, KVH, hd] into its slot of `cache` [S, KVH, hd],
// converted as `x.to(cache.dtype)` converts (round to nearest even): what
// `cache.index_copy_(0, slots, x.to(cache.dtype))` writes, without its two operators' setup
// (~6-12 us a layer, more than the writing).
template <typename T>
void write_rows_as(const at::Tensor& cache, const int64_t* slots, int64_t D, const float* x) {
  const int64_t row = cache.stride(0), S = cache.size(0);
  T* out = cache.data_ptr<T>();
  for (int64_t d = 0; d < D; ++d) {
    TORCH_CHECK(slots[d] >= 0 && slots[d] < S, "paged_attention: slot ", slots[d],
                " outside the cache's ", S);
    T* dst = out + slots[d] * row;
    const float* src = x + d * row;
    for (int64_t i = 0; i < row; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

void write_rows(const at::Tensor& cache, const at::Tensor& slots, const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && slots.scalar_type() == at::kLong &&
                  cache.is_contiguous() && x.numel() == slots.numel() * cache.stride(0),
              "paged_attention: float32 keys and values [D, KVH, hd] for D int64 slots");
  const auto xc = x.contiguous();
  const auto sc = slots.contiguous();
  const int64_t D = sc.numel();
  switch (cache.scalar_type()) {
    case at::kFloat:
      return write_rows_as<float>(cache, sc.data_ptr<int64_t>(), D, xc.data_ptr<float>());
    case at::kHalf:
      return write_rows_as<c10::Half>(cache, sc.data_ptr<int64_t>(), D, xc.data_ptr<float>());
    case at::kBFloat16:
      return write_rows_as<c10::BFloat16>(cache, sc.data_ptr<int64_t>(), D, xc.data_ptr<float>());
    default:
      TORCH_CHECK(false, "paged_attention: a float32, float16 or bfloat16 cache");
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           int64_t layer, double scale, std::optional<int64_t> window) {
  const DecodeStep& s = decode_step;
  if (s.active && layer >= 0 && 2 * layer + 1 < static_cast<int64_t>(s.caches.size()) &&
      (!window.has_value() || *window == s.window) && q.scalar_type() == at::kFloat &&
      k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat) {
    const bool w = window.has_value();
    const at::Tensor& kc = s.caches[2 * layer];
    const at::Tensor& vc = s.caches[2 * layer + 1];
    const at::Tensor& slots = w ? s.w_slot_mapping : s.slot_mapping;
    write_rows(kc, slots, k);
    write_rows(vc, slots, v);
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

// RoPE's cos and sin rows of `positions` (int64 [N]) for `inv_freq` (float32 [D/2]), by the
// ATen kernels a table of every position is built with (torch.outer(arange(P).float(),
// inv_freq).cos(), .sin()): the same bits as that table's rows, which Inductor's own cos and
// sin are not (lifeline/model/layers/rotary.py).
std::tuple<at::Tensor, at::Tensor> rope_rows(const at::Tensor& positions,
                                             const at::Tensor& inv_freq) {
  TORCH_CHECK(positions.dim() == 1 && inv_freq.dim() == 1 &&
                  inv_freq.scalar_type() == at::kFloat,
              "rope_rows: positions [N] and float32 inv_freq [D/2]");
  const at::Tensor freqs = at::outer(positions.to(at::kFloat), inv_freq);
  return {freqs.cos(), freqs.sin()};
}

// lifeline_ext::hadamard_rows(x, block): x times the block-diagonal Hadamard matrix of `block`
// (Sylvester's order, scaled by 1/sqrt(block): lifeline.model.weight_format.hadamard), each
// row's consecutive blocks of columns by the fast Walsh-Hadamard transform (log2(block) passes of
// sums and differences), in place of an `aten::mm` against the matrix in the compiled graph
// (docs/performance.md, "Rotations by the fast Walsh-Hadamard transform").
// x [R, C] float32, C a multiple of `block`, `block` a power of two. Returns [R, C] float32.

// One row of C values, blocks of `block`, transformed in place and scaled.
void hadamard_row(float* v, int64_t C, int64_t block, float scale) {
  int64_t h = 1;
#ifdef __AVX2__
  if (block >= 8) {
    // sums and differences at distances 1, 2 and 4 inside each vector of 8 (a block is whole
    // vectors): the partner by a permutation, the sum kept in the lower lane of each pair
    for (int64_t i = 0; i < C; i += 8) {
      __m256 x = _mm256_loadu_ps(v + i);
      __m256 p = _mm256_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1));
      x = _mm256_blend_ps(_mm256_add_ps(x, p), _mm256_sub_ps(p, x), 0xAA);
      p = _mm256_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2));
      x = _mm256_blend_ps(_mm256_add_ps(x, p), _mm256_sub_ps(p, x), 0xCC);
      p = _mm256_permute2f128_ps(x, x, 0x01);
      x = _mm256_blend_ps(_mm256_add_ps(x, p), _mm256_sub_ps(p, x), 0xF0);
      _mm256_storeu_ps(v + i, x);
    }
    h = 8;
    for (; h < block; h *= 2) {
      const bool last = 2 * h == block;
      const __m256 sv = _mm256_set1_ps(last ? scale : 1.f);
      for (int64_t b = 0; b < C; b += block)
        for (int64_t i = b; i < b + block; i += 2 * h)
          for (int64_t j = i; j < i + h; j += 8) {
            const __m256 a = _mm256_loadu_ps(v + j), c = _mm256_loadu_ps(v + j + h);
            _mm256_storeu_ps(v + j, _mm256_mul_ps(_mm256_add_ps(a, c), sv));
            _mm256_storeu_ps(v + j + h, _mm256_mul_ps(_mm256_sub_ps(a, c), sv));
          }
    }
    if (block == 8)
      for (int64_t i = 0; i < C; ++i) v[i] *= scale;
    return;
  }
#endif
  for (; h < block; h *= 2)
    for (int64_t i = 0; i < C; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = v[j], c = v[j + h];
        v[j] = a + c;
        v[j + h] = a - c;
      }
  for (int64_t i = 0; i < C; ++i) v[i] *= scale;
}

at::Tensor hadamard_rows(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "hadamard_rows: x must be a 2-D float32 tensor");
  TORCH_CHECK(block >= 1 && (block & (block - 1)) == 0 && x.size(1) % block == 0,
              "hadamard_rows: block must be a power of two dividing the columns");
  const auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  const int64_t R = xc.size(0), C = xc.size(1);
  const float* src = xc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const float scale = 1.f / std::sqrt(static_cast<float>(block));
  auto rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      std::memcpy(dst + r * C, src + r * C, C * sizeof(float));
      hadamard_row(dst + r * C, C, block, scale);
    }
  };
  if (R * C >= (1 << 17))  // below, one thread's work is shorter than waking the other
    at::parallel_for(0, R, 1, rows);
  else
    rows(0, R);
  return out;
}

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
  m.def("rope_rows(Tensor positions, Tensor inv_freq) -> (Tensor, Tensor)");
  m.def("hadamard_rows(Tensor x, int block) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, int window) -> Tensor");
  m.def("prefill_attention_head_multiple() -> int", prefill_attention_head_multiple);
}

TORCH_LIBRARY_IMPL(lifeline_ext, CPU, m) {
  m.impl("int8_linear", int8_linear);
  m.impl("decode_attention", decode_attention);
  m.impl("paged_attention", paged_attention);
  m.impl("rope_rows", rope_rows);
  m.impl("hadamard_rows", hadamard_rows);
  m.impl("prefill_attention", prefill_attention);
}
