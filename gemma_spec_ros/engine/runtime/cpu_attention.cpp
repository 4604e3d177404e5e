// torch.ops.gemma_spec.decode_attention: attention of a few queries over a decode step's keys (cpu_ops.py).
//
// Each query row and head is computed alone, in a fixed order, so a row's result does not depend on how many
// queries share the pass. Scores are dot products of one query and one key row; the softmax is exp(s - max) over
// the row; the output sums the value rows weighted by it, CHUNK outputs at a time in registers. A row reads only the
// keys from its first to its last visible one, so its result does not depend on the mask's width either.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>
#include <cmath>
#include <vector>

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t CHUNK = 8 * W;  // outputs accumulated in registers at once

static inline float hsum(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// dot of two rows of d floats (d a multiple of W)
static inline float dot(const float* a, const float* b, int64_t d) {
  Vec s0(0), s1(0);
  int64_t t = 0;
  for (; t + 2 * W <= d; t += 2 * W) {
    s0 = at::vec::fmadd(Vec::loadu(a + t), Vec::loadu(b + t), s0);
    s1 = at::vec::fmadd(Vec::loadu(a + t + W), Vec::loadu(b + t + W), s1);
  }
  for (; t < d; t += W) s0 = at::vec::fmadd(Vec::loadu(a + t), Vec::loadu(b + t), s0);
  return hsum(s0 + s1);
}

// out[0:width] = sum_j p[j] * v[j * stride + 0:width] / sum, width <= CHUNK, a multiple of W
template <int N>
static inline void weighted_sum(const float* p, const float* v, int64_t stride, int64_t length, float inv, float* out) {
  Vec acc[N];
  for (int k = 0; k < N; ++k) acc[k] = Vec(0);
  for (int64_t j = 0; j < length; ++j) {
    const Vec pj(p[j]);
    const float* row = v + j * stride;
    for (int k = 0; k < N; ++k) acc[k] = at::vec::fmadd(pj, Vec::loadu(row + k * W), acc[k]);
  }
  const Vec scale(inv);
  for (int k = 0; k < N; ++k) (acc[k] * scale).store(out + k * W);
}

// query [q, H, d] float32, keys/values [KV, L, d] (last dim contiguous, d a multiple of the vector width),
// mask [q, L] bool (true: attend; every row has one) -> [q, H * d]; scale 1, query head h reads KV head h / (H / KV)
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& mask) {
  const int64_t q = query.size(0), H = query.size(1), d = query.size(2);
  const int64_t KV = keys.size(0), L = keys.size(1);
  const int64_t g = H / KV;
  auto out = at::empty({q, H * d}, query.options());
  auto qc = query.contiguous();
  auto mc = mask.contiguous();
  const float* qp = qc.data_ptr<float>();
  const bool* mp = mc.data_ptr<bool>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), vs0 = values.stride(0), vs1 = values.stride(1);
  float* op = out.data_ptr<float>();
  std::vector<float> scores(L);
  for (int64_t i = 0; i < q; ++i) {
    const bool* row_mask = mp + i * L;
    // only the keys from the row's first to its last visible one
    int64_t begin = 0, end = L;
    while (begin < end && !row_mask[begin]) ++begin;
    while (end > begin && !row_mask[end - 1]) --end;
    const int64_t length = end - begin;
    for (int64_t h = 0; h < H; ++h) {
      const float* qv = qp + (i * H + h) * d;
      const float* kbase = kp + (h / g) * ks0 + begin * ks1;
      const float* vbase = vp + (h / g) * vs0 + begin * vs1;
      const bool* visible = row_mask + begin;
      float mx = -INFINITY;
      for (int64_t j = 0; j < length; ++j) {
        const float s = visible[j] ? dot(qv, kbase + j * ks1, d) : -INFINITY;
        scores[j] = s;
        mx = std::max(mx, s);
      }
      const Vec vm(mx);
      Vec vsum(0);
      int64_t j = 0;
      for (; j + W <= length; j += W) {
        const Vec e = (Vec::loadu(scores.data() + j) - vm).exp();
        e.store(scores.data() + j);
        vsum = vsum + e;
      }
      float sum = hsum(vsum);
      for (; j < length; ++j) {
        scores[j] = std::exp(scores[j] - mx);
        sum += scores[j];
      }
      float* o = op + (i * H + h) * d;
      const float inv = 1.f / sum;
      for (int64_t c = 0; c < d; c += CHUNK) {
        const int64_t width = std::min(CHUNK, d - c);
        if (width == CHUNK) weighted_sum<8>(scores.data(), vbase + c, vs1, length, inv, o + c);
        else if (width == 4 * W) weighted_sum<4>(scores.data(), vbase + c, vs1, length, inv, o + c);
        else for (int64_t t = 0; t < width; t += W) weighted_sum<1>(scores.data(), vbase + c + t, vs1, length, inv, o + c + t);
      }
    }
  }
  return out;
}

TORCH_LIBRARY(gemma_spec, m) {
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor mask) -> Tensor");
}
TORCH_LIBRARY_IMPL(gemma_spec, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
