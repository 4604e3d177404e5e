// torch.ops.gemma_spec.int8_linear: float32 rows times int8 matrices with per-output scales (cpu_ops.py).
//
// Each row is first rounded to 16-bit integers per block of 32 inputs (a scale per block: its largest magnitude
// maps to 32767). A block's products with a weight row are then exact integer sums, eight lane sums of four
// products each (below 2^24, so exact in float32 too); each lane adds its sum times the block's scale to a float
// lane total, block after block; the eight totals add as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)), times the output's
// scale. Tiles of rows and outputs only share loaded weights, so a row's result does not depend on how many rows
// share the pass. A matrix is stored in tiles of 1 or 8 outputs (matrix_strides): tile-major, one memory stream per
// block of outputs, decode reads its weights near the machine's bandwidth. Several matrices of the same input width
// and tile run in one call (a layer's query, key and value), their outputs side by side; torch.ops.gemma_spec.int8_feed_forward runs a whole feed-forward block (gate and up, the
// gelu gate, down) in one call.
//
// torch.ops.gemma_spec.int4_linear does the same for int4 matrices: levels 0..15, two a byte, with a scale and a low
// per output and block of 32 inputs (value = level * scale + low, the engine's asymmetric int4), stored tile-major
// (outputs in groups of 8, see tile4). A block's lane sums
// of level times activation level are exact as above; the low's share is the low times the block's rounded
// activation sum, added per output beside the lanes.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "lane_totals.h"

using Vec = at::vec::Vectorized<float>;

constexpr int64_t BLOCK = 32;          // inputs per activation scale; the input width must be a multiple
constexpr float LEVELS = 32767.f;      // int16 levels of a block's largest magnitude
constexpr int64_t PREFETCH_BYTES = 1024;  // how far ahead a tile-major product (int8, int4) asks for its weights

// Rows x [q, width] -> int16 levels [q, width] and a scale per block [q, width / BLOCK]
static void quantize_rows(const float* x, int64_t q, int64_t width, int16_t* levels, float* scales) {
  for (int64_t b = 0; b < q * width / BLOCK; ++b) {
    const float* block = x + b * BLOCK;
    float largest = 0.f;
    for (int64_t i = 0; i < BLOCK; ++i) largest = std::max(largest, std::fabs(block[i]));
    const float inverse = largest > 0.f ? LEVELS / largest : 0.f;
    scales[b] = largest / LEVELS;
    for (int64_t i = 0; i < BLOCK; ++i) levels[b * BLOCK + i] = static_cast<int16_t>(std::nearbyint(block[i] * inverse));
  }
}

#if defined(__AVX2__) && defined(__FMA__)
using Acc = __m256;
struct Weights { __m256i low, high; };  // a block of one weight row as 2 x 16 int16
static inline Acc acc_zero() { return _mm256_setzero_ps(); }
static inline Weights weights_at(const int8_t* w) {
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))),
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)))};
}
struct Inputs { __m256i low, high; __m256 scale; };  // a block of one row: 2 x 16 levels and the block's scale
static inline Inputs inputs_at(const int16_t* x, float scale) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)), _mm256_set1_ps(scale)};
}
// acc += (the block's eight exact lane sums of weight times level) * scale
static inline Acc block_add(const Weights& w, const Inputs& x, Acc acc) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)  // the second multiply-add and the add in one instruction
  const __m256i sums = _mm256_dpwssd_epi32(_mm256_madd_epi16(w.low, x.low), w.high, x.high);
#else
  const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(w.low, x.low), _mm256_madd_epi16(w.high, x.high));
