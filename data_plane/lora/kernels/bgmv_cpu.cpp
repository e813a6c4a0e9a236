// BGMV on the CPU (punica's idea): each decode token multiplies by its own slot's LoRA weights, read in
// place, so a step of many adapters copies no weights. For each i with slots[i] >= 0, t = index[i]:
//
//   shrink:  v[t, l*rank + r]  = sum_k x[t, k] * A[slots[i], k, l*R + r]            r < rank, l < lanes
//   expand:  y[t, off_l + c]  += sum_r v[t, l*rank + r] * B[slots[i], r, off_l + c]  c < width_l
//
// A: [slots, in, lanes * R], B: [slots, R, out] (rows contiguous, any slot stride); rows of v and y of
// tokens not listed are left alone. Products accumulate in float for every dtype; tokens are split over
// torch's own OpenMP threads (at::parallel_for, linked against the libgomp torch loaded).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

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
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, name, ": a CPU tensor of the op's dtype");
  TORCH_CHECK(t.stride(-1) == 1, name, ": rows must be contiguous");
}

template <typename T>
void shrink_kernel(at::Tensor& v, const at::Tensor& x, const at::Tensor& a, const int64_t* index,
                   const int64_t* slots, int64_t n, int64_t lanes, int64_t rank) {
  const int64_t dim = x.size(1), padded = a.size(2) / lanes;
  const int64_t x_row = x.stride(0), a_slot = a.stride(0), a_row = a.stride(1), v_row = v.stride(0);
  const T* xp = x.const_data_ptr<T>();
  const T* ap = a.const_data_ptr<T>();
  T* vp = v.mutable_data_ptr<T>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(lanes * rank);  // [lanes * rank]: one token's shrink output
    for (int64_t i = begin; i < end; ++i) {
      if (slots[i] < 0) continue;
      const T* xr = xp + index[i] * x_row;
      const T* as = ap + slots[i] * a_slot;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t k = 0; k < dim; ++k) {
        const float xk = static_cast<float>(xr[k]);
        const T* row = as + k * a_row;
        for (int64_t l = 0; l < lanes; ++l) {
          float* out = acc.data() + l * rank;
          const T* w = row + l * padded;
          for (int64_t r = 0; r < rank; ++r) out[r] += xk * static_cast<float>(w[r]);
        }
      }
      T* vr = vp + index[i] * v_row;
      for (int64_t j = 0; j < lanes * rank; ++j) vr[j] = static_cast<T>(acc[j]);
    }
  });
}

template <typename T>
void expand_kernel(at::Tensor& y, const at::Tensor& v, const at::Tensor& b, const int64_t* index,
                   const int64_t* slots, int64_t n, at::IntArrayRef offsets, at::IntArrayRef widths, int64_t rank) {
  const int64_t y_row = y.stride(0), v_row = v.stride(0), b_slot = b.stride(0), b_row = b.stride(1);
  const int64_t widest = *std::max_element(widths.begin(), widths.end());
  const T* vp = v.const_data_ptr<T>();
  const T* bp = b.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(widest);  // [width_l]: one lane's delta of one token
    for (int64_t i = begin; i < end; ++i) {
      if (slots[i] < 0) continue;
      const T* vr = vp + index[i] * v_row;
      const T* bs = bp + slots[i] * b_slot;
      T* yr = yp + index[i] * y_row;
      for (size_t l = 0; l < offsets.size(); ++l) {
        const int64_t offset = offsets[l], width = widths[l];
        std::fill(acc.begin(), acc.begin() + width, 0.f);
        for (int64_t r = 0; r < rank; ++r) {
          const float vk = static_cast<float>(vr[l * rank + r]);
          const T* row = bs + r * b_row + offset;
          for (int64_t c = 0; c < width; ++c) acc[c] += vk * static_cast<float>(row[c]);
        }
        for (int64_t c = 0; c < width; ++c) yr[offset + c] = static_cast<T>(static_cast<float>(yr[offset + c]) + acc[c]);
      }
    }
  });
}

void bgmv_shrink(at::Tensor v, const at::Tensor& x, const at::Tensor& a, const at::Tensor& index,
                 const at::Tensor& slots, int64_t lanes, int64_t rank) {
  check_rows(x, "x", x.scalar_type());
  check_rows(a, "lora_a", x.scalar_type());
  check_rows(v, "v", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && v.dim() == 2 && a.size(1) == x.size(1), "shapes x [T, in], A [S, in, L*R]");
  TORCH_CHECK(a.size(2) % lanes == 0 && rank <= a.size(2) / lanes && v.size(1) == lanes * rank, "lanes and rank");
  check_routing(index, slots, std::min(x.size(0), v.size(0)), a.size(0));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bgmv_shrink", [&] {
    shrink_kernel<scalar_t>(v, x, a, index.const_data_ptr<int64_t>(), slots.const_data_ptr<int64_t>(),
                            index.numel(), lanes, rank);
  });
}

void bgmv_expand(at::Tensor y, const at::Tensor& v, const at::Tensor& b, const at::Tensor& index,
                 const at::Tensor& slots, at::IntArrayRef offsets, at::IntArrayRef widths, int64_t rank) {
  check_rows(y, "y", y.scalar_type());
  check_rows(v, "v", y.scalar_type());
  check_rows(b, "lora_b", y.scalar_type());
  TORCH_CHECK(y.dim() == 2 && v.dim() == 2 && b.dim() == 3 && rank <= b.size(1), "shapes y [T, out], B [S, R, out]");
  TORCH_CHECK(offsets.size() == widths.size() && !offsets.empty() && v.size(1) == int64_t(offsets.size()) * rank,
              "one offset and width per lane");
  for (size_t l = 0; l < offsets.size(); ++l)
    TORCH_CHECK(offsets[l] >= 0 && offsets[l] + widths[l] <= std::min(y.size(1), b.size(2)), "lane out of range");
  check_routing(index, slots, std::min(y.size(0), v.size(0)), b.size(0));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "bgmv_expand", [&] {
    expand_kernel<scalar_t>(y, v, b, index.const_data_ptr<int64_t>(), slots.const_data_ptr<int64_t>(),
                            index.numel(), offsets, widths, rank);
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
