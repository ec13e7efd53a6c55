// Decode attention over the engine's KV pool: each query row attends positions
// [starts[r], lengths[r]) of its request's slot (a sliding-window layer's window; 0 on a full
// layer), optionally with one attention-sink logit per query head, read in place (serve/engine/kv_pool.py's layout, one tensor
// [slots, Hkv, capacity, d] per layer). One call covers every decode and verify row of a pass,
// however different their lengths: no padding to the longest row and no per-request dispatch,
// which is what bounded the PyTorch paths (serve/engine/decode_attention.py).
//
// Per (row, key/value head) work item: the g = Hq / Hkv query heads sharing that key/value head
// are scored against each key once (grouped-query attention without repeating keys), the scores
// kept in fp32, softmax in fp32, and the values accumulated in fp32. Paths, fixed when the file
// is compiled for a CPU (-march): with AVX512-BF16 and head dim 64, bf16 scores use the
// dot-product instruction and values are widened 16 at a time; everything else runs the portable
// loops, which the compiler vectorises for the instruction sets it is given (AVX-512, AVX2 + FMA,
// or baseline SSE2). fp32 on an AVX2-only CPU (its dtype: it has no native bf16) is these loops
// built for AVX2: measured up to 1.7x the baseline build, and 2.4x faster than a hand-written
// AVX2-intrinsics version of the same loops, which was dropped for it
// (benchmarks/decode_kernel_paths.py). kernel_paths() says which a build took.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

namespace {

inline float widen(const float* p, int64_t i) { return p[i]; }
inline float widen(const at::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// scores [G][L] -> softmax weights in place; the running maximum starts at the first score
// (every row sees at least its own key), so no infinity is needed. sinks (or nullptr): one logit
// per query head that joins the softmax's denominator and attends no value (gpt-oss's sinks,
// transformers' eager attention: softmax over [scores, sink], the sink's column dropped)
template <int G>
void softmax_rows(float* sc, int64_t L, const float* sinks) {
  for (int a = 0; a < G; ++a) {
    float* s = sc + a * L;
    float m = s[0];
    for (int64_t t = 1; t < L; ++t) m = std::max(m, s[t]);
    if (sinks) m = std::max(m, sinks[a]);
    float sum = sinks ? std::exp(sinks[a] - m) : 0.f;
    for (int64_t t = 0; t < L; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; ++t) s[t] *= inv;
  }
}


// one work item: G query heads q [G, d] over keys / values kb, vb (row stride kstride) of L
// positions; sc: scratch of G * L floats; out [G, d]
template <typename T, int G>
void attend(const T* q, const T* kb, const T* vb, int64_t kstride, int64_t L, int64_t d,
            float scale, const float* sinks, float* sc, float* work, T* out) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<T, at::BFloat16>::value) {
    if (d == 64) {
      __m512bh qv[G][2];
      for (int a = 0; a < G; ++a) {
        qv[a][0] = (__m512bh)_mm512_loadu_si512(q + a * 64);
        qv[a][1] = (__m512bh)_mm512_loadu_si512(q + a * 64 + 32);
      }
      for (int64_t t = 0; t < L; ++t) {
        const T* kr = kb + t * kstride;
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kr);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kr + 32);
        for (int a = 0; a < G; ++a) {
          __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[a][0], k0);
          acc = _mm512_dpbf16_ps(acc, qv[a][1], k1);
          sc[a * L + t] = _mm512_reduce_add_ps(acc) * scale;
        }
      }
      softmax_rows<G>(sc, L, sinks);
      __m512 acc[G][4];
      for (int a = 0; a < G; ++a)
        for (int c = 0; c < 4; ++c) acc[a][c] = _mm512_setzero_ps();
      for (int64_t t = 0; t < L; ++t) {
        const T* vr = vb + t * kstride;
        __m512 v[4];
        for (int c = 0; c < 4; ++c)
          v[c] = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(vr + 16 * c)));
        for (int a = 0; a < G; ++a) {
          const __m512 w = _mm512_set1_ps(sc[a * L + t]);
          for (int c = 0; c < 4; ++c) acc[a][c] = _mm512_fmadd_ps(w, v[c], acc[a][c]);
        }
      }
      for (int a = 0; a < G; ++a)
        for (int c = 0; c < 4; ++c)
          _mm256_storeu_si256((__m256i*)(out + a * 64 + 16 * c),
                              (__m256i)_mm512_cvtneps_pbh(acc[a][c]));
      return;
    }
  }