#endif
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), x.scale, acc);
}
// A block of an int4 row: byte j holds input j (low nibble) and input 16 + j (high nibble). Widened to 16 bits
// first, each byte's high nibble is its value shifted right by 4.
static inline Weights nibbles_at(const uint8_t* w) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return {_mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16(bytes, 4)};
}
// acc += (the block's eight exact lane sums) * scale, the scale given (int4: the weight block's times the row's)
static inline Acc block_add_scaled(const Weights& w, const Inputs& x, float scale, Acc acc) {
  const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(w.low, x.low), _mm256_madd_epi16(w.high, x.high));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(scale), acc);
}
static inline void reduce8(const Acc* acc, float* totals) { lane_totals8(acc, totals); }
// Eight floats, one per output of a tile (int4's lows' share)
using Lanes8 = __m256;
static inline Lanes8 lanes8_zero() { return _mm256_setzero_ps(); }
static inline Lanes8 lanes8_fma(const float* values, float factor, Lanes8 acc) {
  return _mm256_fmadd_ps(_mm256_loadu_ps(values), _mm256_set1_ps(factor), acc);
}
static inline void lanes8_store(Lanes8 lanes, float* out) { _mm256_storeu_ps(out, lanes); }
#else
struct Acc { float lane[8]; };
struct Weights { int8_t value[32]; };
struct Inputs { const int16_t* row; float scale; };
static inline Acc acc_zero() { return Acc{}; }
static inline Weights weights_at(const int8_t* w) {
  Weights block;
  std::memcpy(block.value, w, 32);
  return block;
}
static inline Weights nibbles_at(const uint8_t* w) {
  Weights block;
  for (int j = 0; j < 16; ++j) {
    block.value[j] = static_cast<int8_t>(w[j] & 0x0F);
    block.value[16 + j] = static_cast<int8_t>(w[j] >> 4);
  }
  return block;
}
static inline Inputs inputs_at(const int16_t* x, float scale) { return {x, scale}; }
static inline Acc block_add_scaled(const Weights& weights, const Inputs& inputs, float scale, Acc acc) {
  const int8_t* w = weights.value;
  const int16_t* x = inputs.row;
  // lane l: inputs 2l, 2l+1, 16+2l, 16+2l+1 (the AVX2 form's pairing)
  for (int l = 0; l < 8; ++l) {
    const int32_t sum = w[2 * l] * x[2 * l] + w[2 * l + 1] * x[2 * l + 1] + w[16 + 2 * l] * x[16 + 2 * l] +
                        w[17 + 2 * l] * x[17 + 2 * l];
    acc.lane[l] = std::fma(static_cast<float>(sum), scale, acc.lane[l]);
  }
  return acc;
}
static inline Acc block_add(const Weights& weights, const Inputs& inputs, Acc acc) {
  return block_add_scaled(weights, inputs, inputs.scale, acc);
}
static inline void reduce8(const Acc* acc, float* totals) {
  for (int o = 0; o < 8; ++o) totals[o] = lane_total(acc[o].lane);
}
struct Lanes8 { float lane[8]; };
static inline Lanes8 lanes8_zero() { return Lanes8{}; }
static inline Lanes8 lanes8_fma(const float* values, float factor, Lanes8 acc) {
  for (int o = 0; o < 8; ++o) acc.lane[o] = std::fma(values[o], factor, acc.lane[o]);
  return acc;
}
static inline void lanes8_store(Lanes8 lanes, float* out) { std::memcpy(out, lanes.lane, sizeof(lanes.lane)); }
#endif

// y[r, o] = weight_scale[o] * dot(row r, w[o]) for R rows (levels and block scales) and O outputs. Output o's
// block b is at w + o * output_stride + b * block_stride (the matrix's layout: matrix_strides).
template <int R, int O>
static inline void tile(const int16_t* x, const float* x_scales, int64_t width, const int8_t* w,
                        int64_t output_stride, int64_t block_stride, const float* weight_scale, float* y,
                        int64_t y_stride) {
  const int64_t blocks = width / BLOCK;
  const bool contiguous = output_stride == BLOCK;  // tile-major: one stream, which the loop asks for ahead
  Acc acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = acc_zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* at = w + b * block_stride;
    if (contiguous)
      for (int line = 0; line < O * BLOCK; line += 64) __builtin_prefetch(at + PREFETCH_BYTES + line, 0, 0);
    Inputs inputs[R];
    for (int r = 0; r < R; ++r) inputs[r] = inputs_at(x + r * width + b * BLOCK, x_scales[r * blocks + b]);
    for (int o = 0; o < O; ++o) {
      const Weights block = weights_at(at + o * output_stride);
      for (int r = 0; r < R; ++r) acc[r][o] = block_add(block, inputs[r], acc[r][o]);
    }
  }
  for (int r = 0; r < R; ++r) {
    Acc padded[8];
    for (int o = 0; o < 8; ++o) padded[o] = o < O ? acc[r][o] : acc_zero();
    float totals[8];
    reduce8(padded, totals);
    for (int o = 0; o < O; ++o) y[r * y_stride + o] = totals[o] * weight_scale[o];
  }
}

