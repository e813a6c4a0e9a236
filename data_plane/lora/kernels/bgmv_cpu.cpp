// BGMV/SGMV on the CPU (punica's idea): each token multiplies by its own slot's LoRA weights, read in
// place, so a step of many adapters copies no weights. For each i with slots[i] >= 0, t = index[i]:
//
//   shrink:  v[t, l*rank + r]  = sum_k x[t, k] * A[slots[i], k, l*R + r]            r < rank, l < lanes
//   expand:  y[t, off_l + c]  += sum_r v[t, l*rank + r] * B[slots[i], r, off_l + c]  c < width_l
//   shrink_expand: both for each token, v kept in registers and a small buffer (no v tensor, one pass)
//
// A: [slots, in, lanes * R], B: [slots, R, out] (rows contiguous, any slot stride); rows of v and y of
// tokens not listed are left alone. x, v and y share one dtype; A and B have either that dtype or, with
// float32 activations, bfloat16 or float16 (slots stored in half the bytes, --lora-dtype). Products
// accumulate in float for every dtype; v is rounded to the activations' dtype between the halves, as the
// torch ops round it.
//
// Neighbours in index/slots with the same slot form a run (the LoRABatch lists each prefill segment and
// the decode tokens of one adapter that way); a run is cut into tiles of up to 4 tokens that read each
// weight once for the whole tile, summing in registers: a prefill segment's weights then come from the
// cache and the FMAs are the limit. Tokens alone in their run (a decode step of many adapters is all of
// them: two flops per weight read, the memory's speed) are paired, and both halves stream the two
// tokens' slots side by side, which keeps more reads in flight than one stream; such a tile reads A and
// B in their memory's order where it can (rows of A up to 56 columns wide in one pass, B row after
// row). Tiles are split over torch's own OpenMP threads (at::parallel_for, linked against the libgomp
// torch loaded), one parallel region per call, and shrink_expand runs a layer's two halves in one of
// them.
//
// Vectors are AVX2 where the build targets it (cpu_extension.py; with AVX-512 too), half-width weights
// converted in registers; plain loops else.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

// 256-bit vectors also where the build targets AVX-512: a decode step streams the weights from memory,
// and 512-bit loads measured slower (docs/performance.md#lora-kernels); AVX-512VL's 32 registers
// still hold bigger tiles
#if defined(__AVX2__) && defined(__FMA__)
#pragma GCC target("f16c")  // every AVX2 CPU has F16C (vcvtph2ps); after the headers, for this file only
#include <immintrin.h>
#define LORAPLANE_SIMD 8
#else
#define LORAPLANE_SIMD 0
#endif

