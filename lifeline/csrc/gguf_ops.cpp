// GGUF's quantized blocks computed as stored (lifeline.model.gguf_rows: GGUFLinear, StoredEmbedding).
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
// time, and can be forced down for tests (`gguf_force_path`: a path the CPU lacks gives the best
// one below it that it has).
//
// Each weight row's blocks are unpacked in registers and dotted with up to four activation
// rows at once (the SIMD kernels: the kernel pass at the end of this file, compiled once per
// instruction set); the portable path decodes a row into (u, d, m) first. From
// `gemm_min_rows` rows the weight is decoded into a buffer for PyTorch's GEMM instead
// (`gguf_set_gemm`).
//
// lifeline_ext::gguf_get_rows(w, qtype, ids, K): float32 rows `ids` of W (embedding lookups and
// the LM head's exact rescoring), decoded the same way.
#ifndef LIFELINE_GGUF_KERNEL_PASS
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <atomic>
#include <functional>
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

// Weights repacked for one-row products (`gguf_repack`): 4-bit values of eight rows interleaved,
// so that one pass over a 32-value block dots eight rows at once and its scales are one vector
// (the dot kernels above spend most of a block on one row's scalar scale work: ~10 cycles a
// block, a third of the memory's pace on two cores). Per group of 8 rows (the last padded
// with zero rows) and block of 32 values: 128 bytes of nibbles, rows (0,1), (2,3), (4,5), (6,7)
// in 32 bytes each (a row's 16 bytes: value i in the low nibble of byte i, value i + 16 in the
// high one), then the 8 rows' d and the 8 rows' m (w = d u + m) in the lane order the kernel's
// horizontal adds leave them in (`X8_LANE`): fp16 as stored for Q4_1 (160 bytes), float32 for
// Q4_0 and Q4_K (192 bytes: Q4_K's sub-block scale d * sc, exact in float32, not in fp16).
// Q5_0 (X8_Q5, 176 bytes, the file's own 22 bytes a row and block): the nibbles as above, the
// 8 rows' d as stored (fp16; m = -16 d is not stored), then each row pair's fifth bits as two
// 32-bit masks (bit i of the first: byte i of the pair's 32 bytes of low nibbles; of the
// second: of its high nibbles).
enum : int64_t { X8_F16 = 1024, X8_F32 = 1025, X8_Q5 = 1026 };
constexpr int X8_LANE[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // lane -> row of the group
constexpr int X8_POS[8] = {0, 4, 1, 5, 2, 6, 3, 7};   // row of the group -> lane

inline bool is_x8(int64_t qtype) { return qtype == X8_F16 || qtype == X8_F32 || qtype == X8_Q5; }
inline int64_t x8_block_bytes(int64_t qtype) {
  return qtype == X8_F16 ? 160 : qtype == X8_Q5 ? 176 : 192;
}
inline int64_t x8_type_for(int64_t qtype) {
  return qtype == Q4_1 ? X8_F16 : qtype == Q4_0 || qtype == Q4_K ? X8_F32 : qtype == Q5_0 ? X8_Q5 : -1;
}

// Row r's fifth bits in an X8_Q5 block at p: bit i for its value i (0-31).
inline uint32_t x8_q5_bits(const uint8_t* p, int r) {
  uint32_t lo, hi;
  std::memcpy(&lo, p + 144 + 8 * (r / 2), 4);
  std::memcpy(&hi, p + 148 + 8 * (r / 2), 4);
  const int shift = 16 * (r % 2);
  return ((lo >> shift) & 0xFFFFu) | (((hi >> shift) & 0xFFFFu) << 16);
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

// Activations: a [K] int8 with dx [K/32] per 32 values, s16 [K/16] = dx * (sum of a over 16)
// and s32 [K/32] over 32.
void quantize_row(const float* x, int64_t K, int8_t* a, float* dx, float* s16, float* s32) {
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
    s16[2 * b] = scale * s0;
    s16[2 * b + 1] = scale * s1;
    s32[b] = scale * (s0 + s1);
  }
}

// N activation rows quantized (`quantize_row`), row n at a + n K, dx + n K/32, ...
struct Acts {
  const int8_t* a;
  const float* dx;
  const float* s16;
  const float* s32;
  int64_t K;
};

// Kernel paths, best first.
enum Path : int { PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_AVXVNNI = 2, PATH_AVX512VNNI = 3 };

// The paths this CPU runs, a bit each: the VNNI paths are not nested (a Zen 4 has
// AVX-512 VNNI but not the VEX-encoded AVX-VNNI).
int detect_paths() {
  __builtin_cpu_init();
  int paths = 1 << PATH_SCALAR;
  // every SIMD path needs AVX2, FMA and F16C (the blocks' fp16 scales)
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")))
    return paths;
  paths |= 1 << PATH_AVX2;
  if (__builtin_cpu_supports("avxvnni")) paths |= 1 << PATH_AVXVNNI;
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512f"))
    paths |= 1 << PATH_AVX512VNNI;
  return paths;
}

const int supported_paths = detect_paths();
const int best_path = 31 - __builtin_clz(supported_paths);
std::atomic<int> forced_path{-1};

// The forced path, or the best this CPU runs below it (never one it does not run).
int current_path() {
  int f = forced_path.load(std::memory_order_relaxed);
  if (f < 0 || f > best_path) return best_path;
  while (!(supported_paths & (1 << f))) --f;
  return f;
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

// The SIMD kernels, compiled once per instruction set: the kernel pass at the end of this file
// is included three times, each inside its own namespace and `#pragma GCC target`, with that
// set's 32-byte u8 x s8 dot (`dot32`: 8 int32 lanes, lane i the sum of bytes 4i..4i+3).
#define LIFELINE_GGUF_KERNEL_PASS 1

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
inline __m256i dot32(__m256i u, __m256i x) {
  // u <= 63 (or <= 128 for Q8_0's magnitudes) and |x| <= 127: a pair's sum fits int16
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}
// dot32(lo, xl) + dot32(hi, xh) for 4- or 5-bit u (<= 31): each pair's int16 sum <= 7874, two
// <= 15748
inline __m256i dot64(__m256i lo, __m256i xl, __m256i hi, __m256i xh) {
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xl),
                                            _mm256_maddubs_epi16(hi, xh)),
                           _mm256_set1_epi16(1));
}
#include __FILE__
}  // namespace isa_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace isa_avxvnni {
inline __m256i dot32(__m256i u, __m256i x) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x);
}
inline __m256i dot64(__m256i lo, __m256i xl, __m256i hi, __m256i xh) {
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, xl), hi, xh);
}
#include __FILE__
}  // namespace isa_avxvnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
namespace isa_avx512vnni {
inline __m256i dot32(__m256i u, __m256i x) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
}
inline __m256i dot64(__m256i lo, __m256i xl, __m256i hi, __m256i xh) {
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xl), hi, xh);
}
#include __FILE__
}  // namespace isa_avx512vnni
#pragma GCC pop_options