// R rows against n outputs: O at a time (eight accumulators in flight), the rest one at a time
template <int R, int O>
static void rows_times_matrix(const int16_t* x, const float* x_scales, int64_t width, const int8_t* w, int64_t n,
                              int64_t output_stride, int64_t block_stride, const float* weight_scale, float* y,
                              int64_t y_stride) {
  int64_t o = 0;
  for (; o + O <= n; o += O)
    tile<R, O>(x, x_scales, width, w + o * output_stride, output_stride, block_stride, weight_scale + o, y + o,
               y_stride);
  for (; o < n; ++o)
    tile<R, 1>(x, x_scales, width, w + o * output_stride, output_stride, block_stride, weight_scale + o, y + o,
               y_stride);
}

static void check_matrix(const at::Tensor& w, const at::Tensor& scales, int64_t width, int64_t tile, const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.size(1) == width && w.is_contiguous(), op,
              ": weights must be contiguous int8 [out, in] of the input's width");
  TORCH_CHECK(w.size(0) % tile == 0, op, ": a matrix stored in tiles of ", tile, " outputs must have a multiple of ",
              tile, " outputs");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == w.size(0) && scales.is_contiguous(), op,
              ": scales must be contiguous float32 [out]");
}

struct Matrix { const int8_t* data; const float* scales; int64_t outputs; };

// An int8 matrix [out, in] is stored in tiles of `tile` outputs (1 or OUTPUT_BLOCK): for each tile and block of 32
// inputs, the tile's outputs' 32 bytes one after another (tile 1: row-major). A tile's product then reads one
// memory stream instead of one per output, which the hardware's prefetchers follow at a higher rate.
static inline void matrix_strides(int64_t width, int64_t tile, int64_t& output_stride, int64_t& block_stride) {
  output_stride = tile == 1 ? width : BLOCK;
  block_stride = tile * BLOCK;
}

constexpr int64_t ROW_BLOCK = 16;  // rows whose levels stay in L2 while a block of outputs passes over them
constexpr int64_t OUTPUT_BLOCK = 8;  // outputs whose weights stay in L1 while every row of a row block uses them
// at::parallel_for splits a matrix's output blocks among torch's threads, at least this many a thread: each output
// is still one tile's, so the bits do not depend on the number of threads
constexpr int64_t PARALLEL_GRAIN = 32;

// The order every pass walks in: row blocks outside, blocks of OUTPUT_BLOCK outputs inside (split among torch's
// threads), so a verify pass of up to ROW_BLOCK rows reads each weight from memory once and its cost grows with the
// rows' arithmetic, not with the weights' bytes again for every pair of rows. block(first, last, m, o, n, column)
// computes rows [first, last) of matrix m's outputs [o, o + n), whose results go to y's columns from column + o.
template <typename M, typename Block>
static void walk(int64_t q, const std::vector<M>& matrices, const Block& block) {
  for (int64_t first = 0; first < q; first += ROW_BLOCK) {
    const int64_t last = std::min(q, first + ROW_BLOCK);
    int64_t column = 0;
    for (const M& m : matrices) {
      at::parallel_for(0, (m.outputs + OUTPUT_BLOCK - 1) / OUTPUT_BLOCK, PARALLEL_GRAIN, [&](int64_t begin, int64_t end) {
        for (int64_t o = begin * OUTPUT_BLOCK; o < std::min(m.outputs, end * OUTPUT_BLOCK); o += OUTPUT_BLOCK)
          block(first, last, m, o, std::min(OUTPUT_BLOCK, m.outputs - o), column);
      });
      column += m.outputs;
    }
  }
}

