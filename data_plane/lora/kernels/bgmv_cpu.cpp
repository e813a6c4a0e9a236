// BGMV on the CPU (punica's idea): each decode token multiplies by its own slot's LoRA weights, read in
// place, so a step of many adapters copies no weights. For each i with slots[i] >= 0, t = index[i]:
//
//   shrink:  v[t, l*rank + r]  = sum_k x[t, k] * A[slots[i], k, l*R + r]            r < rank, l < lanes
//   expand:  y[t, off_l + c]  += sum_r v[t, l*rank + r] * B[slots[i], r, off_l + c]  c < width_l
//
// A: [slots, in, lanes * R], B: [slots, R, out] (rows contiguous, any slot stride); rows of v and y of
// tokens not listed are left alone. x, v and y share one dtype; A and B have either that dtype or, with
// float32 activations, bfloat16 or float16 (slots stored in half the bytes, --lora-dtype). Products
// accumulate in float for every dtype; tokens are split over torch's own OpenMP threads
// (at::parallel_for, linked against the libgomp torch loaded).
//
// A decode step of many adapters reads every slot's A and B once per token and does two flops per
// weight, so it runs at the memory's speed: the loops keep their sums in registers (up to 64 float
// columns of A per pass over x, 64 output columns per pass over B's rows), read each weight once and
// convert half-width weights in registers (AVX2 + F16C where the build has AVX2; plain loops else).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#pragma GCC target("f16c")  // every AVX2 CPU has F16C (vcvtph2ps); after the headers, for this file only
#include <immintrin.h>
#define LORAPLANE_BGMV_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 64;  // float columns summed in registers per pass (8 AVX2 vectors)

void check_routing(const at::Tensor& index, const at::Tensor& slots, int64_t tokens, int64_t num_slots) {
  TORCH_CHECK(index.scalar_type() == at::kLong && slots.scalar_type() == at::kLong, "index and slots must be int64");
  TORCH_CHECK(index.is_contiguous() && slots.is_contiguous() && index.numel() == slots.numel(),
              "index and slots must be contiguous and of one length");
  const int64_t* ip = index.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < tokens, "token index ", ip[i], " out of range");
    TORCH_CHECK(sp[i] < num_slots, "slot ", sp[i], " out of range");
  }
}

void check_rows(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, name, ": a CPU tensor of dtype ", dtype);
  TORCH_CHECK(t.stride(-1) == 1, name, ": rows must be contiguous");
}

void check_weights(const at::Tensor& w, const char* name, at::ScalarType act) {
  const auto dtype = w.scalar_type();
  TORCH_CHECK(dtype == act || (act == at::kFloat && (dtype == at::kBFloat16 || dtype == at::kHalf)), name,
              ": the activations' dtype, or bfloat16/float16 with float32 activations (got ", dtype, ")");
  check_rows(w, name, dtype);
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

// acc[j] += s * w[j] for j < n (n < 8 or no AVX2): the scalar tail
template <typename TW>
inline void axpy_tail(float* acc, float s, const TW* w, int64_t n) {
  for (int64_t j = 0; j < n; ++j) acc[j] += s * to_float(w[j]);
}

#ifdef LORAPLANE_BGMV_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bfloat16 is the high half of a float
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// out[0 : 8*NV] = sum_k x[k] * w[k * stride + 0 : 8*NV], the sums in registers: U interleaved sets of NV
// (rows k, k+1, ... go to different sets) so that about eight FMAs are in flight whatever NV is
template <int NV, typename TW>
inline void dot_rows(float* out, const float* x, const TW* w, int64_t stride, int64_t count) {
  constexpr int U = NV <= 2 ? 4 : (NV <= 4 ? 2 : 1);
  __m256 acc[U][NV];
  for (int u = 0; u < U; ++u)
    for (int j = 0; j < NV; ++j) acc[u][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + U <= count; k += U)
    for (int u = 0; u < U; ++u) {
      const __m256 xk = _mm256_set1_ps(x[k + u]);
      const TW* row = w + (k + u) * stride;
      for (int j = 0; j < NV; ++j) acc[u][j] = _mm256_fmadd_ps(xk, load8(row + 8 * j), acc[u][j]);
    }
  for (; k < count; ++k) {
    const __m256 xk = _mm256_set1_ps(x[k]);
    const TW* row = w + k * stride;
    for (int j = 0; j < NV; ++j) acc[0][j] = _mm256_fmadd_ps(xk, load8(row + 8 * j), acc[0][j]);
  }
  for (int j = 0; j < NV; ++j) {
    __m256 sum = acc[0][j];
    for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, acc[u][j]);
    _mm256_storeu_ps(out + 8 * j, sum);
  }
}