// The portable path: one weight row decoded into (u, d, m), then dotted value by value.
void linear_rows_scalar(int64_t qtype, const uint8_t* wp, int64_t row_bytes, int64_t r0,
                        int64_t r1, const Acts& x, int64_t N, float* out, int64_t M) {
  Decoded row(x.K);
  const bool is_signed = qtype == Q8_0;
  for (int64_t r = r0; r < r1; ++r) {
    row.decode(qtype, wp + r * row_bytes, x.K);
    for (int64_t n = 0; n < N; ++n) {
      float part;
      dot_scalar(&row, 1, is_signed, x.a + n * x.K, x.dx + n * (x.K / 32),
                 x.s16 + n * (x.K / 16), x.K, &part);
      out[n * M + r] = part;
    }
  }
}

using LinearRows = void (*)(int64_t, const uint8_t*, int64_t, int64_t, int64_t, const Acts&,
                            int64_t, float*, int64_t);

using DequantRows = void (*)(int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t, void*,
                             bool);

void dequant_rows_scalar(int64_t qtype, const uint8_t* wp, int64_t row_bytes, int64_t r0,
                         int64_t r1, int64_t K, void* out, bool bf16) {
  std::vector<uint8_t> u(K);
  std::vector<float> d(K / 16), m(K / 16);
  const bool is_signed = qtype == Q8_0;
  for (int64_t r = r0; r < r1; ++r) {
    decode_row(qtype, wp + r * row_bytes, K, u.data(), d.data(), m.data());
    for (int64_t k = 0; k < K; ++k) {
      const float v = d[k / 16] * (is_signed ? float(int8_t(u[k])) : float(u[k])) + m[k / 16];
      if (bf16)
        static_cast<at::BFloat16*>(out)[r * K + k] = at::BFloat16(v);
      else
        static_cast<float*>(out)[r * K + k] = v;
    }
  }
}

DequantRows dequant_rows_for(int path) {
  switch (path) {
    case PATH_AVX512VNNI: return isa_avx512vnni::dequant_rows;
    case PATH_AVXVNNI: return isa_avxvnni::dequant_rows;
    case PATH_AVX2: return isa_avx2::dequant_rows;
    default: return dequant_rows_scalar;
  }
}

LinearRows linear_rows_for(int path) {
  switch (path) {
    case PATH_AVX512VNNI: return isa_avx512vnni::linear_rows;
    case PATH_AVXVNNI: return isa_avxvnni::linear_rows;
    case PATH_AVX2: return isa_avx2::linear_rows;
    default: return linear_rows_scalar;
  }
}

// ---- repacked weights, portable path and dispatch

// Row r of a repacked group, block b: u [32], d, m.
void x8_unpack(int64_t qtype, const uint8_t* gp, int64_t b, int r, uint8_t* u, float* d, float* m) {
  const uint8_t* p = gp + b * x8_block_bytes(qtype);
  const uint8_t* q = p + (r / 2) * 32 + (r % 2) * 16;
  for (int i = 0; i < 16; ++i) {
    u[i] = q[i] & 15;
    u[i + 16] = q[i] >> 4;
  }
  if (qtype == X8_Q5) {
    const uint32_t bits = x8_q5_bits(p, r);
    for (int i = 0; i < 32; ++i) u[i] |= ((bits >> i) & 1) << 4;
    *d = fp16(p + 128 + 2 * X8_POS[r]);
    *m = -16.f * *d;
  } else if (qtype == X8_F16) {
    *d = fp16(p + 128 + 2 * X8_POS[r]);
    *m = fp16(p + 144 + 2 * X8_POS[r]);
  } else {
    std::memcpy(d, p + 128 + 4 * X8_POS[r], 4);
    std::memcpy(m, p + 160 + 4 * X8_POS[r], 4);
  }
}