// y[r, :] = rows x [q, width] (rounded as above) times each matrix, their outputs side by side; y has y_stride columns
static void products(const float* x, int64_t q, int64_t width, const std::vector<Matrix>& matrices, int64_t tile,
                     float* y, int64_t y_stride) {
  std::vector<int16_t> levels(q * width);
  std::vector<float> x_scales(q * width / BLOCK);
  quantize_rows(x, q, width, levels.data(), x_scales.data());
  const int64_t blocks = width / BLOCK;
  int64_t output_stride, block_stride;
  matrix_strides(width, tile, output_stride, block_stride);
  walk(q, matrices, [&](int64_t first, int64_t last, const Matrix& m, int64_t o, int64_t n, int64_t column) {
    const int8_t* w = m.data + o * width;  // a block of outputs starts a tile (OUTPUT_BLOCK is a multiple of tile)
    int64_t r = first;
    for (; r + 2 <= last; r += 2)
      rows_times_matrix<2, 4>(levels.data() + r * width, x_scales.data() + r * blocks, width, w, n, output_stride,
                              block_stride, m.scales + o, y + r * y_stride + column + o, y_stride);
    for (; r < last; ++r)
      rows_times_matrix<1, 8>(levels.data() + r * width, x_scales.data() + r * blocks, width, w, n, output_stride,
                              block_stride, m.scales + o, y + r * y_stride + column + o, y_stride);
  });
}

// A tile's block of params: its 8 outputs' float16 scales, then their 8 lows, as floats
#if defined(__F16C__)
static inline void tile_params(const uint16_t* params, float* scales, float* lows) {
  _mm256_storeu_ps(scales, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(params))));
  _mm256_storeu_ps(lows, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(params + OUTPUT_BLOCK))));
}
#else
static inline void tile_params(const uint16_t* params, float* scales, float* lows) {
  for (int o = 0; o < OUTPUT_BLOCK; ++o) {
    scales[o] = static_cast<float>(c10::Half(params[o], c10::Half::from_bits()));
    lows[o] = static_cast<float>(c10::Half(params[OUTPUT_BLOCK + o], c10::Half::from_bits()));
  }
}
#endif

// int4: y[r, o] for R rows and O outputs of one group of 8, from output `first` of the group. The data is stored
// tile-major: for a group of 8 outputs and a block b, the 8 outputs' 16 bytes follow each other, and the params the
// 8 float16 scales then the 8 lows, so a tile reads two streams instead of one per output. w and params point at the
// group. x_sums [q, blocks]: each block's sum of levels times its scale (the rounded activations' sum), which the low
// multiplies; the 8 outputs' lows accumulate as one vector, block after block.
template <int R, int O>
static inline void tile4(const int16_t* x, const float* x_scales, const float* x_sums, int64_t width,
                         const uint8_t* w, const uint16_t* params, int first, float* y, int64_t y_stride) {
  const int64_t blocks = width / BLOCK;
  Acc acc[R][O];
  Lanes8 offsets[R];
  for (int r = 0; r < R; ++r) {
    offsets[r] = lanes8_zero();
    for (int o = 0; o < O; ++o) acc[r][o] = acc_zero();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* at = w + b * OUTPUT_BLOCK * (BLOCK / 2);
    __builtin_prefetch(at + PREFETCH_BYTES, 0, 0);
    __builtin_prefetch(at + PREFETCH_BYTES + 64, 0, 0);
    alignas(32) float scales[OUTPUT_BLOCK], lows[OUTPUT_BLOCK];
    tile_params(params + b * 2 * OUTPUT_BLOCK, scales, lows);
    Inputs inputs[R];
    for (int r = 0; r < R; ++r) {
      inputs[r] = inputs_at(x + r * width + b * BLOCK, 0.f);
      offsets[r] = lanes8_fma(lows, x_sums[r * blocks + b], offsets[r]);
    }
    for (int o = 0; o < O; ++o) {
      const Weights block = nibbles_at(at + (first + o) * (BLOCK / 2));
      for (int r = 0; r < R; ++r)
        acc[r][o] = block_add_scaled(block, inputs[r], scales[first + o] * x_scales[r * blocks + b], acc[r][o]);
    }
  }
  for (int r = 0; r < R; ++r) {
    Acc padded[8];
    for (int o = 0; o < 8; ++o) padded[o] = o < O ? acc[r][o] : acc_zero();
    float totals[8], offset[OUTPUT_BLOCK];
    reduce8(padded, totals);
    lanes8_store(offsets[r], offset);
    for (int o = 0; o < O; ++o) y[r * y_stride + o] = totals[o] + offset[first + o];
  }
}

// R rows against one group of OUTPUT_BLOCK outputs, O at a time
template <int R, int O>
static void rows_times_int4(const int16_t* x, const float* x_scales, const float* x_sums, int64_t width,
                            const uint8_t* w, const uint16_t* params, float* y, int64_t y_stride) {
  for (int o = 0; o < OUTPUT_BLOCK; o += O) tile4<R, O>(x, x_scales, x_sums, width, w, params, o, y + o, y_stride);
}