namespace {

constexpr int kMaxTile = 4;  // tokens of one run that share each weight read

struct Tile {
  int64_t first;  // position in index/slots
  int count;      // 1, 2 or 4 tokens
  bool shared;    // all of one slot (a run of equal slots); else two tokens of two slots
};

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

// Runs of equal slots cut into shared tiles of 4, then 2 tokens; the tokens left alone (a decode step of
// many adapters is all of them) paired into tiles of two slots, each token reading its own weights.
// Tokens of slot -1 are skipped.
std::vector<Tile> make_tiles(const int64_t* slots, int64_t n) {
  std::vector<Tile> tiles;
  int64_t alone = -1;  // a single token waiting for another to pair with
  for (int64_t i = 0; i < n;) {
    int64_t end = i + 1;
    while (end < n && slots[end] == slots[i]) ++end;
    int64_t p = i;
    for (; slots[i] >= 0 && end - p >= 2; p += end - p >= 4 ? 4 : 2)
      tiles.push_back({p, end - p >= 4 ? 4 : 2, true});
    if (slots[i] >= 0 && p < end) {
      if (alone >= 0 && alone + 1 == p) {  // neighbours: the pair's rows are index[alone], index[alone + 1]
        tiles.push_back({alone, 2, false});
        alone = -1;
      } else {
        if (alone >= 0) tiles.push_back({alone, 1, true});
        alone = p;
      }
    }
    i = end;
  }
  if (alone >= 0) tiles.push_back({alone, 1, true});
  return tiles;
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

#if LORAPLANE_SIMD
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec vload(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#if defined(__AVX512VL__)
constexpr int kRegisters = 32;  // ymm0-31
#else
constexpr int kRegisters = 16;
#endif
#endif

#if LORAPLANE_SIMD
constexpr int kWidth = LORAPLANE_SIMD;  // floats per vector

// Vectors of sums a tile of TT tokens keeps in registers: TT * NV sums, NV weights and a broadcast fit.
// Tiles of two slots keep no weights in registers (each token's loads feed its own FMAs).
constexpr int max_vectors(int tt, bool shared = true) {
  return tt == 1 ? 8 : std::min(8, (kRegisters - 2) / (shared ? tt + 1 : tt));
}

// out[t][0 : NV*kWidth] = sum_k in[t][k] * w[t][k * stride + 0 : NV*kWidth] for t < TT. SHARED: one
// slot for the tile (w[t] == w[0]), each weight loaded once for every token; else each token streams its
// own slot's rows side by side with the others (more reads in flight than one token alone keeps). One
// token: U interleaved sets of sums (rows k, k+1, ... go to different sets) so that about eight FMAs are
// in flight whatever NV is; more tokens bring their own independent sums.
template <int TT, int NV, bool SHARED, typename TW>
inline void tile_rows(float* const* out, const float* const* in, const TW* const* w, int64_t stride, int64_t count) {
  constexpr int U = TT > 1 ? 1 : (NV <= 2 ? 4 : (NV <= 4 ? 2 : 1));
  Vec acc[U][TT][NV];
  for (int u = 0; u < U; ++u)
    for (int t = 0; t < TT; ++t)
      for (int j = 0; j < NV; ++j) acc[u][t][j] = vzero();
  const auto step = [&](int u, int64_t k) {
    if constexpr (SHARED && TT > 1) {
      const TW* row = w[0] + k * stride;
      Vec wv[NV];
      for (int j = 0; j < NV; ++j) wv[j] = vload(row + kWidth * j);
      for (int t = 0; t < TT; ++t) {
        const Vec xk = vset1(in[t][k]);
        for (int j = 0; j < NV; ++j) acc[u][t][j] = vfma(xk, wv[j], acc[u][t][j]);
      }
    } else {
      for (int t = 0; t < TT; ++t) {
        const Vec xk = vset1(in[t][k]);
        const TW* row = w[t] + k * stride;
        for (int j = 0; j < NV; ++j) acc[u][t][j] = vfma(xk, vload(row + kWidth * j), acc[u][t][j]);
      }
    }
  };
  int64_t k = 0;
  for (; k + U <= count; k += U)
    for (int u = 0; u < U; ++u) step(u, k + u);
  for (; k < count; ++k) step(0, k);
  for (int t = 0; t < TT; ++t)
    for (int j = 0; j < NV; ++j) {
      Vec sum = acc[0][t][j];
      for (int u = 1; u < U; ++u) sum = vadd(sum, acc[u][t][j]);
      vstore(out[t] + kWidth * j, sum);
    }
}

template <int TT, bool SHARED, typename TW>
void tile_rows_vec(float* const* out, const float* const* in, const TW* const* w, int64_t stride, int64_t count,
                   int nv) {
  // the cases above max_vectors(TT) are never asked for (block_columns); they collapse to 1 to keep
  // the instantiations few
#define LORAPLANE_NV(N) \
  case N: return tile_rows<TT, (N <= max_vectors(TT, SHARED) ? N : 1), SHARED>(out, in, w, stride, count);
  switch (nv) {
    LORAPLANE_NV(1) LORAPLANE_NV(2) LORAPLANE_NV(3) LORAPLANE_NV(4)
    LORAPLANE_NV(5) LORAPLANE_NV(6) LORAPLANE_NV(7) LORAPLANE_NV(8)
  }
#undef LORAPLANE_NV
}

constexpr int64_t block_columns(int tt, bool shared = true) { return max_vectors(tt, shared) * kWidth; }
#else
constexpr int64_t block_columns(int, bool = true) { return 64; }
#endif

// sums[t][0 : n] (+)= s[t] * rows[t][0 : n] for t < TT; FIRST: the first row, which sets the sums
template <int TT, bool FIRST, typename TW>
inline void rows_fma(float* const* sums, const float* s, const TW* const* rows, int64_t n) {
  int64_t j = 0;
#if LORAPLANE_SIMD
  Vec sv[TT];
  for (int t = 0; t < TT; ++t) sv[t] = vset1(s[t]);
  for (; j + 4 * kWidth <= n; j += 4 * kWidth)
    for (int t = 0; t < TT; ++t)
      for (int u = 0; u < 4; ++u) {
        float* o = sums[t] + j + u * kWidth;
        const Vec w = vload(rows[t] + j + u * kWidth);
        vstore(o, FIRST ? vmul(sv[t], w) : vfma(sv[t], w, vload(o)));
      }
  for (; j + kWidth <= n; j += kWidth)
    for (int t = 0; t < TT; ++t) {
      float* o = sums[t] + j;
      const Vec w = vload(rows[t] + j);
      vstore(o, FIRST ? vmul(sv[t], w) : vfma(sv[t], w, vload(o)));
    }
#endif
  for (; j < n; ++j)
    for (int t = 0; t < TT; ++t) {
      const float w = to_float(rows[t][j]);
      sums[t][j] = FIRST ? s[t] * w : sums[t][j] + s[t] * w;
    }
}

constexpr int64_t kMaxBlock = 8 * (LORAPLANE_SIMD ? LORAPLANE_SIMD : 8);  // the widest block any tile uses

// out[t][0 : n] = sum_k in[t][k] * w[t][k * stride + 0 : n] for t < tile.count and n <= block_columns(count):
// one pass over the k rows of the weights for the whole tile
template <typename TW>
void tile_block(float* const* out, const float* const* in, const TW* const* w, int64_t stride, int64_t count,
                int64_t n, const Tile& tile) {
  int64_t done = 0;
#if LORAPLANE_SIMD
  if (n >= kWidth) {
    const int nv = static_cast<int>(n / kWidth);
    if (tile.count == 4) tile_rows_vec<4, true>(out, in, w, stride, count, nv);
    else if (tile.count == 2 && tile.shared) tile_rows_vec<2, true>(out, in, w, stride, count, nv);
    else if (tile.count == 2) tile_rows_vec<2, false>(out, in, w, stride, count, nv);
    else tile_rows_vec<1, true>(out, in, w, stride, count, nv);
    done = nv * kWidth;
  }
#endif
  if (done == n) return;
  for (int t = 0; t < tile.count; ++t) {  // the scalar tail
    float* o = out[t] + done;
    std::fill(o, o + (n - done), 0.f);
    for (int64_t k = 0; k < count; ++k) {
      const float s = in[t][k];
      const TW* row = w[t] + k * stride + done;
      for (int64_t j = 0; j < n - done; ++j) o[j] += s * to_float(row[j]);
    }
  }
}

// The columns of A a shrink reads: each lane's first `rank` of its R, merged when rank == R.
std::vector<std::pair<int64_t, int64_t>> shrink_runs(int64_t lanes, int64_t padded, int64_t rank) {
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first column of A's row, width)
  if (rank == padded) runs.emplace_back(0, lanes * rank);
  else
    for (int64_t l = 0; l < lanes; ++l) runs.emplace_back(l * padded, rank);
  return runs;
}

// What a thread keeps for its tiles: the tile's x rows and v rows in float, one block's sums per token,
// and the lanes' sums of the expand of a lone token or a pair (expand_rows).
struct Scratch {
  std::vector<float> x, v, acc, y;
  float* xs[kMaxTile];
  float* vs[kMaxTile];
  float* accs[kMaxTile];
  float* ys[2];
  Scratch(int64_t dim, int64_t v_width, int64_t y_width)
      : x(kMaxTile * dim), v(kMaxTile * v_width), acc(kMaxTile * kMaxBlock), y(2 * y_width) {
    for (int t = 0; t < kMaxTile; ++t) {
      xs[t] = x.data() + t * dim;
      vs[t] = v.data() + t * v_width;
      accs[t] = acc.data() + t * kMaxBlock;
    }
    for (int t = 0; t < 2; ++t) ys[t] = y.data() + t * y_width;
  }
};

// The tile's shrink: s.vs[t][0 : lanes*rank] = x[rows[t]] @ as[t] (its slot's A, ranked lanes), in float,
// rounded to TA as the torch ops round v.
template <typename TA, typename TW>
void shrink_tile(Scratch& s, const Tile& tile, const int64_t* rows, const TW* const* as, const TA* xp, int64_t x_row,
                 int64_t a_row, int64_t dim, int64_t padded, int64_t rank,
                 const std::vector<std::pair<int64_t, int64_t>>& runs) {
  for (int t = 0; t < tile.count; ++t) {
    const TA* xr = xp + rows[t] * x_row;
    for (int64_t k = 0; k < dim; ++k) s.xs[t][k] = to_float(xr[k]);
  }
  const int64_t step = block_columns(tile.count, tile.shared);
  const TW* w[kMaxTile];
  for (auto [first, width] : runs)
    for (int64_t c = 0; c < width; c += step) {
      const int64_t col = first + c, n = std::min(step, width - c);
      for (int t = 0; t < tile.count; ++t) w[t] = as[t] + col;
      tile_block(s.accs, s.xs, w, a_row, dim, n, tile);
      const int64_t out = col / padded * rank + col % padded;  // its place in v's lanes * rank
      for (int t = 0; t < tile.count; ++t)
        for (int64_t j = 0; j < n; ++j) s.vs[t][out + j] = to_float(static_cast<TA>(s.accs[t][j]));
    }
}

// The expand of TT tokens of TT slots (a lone token or a pair), B read in its memory's order: row r of
// every lane, then row r + 1, so that each slot's B is one sequential stream, the pair's two side by
// side; the sums wait in s.ys (a token's lanes side by side, an L1-sized row). Blocks of columns over
// the rank rows, as the shared tiles read B, would make `rank` short strided streams per block, slower
// for a decode step's expand (docs/performance.md#lora-kernels; measure with bench/lora_ops.py).
template <int TT, typename TA, typename TW>
void expand_rows(Scratch& s, const int64_t* rows, const float* const* vs, const TW* const* bs, TA* yp,
                 int64_t y_row, int64_t b_row, int64_t rank, at::IntArrayRef offsets, at::IntArrayRef widths) {
  if (rank == 0) return;  // nothing to add (the sums would be unset)
  for (int64_t r = 0; r < rank; ++r) {
    int64_t at = 0;
    for (size_t l = 0; l < offsets.size(); ++l) {
      float sv[TT];
      const TW* w[TT];
      float* o[TT];
      for (int t = 0; t < TT; ++t) {
        sv[t] = vs[t][l * rank + r];
        w[t] = bs[t] + r * b_row + offsets[l];
        o[t] = s.ys[t] + at;
      }
      if (r == 0) rows_fma<TT, true>(o, sv, w, widths[l]);
      else rows_fma<TT, false>(o, sv, w, widths[l]);
      at += widths[l];
    }
  }
  for (int t = 0; t < TT; ++t) {
    const float* sums = s.ys[t];
    for (size_t l = 0; l < offsets.size(); ++l) {
      TA* yr = yp + rows[t] * y_row + offsets[l];
      for (int64_t j = 0; j < widths[l]; ++j) yr[j] = static_cast<TA>(to_float(yr[j]) + sums[j]);
      sums += widths[l];
    }
  }
}

// The tile's expand: y[rows[t], lane columns] += s.vs[t][lane's block] @ bs[t][:rank, lane columns].
// Shared tiles (a prefill run: B from the cache after its first tile) keep a block's sums in registers
// over the rank rows; the others stream B by rows.
template <typename TA, typename TW>
void expand_tile(Scratch& s, const Tile& tile, const int64_t* rows, const TW* const* bs, TA* yp, int64_t y_row,
                 int64_t b_row, int64_t rank, at::IntArrayRef offsets, at::IntArrayRef widths) {
  if (tile.count == 1) return expand_rows<1>(s, rows, s.vs, bs, yp, y_row, b_row, rank, offsets, widths);
  if (!tile.shared) return expand_rows<2>(s, rows, s.vs, bs, yp, y_row, b_row, rank, offsets, widths);
  const int64_t step = block_columns(tile.count);
  const float* in[kMaxTile];
  const TW* w[kMaxTile];
  for (size_t l = 0; l < offsets.size(); ++l) {
    for (int t = 0; t < tile.count; ++t) in[t] = s.vs[t] + l * rank;
    for (int64_t c = 0; c < widths[l]; c += step) {
      const int64_t col = offsets[l] + c, n = std::min(step, widths[l] - c);
      for (int t = 0; t < tile.count; ++t) w[t] = bs[t] + col;
      tile_block(s.accs, in, w, b_row, rank, n, tile);
      for (int t = 0; t < tile.count; ++t) {
        TA* yr = yp + rows[t] * y_row + col;
        for (int64_t j = 0; j < n; ++j) yr[j] = static_cast<TA>(to_float(yr[j]) + s.accs[t][j]);
      }
    }
  }
}

// The slot's weights of each token of the tile: base + slot * slot_stride.
template <typename TW>
inline void slot_weights(const TW** out, const TW* base, int64_t slot_stride, const int64_t* slots, const Tile& tile) {
  for (int t = 0; t < tile.count; ++t) out[t] = base + slots[tile.first + t] * slot_stride;
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

// Calls body(scratch, tile, rows[count]) for every tile, the tiles split over the threads.
template <typename Body>
void for_tiles(const at::Tensor& index, const at::Tensor& slots, int64_t dim, int64_t v_width, int64_t y_width,
               Body&& body) {
  const int64_t* ip = index.const_data_ptr<int64_t>();
  const auto tiles = make_tiles(slots.const_data_ptr<int64_t>(), slots.numel());
  const int64_t n = static_cast<int64_t>(tiles.size());
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(dim, v_width, y_width);
    for (int64_t i = begin; i < end; ++i) body(scratch, tiles[i], ip + tiles[i].first);
  });
}

int64_t lane_columns(at::IntArrayRef widths) {
  int64_t n = 0;
  for (int64_t w : widths) n += w;
  return n;
}

void check_shrink(const at::Tensor& x, const at::Tensor& a, int64_t lanes, int64_t rank) {
  check_rows(x, "x", x.scalar_type());
  check_weights(a, "lora_a", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && a.size(1) == x.size(1), "shapes x [T, in], A [S, in, L*R]");
  TORCH_CHECK(lanes > 0 && a.size(2) % lanes == 0 && rank <= a.size(2) / lanes, "lanes and rank");
}

void check_expand(const at::Tensor& y, const at::Tensor& b, at::IntArrayRef offsets, at::IntArrayRef widths,
                  int64_t rank) {
  check_rows(y, "y", y.scalar_type());
  check_weights(b, "lora_b", y.scalar_type());
  TORCH_CHECK(y.dim() == 2 && b.dim() == 3 && rank <= b.size(1), "shapes y [T, out], B [S, R, out]");
  TORCH_CHECK(offsets.size() == widths.size() && !offsets.empty(), "one offset and width per lane");
  for (size_t l = 0; l < offsets.size(); ++l)
    TORCH_CHECK(offsets[l] >= 0 && offsets[l] + widths[l] <= std::min(y.size(1), b.size(2)), "lane out of range");
}

void bgmv_shrink(at::Tensor v, const at::Tensor& x, const at::Tensor& a, const at::Tensor& index,
                 const at::Tensor& slots, int64_t lanes, int64_t rank) {
  check_shrink(x, a, lanes, rank);
  check_rows(v, "v", x.scalar_type());
  TORCH_CHECK(v.dim() == 2 && v.size(1) == lanes * rank, "v [T, L * rank]");
  check_routing(index, slots, std::min(x.size(0), v.size(0)), a.size(0));
  const int64_t dim = x.size(1), padded = a.size(2) / lanes, width = lanes * rank;
  const auto runs = shrink_runs(lanes, padded, rank);
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  dispatch(x.scalar_type(), a.scalar_type(), [&](auto ta, auto tw) {
    using TA = decltype(ta);
    using TW = decltype(tw);
    const TA* xp = x.const_data_ptr<TA>();
    const TW* ap = a.const_data_ptr<TW>();
    TA* vp = v.mutable_data_ptr<TA>();
    for_tiles(index, slots, dim, width, 0, [&](Scratch& s, const Tile& tile, const int64_t* rows) {
      const TW* as[kMaxTile];
      slot_weights(as, ap, a.stride(0), sp, tile);
      shrink_tile<TA, TW>(s, tile, rows, as, xp, x.stride(0), a.stride(1), dim, padded, rank, runs);
      for (int t = 0; t < tile.count; ++t)
        for (int64_t j = 0; j < width; ++j) vp[rows[t] * v.stride(0) + j] = static_cast<TA>(s.vs[t][j]);
    });
  });
}

void bgmv_expand(at::Tensor y, const at::Tensor& v, const at::Tensor& b, const at::Tensor& index,
                 const at::Tensor& slots, at::IntArrayRef offsets, at::IntArrayRef widths, int64_t rank) {
  check_expand(y, b, offsets, widths, rank);
  check_rows(v, "v", y.scalar_type());
  TORCH_CHECK(v.dim() == 2 && v.size(1) == int64_t(offsets.size()) * rank, "v [T, L * rank]");
  check_routing(index, slots, std::min(y.size(0), v.size(0)), b.size(0));
  const int64_t width = v.size(1), y_width = lane_columns(widths);
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  dispatch(y.scalar_type(), b.scalar_type(), [&](auto ta, auto tw) {
    using TA = decltype(ta);
    using TW = decltype(tw);
    const TA* vp = v.const_data_ptr<TA>();
    const TW* bp = b.const_data_ptr<TW>();
    TA* yp = y.mutable_data_ptr<TA>();
    for_tiles(index, slots, 0, width, y_width, [&](Scratch& s, const Tile& tile, const int64_t* rows) {
      for (int t = 0; t < tile.count; ++t)
        for (int64_t j = 0; j < width; ++j) s.vs[t][j] = to_float(vp[rows[t] * v.stride(0) + j]);
      const TW* bs[kMaxTile];
      slot_weights(bs, bp, b.stride(0), sp, tile);
      expand_tile<TA, TW>(s, tile, rows, bs, yp, y.stride(0), b.stride(1), rank, offsets, widths);
    });
  });
}

void bgmv_shrink_expand(at::Tensor y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                        const at::Tensor& index, const at::Tensor& slots, int64_t lanes, int64_t rank,
                        at::IntArrayRef offsets, at::IntArrayRef widths) {
  check_shrink(x, a, lanes, rank);
  check_expand(y, b, offsets, widths, rank);
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && int64_t(offsets.size()) == lanes && a.size(0) == b.size(0),
              "x and y of one dtype, one lane per offset, A and B of the same slots");
  check_routing(index, slots, std::min(x.size(0), y.size(0)), a.size(0));
  const int64_t dim = x.size(1), padded = a.size(2) / lanes, y_width = lane_columns(widths);
  const auto runs = shrink_runs(lanes, padded, rank);
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  dispatch(x.scalar_type(), a.scalar_type(), [&](auto ta, auto tw) {
    using TA = decltype(ta);
    using TW = decltype(tw);
    TORCH_CHECK(b.scalar_type() == a.scalar_type(), "A and B of one dtype");
    const TA* xp = x.const_data_ptr<TA>();
    const TW* ap = a.const_data_ptr<TW>();
    const TW* bp = b.const_data_ptr<TW>();
    TA* yp = y.mutable_data_ptr<TA>();
    for_tiles(index, slots, dim, lanes * rank, y_width, [&](Scratch& s, const Tile& tile, const int64_t* rows) {
      const TW* as[kMaxTile];
      const TW* bs[kMaxTile];
      slot_weights(as, ap, a.stride(0), sp, tile);
      slot_weights(bs, bp, b.stride(0), sp, tile);
      shrink_tile<TA, TW>(s, tile, rows, as, xp, x.stride(0), a.stride(1), dim, padded, rank, runs);
      expand_tile<TA, TW>(s, tile, rows, bs, yp, y.stride(0), b.stride(1), rank, offsets, widths);
    });
  });
}

}  // namespace

TORCH_LIBRARY(loraplane_lora, m) {
  m.def("bgmv_shrink(Tensor(a!) v, Tensor x, Tensor lora_a, Tensor index, Tensor slots, int lanes, int rank) -> ()");
  m.def("bgmv_expand(Tensor(a!) y, Tensor v, Tensor lora_b, Tensor index, Tensor slots, int[] offsets, "
        "int[] widths, int rank) -> ()");
  m.def("bgmv_shrink_expand(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor index, Tensor slots, "
        "int lanes, int rank, int[] offsets, int[] widths) -> ()");
}

TORCH_LIBRARY_IMPL(loraplane_lora, CPU, m) {
  m.impl("bgmv_shrink", &bgmv_shrink);
  m.impl("bgmv_expand", &bgmv_expand);
  m.impl("bgmv_shrink_expand", &bgmv_shrink_expand);
}