void x8_linear_scalar(int64_t qtype, const uint8_t* wp, int64_t g0, int64_t g1, const Acts& x,
                      int64_t N, float* out, int64_t M) {
  const int64_t nb = x.K / 32, group_bytes = nb * x8_block_bytes(qtype);
  uint8_t u[32];
  float d, m;
  for (int64_t g = g0; g < g1; ++g)
    for (int r = 0; r < 8 && g * 8 + r < M; ++r)
      for (int64_t n = 0; n < N; ++n) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          x8_unpack(qtype, wp + g * group_bytes, b, r, u, &d, &m);
          const int8_t* a = x.a + n * x.K + 32 * b;
          int32_t sum = 0;
          for (int i = 0; i < 32; ++i) sum += int32_t(u[i]) * a[i];
          acc += float(sum) * (d * x.dx[n * nb + b]) + m * x.s32[n * nb + b];
        }
        out[n * M + g * 8 + r] = acc;
      }
}

void x8_dequant_scalar(int64_t qtype, const uint8_t* wp, int64_t g0, int64_t g1, int64_t M,
                       int64_t K, void* out, bool bf16) {
  const int64_t nb = K / 32, group_bytes = nb * x8_block_bytes(qtype);
  uint8_t u[32];
  float d, m;
  for (int64_t g = g0; g < g1; ++g)
    for (int r = 0; r < 8 && g * 8 + r < M; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        x8_unpack(qtype, wp + g * group_bytes, b, r, u, &d, &m);
        for (int i = 0; i < 32; ++i) {
          const float v = d * float(u[i]) + m;
          const int64_t k = (g * 8 + r) * K + 32 * b + i;
          if (bf16)
            static_cast<at::BFloat16*>(out)[k] = at::BFloat16(v);
          else
            static_cast<float*>(out)[k] = v;
        }
      }
}

using X8Linear = void (*)(int64_t, const uint8_t*, int64_t, int64_t, const Acts&, int64_t, float*,
                          int64_t);
using X8Dequant = void (*)(int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t, void*, bool);

X8Linear x8_linear_for(int path) {
  switch (path) {
    case PATH_AVX512VNNI: return isa_avx512vnni::x8_linear;
    case PATH_AVXVNNI: return isa_avxvnni::x8_linear;
    case PATH_AVX2: return isa_avx2::x8_linear;
    default: return x8_linear_scalar;
  }
}

X8Dequant x8_dequant_for(int path) {
  switch (path) {
    case PATH_AVX512VNNI: return isa_avx512vnni::x8_dequant;
    case PATH_AVXVNNI: return isa_avxvnni::x8_dequant;
    case PATH_AVX2: return isa_avx2::x8_dequant;
    default: return x8_dequant_scalar;
  }
}

void check_x8(const at::Tensor& w, int64_t qtype, int64_t K, int64_t M, const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op,
              ": repacked weights must be contiguous uint8 [groups, group_bytes]");
  TORCH_CHECK(K > 0 && K % 32 == 0, op, ": ", K, " values a row is not a whole number of blocks of 32");
  TORCH_CHECK(w.size(0) == (M + 7) / 8 && w.size(1) == K / 32 * x8_block_bytes(qtype), op,
              ": repacked weights of ", M, " rows of ", K, " values are [", (M + 7) / 8, ", ",
              K / 32 * x8_block_bytes(qtype), "], not [", w.size(0), ", ", w.size(1), "]");
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


// [0, n) in contiguous ranges of at least `grain` rows on PyTorch's intra-op threads (OpenMP:
// the team the compiled graph's own kernels use; a pool of our own spinning beside it cost
// 3x a product on two cores, docs/performance.md).
void parallel_ranges(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  at::parallel_for(0, n, grain, fn);
}

// Batches of at least `gemm_min_rows` rows (prefill) take another road: the weight is decoded
// once into a float32 or bfloat16 matrix (a transient buffer, freed after the call) and
// multiplied by PyTorch's GEMM (oneDNN: AMX or AVX512-BF16 where the CPU has them), which at
// hundreds of rows beats any dot-product kernel. 0 = never (`gguf_set_gemm`).
std::atomic<int64_t> gemm_min_rows{0};
std::atomic<bool> gemm_bf16{false};

// The [M, K] float32 or bfloat16 matrix a weight is decoded into: `scratch` (grown as needed
// and kept: a fresh buffer each call is a fresh mapping whose every page faults), else a new
// tensor.
at::Tensor decoded_buffer(const at::Tensor& w, int64_t M, int64_t K, bool bf16, at::Tensor* scratch) {
  const auto dtype = bf16 ? at::kBFloat16 : at::kFloat;
  if (scratch == nullptr) return at::empty({M, K}, w.options().dtype(dtype));
  if (!scratch->defined() || scratch->scalar_type() != dtype || scratch->numel() < M * K)
    *scratch = at::empty({M * K}, w.options().dtype(dtype));
  return scratch->narrow(0, 0, M * K).view({M, K});
}

at::Tensor dequantize_matrix(const at::Tensor& w, int64_t qtype, int64_t K, bool bf16,
                             at::Tensor* scratch = nullptr) {
  const int64_t M = w.size(0), row_bytes = w.size(1);
  at::Tensor out = decoded_buffer(w, M, K, bf16, scratch);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  void* op = out.data_ptr();
  const DequantRows rows = dequant_rows_for(current_path());
  parallel_ranges(M, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    rows(qtype, wp, row_bytes, begin, end, K, op, bf16);
  });
  return out;
}

// The activations quantized once per call (`quantize_row`, each row).
struct QuantizedActs {
  std::vector<int8_t> a;
  std::vector<float> dx, s16, s32;
  QuantizedActs(const float* xp, int64_t N, int64_t K)
      : a(N * K), dx(N * K / 32), s16(N * K / 16), s32(N * K / 32) {
    for (int64_t n = 0; n < N; ++n)
      quantize_row(xp + n * K, K, a.data() + n * K, dx.data() + n * K / 32,
                   s16.data() + n * K / 16, s32.data() + n * K / 32);
  }
  Acts view(int64_t K) const { return Acts{a.data(), dx.data(), s16.data(), s32.data(), K}; }
};