struct Int4Matrix { const uint8_t* data; const uint16_t* params; int64_t outputs; };

// products() for int4 matrices: the same rounding of the rows, the same walk (whole groups of OUTPUT_BLOCK outputs)
static void products4(const float* x, int64_t q, int64_t width, const std::vector<Int4Matrix>& matrices, float* y,
                      int64_t y_stride) {
  const int64_t blocks = width / BLOCK;
  std::vector<int16_t> levels(q * width);
  std::vector<float> x_scales(q * blocks), x_sums(q * blocks);
  quantize_rows(x, q, width, levels.data(), x_scales.data());
  for (int64_t b = 0; b < q * blocks; ++b) {
    int32_t sum = 0;
    for (int64_t i = 0; i < BLOCK; ++i) sum += levels[b * BLOCK + i];
    x_sums[b] = static_cast<float>(sum) * x_scales[b];
  }
  walk(q, matrices, [&](int64_t first, int64_t last, const Int4Matrix& m, int64_t o, int64_t, int64_t column) {
    const uint8_t* w = m.data + o * (width / 2);
    const uint16_t* params = m.params + o * blocks * 2;
    int64_t r = first;
    for (; r + 2 <= last; r += 2)
      rows_times_int4<2, 4>(levels.data() + r * width, x_scales.data() + r * blocks, x_sums.data() + r * blocks,
                            width, w, params, y + r * y_stride + column + o, y_stride);
    for (; r < last; ++r)
      rows_times_int4<1, 8>(levels.data() + r * width, x_scales.data() + r * blocks, x_sums.data() + r * blocks,
                            width, w, params, y + r * y_stride + column + o, y_stride);
  });
}

// x [q, in] float32 with in a multiple of BLOCK (op names the caller in the error), contiguous
static at::Tensor checked_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": x must be float32 [rows, in]");
  TORCH_CHECK(x.size(1) % BLOCK == 0, op, ": the input width must be a multiple of ", BLOCK);
  return x.contiguous();
}

// x [q, in] float32; data: uint8 [out_i, in / 2]; params: float16 [out_i, in / 32, 2] -> [q, sum of out_i]
at::Tensor int4_linear(const at::Tensor& x, at::TensorList data, at::TensorList params) {
  const at::Tensor xc = checked_rows(x, "int4_linear");
  TORCH_CHECK(data.size() == params.size() && !data.empty(), "int4_linear: one params tensor per matrix");
  const int64_t q = x.size(0), width = x.size(1);
  std::vector<Int4Matrix> matrices;
  int64_t total = 0;
  for (size_t i = 0; i < data.size(); ++i) {
    TORCH_CHECK(data[i].scalar_type() == at::kByte && data[i].dim() == 2 && data[i].size(1) * 2 == width &&
                data[i].size(0) % OUTPUT_BLOCK == 0 && data[i].is_contiguous(),
                "int4_linear: data must be contiguous uint8 [out, in / 2], out a multiple of ", OUTPUT_BLOCK);
    TORCH_CHECK(params[i].scalar_type() == at::kHalf && params[i].is_contiguous() &&
                params[i].numel() == data[i].size(0) * (width / BLOCK) * 2,
                "int4_linear: params must be contiguous float16 [out, in / 32, 2]");
    matrices.push_back({data[i].data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(params[i].data_ptr<at::Half>()),
                        data[i].size(0)});
    total += data[i].size(0);
  }
  at::Tensor y = at::empty({q, total}, x.options());
  products4(xc.data_ptr<float>(), q, width, matrices, y.data_ptr<float>(), total);
  return y;
}

static void check_tile(int64_t tile, const char* op) {
  TORCH_CHECK(tile == 1 || tile == OUTPUT_BLOCK, op, ": tile must be 1 or ", OUTPUT_BLOCK, ", got ", tile);
}