#endif
  // portable path; work: (2 G + 1) d floats (queries, accumulators, one widened key or value)
  float* __restrict qf = work;
  float* __restrict acc = work + G * d;
  float* __restrict row = work + 2 * G * d;
  for (int a = 0; a < G; ++a)
    for (int64_t i = 0; i < d; ++i) qf[a * d + i] = widen(q + a * d, i) * scale;
  for (int64_t t = 0; t < L; ++t) {
    const T* kr = kb + t * kstride;
    for (int64_t i = 0; i < d; ++i) row[i] = widen(kr, i);
    for (int a = 0; a < G; ++a) {
      float s = 0.f;
      const float* qa = qf + a * d;
      for (int64_t i = 0; i < d; ++i) s += qa[i] * row[i];
      sc[a * L + t] = s;
    }
  }
  softmax_rows<G>(sc, L, sinks);
  std::fill(acc, acc + G * d, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const T* vr = vb + t * kstride;
    for (int64_t i = 0; i < d; ++i) row[i] = widen(vr, i);
    for (int a = 0; a < G; ++a) {
      const float w = sc[a * L + t];
      float* o = acc + a * d;
      for (int64_t i = 0; i < d; ++i) o[i] += w * row[i];
    }
  }
  for (int a = 0; a < G; ++a)
    for (int64_t i = 0; i < d; ++i) out[a * d + i] = static_cast<T>(acc[a * d + i]);
}

template <typename T, int G>
void run(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
         const int64_t* slots, const int64_t* starts, const int64_t* lengths, const float* sinks,
         float scale, at::Tensor& out) {
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2), hkv = keys.size(1);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  const int64_t s0 = keys.stride(0), s1 = keys.stride(1), s2 = keys.stride(2);
  at::parallel_for(0, n * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sc, work((2 * G + 1) * d);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / hkv, h = w % hkv, first = starts ? starts[r] : 0;
      const int64_t L = lengths[r] - first;
      sc.resize(G * L);
      const int64_t at = slots[r] * s0 + h * s1 + first * s2;
      attend<T, G>(qp + (r * hq + h * G) * d, kp + at, vp + at, s2, L, d, scale,
                   sinks ? sinks + h * G : nullptr, sc.data(), work.data(),
                   op + (r * hq + h * G) * d);
    }
  });
}

template <typename T>
void by_group(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* s,
              const int64_t* b, const int64_t* l, const float* sk, float scale, at::Tensor& out) {
  switch (q.size(1) / k.size(1)) {
    case 1: return run<T, 1>(q, k, v, s, b, l, sk, scale, out);
    case 2: return run<T, 2>(q, k, v, s, b, l, sk, scale, out);
    case 3: return run<T, 3>(q, k, v, s, b, l, sk, scale, out);
    case 4: return run<T, 4>(q, k, v, s, b, l, sk, scale, out);
    case 5: return run<T, 5>(q, k, v, s, b, l, sk, scale, out);
    case 6: return run<T, 6>(q, k, v, s, b, l, sk, scale, out);
    case 7: return run<T, 7>(q, k, v, s, b, l, sk, scale, out);
    case 8: return run<T, 8>(q, k, v, s, b, l, sk, scale, out);
  }
}

}  // namespace