// A repacked weight decoded into [M, K] (the GEMM road), as `dequantize_matrix`.
at::Tensor x8_dequantize_matrix(const at::Tensor& w, int64_t qtype, int64_t K, int64_t M, bool bf16,
                                at::Tensor* scratch = nullptr) {
  at::Tensor out = decoded_buffer(w, M, K, bf16, scratch);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  void* op = out.data_ptr();
  const X8Dequant groups = x8_dequant_for(current_path());
  parallel_ranges(w.size(0), std::max<int64_t>(1, 2048 / K), [&](int64_t begin, int64_t end) {
    groups(qtype, wp, begin, end, M, K, op, bf16);
  });
  return out;
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                       int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "gguf_linear: x must be float32 [N, K]");
  const int64_t N = x.size(0), K = x.size(1);
  const bool x8 = is_x8(qtype);
  TypeInfo info;
  if (x8)
    check_x8(w, qtype, K, out_features, "gguf_linear");
  else
    check_weight(w, qtype, K, &info, "gguf_linear");
  const int64_t M = x8 ? out_features : w.size(0);
  TORCH_CHECK(out_features == M, "gguf_linear: ", M, " weight rows, not ", out_features);
  auto xc = x.contiguous();
  const int64_t gemm_rows = gemm_min_rows.load(std::memory_order_relaxed);
  if (gemm_rows > 0 && N >= gemm_rows && M > 0) {
    const bool bf16 = gemm_bf16.load(std::memory_order_relaxed);
    // one buffer per thread (engines of several models may run at once), the size of the
    // largest weight it has decoded: freed with the thread
    thread_local at::Tensor scratch;
    const auto wd = x8 ? x8_dequantize_matrix(w, qtype, K, M, bf16, &scratch)
                       : dequantize_matrix(w, qtype, K, bf16, &scratch);
    return bf16 ? at::linear(xc.to(at::kBFloat16), wd).to(at::kFloat) : at::linear(xc, wd);
  }
  auto out = at::empty({N, M}, x.options());
  if (N == 0 || M == 0) return out;
  const QuantizedActs q(xc.data_ptr<float>(), N, K);
  const Acts acts = q.view(K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  // a thread gets at least ~256K multiply-adds: a small product runs on the calling thread
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, K * N));
  if (x8) {
    const X8Linear groups = x8_linear_for(current_path());
    parallel_ranges(w.size(0), std::max<int64_t>(1, grain / 8), [&](int64_t begin, int64_t end) {
      groups(qtype, wp, begin, end, acts, N, op, M);
    });
    return out;
  }
  const int64_t row_bytes = w.size(1);
  const LinearRows rows = linear_rows_for(current_path());
  parallel_ranges(M, grain, [&](int64_t begin, int64_t end) {
    rows(qtype, wp, row_bytes, begin, end, acts, N, op, M);
  });
  return out;
}

// W's rows repacked eight at a time (X8_F16 / X8_F32 / X8_Q5, above) for `gguf_linear`:
// [ceil(M/8), K/32 * block bytes], the last group padded with zero rows. Q4_0, Q4_1, Q4_K and
// Q5_0 only.
at::Tensor gguf_repack(const at::Tensor& w, int64_t qtype, int64_t K) {
  TypeInfo info;
  check_weight(w, qtype, K, &info, "gguf_repack");
  const int64_t xt = x8_type_for(qtype);
  TORCH_CHECK(xt >= 0, "gguf_repack: no repacked layout for GGML type ", qtype);
  const int64_t M = w.size(0), G = (M + 7) / 8, nb = K / 32, BB = x8_block_bytes(xt);
  const int64_t row_bytes = w.size(1);
  auto out = at::zeros({G, nb * BB}, w.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int r = 0; r < 8 && g * 8 + r < M; ++r) {
        const uint8_t* src = wp + (g * 8 + r) * row_bytes;
        for (int64_t b = 0; b < nb; ++b) {
          uint8_t* p = op + (g * nb + b) * BB;
          uint8_t* q = p + (r / 2) * 32 + (r % 2) * 16;
          float d, m;
          if (qtype == Q4_1) {
            const uint8_t* blk = src + b * 20;
            std::memcpy(q, blk + 4, 16);
            std::memcpy(p + 128 + 2 * X8_POS[r], blk, 2);
            std::memcpy(p + 144 + 2 * X8_POS[r], blk + 2, 2);
            continue;
          }
          if (qtype == Q5_0) {
            const uint8_t* blk = src + b * 22;
            std::memcpy(q, blk + 6, 16);
            std::memcpy(p + 128 + 2 * X8_POS[r], blk, 2);
            uint32_t qh, lo, hi;
            std::memcpy(&qh, blk + 2, 4);
            uint8_t* masks = p + 144 + 8 * (r / 2);
            std::memcpy(&lo, masks, 4);
            std::memcpy(&hi, masks + 4, 4);
            lo |= (qh & 0xFFFFu) << (16 * (r % 2));
            hi |= (qh >> 16) << (16 * (r % 2));
            std::memcpy(masks, &lo, 4);
            std::memcpy(masks + 4, &hi, 4);
            continue;
          }
          if (qtype == Q4_0) {
            const uint8_t* blk = src + b * 18;
            std::memcpy(q, blk + 2, 16);
            d = fp16(blk);
            m = -8.f * d;
          } else {  // Q4_K: sub-block j of super-block b / 8, its nibbles rearranged
            const uint8_t* blk = src + (b / 8) * 144;
            const int j = static_cast<int>(b % 8);
            uint8_t sc, mn;
            scale_min_k4(j, blk + 4, &sc, &mn);
            d = fp16(blk) * sc;
            m = -fp16(blk + 2) * mn;
            const uint8_t* qs = blk + 16 + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            for (int i = 0; i < 16; ++i)
              q[i] = static_cast<uint8_t>(((qs[i] >> shift) & 15) | (((qs[i + 16] >> shift) & 15) << 4));
          }
          std::memcpy(p + 128 + 4 * X8_POS[r], &d, 4);
          std::memcpy(p + 160 + 4 * X8_POS[r], &m, 4);
        }
      }
  });
  return out;
}

