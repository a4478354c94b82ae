// GGUF's quantized blocks computed as stored (lifeline/model/gguf_linear.py).
//
// lifeline_ext::gguf_linear(x, w, qtype, out_features): y = x W^T for float32 rows x [N, K] and a
// weight W [M, K] given as the GGUF file's own bytes [M, row_bytes] of GGML type `qtype` (the
// file is memory-mapped: nothing is copied or dequantized ahead of time).
//
// Every supported type is, per sub-block of 16 values, w = d * u + m with u unsigned 8-bit
// (Q4_0: d * q - 8 d; Q4_1: d * q + min; Q5_0: d * q - 16 d; Q4_K/Q5_K: (d sc) q - dmin mn;
// Q6_K: (d sc) q - 32 (d sc)); Q8_0 is signed (w = d q, q in [-128, 127], m = 0). The
// activations are quantized once per call to int8 with one scale per 32 values (llama.cpp's
// Q8_0 for activations): x = dx a. Then
//     sum_k w_k x_k = sum_b dx_b (sum_{h<2} d_{2b+h} dot16(u, a)) + sum_j m_j (dx sum_16 a)_j,
// the integer dots by u8 x s8 multiply-adds: AVX-512 VNNI or AVX-VNNI (vpdpbusd) where the CPU
// has either, AVX2 (vpmaddubsw + vpmaddwd: every u8 x s8 pair here fits int16: u <= 63, or
// |q| <= 128 for Q8_0 by the sign trick) where not, and portable C++ on any other CPU. The path
// is chosen at run time from what the CPU reports (`gguf_kernel_path`), never assumed at build
// time, and can be forced down for tests (`gguf_force_path`).
//
// One weight row is decoded at a time into (u, d, m) in L1 and then dotted with every
// activation row: a lone decode row pays one decode per weight byte; a batch shares it.
//
// lifeline_ext::gguf_get_rows(w, qtype, ids, K): float32 rows `ids` of W (embedding lookups and
// the LM head's exact rescoring), decoded the same way.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// GGML type ids (ggml.h)
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct TypeInfo {
  int64_t block_values;
  int64_t block_bytes;
};

bool type_info(int64_t qtype, TypeInfo* info) {
  switch (qtype) {
    case Q4_0: *info = {32, 18}; return true;
    case Q4_1: *info = {32, 20}; return true;
    case Q5_0: *info = {32, 22}; return true;
    case Q8_0: *info = {32, 34}; return true;
    case Q4_K: *info = {256, 144}; return true;
    case Q5_K: *info = {256, 176}; return true;
    case Q6_K: *info = {256, 210}; return true;
    default: return false;
  }
}

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = mant;
      do { m <<= 1; ++e; } while (!(m & 0x400));
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The 6-bit (scale, min) of sub-block j of a Q4_K / Q5_K block (llama.cpp's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Decode one weight row of K values into u [K] (u8, or s8 for Q8_0), d [K/16], m [K/16].
void decode_row(int64_t qtype, const uint8_t* row, int64_t K, uint8_t* u, float* d, float* m) {
  switch (qtype) {
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q8_0: {
      const int64_t bytes = qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q5_0 ? 22 : 34;
      for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* blk = row + b * bytes;
        const float scale = fp16(blk);
        float offset = 0.f;
        uint8_t* out = u + b * 32;
        if (qtype == Q8_0) {
          std::memcpy(out, blk + 2, 32);
        } else if (qtype == Q5_0) {
          uint32_t qh;
          std::memcpy(&qh, blk + 2, 4);
          const uint8_t* qs = blk + 6;
          for (int j = 0; j < 16; ++j) {
            out[j] = (qs[j] & 0xF) | (((qh >> j) << 4) & 0x10);
            out[j + 16] = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
          }
          offset = -16.f * scale;
        } else {
          const uint8_t* qs = blk + (qtype == Q4_1 ? 4 : 2);
          for (int j = 0; j < 16; ++j) {
            out[j] = qs[j] & 0xF;
            out[j + 16] = qs[j] >> 4;
          }
          offset = qtype == Q4_1 ? fp16(blk + 2) : -8.f * scale;
        }
        d[2 * b] = d[2 * b + 1] = scale;
        m[2 * b] = m[2 * b + 1] = offset;
      }
      return;
    }
    case Q4_K:
    case Q5_K: {
      const int64_t bytes = qtype == Q4_K ? 144 : 176;
      for (int64_t b = 0; b < K / 256; ++b) {
        const uint8_t* blk = row + b * bytes;
        const float dd = fp16(blk), dmin = fp16(blk + 2);
        const uint8_t* scales = blk + 4;
        const uint8_t* qh = blk + 16;  // Q5_K only
        const uint8_t* ql = blk + (qtype == Q4_K ? 16 : 48);
        uint8_t* out = u + b * 256;
        for (int j = 0; j < 4; ++j) {
          for (int l = 0; l < 32; ++l) {
            uint8_t lo = ql[32 * j + l] & 0xF, hi = ql[32 * j + l] >> 4;
            if (qtype == Q5_K) {
              lo |= ((qh[l] >> (2 * j)) & 1) << 4;
              hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
            }
            out[64 * j + l] = lo;
            out[64 * j + 32 + l] = hi;
          }
        }
        for (int s = 0; s < 8; ++s) {
          uint8_t sc, mn;
          scale_min_k4(s, scales, &sc, &mn);
          const float ds = dd * sc, ms = -dmin * mn;
          float* db = d + b * 16 + 2 * s;
          float* mb = m + b * 16 + 2 * s;
          db[0] = db[1] = ds;
          mb[0] = mb[1] = ms;
        }
      }
      return;
    }
    case Q6_K: {
      for (int64_t b = 0; b < K / 256; ++b) {
        const uint8_t* blk = row + b * 210;
        const uint8_t* ql = blk;
        const uint8_t* qh = blk + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const float dd = fp16(blk + 208);
        uint8_t* out = u + b * 256;
        for (int half = 0; half < 2; ++half) {
          const uint8_t* l0 = ql + 64 * half;
          const uint8_t* h0 = qh + 32 * half;
          uint8_t* o = out + 128 * half;
          for (int l = 0; l < 32; ++l) {
            o[l] = (l0[l] & 0xF) | (((h0[l] >> 0) & 3) << 4);
            o[l + 32] = (l0[l + 32] & 0xF) | (((h0[l] >> 2) & 3) << 4);
            o[l + 64] = (l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4);
            o[l + 96] = (l0[l + 32] >> 4) | (((h0[l] >> 6) & 3) << 4);
          }
        }
        for (int s = 0; s < 16; ++s) {
          const float ds = dd * sc[s];
          d[b * 16 + s] = ds;
          m[b * 16 + s] = -32.f * ds;
        }
      }
      return;
    }
  }
}