template <typename TW>
void dot_rows_vec(float* out, const float* x, const TW* w, int64_t stride, int64_t count, int nv) {
  switch (nv) {
    case 1: return dot_rows<1>(out, x, w, stride, count);
    case 2: return dot_rows<2>(out, x, w, stride, count);
    case 3: return dot_rows<3>(out, x, w, stride, count);
    case 4: return dot_rows<4>(out, x, w, stride, count);
    case 5: return dot_rows<5>(out, x, w, stride, count);
    case 6: return dot_rows<6>(out, x, w, stride, count);
    case 7: return dot_rows<7>(out, x, w, stride, count);
    default: return dot_rows<8>(out, x, w, stride, count);
  }
}
#endif

// out[0 : n] = sum_k x[k] * w[k * stride + 0 : n] for n <= kBlock: one pass over the k rows of w
template <typename TW>
void dot_block(float* out, const float* x, const TW* w, int64_t stride, int64_t count, int64_t n) {
  int64_t done = 0;
#ifdef LORAPLANE_BGMV_AVX2
  if (n >= 8) {
    dot_rows_vec(out, x, w, stride, count, static_cast<int>(n / 8));
    done = n / 8 * 8;
  }
#endif
  if (done == n) return;
  std::fill(out + done, out + n, 0.f);
  for (int64_t k = 0; k < count; ++k) axpy_tail(out + done, x[k], w + k * stride + done, n - done);
}

// Columns of A that a pass reads: each lane's first `rank` of its R, merged when rank == R.
std::vector<std::pair<int64_t, int64_t>> shrink_blocks(int64_t lanes, int64_t padded, int64_t rank) {
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first column of A's row, width)
  if (rank == padded) runs.emplace_back(0, lanes * rank);
  else
    for (int64_t l = 0; l < lanes; ++l) runs.emplace_back(l * padded, rank);
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (auto [first, width] : runs)
    for (int64_t c = 0; c < width; c += kBlock) blocks.emplace_back(first + c, std::min(kBlock, width - c));
  return blocks;
}

template <typename TA, typename TW>
void shrink_kernel(at::Tensor& v, const at::Tensor& x, const at::Tensor& a, const int64_t* index,
                   const int64_t* slots, int64_t n, int64_t lanes, int64_t rank) {
  const int64_t dim = x.size(1), padded = a.size(2) / lanes;
  const int64_t x_row = x.stride(0), a_slot = a.stride(0), a_row = a.stride(1), v_row = v.stride(0);
  const TA* xp = x.const_data_ptr<TA>();
  const TW* ap = a.const_data_ptr<TW>();
  TA* vp = v.mutable_data_ptr<TA>();
  const auto blocks = shrink_blocks(lanes, padded, rank);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(dim), acc(kBlock);  // one token's x in float, one block's sums
    for (int64_t i = begin; i < end; ++i) {
      if (slots[i] < 0) continue;
      const TA* xr = xp + index[i] * x_row;
      for (int64_t k = 0; k < dim; ++k) xf[k] = to_float(xr[k]);
      const TW* as = ap + slots[i] * a_slot;
      TA* vr = vp + index[i] * v_row;
      for (auto [first, width] : blocks) {
        dot_block(acc.data(), xf.data(), as + first, a_row, dim, width);
        const int64_t out = first / padded * rank + first % padded;  // its place in v's lanes * rank
        for (int64_t j = 0; j < width; ++j) vr[out + j] = static_cast<TA>(acc[j]);
      }
    }
  });
}

template <typename TA, typename TW>
void expand_kernel(at::Tensor& y, const at::Tensor& v, const at::Tensor& b, const int64_t* index,
                   const int64_t* slots, int64_t n, at::IntArrayRef offsets, at::IntArrayRef widths, int64_t rank) {
  const int64_t y_row = y.stride(0), v_row = v.stride(0), b_slot = b.stride(0), b_row = b.stride(1);
  const TA* vp = v.const_data_ptr<TA>();
  const TW* bp = b.const_data_ptr<TW>();
  TA* yp = y.mutable_data_ptr<TA>();
  const int64_t lanes = static_cast<int64_t>(offsets.size());
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> vf(lanes * rank), acc(kBlock);  // one token's shrink output, one block's deltas
    for (int64_t i = begin; i < end; ++i) {
      if (slots[i] < 0) continue;
      const TA* vr = vp + index[i] * v_row;
      for (int64_t j = 0; j < lanes * rank; ++j) vf[j] = to_float(vr[j]);
      const TW* bs = bp + slots[i] * b_slot;
      TA* yr = yp + index[i] * y_row;
      for (int64_t l = 0; l < lanes; ++l) {
        for (int64_t c = 0; c < widths[l]; c += kBlock) {  // y[off_l + c : + width] += v_l @ B[:rank, that block]
          const int64_t col = offsets[l] + c, width = std::min(kBlock, widths[l] - c);
          dot_block(acc.data(), vf.data() + l * rank, bs + col, b_row, rank, width);
          for (int64_t j = 0; j < width; ++j) yr[col + j] = static_cast<TA>(to_float(yr[col + j]) + acc[j]);
        }
      }
    }
  });
}