int64_t gguf_repacked_type(int64_t qtype) { return x8_type_for(qtype); }

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

at::Tensor gguf_dequantize(const at::Tensor& w, int64_t qtype, int64_t K, bool bf16) {
  if (is_x8(qtype)) {  // every row of every group, the padding's zero rows included
    check_x8(w, qtype, K, w.size(0) * 8, "gguf_dequantize");
    return x8_dequantize_matrix(w, qtype, K, w.size(0) * 8, bf16);
  }
  TypeInfo info;
  check_weight(w, qtype, K, &info, "gguf_dequantize");
  return dequantize_matrix(w, qtype, K, bf16);
}

int64_t gguf_kernel_path() { return current_path(); }

int64_t gguf_set_gemm(int64_t min_rows, bool bf16) {
  gemm_bf16.store(bf16, std::memory_order_relaxed);
  gemm_min_rows.store(std::max<int64_t>(0, min_rows), std::memory_order_relaxed);
  return gemm_min_rows.load();
}

int64_t gguf_force_path(int64_t path) {
  forced_path.store(static_cast<int>(path), std::memory_order_relaxed);
  return current_path();
}

}  // namespace

TORCH_LIBRARY(lifeline_gguf, m) {
  m.def("gguf_linear(Tensor x, Tensor w, int qtype, int out_features) -> Tensor");
  m.def("gguf_get_rows(Tensor w, int qtype, Tensor ids, int K) -> Tensor");
  m.def("gguf_dequantize(Tensor w, int qtype, int K, bool bf16) -> Tensor");
  m.def("gguf_repack(Tensor w, int qtype, int K) -> Tensor");
  m.def("gguf_repacked_type(int qtype) -> int", gguf_repacked_type);
  m.def("gguf_kernel_path() -> int", gguf_kernel_path);
  m.def("gguf_force_path(int path) -> int", gguf_force_path);
  m.def("gguf_set_gemm(int min_rows, bool bf16) -> int", gguf_set_gemm);
}

TORCH_LIBRARY_IMPL(lifeline_gguf, CPU, m) {
  m.impl("gguf_linear", gguf_linear);
  m.impl("gguf_get_rows", gguf_get_rows);
  m.impl("gguf_repack", gguf_repack);
  m.impl("gguf_dequantize", gguf_dequantize);
}
#else  // LIFELINE_GGUF_KERNEL_PASS: the kernels of one instruction set (see above)

inline float h16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 bits to 32 bytes, 0xFF where the bit is set (byte i from bit i).
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL, 0x0202020202020202LL,
                         0x0303030303030303LL));
  const __m256i mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL);
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, mask), _mm256_set1_epi64x(-1LL));
}

// ---- block unpacking, shared by the dot kernels and the dequantizer

// A legacy block (Q4_0, Q4_1, Q5_0; not Q8_0) as w = d u + m: u in 32 bytes, d and m returned.
inline __m256i unpack_legacy(int64_t qtype, const uint8_t* blk, float* d, float* m) {
  *d = h16(blk);
  const __m128i q = _mm_loadu_si128(
      reinterpret_cast<const __m128i*>(blk + (qtype == Q4_1 ? 4 : qtype == Q5_0 ? 6 : 2)));
  __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
  if (qtype == Q5_0) {
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    u = _mm256_or_si256(u, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
    *m = -16.f * *d;
  } else {
    *m = qtype == Q4_1 ? h16(blk + 2) : -8.f * *d;
  }
  return u;
}

// Q4_K / Q5_K: sub-blocks 2i (lo) and 2i+1 (hi) of a super-block, from its 32 bytes `qs + 32 i`
// (and, for Q5_K, the high bits `hv`).
inline void unpack_k45(bool five_bits, const uint8_t* qs, __m256i hv, int i, __m256i* lo,
                       __m256i* hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), bit5 = _mm256_set1_epi8(0x10);
  const __m256i q = load32(qs + 32 * i);
  *lo = _mm256_and_si256(q, m4);
  *hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
  if (five_bits) {
    const __m256i b0 = _mm256_set1_epi8(static_cast<char>(1 << (2 * i)));
    const __m256i b1 = _mm256_set1_epi8(static_cast<char>(2 << (2 * i)));
    *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hv, b0), b0), bit5));
    *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hv, b1), b1), bit5));
  }
}

// Q6_K: half h of a super-block as four groups of 32 unsigned 6-bit values (w = (d sc)(u - 32)).
inline void unpack_q6k_half(const uint8_t* blk, int h, __m256i u[4]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
  const __m256i q0 = load32(blk + 64 * h), q1 = load32(blk + 64 * h + 32);
  const __m256i hh = load32(blk + 128 + 32 * h);
  for (int k = 0; k < 4; ++k) {
    const __m256i low = _mm256_and_si256(k < 2 ? (k ? q1 : q0)
                                                : _mm256_srli_epi16(k == 3 ? q1 : q0, 4), m4);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(hh, 2 * k), m3);
    u[k] = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
  }
}