// Activations: a [K] int8 with dx [K/32] per 32 values, and sa [K/16] = dx * (sum of a over 16).
void quantize_row(const float* x, int64_t K, int8_t* a, float* dx, float* sa) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float scale = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int8_t* ab = a + b * 32;
    int s0 = 0, s1 = 0;
    for (int i = 0; i < 32; ++i) {
      const int q = static_cast<int>(std::nearbyint(xb[i] * inv));
      ab[i] = static_cast<int8_t>(q);
      (i < 16 ? s0 : s1) += q;
    }
    dx[b] = scale;
    sa[2 * b] = scale * s0;
    sa[2 * b + 1] = scale * s1;
  }
}

// Kernel paths, best first.
enum Path : int { PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_AVXVNNI = 2, PATH_AVX512VNNI = 3 };

int detect_path() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw"))
    return PATH_AVX512VNNI;
  if (__builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("avx2")) return PATH_AVXVNNI;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return PATH_AVX2;
  return PATH_SCALAR;
}

const int best_path = detect_path();
std::atomic<int> forced_path{-1};

int current_path() {
  const int f = forced_path.load(std::memory_order_relaxed);
  return f >= 0 && f < best_path ? f : best_path;
}

// A decoded weight row: u [K] (u8, or s8 for Q8_0), the scales of each 32-value block as 8
// lanes (`ROWS` lanes 0-3: values 0-15's scale, 4-7: values 16-31's: the lanes of a 32-byte
// integer dot), and the offsets m [K/16].
struct Decoded {
  std::vector<uint8_t> u;
  std::vector<float> dvec, d, m;
  explicit Decoded(int64_t K) : u(K), dvec(K / 4), d(K / 16), m(K / 16) {}
  void decode(int64_t qtype, const uint8_t* row, int64_t K) {
    decode_row(qtype, row, K, u.data(), d.data(), m.data());
    for (int64_t b = 0; b < K / 32; ++b)
      for (int l = 0; l < 8; ++l) dvec[8 * b + l] = d[2 * b + l / 4];
  }
};

// Rows decoded together and dotted with each activation row in one pass: independent
// accumulators (the multiply-adds of one row are a chain) and one load of the activations.
constexpr int ROWS = 4;

