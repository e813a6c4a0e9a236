// RMSNorm of bfloat16/float16 rows on the CPU in one pass over each row, optionally after adding the
// layer's output into the residual stream (Llama's `h = h + f(h)`, then the next norm):
//
//   add_rms_norm:  residual[t] = round(residual[t] + x[t]);  out[t] = rms_norm(residual[t])
//   rms_norm:      out[t] = rms_norm(x[t])
//   rms_norm(r)  = round(weight * round(r * 1 / sqrt(mean(r^2) + eps)))
//
// Rows are [T, H], contiguous. The arithmetic is Hugging Face's (and the torch path's): float32 inside,
// round to the activations' dtype (round to nearest even) after the residual add, after normalizing and
// after the weight multiply. Only the order in which the squares are summed differs from torch's, so a
// result may differ from the torch path's by one unit in the last place of the activations' dtype.
// Rows are split over torch's OpenMP threads (at::parallel_for), a decode step's few rows run in one.
// AVX2 vectors (8 lanes) where the build targets it (cpu_extension.py; with AVX-512 too), plain loops else.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#pragma GCC target("f16c")  // every AVX2 CPU has F16C (vcvtph2ps); after the headers, for this file only
#include <immintrin.h>
#define LORAPLANE_SIMD 8
#else
#define LORAPLANE_SIMD 0
#endif

namespace {

constexpr int64_t kElementsPerTask = 32768;  // rows handed to one thread at least hold this many values

#if LORAPLANE_SIMD
// 8 values at a time: load to float32, and round float32 to the dtype (kept as float32 or stored)
template <typename T>
struct Vec8;

template <>
struct Vec8<c10::BFloat16> {
  static __m256 load(const c10::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static __m256i rounded_bits(__m256 v) {  // round to nearest even in the top 16 bits; NaN stays NaN
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
  }
  static __m256 round(__m256 v) {
    return _mm256_castsi256_ps(_mm256_and_si256(rounded_bits(v), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static void store(c10::BFloat16* p, __m256 v) {
    const __m256i high = _mm256_srli_epi32(rounded_bits(v), 16);  // eight values below 2^16
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
};

template <>
struct Vec8<c10::Half> {
  static __m256 load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static __m256 round(__m256 v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }
  static void store(c10::Half* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};

float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

template <typename T>
float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// One row: the residual add (when `residual` is set: it is read and written, `x` is the addend), the sum
// of squares, then the normalized, weighted output.
template <typename T>
void norm_row(T* out, T* residual, const T* x, const T* weight, int64_t hidden, float eps) {
  const T* source = residual != nullptr ? residual : x;
  float sum = 0.f;
  int64_t k = 0;
#if LORAPLANE_SIMD
  __m256 acc = _mm256_setzero_ps();
  for (; k + 8 <= hidden; k += 8) {
    __m256 r = Vec8<T>::load(source + k);
    if (residual != nullptr) {
      r = Vec8<T>::round(_mm256_add_ps(r, Vec8<T>::load(x + k)));
      Vec8<T>::store(residual + k, r);
    }
    acc = _mm256_fmadd_ps(r, r, acc);
  }
  sum = sum8(acc);
#endif
  for (; k < hidden; ++k) {
    float r = static_cast<float>(source[k]);
    if (residual != nullptr) {
      r = rounded<T>(r + static_cast<float>(x[k]));
      residual[k] = static_cast<T>(r);
    }
    sum += r * r;
  }
  const float inverse = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  k = 0;
#if LORAPLANE_SIMD
  const __m256 scale = _mm256_set1_ps(inverse);
  for (; k + 8 <= hidden; k += 8) {
    const __m256 normed = Vec8<T>::round(_mm256_mul_ps(Vec8<T>::load(source + k), scale));
    Vec8<T>::store(out + k, _mm256_mul_ps(Vec8<T>::load(weight + k), normed));
  }
#endif
  for (; k < hidden; ++k) {
    const float normed = rounded<T>(static_cast<float>(source[k]) * inverse);
    out[k] = static_cast<T>(static_cast<float>(weight[k]) * normed);
  }
}

template <typename T>
void run_rows(at::Tensor& out, at::Tensor* residual, const at::Tensor& x, const at::Tensor& weight, int64_t rows,
              int64_t hidden, float eps) {
  T* out_p = out.data_ptr<T>();
  T* res_p = residual != nullptr ? residual->data_ptr<T>() : nullptr;
  const T* x_p = x.data_ptr<T>();
  const T* w_p = weight.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(hidden, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      norm_row<T>(out_p + t * hidden, res_p != nullptr ? res_p + t * hidden : nullptr, x_p + t * hidden, w_p, hidden,
                  eps);
    }
  });
}

void check_rows(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t rows, int64_t hidden) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, name, ": a CPU tensor of dtype ", dtype);
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == hidden && t.is_contiguous(), name,
              ": contiguous [", rows, ", ", hidden, "]");
}

void run(at::Tensor& out, at::Tensor* residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "x: bfloat16 or float16 (got ", dtype, ")");
  TORCH_CHECK(x.dim() == 2, "x: [tokens, hidden]");
  const int64_t rows = x.size(0), hidden = x.size(1);
  check_rows(x, "x", dtype, rows, hidden);
  check_rows(out, "out", dtype, rows, hidden);
  if (residual != nullptr) check_rows(*residual, "residual", dtype, rows, hidden);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == dtype && weight.dim() == 1 &&
                  weight.size(0) == hidden && weight.is_contiguous(),
              "weight: a contiguous [", hidden, "] CPU tensor of dtype ", dtype);
  if (dtype == at::kBFloat16) {
    run_rows<c10::BFloat16>(out, residual, x, weight, rows, hidden, static_cast<float>(eps));
  } else {
    run_rows<c10::Half>(out, residual, x, weight, rows, hidden, static_cast<float>(eps));
  }
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  run(out, nullptr, x, weight, eps);
}

void add_rms_norm(at::Tensor out, at::Tensor residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  run(out, &residual, x, weight, eps);
}

}  // namespace

TORCH_LIBRARY(loraplane_norm, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor x, Tensor weight, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(loraplane_norm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