// One weight row against NC activation rows n0.. (out[c * ostride]): the row's blocks are
// unpacked in registers once and dotted with each activation row. Two accumulators per row
// (even and odd blocks) keep the multiply-add chains short at NC = 1.
template <int T, int NC>
void legacy_rows(const uint8_t* w, int64_t nb, const Acts& x, int64_t n0, float* out,
                 int64_t ostride) {
  constexpr int BYTES = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : 34;
  const int64_t K = x.K;
  __m256 acc[NC][2];
  float off[NC][2];
  for (int c = 0; c < NC; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps(), off[c][0] = off[c][1] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BYTES;
    float d, m = 0.f;
    __m256i u;
    if constexpr (T == Q8_0) {
      d = h16(blk);
      u = load32(blk + 2);
    } else {
      u = unpack_legacy(T, blk, &d, &m);
    }
    __m256i ua = u;
    if constexpr (T == Q8_0) ua = _mm256_sign_epi8(u, u);
    for (int c = 0; c < NC; ++c) {
      const int64_t n = n0 + c;
      __m256i a = load32(x.a + n * K + 32 * b);
      if constexpr (T == Q8_0) a = _mm256_sign_epi8(a, u);
      const float s = d * x.dx[n * (K / 32) + b];
      acc[c][b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(ua, a)), _mm256_set1_ps(s),
                                      acc[c][b & 1]);
      if constexpr (T != Q8_0) off[c][b & 1] += m * x.s32[n * (K / 32) + b];
    }
  }
  for (int c = 0; c < NC; ++c)
    out[c * ostride] = hsum(_mm256_add_ps(acc[c][0], acc[c][1])) + (off[c][0] + off[c][1]);
}

// Q4_K and Q5_K: 256 values in 8 sub-blocks of 32, each w = (d sc) u - (dmin mn).
template <int T, int NC>
void k45_rows(const uint8_t* w, int64_t nb, const Acts& x, int64_t n0, float* out,
              int64_t ostride) {
  constexpr int BYTES = T == Q4_K ? 144 : 176;
  const int64_t K = x.K;
  __m256 acc[NC][2];
  float off[NC];
  for (int c = 0; c < NC; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps(), off[c] = 0.f;
  for (int64_t sb = 0; sb < nb; ++sb) {
    const uint8_t* blk = w + sb * BYTES;
    const float d = h16(blk), dmin = h16(blk + 2);
    float sc[8], mn[8];
    for (int j = 0; j < 8; ++j) {
      uint8_t s, mm;
      scale_min_k4(j, blk + 4, &s, &mm);
      sc[j] = d * s;
      mn[j] = dmin * mm;
    }
    const uint8_t* qs = blk + (T == Q4_K ? 16 : 48);
    __m256i hv = _mm256_setzero_si256();
    if constexpr (T == Q5_K) hv = load32(blk + 16);
    for (int c = 0; c < NC; ++c) {
      const float* s32 = x.s32 + (n0 + c) * (K / 32) + 8 * sb;
      float o = 0.f;
      for (int j = 0; j < 8; ++j) o += mn[j] * s32[j];
      off[c] -= o;
    }
    for (int i = 0; i < 4; ++i) {
      __m256i lo, hi;
      unpack_k45(T == Q5_K, qs, hv, i, &lo, &hi);
      const int64_t j = 8 * sb + 2 * i;  // the activation block of `lo`
      for (int c = 0; c < NC; ++c) {
        const int64_t n = n0 + c;
        const int8_t* a = x.a + n * K + 32 * j;
        const float* dx = x.dx + n * (K / 32) + j;
        acc[c][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(lo, load32(a))),
                                    _mm256_set1_ps(sc[2 * i] * dx[0]), acc[c][0]);
        acc[c][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(hi, load32(a + 32))),
                                    _mm256_set1_ps(sc[2 * i + 1] * dx[1]), acc[c][1]);
      }
    }
  }
  for (int c = 0; c < NC; ++c) out[c * ostride] = hsum(_mm256_add_ps(acc[c][0], acc[c][1])) + off[c];
}

// Q6_K: 256 values, 16 sub-blocks of 16 with signed 8-bit scales, w = (d sc) (u - 32).
template <int NC>
void q6k_rows(const uint8_t* w, int64_t nb, const Acts& x, int64_t n0, float* out,
              int64_t ostride) {
  const int64_t K = x.K;
  __m256 acc[NC][2];
  float off[NC];
  for (int c = 0; c < NC; ++c) acc[c][0] = acc[c][1] = _mm256_setzero_ps(), off[c] = 0.f;
  for (int64_t sb = 0; sb < nb; ++sb) {
    const uint8_t* blk = w + sb * 210;
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = h16(blk + 208);
    for (int h = 0; h < 2; ++h) {
      __m256i u[4];
      unpack_q6k_half(blk, h, u);
      for (int k = 0; k < 4; ++k) {
        const float slo = d * scales[8 * h + 2 * k], shi = d * scales[8 * h + 2 * k + 1];
        const int64_t j = 8 * sb + 4 * h + k;
        for (int c = 0; c < NC; ++c) {
          const int64_t n = n0 + c;
          const float dx = x.dx[n * (K / 32) + j];
          const float* s16 = x.s16 + n * (K / 16) + 2 * j;
          const __m256 scale = _mm256_set_m128(_mm_set1_ps(shi * dx), _mm_set1_ps(slo * dx));
          acc[c][k & 1] = _mm256_fmadd_ps(
              _mm256_cvtepi32_ps(dot32(u[k], load32(x.a + n * K + 32 * j))), scale, acc[c][k & 1]);
          off[c] -= 32.f * (slo * s16[0] + shi * s16[1]);
        }
      }
    }
  }
  for (int c = 0; c < NC; ++c) out[c * ostride] = hsum(_mm256_add_ps(acc[c][0], acc[c][1])) + off[c];
}