// x [q, in] float32; weights: int8 [out_i, in] (contiguous, in tiles of `tile` outputs); scales: float32 [out_i]
// -> [q, sum of out_i]
at::Tensor int8_linear(const at::Tensor& x, at::TensorList weights, at::TensorList scales, int64_t tile) {
  const at::Tensor xc = checked_rows(x, "int8_linear");
  TORCH_CHECK(weights.size() == scales.size() && !weights.empty(), "int8_linear: one scales tensor per matrix");
  check_tile(tile, "int8_linear");
  const int64_t q = x.size(0), width = x.size(1);
  std::vector<Matrix> matrices;
  int64_t total = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    check_matrix(weights[i], scales[i], width, tile, "int8_linear");
    matrices.push_back({weights[i].data_ptr<int8_t>(), scales[i].data_ptr<float>(), weights[i].size(0)});
    total += weights[i].size(0);
  }
  at::Tensor y = at::empty({q, total}, x.options());
  products(xc.data_ptr<float>(), q, width, matrices, tile, y.data_ptr<float>(), total);
  return y;
}

// gated[i] = gelu(gate[i]) * up[i] for n values, gelu's tanh form as aten computes it: 0.5 x (1 + tanh(beta (x +
// kappa x^3))). Every value goes through the same vector code (the tail as a partial vector), whatever the row.
static void gelu_gate(const float* gate, const float* up, int64_t n, float* gated) {
  const Vec beta(static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5)), kappa(0.044715f), half(0.5f), one(1.f);
  for (int64_t i = 0; i < n; i += Vec::size()) {
    const int count = static_cast<int>(std::min<int64_t>(Vec::size(), n - i));
    const Vec x = Vec::loadu(gate + i, count), u = Vec::loadu(up + i, count);
    const Vec inner = beta * (x + kappa * (x * x * x));
    (half * x * (one + inner.tanh()) * u).store(gated + i, count);
  }
}

// A feed-forward block in one call: down(gelu(gate(x)) * up(x)) for x [q, in] float32; gate and up int8 [hidden,
// in], down int8 [out, hidden] (hidden a multiple of the block), each with its float32 scales -> [q, out]. The
// products are int8_linear's, so a row's result still does not depend on the rows beside it.
at::Tensor int8_feed_forward(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& gate_scales,
                             const at::Tensor& up, const at::Tensor& up_scales, const at::Tensor& down,
                             const at::Tensor& down_scales, int64_t tile) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_feed_forward: x must be float32 [rows, in]");
  const int64_t q = x.size(0), width = x.size(1), hidden = gate.size(0);
  TORCH_CHECK(width % BLOCK == 0 && hidden % BLOCK == 0, "int8_feed_forward: the input and hidden widths must be "
              "multiples of ", BLOCK);
  check_tile(tile, "int8_feed_forward");
  check_matrix(gate, gate_scales, width, tile, "int8_feed_forward");
  check_matrix(up, up_scales, width, tile, "int8_feed_forward");
  check_matrix(down, down_scales, hidden, tile, "int8_feed_forward");
  TORCH_CHECK(up.size(0) == hidden, "int8_feed_forward: gate and up must have as many outputs");
  const at::Tensor xc = x.contiguous();
  std::vector<float> gate_up(q * 2 * hidden), gated(q * hidden);
  products(xc.data_ptr<float>(), q, width,
           {{gate.data_ptr<int8_t>(), gate_scales.data_ptr<float>(), hidden},
            {up.data_ptr<int8_t>(), up_scales.data_ptr<float>(), hidden}}, tile, gate_up.data(), 2 * hidden);
  for (int64_t r = 0; r < q; ++r)
    gelu_gate(gate_up.data() + r * 2 * hidden, gate_up.data() + r * 2 * hidden + hidden, hidden,
              gated.data() + r * hidden);
  at::Tensor y = at::empty({q, down.size(0)}, x.options());
  products(gated.data(), q, hidden, {{down.data_ptr<int8_t>(), down_scales.data_ptr<float>(), down.size(0)}}, tile,
           y.data_ptr<float>(), down.size(0));
  return y;
}

TORCH_LIBRARY_FRAGMENT(gemma_spec, m) {
  m.def("int8_linear(Tensor x, Tensor[] weights, Tensor[] scales, int tile) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor[] data, Tensor[] params) -> Tensor");
  m.def("int8_feed_forward(Tensor x, Tensor gate, Tensor gate_scales, Tensor up, Tensor up_scales, Tensor down, "
        "Tensor down_scales, int tile) -> Tensor");
}
TORCH_LIBRARY_IMPL(gemma_spec, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_feed_forward", &int8_feed_forward);
}