// The (activation, weight) dtype pairs: float32, bfloat16 or float16 throughout, or float32 activations
// with half-width slots.
template <typename F>
void dispatch(at::ScalarType act, at::ScalarType weight, F&& run) {
  if (act == at::kFloat && weight == at::kFloat) run(float{}, float{});
  else if (act == at::kFloat && weight == at::kBFloat16) run(float{}, c10::BFloat16{});
  else if (act == at::kFloat && weight == at::kHalf) run(float{}, c10::Half{});
  else if (act == at::kBFloat16 && weight == at::kBFloat16) run(c10::BFloat16{}, c10::BFloat16{});
  else if (act == at::kHalf && weight == at::kHalf) run(c10::Half{}, c10::Half{});
  else TORCH_CHECK(false, "LoRA kernels: activations ", act, " with weights ", weight, " are not supported");
}

void bgmv_shrink(at::Tensor v, const at::Tensor& x, const at::Tensor& a, const at::Tensor& index,
                 const at::Tensor& slots, int64_t lanes, int64_t rank) {
  check_rows(x, "x", x.scalar_type());
  check_weights(a, "lora_a", x.scalar_type());
  check_rows(v, "v", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && v.dim() == 2 && a.size(1) == x.size(1), "shapes x [T, in], A [S, in, L*R]");
  TORCH_CHECK(a.size(2) % lanes == 0 && rank <= a.size(2) / lanes && v.size(1) == lanes * rank, "lanes and rank");
  check_routing(index, slots, std::min(x.size(0), v.size(0)), a.size(0));
  dispatch(x.scalar_type(), a.scalar_type(), [&](auto ta, auto tw) {
    shrink_kernel<decltype(ta), decltype(tw)>(v, x, a, index.const_data_ptr<int64_t>(),
                                              slots.const_data_ptr<int64_t>(), index.numel(), lanes, rank);
  });
}

void bgmv_expand(at::Tensor y, const at::Tensor& v, const at::Tensor& b, const at::Tensor& index,
                 const at::Tensor& slots, at::IntArrayRef offsets, at::IntArrayRef widths, int64_t rank) {
  check_rows(y, "y", y.scalar_type());
  check_rows(v, "v", y.scalar_type());
  check_weights(b, "lora_b", y.scalar_type());
  TORCH_CHECK(y.dim() == 2 && v.dim() == 2 && b.dim() == 3 && rank <= b.size(1), "shapes y [T, out], B [S, R, out]");
  TORCH_CHECK(offsets.size() == widths.size() && !offsets.empty() && v.size(1) == int64_t(offsets.size()) * rank,
              "one offset and width per lane");
  for (size_t l = 0; l < offsets.size(); ++l)
    TORCH_CHECK(offsets[l] >= 0 && offsets[l] + widths[l] <= std::min(y.size(1), b.size(2)), "lane out of range");
  check_routing(index, slots, std::min(y.size(0), v.size(0)), b.size(0));
  dispatch(y.scalar_type(), b.scalar_type(), [&](auto ta, auto tw) {
    expand_kernel<decltype(ta), decltype(tw)>(y, v, b, index.const_data_ptr<int64_t>(),
                                              slots.const_data_ptr<int64_t>(), index.numel(), offsets, widths, rank);
  });
}

}  // namespace

TORCH_LIBRARY(loraplane_lora, m) {
  m.def("bgmv_shrink(Tensor(a!) v, Tensor x, Tensor lora_a, Tensor index, Tensor slots, int lanes, int rank) -> ()");
  m.def("bgmv_expand(Tensor(a!) y, Tensor v, Tensor lora_b, Tensor index, Tensor slots, int[] offsets, "
        "int[] widths, int rank) -> ()");
}

TORCH_LIBRARY_IMPL(loraplane_lora, CPU, m) {
  m.impl("bgmv_shrink", &bgmv_shrink);
  m.impl("bgmv_expand", &bgmv_expand);
}