template <int NC>
void dot_rows(int64_t qtype, const uint8_t* w, const Acts& x, int64_t n0, float* out,
              int64_t ostride) {
  switch (qtype) {
    case Q4_0: return legacy_rows<Q4_0, NC>(w, x.K / 32, x, n0, out, ostride);
    case Q4_1: return legacy_rows<Q4_1, NC>(w, x.K / 32, x, n0, out, ostride);
    case Q5_0: return legacy_rows<Q5_0, NC>(w, x.K / 32, x, n0, out, ostride);
    case Q8_0: return legacy_rows<Q8_0, NC>(w, x.K / 32, x, n0, out, ostride);
    case Q4_K: return k45_rows<Q4_K, NC>(w, x.K / 256, x, n0, out, ostride);
    case Q5_K: return k45_rows<Q5_K, NC>(w, x.K / 256, x, n0, out, ostride);
    case Q6_K: return q6k_rows<NC>(w, x.K / 256, x, n0, out, ostride);
  }
}

// Weight rows [r0, r1) against all N activation rows, four at a time: out [N, M].
void linear_rows(int64_t qtype, const uint8_t* wp, int64_t row_bytes, int64_t r0, int64_t r1,
                 const Acts& x, int64_t N, float* out, int64_t M) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* w = wp + r * row_bytes;
    int64_t n = 0;
    for (; n + 4 <= N; n += 4) dot_rows<4>(qtype, w, x, n, out + n * M + r, M);
    switch (N - n) {
      case 3: dot_rows<3>(qtype, w, x, n, out + n * M + r, M); break;
      case 2: dot_rows<2>(qtype, w, x, n, out + n * M + r, M); break;
      case 1: dot_rows<1>(qtype, w, x, n, out + n * M + r, M); break;
    }
  }
}

// ---- repacked weights (X8_F16 / X8_F32 / X8_Q5): eight rows a block, one activation row at
// a time (the group's bytes stay in L1 between activation rows)
template <int64_t XT>
void x8_rows(const uint8_t* wp, int64_t g0, int64_t g1, const Acts& x, int64_t N, float* out,
             int64_t M) {
  constexpr bool F16 = XT != X8_F32, Q5 = XT == X8_Q5;
  constexpr int64_t BB = XT == X8_F16 ? 160 : Q5 ? 176 : 192;
  const int64_t K = x.K, nb = K / 32;
  const __m256i m4 = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = wp + g * nb * BB;
    for (int64_t n = 0; n < N; ++n) {
      const int8_t* a = x.a + n * K;
      const float* dx = x.dx + n * nb;
      const float* s32 = x.s32 + n * nb;
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), off = _mm256_setzero_ps();
      const uint8_t* p = gp;
      for (int64_t b = 0; b < nb; ++b, p += BB) {
        const __m128i al = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 32 * b));
        const __m128i ah = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 32 * b + 16));
        const __m256i xl = _mm256_set_m128i(al, al), xh = _mm256_set_m128i(ah, ah);
        __m256i v[4];
        for (int k = 0; k < 4; ++k) {
          const __m256i q = load32(p + 32 * k);
          __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
          if constexpr (Q5) {  // u <= 31: a pair's int16 sum <= 7874, dot64's two <= 15748
            uint32_t bl, bh;
            std::memcpy(&bl, p + 144 + 8 * k, 4);
            std::memcpy(&bh, p + 148 + 8 * k, 4);
            lo = _mm256_or_si256(lo, _mm256_and_si256(bits_to_bytes(bl), fifth));
            hi = _mm256_or_si256(hi, _mm256_and_si256(bits_to_bytes(bh), fifth));
          }
          v[k] = dot64(lo, xl, hi, xh);
        }
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        __m256 d, m;
        if constexpr (Q5) {
          d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 128)));
          m = _mm256_mul_ps(d, _mm256_set1_ps(-16.f));
        } else if constexpr (F16) {
          d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 128)));
          m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 144)));
        } else {
          d = _mm256_loadu_ps(reinterpret_cast<const float*>(p + 128));
          m = _mm256_loadu_ps(reinterpret_cast<const float*>(p + 160));
        }
        const __m256 s = _mm256_mul_ps(d, _mm256_set1_ps(dx[b]));
        if (b & 1)
          acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), s, acc1);
        else
          acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), s, acc0);
        off = _mm256_fmadd_ps(m, _mm256_set1_ps(s32[b]), off);
      }
      alignas(32) float t[8];
      _mm256_store_ps(t, _mm256_add_ps(_mm256_add_ps(acc0, acc1), off));
      float* o = out + n * M + g * 8;
      for (int l = 0; l < 8; ++l)
        if (g * 8 + X8_LANE[l] < M) o[X8_LANE[l]] = t[l];
    }
  }
}

void x8_linear(int64_t qtype, const uint8_t* wp, int64_t g0, int64_t g1, const Acts& x,
               int64_t N, float* out, int64_t M) {
  if (qtype == X8_F16)
    x8_rows<X8_F16>(wp, g0, g1, x, N, out, M);
  else if (qtype == X8_Q5)
    x8_rows<X8_Q5>(wp, g0, g1, x, N, out, M);
  else
    x8_rows<X8_F32>(wp, g0, g1, x, N, out, M);
}

// ---- dequantization (the GEMM road for large batches): 32 values at a time from registers