void dot_scalar(const Decoded* w, int rows, bool is_signed, const int8_t* a, const float* dx,
                const float* sa, int64_t K, float* out) {
  for (int r = 0; r < rows; ++r) {
    const uint8_t* u = w[r].u.data();
    float acc = 0.f;
    for (int64_t j = 0; j < K / 16; ++j) {
      int32_t s = 0;
      if (is_signed) {
        const int8_t* q = reinterpret_cast<const int8_t*>(u + 16 * j);
        for (int i = 0; i < 16; ++i) s += int32_t(q[i]) * a[16 * j + i];
      } else {
        for (int i = 0; i < 16; ++i) s += int32_t(u[16 * j + i]) * a[16 * j + i];
      }
      acc += dx[j / 2] * w[r].d[j] * float(s) + w[r].m[j] * sa[j];
    }
    out[r] = acc;
  }
}

#define LIFELINE_HSUM(acc, result)                                                          \
  {                                                                                         \
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));     \
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                             \
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));                                               \
    result = _mm_cvtss_f32(s4);                                                             \
  }

// ROWS rows' dots with one activation row; DOT32 is the 32-byte u8 x s8 dot into 8 int32 lanes
// (lanes 0-3: bytes 0-15, lanes 4-7: bytes 16-31).
#define LIFELINE_DOT_ROWS(DOT32)                                                            \
  if (rows != ROWS) return dot_scalar(w, rows, is_signed, a, dx, sa, K, out);               \
  __m256 acc[ROWS], off[ROWS];                                                              \
  for (int r = 0; r < ROWS; ++r) acc[r] = off[r] = _mm256_setzero_ps();                     \
  for (int64_t b = 0; b < K / 32; ++b) {                                                    \
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * b));     \
    const __m256 sx = _mm256_set1_ps(dx[b]);                                                \
    for (int r = 0; r < ROWS; ++r) {                                                        \
      __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r].u.data() + 32 * b)); \
      __m256i xr = x;                                                                       \
      if (is_signed) {                                                                      \
        xr = _mm256_sign_epi8(x, q);                                                        \
        q = _mm256_sign_epi8(q, q);                                                         \
      }                                                                                     \
      const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(w[r].dvec.data() + 8 * b), sx);       \
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT32(q, xr)), sc, acc[r]);               \
    }                                                                                       \
  }                                                                                         \
  const int64_t n16 = K / 16;                                                               \
  int64_t j = 0;                                                                            \
  for (; j + 8 <= n16; j += 8) {                                                            \
    const __m256 s = _mm256_loadu_ps(sa + j);                                               \
    for (int r = 0; r < ROWS; ++r)                                                          \
      off[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w[r].m.data() + j), s, off[r]);              \
  }                                                                                         \
  for (int r = 0; r < ROWS; ++r) {                                                          \
    float total;                                                                            \
    LIFELINE_HSUM(_mm256_add_ps(acc[r], off[r]), total);                                    \
    for (int64_t t = j; t < n16; ++t) total += w[r].m[t] * sa[t];                           \
    out[r] = total;                                                                         \
  }

__attribute__((target("avx2,fma"))) inline __m256i dot32_avx2(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

__attribute__((target("avx2,fma"))) void dot_avx2(const Decoded* w, int rows, bool is_signed,
                                                  const int8_t* a, const float* dx,
                                                  const float* sa, int64_t K, float* out) {
  LIFELINE_DOT_ROWS(dot32_avx2)
}

__attribute__((target("avx2,fma,avxvnni"))) inline __m256i dot32_avxvnni(__m256i w, __m256i x) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
}

__attribute__((target("avx2,fma,avxvnni"))) void dot_avxvnni(const Decoded* w, int rows,
                                                             bool is_signed, const int8_t* a,
                                                             const float* dx, const float* sa,
                                                             int64_t K, float* out) {
  LIFELINE_DOT_ROWS(dot32_avxvnni)
}

__attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni"))) inline __m256i
dot32_avx512vnni(__m256i w, __m256i x) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
}

__attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni"))) void dot_avx512vnni(
    const Decoded* w, int rows, bool is_signed, const int8_t* a, const float* dx,
    const float* sa, int64_t K, float* out) {
  LIFELINE_DOT_ROWS(dot32_avx512vnni)
}

using DotFn = void (*)(const Decoded*, int, bool, const int8_t*, const float*, const float*,
                       int64_t, float*);

DotFn dot_for(int path) {
  switch (path) {
    case PATH_AVX512VNNI: return dot_avx512vnni;
    case PATH_AVXVNNI: return dot_avxvnni;
    case PATH_AVX2: return dot_avx2;
    default: return dot_scalar;
  }
}