// q [N, Hq, d] (contiguous); keys, values [slots, Hkv, capacity, d] (last dim contiguous);
// slots, lengths int64 [N]: row r attends positions [starts[r], lengths[r]) of slot slots[r]
// (starts: int64 [N], None = 0); sinks: float32 [Hq] or None. Returns [N, Hq, d] in q's dtype
// (float32 or bfloat16).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& slots, const at::Tensor& lengths, double scale,
                            const std::optional<at::Tensor>& starts,
                            const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [N, Hq, d]");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() &&
                  keys.strides() == values.strides() && keys.stride(3) == 1,
              "keys and values must be [slots, Hkv, capacity, d] alike, d contiguous");
  TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu(),
              "decode_attention runs on CPU tensors");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == values.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q, keys and values must share one dtype, float32 or bfloat16");
  TORCH_CHECK(q.size(2) == keys.size(3), "q and keys differ in head dim");
  const int64_t hkv = keys.size(1);
  TORCH_CHECK(hkv >= 1 && q.size(1) % hkv == 0 && q.size(1) / hkv >= 1 && q.size(1) / hkv <= 8,
              "query heads must be 1..8 times the key/value heads");
  const int64_t n = q.size(0);
  TORCH_CHECK(slots.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong &&
                  slots.is_contiguous() && lengths.is_contiguous() && slots.numel() == n &&
                  lengths.numel() == n,
              "slots and lengths must be contiguous int64 [N]");
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t* l = lengths.data_ptr<int64_t>();
  const int64_t* b = nullptr;
  if (starts.has_value()) {
    TORCH_CHECK(starts->scalar_type() == at::kLong && starts->is_contiguous() &&
                    starts->numel() == n,
                "starts must be contiguous int64 [N]");
    b = starts->data_ptr<int64_t>();
  }
  const float* sk = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->numel() == q.size(1),
                "sinks must be contiguous float32 [Hq]");
    sk = sinks->data_ptr<float>();
  }
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(s[r] >= 0 && s[r] < keys.size(0), "slot ", s[r], " outside the pool");
    TORCH_CHECK(l[r] >= 1 && l[r] <= keys.size(2), "length ", l[r], " outside [1, capacity]");
    TORCH_CHECK(!b || (b[r] >= 0 && b[r] < l[r]), "start ", b ? b[r] : 0,
                " outside [0, length)");
  }
  at::Tensor out = at::empty_like(q);
  if (q.scalar_type() == at::kBFloat16)
    by_group<at::BFloat16>(q, keys, values, s, b, l, sk, static_cast<float>(scale), out);
  else
    by_group<float>(q, keys, values, s, b, l, sk, static_cast<float>(scale), out);
  return out;
}

// the inner path this build takes per dtype (what it was compiled for)
std::map<std::string, std::string> kernel_paths() {
#if defined(__AVX512F__)
  const std::string loops = "vectorised loops, AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
  const std::string loops = "vectorised loops, AVX2+FMA";
#elif defined(__x86_64__)
  const std::string loops = "vectorised loops, baseline x86-64 (SSE2)";
#else
  const std::string loops = "vectorised loops, this architecture's baseline";
#endif
  std::map<std::string, std::string> out{{"float32", loops}, {"bfloat16", loops}};
#if defined(__AVX512BF16__)
  out["bfloat16"] = "avx512_bf16 dot products (head dim 64; " + loops + " otherwise)";
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kernel_paths", &kernel_paths, "dtype -> the inner path this build takes");
  m.def("decode_attention", &decode_attention,
        "Attention of query rows over positions [starts, lengths) of their slots of a KV pool, "
        "with optional attention-sink logits",
        pybind11::arg("q"), pybind11::arg("keys"), pybind11::arg("values"),
        pybind11::arg("slots"), pybind11::arg("lengths"), pybind11::arg("scale"),
        pybind11::arg("starts") = pybind11::none(), pybind11::arg("sinks") = pybind11::none(),
        // the arguments are converted first; the computation then lets other Python threads
        // run (the HTTP server's event loop runs beside the engine's step thread)
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
