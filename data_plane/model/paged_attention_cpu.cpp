// Decode attention on the CPU that reads the paged KV cache in place: one query token per sequence
// attends to its own context through its block table, so a step copies no keys or values (the torch
// path gathers every decode's blocks into a padded [B, Hkv, L, D] copy per layer first). For each
// sequence b, query head h (KV head g = h / (H / Hkv)) and its context_lens[b] positions j:
//
//   slot(j)  = block_tables[b, j / block_size] * block_size + j % block_size
//   s[j]     = scale * sum_d q[b, h, d] * K[slot(j), g, d]
//   out[b, h] = sum_j softmax(s)[j] * V[slot(j), g]
//
// kv_cache: [2, num_slots, Hkv, D] contiguous; q: [B, H, D] with contiguous rows of D; out: [B, H, D].
// Products accumulate in float for every dtype; sequences (or, when fewer than threads, their KV heads)
// are split over torch's own OpenMP threads, and every query head of a sequence uses each key and value
// row while it is in cache.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#if !defined(__AVX512F__)
#pragma GCC target("f16c")  // every AVX2 CPU has F16C (vcvtph2ps); after the headers, for this file only
#endif
#include <immintrin.h>
#endif

namespace {

// The inner loops in AVX-512 or AVX2 where the build targets them (cpu_extension.py passes -mavx512f /
// -mavx2 by the CPU's capability), plain loops otherwise. One vectorised loop serves float, bf16
// and fp16 alike: each row is loaded as float lanes (vload_as_float) and every product and sum is a
// float operation in the same order, so a bf16 or fp16 result is the float path's on the upcast inputs,
// rounded once (to nearest even) on the way out. The compiler alone would sum a dot product's lanes one
// by one, convert bf16 element by element and keep exp scalar.
#if defined(__AVX512F__) || defined(__AVX2__)
// the sums of four vectors' 8 lanes each, in the 4 lanes of one: three horizontal adds instead of a
// reduction per vector
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
#endif

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using vfloat = __m512;
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline vfloat vset(float x) { return _mm512_set1_ps(x); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
inline float vhmax(vfloat v) { return _mm512_reduce_max_ps(v); }
inline __m256 half_sum(vfloat v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
inline void vsum4(float* s, vfloat a0, vfloat a1, vfloat a2, vfloat a3) {  // s[i] = sum of ai's lanes
  _mm_storeu_ps(s, hsum4(half_sum(a0), half_sum(a1), half_sum(a2), half_sum(a3)));
}
inline vfloat vfloor(vfloat v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vfloat vpow2(vfloat n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// bf16 is float's upper half: widen 16 halves to 32 bits and shift them up. Back to bf16 rounds to
// nearest even as c10::BFloat16 does (a NaN becomes 0x7fc0).
inline vfloat vload_as_float(const float* p) { return _mm512_loadu_ps(p); }
inline vfloat vload_as_float(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vfloat vload_as_float(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vstore_from_float(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline void vstore_from_float(c10::BFloat16* p, vfloat v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline void vstore_from_float(c10::Half* p, vfloat v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#define LORAPLANE_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using vfloat = __m256;
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline vfloat vset(float x) { return _mm256_set1_ps(x); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline float vsum(vfloat v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float vhmax(vfloat v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline void vsum4(float* s, vfloat a0, vfloat a1, vfloat a2, vfloat a3) { _mm_storeu_ps(s, hsum4(a0, a1, a2, a3)); }
inline vfloat vfloor(vfloat v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vfloat vpow2(vfloat n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vfloat vload_as_float(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat vload_as_float(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vfloat vload_as_float(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void vstore_from_float(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline void vstore_from_float(c10::BFloat16* p, vfloat v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7fff));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // every lane is below 2^16, so the signed-to-unsigned saturating pack keeps them all
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void vstore_from_float(c10::Half* p, vfloat v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#define LORAPLANE_SIMD 1
#endif

// Cephes' expf for x <= 0 (scores less their maximum): 2^n * e^r, |r| <= ln2 / 2, e^r by a degree-6
// polynomial; within 2 ulp of std::exp. Below -87.3 e^x leaves float's normal range and becomes ~0.
constexpr float kExpFloor = -87.3f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  x = std::max(x, kExpFloor);
  const float n = std::floor(x * kLog2e + 0.5f);
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef LORAPLANE_SIMD
inline vfloat vexp_nonpositive(vfloat x) {  // the same steps, lane by lane
  x = vmax(x, vset(kExpFloor));
  const vfloat n = vfloor(vfma(x, vset(kLog2e), vset(0.5f)));
  const vfloat r = vfma(n, vset(-kLn2Lo), vfma(n, vset(-kLn2Hi), x));
  vfloat p = vset(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = vfma(p, r, vset(kExpPoly[i]));
  p = vfma(vmul(p, r), r, r);
  return vmul(vadd(p, vset(1.f)), vpow2(n));
}
#endif

// s[j] = exp(s[j] - max s) / sum; the softmax of one query head's scores, in place
inline void softmax(float* s, int64_t len) {
  float top = -std::numeric_limits<float>::infinity(), sum = 0.f;
  int64_t j = 0;
#ifdef LORAPLANE_SIMD
  vfloat vtop = vset(top), vtotal = vzero();
  for (; j + kLanes <= len; j += kLanes) vtop = vmax(vtop, vload(s + j));
  top = vhmax(vtop);
#endif
  for (; j < len; ++j) top = std::max(top, s[j]);
  j = 0;
#ifdef LORAPLANE_SIMD
  for (; j + kLanes <= len; j += kLanes) {
    const vfloat e = vexp_nonpositive(vsub(vload(s + j), vset(top)));
    vstore(s + j, e);
    vtotal = vadd(vtotal, e);
  }
  sum = vsum(vtotal);
#endif
  for (; j < len; ++j) sum += (s[j] = exp_nonpositive(s[j] - top));
  const float inv = 1.f / sum;
  for (j = 0; j < len; ++j) s[j] *= inv;
}

// a * b + c, fused where the build has FMA (as every vector step is): the scalar tails then round alike
// for every T, however the compiler would contract or vectorise each instantiation's loop
inline float mul_add(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// Whether T's rows load as float vectors: float, bf16 and fp16 on a SIMD build; double stays scalar.
template <typename T>
constexpr bool kVectorRows =
#ifdef LORAPLANE_SIMD
    std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;
#else
    false;
#endif

// dst[d] = float(src[d]) * mul for d < n
template <typename T>
inline void row_to_float(float* dst, const T* src, int64_t n, float mul) {
  int64_t d = 0;
#ifdef LORAPLANE_SIMD
  if constexpr (kVectorRows<T>)
    for (; d + kLanes <= n; d += kLanes) vstore(dst + d, vmul(vload_as_float(src + d), vset(mul)));
#endif
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]) * mul;
}

// dst[d] = T(src[d]) for d < n, rounded to nearest even as c10's conversions round
template <typename T>
inline void row_from_float(T* dst, const float* src, int64_t n) {
  int64_t d = 0;
#ifdef LORAPLANE_SIMD
  if constexpr (kVectorRows<T>)
    for (; d + kLanes <= n; d += kLanes) vstore_from_float(dst + d, vload(src + d));
#endif
  for (; d < n; ++d) dst[d] = static_cast<T>(src[d]);
}

// sum_d q[d] * k[d] for d < n
template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  int64_t d = 0;
  float sum = 0.f;
#ifdef LORAPLANE_SIMD
  if constexpr (kVectorRows<T>) {
    vfloat acc = vzero();
    for (; d + kLanes <= n; d += kLanes) acc = vfma(vload(q + d), vload_as_float(k + d), acc);
    sum = vsum(acc);
  }
#endif
  for (; d < n; ++d) sum = mul_add(q[d], static_cast<float>(k[d]), sum);
  return sum;
}

// s[j] = sum_d q[d] * k[j * stride + d] for j < rows: one query head against one block's keys. Four keys
// at a time: four independent chains of FMAs instead of one that waits on each.
template <typename T>
inline void block_scores(float* s, const float* q, const T* k, int64_t rows, int64_t stride, int64_t n) {
  int64_t j = 0;
#ifdef LORAPLANE_SIMD
  if constexpr (kVectorRows<T>) {
    if (n % kLanes == 0) {
      for (; j + 4 <= rows; j += 4) {
        const T* k0 = k + j * stride;
        const T *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
        vfloat a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
        for (int64_t d = 0; d < n; d += kLanes) {
          const vfloat qd = vload(q + d);
          a0 = vfma(qd, vload_as_float(k0 + d), a0);
          a1 = vfma(qd, vload_as_float(k1 + d), a1);
          a2 = vfma(qd, vload_as_float(k2 + d), a2);
          a3 = vfma(qd, vload_as_float(k3 + d), a3);
        }
        vsum4(s + j, a0, a1, a2, a3);
      }
    }
  }
#endif
  for (; j < rows; ++j) s[j] = dot(q, k + j * stride, n);
}

// The same for four query heads that share a KV head: s[i * len + j] = sum_d q[i * n + d] * k[j * stride + d]
// for i < 4, j < rows; each key row is loaded (and converted) once for the four.
template <typename T>
inline void block_scores4(float* s, int64_t len, const float* q, const T* k, int64_t rows, int64_t stride,
                          int64_t n) {
#ifdef LORAPLANE_SIMD
  if constexpr (kVectorRows<T>) {
    if (n % kLanes == 0) {
      for (int64_t j = 0; j < rows; ++j) {
        const T* kj = k + j * stride;
        vfloat a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
        for (int64_t d = 0; d < n; d += kLanes) {
          const vfloat kd = vload_as_float(kj + d);
          a0 = vfma(vload(q + d), kd, a0);
          a1 = vfma(vload(q + n + d), kd, a1);
          a2 = vfma(vload(q + 2 * n + d), kd, a2);
          a3 = vfma(vload(q + 3 * n + d), kd, a3);
        }
        float t[4];
        vsum4(t, a0, a1, a2, a3);
        for (int i = 0; i < 4; ++i) s[i * len + j] = t[i];
      }
      return;
    }
  }
#endif
  for (int i = 0; i < 4; ++i) block_scores(s + i * len, q + i * n, k, rows, stride, n);
}

// acc[d] += sum_j p[j] * v[j * stride + d] for j < rows: one block's values weighted by their
// probabilities. Four vector accumulators stay in registers over the block's rows (through memory, each
// row's update would wait for the previous one's store).
template <typename T>
inline void weighted_rows(float* acc, const float* p, const T* v, int64_t rows, int64_t stride, int64_t n) {
  int64_t d = 0;
#ifdef LORAPLANE_SIMD
  if constexpr (kVectorRows<T>) {
    for (; d + 4 * kLanes <= n; d += 4 * kLanes) {
      vfloat a0 = vload(acc + d), a1 = vload(acc + d + kLanes), a2 = vload(acc + d + 2 * kLanes),
             a3 = vload(acc + d + 3 * kLanes);
      for (int64_t j = 0; j < rows; ++j) {
        const vfloat pj = vset(p[j]);
        const T* r = v + j * stride + d;
        a0 = vfma(pj, vload_as_float(r), a0);
        a1 = vfma(pj, vload_as_float(r + kLanes), a1);
        a2 = vfma(pj, vload_as_float(r + 2 * kLanes), a2);
        a3 = vfma(pj, vload_as_float(r + 3 * kLanes), a3);
      }
      vstore(acc + d, a0);
      vstore(acc + d + kLanes, a1);
      vstore(acc + d + 2 * kLanes, a2);
      vstore(acc + d + 3 * kLanes, a3);
    }
    for (; d + kLanes <= n; d += kLanes) {
      vfloat a = vload(acc + d);
      for (int64_t j = 0; j < rows; ++j) a = vfma(vset(p[j]), vload_as_float(v + j * stride + d), a);
      vstore(acc + d, a);
    }
  }
#endif
  for (; d < n; ++d)
    for (int64_t j = 0; j < rows; ++j) acc[d] = mul_add(p[j], static_cast<float>(v[j * stride + d]), acc[d]);
}

// The same for four query heads that share a KV head: acc[i * n + d] += sum_j p[i * len + j] * v[j * stride + d]
// for i < 4; each value row is loaded (and converted) once for the four, two vectors of it at a time.
template <typename T>
inline void weighted_rows4(float* acc, const float* p, int64_t len, const T* v, int64_t rows, int64_t stride,
                           int64_t n) {
  int64_t d = 0;
#ifdef LORAPLANE_SIMD
  if constexpr (kVectorRows<T>) {
    for (; d + 2 * kLanes <= n; d += 2 * kLanes) {
      vfloat lo0 = vload(acc + d), hi0 = vload(acc + d + kLanes), lo1 = vload(acc + n + d),
             hi1 = vload(acc + n + d + kLanes), lo2 = vload(acc + 2 * n + d), hi2 = vload(acc + 2 * n + d + kLanes),
             lo3 = vload(acc + 3 * n + d), hi3 = vload(acc + 3 * n + d + kLanes);
      for (int64_t j = 0; j < rows; ++j) {
        const T* r = v + j * stride + d;
        const vfloat lo = vload_as_float(r), hi = vload_as_float(r + kLanes);
        vfloat pj = vset(p[j]);
        lo0 = vfma(pj, lo, lo0);
        hi0 = vfma(pj, hi, hi0);
        pj = vset(p[len + j]);
        lo1 = vfma(pj, lo, lo1);
        hi1 = vfma(pj, hi, hi1);
        pj = vset(p[2 * len + j]);
        lo2 = vfma(pj, lo, lo2);
        hi2 = vfma(pj, hi, hi2);
        pj = vset(p[3 * len + j]);
        lo3 = vfma(pj, lo, lo3);
        hi3 = vfma(pj, hi, hi3);
      }
      vstore(acc + d, lo0);
      vstore(acc + d + kLanes, hi0);
      vstore(acc + n + d, lo1);
      vstore(acc + n + d + kLanes, hi1);
      vstore(acc + 2 * n + d, lo2);
      vstore(acc + 2 * n + d + kLanes, hi2);
      vstore(acc + 3 * n + d, lo3);
      vstore(acc + 3 * n + d + kLanes, hi3);
    }
  }
#endif
  if (d < n)
    for (int i = 0; i < 4; ++i) weighted_rows(acc + i * n + d, p + i * len, v + d, rows, stride, n - d);
}

template <typename T>
void decode_kernel(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv, const int64_t* tables,
                   int64_t table_width, const int64_t* lens, int64_t block_size, double scale) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = kv.size(2);
  const int64_t group = heads / kv_heads, num_slots = kv.size(1);
  const int64_t q_seq = q.stride(0), q_head = q.stride(1), o_seq = out.stride(0), o_head = out.stride(1);
  const int64_t slot_stride = kv_heads * dim;
  const T* qp = q.const_data_ptr<T>();
  const T* keys = kv.const_data_ptr<T>();
  const T* values = keys + num_slots * slot_stride;
  T* op = out.mutable_data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  // An item is one sequence's KV heads [g0, g0 + span): all of them when there are sequences enough for
  // every thread, so each slot's row of K (and of V) is read whole, in one pass; one each otherwise.
  const int64_t span = batch >= at::get_num_threads() ? kv_heads : 1, items_per_seq = kv_heads / span;
  at::parallel_for(0, batch * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(span * group * dim), acc(span * group * dim), scores;  // [span*group, D] x2, [span*group, L]
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / items_per_seq, g0 = item % items_per_seq * span, len = lens[b];
      const int64_t* table = tables + b * table_width;
      const int64_t rows = span * group;  // the query heads of this item, head g0 * group first
      scores.resize(rows * len);
      for (int64_t h = 0; h < rows; ++h)
        row_to_float(qf.data() + h * dim, qp + b * q_seq + (g0 * group + h) * q_head, dim, fscale);
      // block by block, every query head over the block's keys while they sit in L1; four heads of one
      // KV head at a time where the group has four left
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t stop = std::min(len, start + block_size);
        const T* block = keys + table[start / block_size] * block_size * slot_stride;
        for (int64_t h = 0; h < rows;) {
          float* s = scores.data() + h * len + start;
          const T* k = block + (g0 + h / group) * dim;
          if (h % group + 4 <= group) {
            block_scores4(s, len, qf.data() + h * dim, k, stop - start, slot_stride, dim);
            h += 4;
          } else {
            block_scores(s, qf.data() + h * dim, k, stop - start, slot_stride, dim);
            h += 1;
          }
        }
      }
      for (int64_t h = 0; h < rows; ++h) softmax(scores.data() + h * len, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t stop = std::min(len, start + block_size);
        const T* block = values + table[start / block_size] * block_size * slot_stride;
        for (int64_t h = 0; h < rows;) {
          const float* p = scores.data() + h * len + start;
          const T* v = block + (g0 + h / group) * dim;
          if (h % group + 4 <= group) {
            weighted_rows4(acc.data() + h * dim, p, len, v, stop - start, slot_stride, dim);
            h += 4;
          } else {
            weighted_rows(acc.data() + h * dim, p, v, stop - start, slot_stride, dim);
            h += 1;
          }
        }
      }
      for (int64_t h = 0; h < rows; ++h)
        row_from_float(op + b * o_seq + (g0 * group + h) * o_head, acc.data() + h * dim, dim);
    }
  });
}

void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                            double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1, "q: [B, H, D] on the CPU, rows contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.scalar_type() == q.scalar_type(), "out like q");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
              kv_cache.scalar_type() == q.scalar_type() && kv_cache.size(3) == q.size(2),
              "kv_cache: [2, slots, Hkv, D] contiguous, of q's dtype");
  TORCH_CHECK(q.size(1) % kv_cache.size(2) == 0, "query heads a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
              block_tables.is_contiguous() && context_lens.is_contiguous() && block_tables.dim() == 2 &&
              block_tables.size(0) == q.size(0) && context_lens.numel() == q.size(0),
              "block_tables [B, max_blocks] and context_lens [B]: contiguous int64");
  TORCH_CHECK(block_size > 0 && kv_cache.size(1) % block_size == 0, "block_size divides the cache's slots");
  // every block a sequence reads must lie in the cache: a bad table is an error, never a stray read
  const int64_t width = block_tables.size(1), num_blocks = kv_cache.size(1) / block_size;
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(lens[b] > 0 && lens[b] <= width * block_size, "context length ", lens[b], " out of range");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tables[b * width + i] >= 0 && tables[b * width + i] < num_blocks, "block out of range");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(out, q, kv_cache, tables, width, lens, block_size, scale);
  });
}

}  // namespace

TORCH_LIBRARY(loraplane_attention, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, "
        "Tensor context_lens, int block_size, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(loraplane_attention, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