void check_weight(const at::Tensor& w, int64_t qtype, int64_t K, TypeInfo* info, const char* op) {
  TORCH_CHECK(type_info(qtype, info), op, ": unsupported GGML type ", qtype);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op,
              ": weights must be contiguous uint8 [rows, row_bytes]");
  TORCH_CHECK(K > 0 && K % info->block_values == 0, op, ": ", K,
              " values a row is not a whole number of blocks of ", info->block_values);
  TORCH_CHECK(w.size(1) == K / info->block_values * info->block_bytes, op, ": a row of ", K,
              " values takes ", K / info->block_values * info->block_bytes, " bytes, not ",
              w.size(1));
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                       int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "gguf_linear: x must be float32 [N, K]");
  const int64_t N = x.size(0), K = x.size(1), M = w.size(0);
  TypeInfo info;
  check_weight(w, qtype, K, &info, "gguf_linear");
  TORCH_CHECK(out_features == M, "gguf_linear: ", M, " weight rows, not ", out_features);
  auto xc = x.contiguous();
  auto out = at::empty({N, M}, x.options());
  if (N == 0 || M == 0) return out;
  // the activations, quantized once
  std::vector<int8_t> a(N * K);
  std::vector<float> dx(N * K / 32), sa(N * K / 16);
  const float* xp = xc.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    quantize_row(xp + n * K, K, a.data() + n * K, dx.data() + n * K / 32, sa.data() + n * K / 16);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  float* op = out.data_ptr<float>();
  const DotFn dot = dot_for(current_path());
  const bool is_signed = qtype == Q8_0;
  // groups of ROWS rows per task: enough work to be worth a thread, at least
  const int64_t groups = (M + ROWS - 1) / ROWS;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, ROWS * K * N));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    std::vector<Decoded> rows(ROWS, Decoded(K));
    float part[ROWS];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * ROWS;
      const int count = static_cast<int>(std::min<int64_t>(ROWS, M - first));
      for (int r = 0; r < count; ++r) rows[r].decode(qtype, wp + (first + r) * row_bytes, K);
      for (int64_t n = 0; n < N; ++n) {
        dot(rows.data(), count, is_signed, a.data() + n * K, dx.data() + n * K / 32,
            sa.data() + n * K / 16, K, part);
        for (int r = 0; r < count; ++r) op[n * M + first + r] = part[r];
      }
    }
  });
  return out;
}

at::Tensor gguf_get_rows(const at::Tensor& w, int64_t qtype, const at::Tensor& ids,
                         int64_t K) {
  TypeInfo info;
  check_weight(w, qtype, K, &info, "gguf_get_rows");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "gguf_get_rows: ids must be int64");
  auto idc = ids.contiguous();
  const int64_t n = idc.numel(), M = w.size(0), row_bytes = w.size(1);
  auto out = at::empty({n, K}, w.options().dtype(at::kFloat));
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < M, "gguf_get_rows: row ", ip[i], " out of [0, ", M, ")");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const bool is_signed = qtype == Q8_0;
  at::parallel_for(0, n, std::max<int64_t>(1, 8192 / K), [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> u(K);
    std::vector<float> d(K / 16), m(K / 16);
    for (int64_t i = begin; i < end; ++i) {
      decode_row(qtype, wp + ip[i] * row_bytes, K, u.data(), d.data(), m.data());
      float* o = op + i * K;
      for (int64_t k = 0; k < K; ++k) {
        const float q = is_signed ? float(int8_t(u[k])) : float(u[k]);
        o[k] = d[k / 16] * q + m[k / 16];
      }
    }
  });
  return out.view(ids.sizes().vec().size() ? [&] {
    auto s = ids.sizes().vec();
    s.push_back(K);
    return s;
  }() : std::vector<int64_t>{K});
}

int64_t gguf_kernel_path() { return current_path(); }

int64_t gguf_force_path(int64_t path) {
  forced_path.store(static_cast<int>(path), std::memory_order_relaxed);
  return current_path();
}

}  // namespace

TORCH_LIBRARY(lifeline_gguf, m) {
  m.def("gguf_linear(Tensor x, Tensor w, int qtype, int out_features) -> Tensor");
  m.def("gguf_get_rows(Tensor w, int qtype, Tensor ids, int K) -> Tensor");
  m.def("gguf_kernel_path() -> int", gguf_kernel_path);
  m.def("gguf_force_path(int path) -> int", gguf_force_path);
}

TORCH_LIBRARY_IMPL(lifeline_gguf, CPU, m) {
  m.impl("gguf_linear", gguf_linear);
  m.impl("gguf_get_rows", gguf_get_rows);
}
