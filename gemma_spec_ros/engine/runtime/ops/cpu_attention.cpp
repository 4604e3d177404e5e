// torch.ops.gemma_spec.decode_attention: attention of a few queries over a decode step's keys (cpu_ops.py).
//
// Each query row and head is computed in a fixed order of its own, so a row's result does not depend on how many
// queries share the pass. Scores are dot products of one query and one key row; the softmax is exp(s - max) over
// the row; the output sums the value rows weighted by it in ascending keys, a chunk at a time in registers.
// The queries that read one KV head go two at a time (a row's heads of a group, or two rows), sharing each key and
// value row they load. A row reads only the keys from its first to its last visible one, so its result does not
// depend on the mask's width either.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "lane_totals.h"

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int CHUNK_VECTORS = 8;  // output vectors of each query accumulated in registers at once

static inline float hsum(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// the totals of acc[0..7] (lane_totals.h with 8 lanes, in lane order otherwise)
static inline void reduce8(const Vec* acc, float* totals) {
#if defined(__AVX2__) && defined(CPU_CAPABILITY_AVX2)  // at::vec's Vec is an __m256 then
  const __m256 lanes[8] = {acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]};
  lane_totals8(lanes, totals);
#else
  for (int a = 0; a < 8; ++a) {
    float lanes[W];
    acc[a].store(lanes);
    float total = 0.f;
    if (W == 8) total = lane_total(lanes);
    else for (int64_t t = 0; t < W; ++t) total += lanes[t];
    totals[a] = total;
  }
#endif
}

// scores[c][k] = dot(query c, key k) for C <= 2 queries and KEYS <= 4 keys (d a multiple of W): one chain of
// multiply-adds per query and key, reduced together, so a score does not depend on the queries or keys beside it
template <int C, int KEYS>
static inline void score_tile(const float* const* queries, const float* keys, int64_t key_stride, int64_t d,
                              float* const* scores) {
  Vec acc[8];
  for (int a = 0; a < 8; ++a) acc[a] = Vec(0);
  for (int64_t t = 0; t < d; t += W) {
    Vec key[KEYS];
    for (int k = 0; k < KEYS; ++k) key[k] = Vec::loadu(keys + k * key_stride + t);
    for (int c = 0; c < C; ++c) {
      const Vec q = Vec::loadu(queries[c] + t);
      for (int k = 0; k < KEYS; ++k) acc[c * 4 + k] = at::vec::fmadd(q, key[k], acc[c * 4 + k]);
    }
  }
  float totals[8];
  reduce8(acc, totals);
  for (int c = 0; c < C; ++c)
    for (int k = 0; k < KEYS; ++k) scores[c][k] = totals[c * 4 + k];
}

// out[c][0:N*W] = inv[c] * sum_{j in [lo, hi)} p[c][j] * v[j * stride + 0:N*W] in ascending j, for C <= 2 queries
// that share the value rows (a query's p is 0 outside its own keys: adding those terms changes no bit)
template <int C, int N>
static inline void weighted_sums(const float* const* p, const float* v, int64_t stride, int64_t lo, int64_t hi,
                                 const float* inv, float* const* out) {
  Vec acc[C][N];
  for (int c = 0; c < C; ++c)
    for (int k = 0; k < N; ++k) acc[c][k] = Vec(0);
  for (int64_t j = lo; j < hi; ++j) {
    const float* row = v + j * stride;
    Vec pj[C];
    for (int c = 0; c < C; ++c) pj[c] = Vec(p[c][j]);
    for (int k = 0; k < N; ++k) {
      const Vec x = Vec::loadu(row + k * W);
      for (int c = 0; c < C; ++c) acc[c][k] = at::vec::fmadd(pj[c], x, acc[c][k]);
    }
  }
  for (int c = 0; c < C; ++c) {
    const Vec scale(inv[c]);
    for (int k = 0; k < N; ++k) (acc[c][k] * scale).store(out[c] + k * W);
  }
}