inline void store8(__m256 f, float* out) { _mm256_storeu_ps(out, f); }
inline void store8(__m256 f, at::BFloat16* out) {  // round to nearest even (weights are finite)
  const __m256i b = _mm256_castps_si256(f);
  const __m256i round = _mm256_add_epi32(
      _mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, round), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

// 32 values d u + m, values 0-15 by (d0, m0) and 16-31 by (d1, m1); u signed where SIGNED.
template <bool SIGNED, class Out>
inline void emit32(__m256i u, float d0, float m0, float d1, float m1, Out* out) {
  const __m128i halves[2] = {_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)};
  for (int h = 0; h < 2; ++h) {
    const __m256 d = _mm256_set1_ps(h ? d1 : d0), m = _mm256_set1_ps(h ? m1 : m0);
    for (int q = 0; q < 2; ++q) {
      const __m128i bytes = q ? _mm_srli_si128(halves[h], 8) : halves[h];
      const __m256i v = SIGNED ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
      store8(_mm256_fmadd_ps(_mm256_cvtepi32_ps(v), d, m), out + 16 * h + 8 * q);
    }
  }
}

template <class Out>
void dequant_row(int64_t qtype, const uint8_t* w, int64_t K, Out* out) {
  if (qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q8_0) {
    const int64_t bytes = qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : qtype == Q5_0 ? 22 : 34;
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = w + b * bytes;
      if (qtype == Q8_0) {
        const float d = h16(blk);
        emit32<true>(load32(blk + 2), d, 0.f, d, 0.f, out + 32 * b);
        continue;
      }
      float d, m;
      const __m256i u = unpack_legacy(qtype, blk, &d, &m);
      emit32<false>(u, d, m, d, m, out + 32 * b);
    }
  } else if (qtype == Q4_K || qtype == Q5_K) {
    const int64_t bytes = qtype == Q4_K ? 144 : 176;
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* blk = w + sb * bytes;
      const float d = h16(blk), dmin = h16(blk + 2);
      const uint8_t* qs = blk + (qtype == Q4_K ? 16 : 48);
      const __m256i hv = qtype == Q5_K ? load32(blk + 16) : _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        __m256i lo, hi;
        unpack_k45(qtype == Q5_K, qs, hv, i, &lo, &hi);
        uint8_t s0, n0, s1, n1;
        scale_min_k4(2 * i, blk + 4, &s0, &n0);
        scale_min_k4(2 * i + 1, blk + 4, &s1, &n1);
        Out* o = out + 256 * sb + 64 * i;
        emit32<false>(lo, d * s0, -dmin * n0, d * s0, -dmin * n0, o);
        emit32<false>(hi, d * s1, -dmin * n1, d * s1, -dmin * n1, o + 32);
      }
    }
  } else {  // Q6_K
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* blk = w + sb * 210;
      const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = h16(blk + 208);
      for (int h = 0; h < 2; ++h) {
        __m256i u[4];
        unpack_q6k_half(blk, h, u);
        for (int k = 0; k < 4; ++k) {
          const float s0 = d * scales[8 * h + 2 * k], s1 = d * scales[8 * h + 2 * k + 1];
          emit32<false>(u[k], s0, -32.f * s0, s1, -32.f * s1, out + 256 * sb + 128 * h + 32 * k);
        }
      }
    }
  }
}

template <class Out>
void x8_dequant_group(int64_t qtype, const uint8_t* gp, int64_t g, int64_t M, int64_t K, Out* out) {
  const int64_t BB = x8_block_bytes(qtype);
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* p = gp + b * BB;
    for (int r = 0; r < 8 && g * 8 + r < M; ++r) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (r / 2) * 32 + (r % 2) * 16));
      __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
      float d, m;
      if (qtype == X8_Q5) {
        u = _mm256_or_si256(u, _mm256_and_si256(bits_to_bytes(x8_q5_bits(p, r)), _mm256_set1_epi8(0x10)));
        d = h16(p + 128 + 2 * X8_POS[r]);
        m = -16.f * d;
      } else if (qtype == X8_F16) {
        d = h16(p + 128 + 2 * X8_POS[r]);
        m = h16(p + 144 + 2 * X8_POS[r]);
      } else {
        std::memcpy(&d, p + 128 + 4 * X8_POS[r], 4);
        std::memcpy(&m, p + 160 + 4 * X8_POS[r], 4);
      }
      emit32<false>(u, d, m, d, m, out + (g * 8 + r) * K + 32 * b);
    }
  }
}

void x8_dequant(int64_t qtype, const uint8_t* wp, int64_t g0, int64_t g1, int64_t M, int64_t K,
                void* out, bool bf16) {
  const int64_t group_bytes = K / 32 * x8_block_bytes(qtype);
  for (int64_t g = g0; g < g1; ++g) {
    if (bf16)
      x8_dequant_group(qtype, wp + g * group_bytes, g, M, K, static_cast<at::BFloat16*>(out));
    else
      x8_dequant_group(qtype, wp + g * group_bytes, g, M, K, static_cast<float*>(out));
  }
}

void dequant_rows(int64_t qtype, const uint8_t* wp, int64_t row_bytes, int64_t r0, int64_t r1,
                  int64_t K, void* out, bool bf16) {
  for (int64_t r = r0; r < r1; ++r) {
    if (bf16)
      dequant_row(qtype, wp + r * row_bytes, K, static_cast<at::BFloat16*>(out) + r * K);
    else
      dequant_row(qtype, wp + r * row_bytes, K, static_cast<float*>(out) + r * K);
  }
}

#endif  // LIFELINE_GGUF_KERNEL_PASS