// the attention of C <= 2 queries that read the same KV head; rows[c] is query c's row of the pass
template <int C>
static void attend(const float* const* queries, const int64_t* rows, const int64_t* begins, const int64_t* ends,
                   const bool* mask, int64_t L, const float* keys, int64_t key_stride, const float* values,
                   int64_t value_stride, int64_t d, float* scores, float* const* out) {
  int64_t lo = L, hi = 0;
  for (int c = 0; c < C; ++c) lo = std::min(lo, begins[rows[c]]), hi = std::max(hi, ends[rows[c]]);
  float* row_scores[C];
  for (int c = 0; c < C; ++c) row_scores[c] = scores + c * L;
  int64_t j = lo;
  for (; j + 4 <= hi; j += 4) {
    float* at[C];
    for (int c = 0; c < C; ++c) at[c] = row_scores[c] + j;
    score_tile<C, 4>(queries, keys + j * key_stride, key_stride, d, at);
  }
  for (; j < hi; ++j) {
    float* at[C];
    for (int c = 0; c < C; ++c) at[c] = row_scores[c] + j;
    score_tile<C, 1>(queries, keys + j * key_stride, key_stride, d, at);
  }
  float inv[C];
  for (int c = 0; c < C; ++c) {  // softmax over the query's own keys; 0 elsewhere in [lo, hi)
    const int64_t begin = begins[rows[c]], end = ends[rows[c]];
    const bool* visible = mask + rows[c] * L;
    float* s = row_scores[c];
    float mx = -INFINITY;
    for (int64_t t = begin; t < end; ++t) {
      if (!visible[t]) s[t] = -INFINITY;
      mx = std::max(mx, s[t]);
    }
    const Vec vm(mx);
    Vec vsum(0);
    int64_t t = begin;
    for (; t + W <= end; t += W) {
      const Vec e = (Vec::loadu(s + t) - vm).exp();
      e.store(s + t);
      vsum = vsum + e;
    }
    float sum = hsum(vsum);
    for (; t < end; ++t) {
      s[t] = std::exp(s[t] - mx);
      sum += s[t];
    }
    inv[c] = 1.f / sum;
    for (t = lo; t < begin; ++t) s[t] = 0.f;
    for (t = end; t < hi; ++t) s[t] = 0.f;
  }
  const float* p[C];
  for (int c = 0; c < C; ++c) p[c] = row_scores[c];
  constexpr int N = CHUNK_VECTORS;
  for (int64_t c0 = 0; c0 < d; c0 += N * W) {
    const int64_t width = std::min<int64_t>(N * W, d - c0);
    if (width == N * W) {
      float* at[C];
      for (int c = 0; c < C; ++c) at[c] = out[c] + c0;
      weighted_sums<C, N>(p, values + c0, value_stride, lo, hi, inv, at);
    } else {
      for (int64_t w = 0; w < width; w += W) {
        float* at[C];
        for (int c = 0; c < C; ++c) at[c] = out[c] + c0 + w;
        weighted_sums<C, 1>(p, values + c0 + w, value_stride, lo, hi, inv, at);
      }
    }
  }
}

// query [q, H, d] float32, keys/values [KV, L, d] (last dim contiguous, d a multiple of the vector width),
// mask [q, L] bool (true: attend; every row has one) -> [q, H * d]; scale 1, query head h reads KV head h / (H / KV)
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& mask) {
  const int64_t q = query.size(0), H = query.size(1), d = query.size(2);
  const int64_t KV = keys.size(0), L = keys.size(1);
  const int64_t g = H / KV, M = q * g;  // M queries read each KV head: its g heads of each of the q rows
  auto out = at::empty({q, H * d}, query.options());
  auto qc = query.contiguous();
  auto mc = mask.contiguous();
  const float* qp = qc.data_ptr<float>();
  const bool* mp = mc.data_ptr<bool>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), vs0 = values.stride(0), vs1 = values.stride(1);
  float* op = out.data_ptr<float>();
  // a row reads only the keys from its first to its last visible one (a static step's mask covers the cache)
  std::vector<int64_t> begins(q), ends(q);
  for (int64_t i = 0; i < q; ++i) {
    const bool* row_mask = mp + i * L;
    int64_t begin = 0, end = L;
    while (begin < end && !row_mask[begin]) ++begin;
    while (end > begin && !row_mask[end - 1]) --end;
    begins[i] = begin, ends[i] = end;
  }
  // Work items (a KV head and a pair of its queries) are independent, so torch's threads share them out without
  // changing any query's arithmetic; each chunk of items has its own scores.
  const int64_t pairs = (M + 1) / 2;
  at::parallel_for(0, KV * pairs, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(2 * L);
    for (int64_t item = first; item < last; ++item) {
      const int64_t kv = item / pairs, m = item % pairs * 2;  // two queries at a time share each key and value row
      const int64_t C = std::min<int64_t>(2, M - m);
      int64_t rows[2];
      const float* queries[2];
      float* outs[2];
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = (m + c) / g, h = kv * g + (m + c) % g;
        rows[c] = i, queries[c] = qp + (i * H + h) * d, outs[c] = op + (i * H + h) * d;
      }
      if (C == 2) attend<2>(queries, rows, begins.data(), ends.data(), mp, L, kp + kv * ks0, ks1, vp + kv * vs0,
                            vs1, d, scores.data(), outs);
      else attend<1>(queries, rows, begins.data(), ends.data(), mp, L, kp + kv * ks0, ks1, vp + kv * vs0, vs1, d,
                     scores.data(), outs);
    }
  });
  return out;
}

TORCH_LIBRARY(gemma_spec, m) {
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor mask) -> Tensor");
}
TORCH_LIBRARY_IMPL(gemma_spec, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
