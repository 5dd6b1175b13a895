// torch binding of the native CPU kernels: repacking of the public layer tensors (prepare_*), the
// per-call entry points (GEMV for few tokens, dequantize + GEMM for many) and run-time ISA selection.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "common.h"

namespace vn = vptq_native;
using at::Tensor;
using std::int64_t;

namespace {

// ------------------------------------------------------------------------------------------ ISA choice
int cpu_level() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512bf16");
  return avx512 ? 2 : (avx2 ? 1 : 0);
#else
  return 0;
#endif
}

const vn::IsaTable* table_for(int level) {
  if (level >= 2 && vn::isa_avx512()) return vn::isa_avx512();
  if (level >= 1 && vn::isa_avx2()) return vn::isa_avx2();
  return vn::isa_scalar();
}

const int kCpuLevel = cpu_level();
std::atomic<const vn::IsaTable*> g_isa{table_for(kCpuLevel)};

inline const vn::IsaTable* isa() { return g_isa.load(std::memory_order_relaxed); }

// name -> level; "" or "auto" = best supported. Returns the active name. Levels above the CPU's are refused.
std::string set_isa(const std::string& name) {
  int level = kCpuLevel;
  if (name == "scalar")
    level = 0;
  else if (name == "avx2")
    level = 1;
  else if (name == "avx512")
    level = 2;
  else if (!(name.empty() || name == "auto"))
    TORCH_CHECK(false, "isa must be 'auto', 'avx512', 'avx2' or 'scalar', got '", name, "'");
  TORCH_CHECK(level <= kCpuLevel, "this CPU does not support the '", name, "' kernels");
  g_isa.store(table_for(level));
  return isa()->name;
}

std::string cpu_isa() { return table_for(kCpuLevel)->name; }

// ------------------------------------------------------------------------------------------ scratch
struct Scratch {
  void* p = nullptr;
  size_t bytes = 0;
  void* get(size_t n) {
    if (n > bytes) {
      std::free(p);
      bytes = ((std::max<size_t>(n, 4096) + 4095) / 4096) * 4096;
      p = std::aligned_alloc(64, bytes);
      TORCH_CHECK(p, "out of memory allocating ", bytes, " bytes of scratch");
    }
    return p;
  }
  ~Scratch() { std::free(p); }
};
thread_local Scratch t_x, t_y, t_tile, t_misc;

inline float bf16f(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Work (multiply-adds) below which a call stays on the calling thread. Measured on 2 threads: a parallel region
// costs ~1-2 us, and already a 64x576 GEMV (37K multiply-adds, ~8 us) is no slower split in two; 192x576 is
// 1.8x faster on 2 threads.
int64_t g_parallel_macs = int64_t(1) << 15;

int64_t threads_for(int64_t macs, int64_t max_chunks) {
  if (at::in_parallel_region()) return 1;
  const int64_t t = at::get_num_threads();
  if (t <= 1) return 1;
  return std::max<int64_t>(1, std::min<int64_t>({t, max_chunks, macs / g_parallel_macs}));
}

// The workers run with the caller's thread-local state (inference mode, grad mode): the prefill paths call ATen
// ops (torch.mm into slices of an output the caller allocated) on them, and an output made under
// torch.inference_mode() may only be written where inference mode is on too.
template <typename F>
void run_chunks(int64_t n, int64_t chunks, const F& f) {
  if (chunks <= 1) {
    f(0, n);
    return;
  }
  const at::ThreadLocalState state;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    at::ThreadLocalStateGuard guard(state);
    for (int64_t c = c0; c < c1; ++c) f(c * n / chunks, (c + 1) * n / chunks);
  });
}

// Rounded lane count for a vector length.
int64_t lanes_for(int64_t v) { return v <= 4 ? 4 : (v <= 8 ? 8 : 16); }

// values of an integer tensor as int64, int16 read as uint16 patterns
Tensor index_values(const Tensor& t) {
  Tensor v = t.to(at::kLong);
  if (t.scalar_type() == at::kShort) v = v.bitwise_and(0xFFFF);
  return v.contiguous();
}

// Codebook [G, k*v] (any float dtype) -> fp32 [G, k*vp + 16] with lanes >= v zero, and its bf16 copy.
std::pair<Tensor, Tensor> pad_codebook(const Tensor& c, int64_t G, int64_t k, int64_t v, int64_t vp) {
  Tensor f = c.detach().to(at::kFloat).reshape({G, k, v});
  Tensor out = at::zeros({G, k * vp + 16}, at::kFloat);
  out.narrow(1, 0, k * vp).view({G, k, vp}).narrow(2, 0, v).copy_(f);
  return {out, out.to(at::kBFloat16)};
}

// ------------------------------------------------------------------------------------------ VQ layer
struct VQLayer {
  int64_t in = 0, out = 0, v = 0, k = 0, kr = -1, vo = -1, ko = -1, G = 1, gs = 0, osz = 0;
  bool has_perm = false, has_norm = false, has_bias = false, cb_exact_bf16 = false, gemv_cb16 = false;
  Tensor idx, ridx, cb32, cb16, rcb32, rcb16, oidx, ocb32, ocb16;
  Tensor perm, iperm, pscale, pwbias, wbias, bias;  // perm/iperm int32 [in]; pscale/pwbias = scale/wbias[perm]
  Tensor colpos, colgrp;  // stored column -> (offset in block 0 of the indices, group), int32
  vn::VQArgs a;
};

// Unpack the public bit streams of one group: words int32 [R, W] -> entries int64 [R, gs].
void unpack_rows(const int32_t* words, int64_t R, int64_t W, int64_t n, int bits, int64_t* dst) {
  const uint64_t mask = bits >= 64 ? ~0ull : ((1ull << bits) - 1);
  for (int64_t r = 0; r < R; ++r) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(words + r * W);
    for (int64_t c = 0; c < n; ++c) {
      const int64_t bit = c * bits, wi = bit >> 5;
      const int sh = int(bit & 31);
      uint64_t lo = w[wi];
      uint64_t hi = (wi + 1 < W) ? uint64_t(w[wi + 1]) : 0;
      dst[r * n + c] = int64_t((((hi << 32) | lo) >> sh) & mask);
    }
  }
}

// Index entries of codebooks with at most 256 entries: 1 uint8 codes (default), 0 uint16 offsets (measurements)
int g_index8 = 1;
// Software prefetch distance of the GEMV's index streams, bytes ahead (0 = off; set_index_prefetch)
int64_t g_index_prefetch = 2048;
// GEMV codebook choice at prepare time (measurements): 0 the rule below, 1 bf16 whenever exact, 2 always fp32
int g_cb16 = 0;
int g_touch = 1;  // a knob for measurements (VQCall::touch_codebooks)
// The layer of the last GEMV call: a layer called again right after itself (a benchmark loop, not a decode step)
// finds its codebook still in this core's caches, and the read-ahead would only cost (2-8% of a hot call).
std::atomic<const void*> g_last_gemv{nullptr};

std::shared_ptr<VQLayer> prepare_vq(std::vector<int64_t> spec, Tensor indices, Tensor centroids,
                                    c10::optional<Tensor> res_centroids, c10::optional<Tensor> outlier_indices,
                                    c10::optional<Tensor> outlier_centroids, c10::optional<Tensor> perm,
                                    c10::optional<Tensor> weight_scale, c10::optional<Tensor> weight_bias,
                                    c10::optional<Tensor> bias) {
  TORCH_CHECK(spec.size() == 10, "spec must have 10 ints (VQSpec.as_list())");
  at::NoGradGuard no_grad;
  auto L = std::make_shared<VQLayer>();
  L->in = spec[0];
  L->out = spec[1];
  L->v = spec[2];
  L->k = spec[3];
  L->kr = spec[4];
  L->vo = spec[5];
  L->ko = spec[6];
  L->G = spec[7];
  L->gs = spec[8];
  L->osz = spec[9];
  const int64_t in = L->in, out = L->out, v = L->v, k = L->k, G = L->G, gs = L->gs, osz = L->osz;
  TORCH_CHECK(v >= 1 && v <= 16, "native kernels support vector lengths 1..16, got ", v);
  TORCH_CHECK(k >= 2 && k <= 65536, "num_centroids must be in 2..65536, got ", k);
  TORCH_CHECK(L->kr == -1 || (L->kr >= 2 && L->kr <= 65536), "num_res_centroids must be -1 or 2..65536");
  TORCH_CHECK(osz + G * gs == in, "outlier_size + group_num * group_size must equal in_features");
  if (osz > 0) TORCH_CHECK(L->vo >= 1 && L->vo <= 16, "native kernels support outlier vector lengths 1..16");
  const bool res = L->kr > 0;
  const int ib = 63 - __builtin_clzll(uint64_t(k)), rbits = res ? 63 - __builtin_clzll(uint64_t(L->kr)) : 0;
  const int64_t R = (out + v - 1) / v, RB = (R + vn::NR_LAYOUT - 1) / vn::NR_LAYOUT, vp = lanes_for(v);
  const int64_t W = (gs * (ib + rbits) + 31) / 32;
  TORCH_CHECK(indices.dim() == 3 && indices.size(0) == G && indices.size(1) == R && indices.size(2) == W &&
                  indices.scalar_type() == at::kInt,
              "indices must be int32 [", G, ", ", R, ", ", W, "]");
  TORCH_CHECK(centroids.numel() == G * k * v, "centroids must have G*k*v elements");
  TORCH_CHECK(res == res_centroids.has_value(), "res_centroids must be given exactly when num_res_centroids > 0");

  // codebooks
  auto cbs = pad_codebook(centroids, G, k, v, vp);
  L->cb32 = cbs.first;
  L->cb16 = cbs.second;
  bool exact = at::equal(L->cb16.to(at::kFloat), L->cb32);
  if (res) {
    TORCH_CHECK(res_centroids->numel() == G * L->kr * v, "res_centroids must have G*k_res*v elements");
    auto r = pad_codebook(*res_centroids, G, L->kr, v, vp);
    L->rcb32 = r.first;
    L->rcb16 = r.second;
    exact = exact && at::equal(L->rcb16.to(at::kFloat), L->rcb32);
  }
  L->cb_exact_bf16 = exact;
  // The bf16 codebook halves the cache footprint of the lookups; used by the GEMV only when it is exact, the fp32
  // one would not stay in L1, and widening pays for itself. 8 lanes (one broadcast + shuffle): on every CPU
  // measured (AVX-512: v6/v8 k4096 0.23-0.41 of dense bf16 time with bf16 against 0.27-0.47 with fp32). 4 lanes
  // (one 8-byte load + unpack): on the AVX2 kernels only. Zen 3 (32 KB L1, AVX2) in one process, 1 thread, 9
  // alternated rounds, three runs: v4 k4096 at 4096x4096 0.44-0.58 with bf16 against 0.54-0.68 with fp32, SmolLM2's
  // shapes 0.43-0.67 against 0.49-0.65 (11 of 15 cells faster); an AVX-512 machine measured the opposite (0.46-0.86
  // with bf16 against 0.36-0.53, v4 k8192 and v12/v16 alike, with a costlier widening than today's). 16 lanes: fp32.
  // AVX-512 with 4 lanes, measured again with today's widening on a Sapphire Rapids: bf16 at least as fast at every
  // codebook size, faster at the small and the large ones (bench/results/decode_fused_spr.txt), so always.
  const std::string level = isa()->name;
  const bool wide_ok = vp == 8 || (vp == 4 && level == "avx2");
  const bool always = vp == 4 && level == "avx512";
  L->gemv_cb16 = exact && (g_cb16 == 1 || (g_cb16 == 0 && (always || (wide_ok && (k + (res ? L->kr : 0)) * vp * 4 >
                                                                                      24 * 1024))));

  // indices -> element offsets (code * vp), rows in blocks of 8; codes themselves (uint8) when they fit a byte
  const int64_t kmax = std::max<int64_t>(k, res ? L->kr : 0);
  const bool i8 = g_index8 != 0 && kmax <= 256;
  const bool i32 = !i8 && (kmax - 1) * vp > 65535;
  const at::ScalarType it = i8 ? at::kByte : (i32 ? at::kInt : at::kShort);
  L->idx = at::zeros({G, RB, gs, vn::NR_LAYOUT}, it);
  if (res) L->ridx = at::zeros({G, RB, gs, vn::NR_LAYOUT}, it);
  {
    Tensor words = indices.contiguous();
    std::vector<int64_t> ent(size_t(R * gs));
    const uint64_t imask = (1ull << ib) - 1;
    for (int64_t g = 0; g < G; ++g) {
      unpack_rows(words.data_ptr<int32_t>() + g * R * W, R, W, gs, ib + rbits, ent.data());
      for (int64_t r = 0; r < R; ++r) {
        const int64_t rb = r / vn::NR_LAYOUT, rr = r % vn::NR_LAYOUT;
        for (int64_t c = 0; c < gs; ++c) {
          const uint64_t e = uint64_t(ent[size_t(r * gs + c)]);
          const int64_t pos = ((g * RB + rb) * gs + c) * vn::NR_LAYOUT + rr;
          const uint64_t i0 = (e & imask) * vp, i1 = (e >> ib) * vp;
          if (i8) {
            L->idx.data_ptr<uint8_t>()[pos] = uint8_t(i0 / vp);
            if (res) L->ridx.data_ptr<uint8_t>()[pos] = uint8_t(i1 / vp);
          } else if (i32) {
            L->idx.data_ptr<int32_t>()[pos] = int32_t(i0);
            if (res) L->ridx.data_ptr<int32_t>()[pos] = int32_t(i1);
          } else {
            L->idx.data_ptr<int16_t>()[pos] = int16_t(uint16_t(i0));
            if (res) L->ridx.data_ptr<int16_t>()[pos] = int16_t(uint16_t(i1));
          }
        }
      }
    }
  }

  // outliers
  int64_t Ro = 0, vpo = 0;
  bool o32 = false;
  if (osz > 0) {
    TORCH_CHECK(outlier_indices.has_value() && outlier_centroids.has_value(),
                "outlier_indices and outlier_centroids are required when outlier_size > 0");
    const int64_t vo = L->vo, ko = L->ko;
    Ro = (out + vo - 1) / vo;
    vpo = lanes_for(vo);
    TORCH_CHECK(outlier_indices->numel() == Ro * osz, "outlier_indices must be [1, ", Ro, ", ", osz, "]");
    TORCH_CHECK(outlier_centroids->numel() == ko * vo, "outlier_centroids must have k_o*vo elements");
    auto oc = pad_codebook(*outlier_centroids, 1, ko, vo, vpo);
    L->ocb32 = oc.first;
    L->ocb16 = oc.second;
    Tensor ov = index_values(*outlier_indices).reshape({Ro, osz});
    TORCH_CHECK(ov.numel() == 0 || (ov.min().item<int64_t>() >= 0 && ov.max().item<int64_t>() < ko),
                "outlier indices out of range");
    o32 = (ko - 1) * vpo > 65535;
    L->oidx = (ov * vpo).to(o32 ? at::kInt : at::kShort).contiguous();
  }

  // perm / norm / bias
  if (perm.has_value()) {
    Tensor p = index_values(*perm);
    TORCH_CHECK(p.numel() == in, "perm must have in_features elements");
    L->perm = p.to(at::kInt).contiguous();
    L->iperm = at::argsort(p).to(at::kInt).contiguous();
    TORCH_CHECK(at::equal(std::get<0>(at::sort(p)), at::arange(in, p.options())), "perm must be a permutation of 0..in-1");
    L->has_perm = true;
  }
  TORCH_CHECK(weight_scale.has_value() == weight_bias.has_value(), "weight_scale and weight_bias go together");
  if (weight_scale.has_value()) {
    Tensor s = weight_scale->detach().to(at::kFloat).reshape({-1}).contiguous();
    Tensor b = weight_bias->detach().to(at::kFloat).reshape({-1}).contiguous();
    TORCH_CHECK(s.numel() == in && b.numel() == in, "weight_scale / weight_bias must have in_features elements");
    L->has_norm = true;
    L->wbias = b;
    if (L->has_perm) {
      Tensor pl = L->perm.to(at::kLong);
      L->pscale = s.index_select(0, pl).contiguous();
      L->pwbias = b.index_select(0, pl).contiguous();
    } else {
      L->pscale = s;
      L->pwbias = b;
    }
  }
  if (bias.has_value()) {
    Tensor b = bias->detach().to(at::kFloat).reshape({-1}).contiguous();
    TORCH_CHECK(b.numel() == out, "bias must have out_features elements");
    L->bias = b;
    L->has_bias = true;
  }

  vn::VQArgs& a = L->a;
  a.n_in = in;
  a.out = out;
  a.v = v;
  a.vp = vp;
  a.G = G;
  a.gs = gs;
  a.R = R;
  a.RB = RB;
  a.idx32 = i32;
  a.idx8 = i8;
  a.res = res;
  a.idx = L->idx.data_ptr();
  a.ridx = res ? L->ridx.data_ptr() : nullptr;
  a.cb32 = L->cb32.data_ptr<float>();
  a.cb16 = reinterpret_cast<const uint16_t*>(L->cb16.data_ptr());
  a.cb_gs = k * vp + 16;
  if (res) {
    a.rcb32 = L->rcb32.data_ptr<float>();
    a.rcb16 = reinterpret_cast<const uint16_t*>(L->rcb16.data_ptr());
    a.rcb_gs = L->kr * vp + 16;
  }
  a.osz = osz;
  if (osz > 0) {
    a.vo = L->vo;
    a.vpo = vpo;
    a.Ro = Ro;
    a.oidx32 = o32;
    a.oidx = L->oidx.data_ptr();
    a.ocb32 = L->ocb32.data_ptr<float>();
    a.ocb16 = reinterpret_cast<const uint16_t*>(L->ocb16.data_ptr());
  }
  a.rowmap = L->has_perm ? L->perm.data_ptr<int32_t>() : nullptr;
  a.iperm = L->has_perm ? L->iperm.data_ptr<int32_t>() : nullptr;
  TORCH_CHECK(G * RB * gs * vn::NR_LAYOUT < (int64_t(1) << 31), "layer too large for 32-bit index offsets");
  L->colpos = at::zeros({in}, at::kInt);
  L->colgrp = at::zeros({in}, at::kInt);
  for (int64_t c = osz; c < in; ++c) {
    const int64_t g = (c - osz) / gs, cc = (c - osz) % gs;
    L->colpos.data_ptr<int32_t>()[c] = int32_t((g * RB * gs + cc) * vn::NR_LAYOUT);
    L->colgrp.data_ptr<int32_t>()[c] = int32_t(g);
  }
  a.colpos = L->colpos.data_ptr<int32_t>();
  a.colgrp = L->colgrp.data_ptr<int32_t>();
  a.cscale = L->has_norm ? L->pscale.data_ptr<float>() : nullptr;
  a.cbias = L->has_norm ? L->pwbias.data_ptr<float>() : nullptr;
  return L;
}

// Output kind of the kernels for x's dtype: 0 fp32, 1 bf16; other dtypes run in fp32 and are converted back.
// x keeps its leading dimensions (no reshape on the per-call path); y is allocated in its final shape.
struct IO {
  Tensor xc;  // x (fp32 or bf16), contiguous, original dims
  int kind = 0;
  at::ScalarType dtype;
  int64_t N = 0, in = 0;
  Tensor x2() const { return xc.dim() == 2 ? xc : xc.view({N, in}); }
};

IO make_io(const Tensor& x, int64_t in) {
  TORCH_CHECK(x.device().is_cpu(), "native kernels need CPU tensors, got x on ", x.device());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in, "x must have last dimension ", in, ", got shape ", x.sizes());
  IO io;
  io.dtype = x.scalar_type();
  Tensor xc = x;
  if (io.dtype == at::kBFloat16) {
    io.kind = 1;
  } else if (io.dtype != at::kFloat) {
    xc = xc.to(at::kFloat);
  }
  if (!xc.is_contiguous()) xc = xc.contiguous();
  io.xc = xc;
  io.in = in;
  io.N = in > 0 ? xc.numel() / in : 0;
  return io;
}

Tensor new_y(const IO& io, int64_t out) {
  if (io.xc.dim() == 2) return at::empty({io.N, out}, io.xc.options());
  std::vector<int64_t> shape(io.xc.sizes().begin(), io.xc.sizes().end());
  shape.back() = out;
  return at::empty(shape, io.xc.options());
}

Tensor shape_result(const Tensor& y, const IO& io) {
  if (io.dtype != at::kFloat && io.dtype != at::kBFloat16) return y.to(io.dtype);
  return y;
}

// xq[c][n] = x[n][perm[c]] * scale[perm[c]], off[n] = dot(wbias, x[n])
template <typename XT>
void build_xq(const VQLayer& L, const XT* x, int64_t N, float* xq, float* off) {
  const int64_t in = L.in;
  const int32_t* perm = L.has_perm ? L.perm.data_ptr<int32_t>() : nullptr;
  const float* ps = L.has_norm ? L.pscale.data_ptr<float>() : nullptr;
  auto rd = [](XT v) -> float {
    if constexpr (std::is_same<XT, float>::value)
      return v;
    else
      return bf16f(v);
  };
  for (int64_t n = 0; n < N; ++n) {
    const XT* xr = x + n * in;
    float* dst = xq + n;
    if (perm && ps)
      for (int64_t c = 0; c < in; ++c) dst[c * N] = rd(xr[perm[c]]) * ps[c];
    else if (perm)
      for (int64_t c = 0; c < in; ++c) dst[c * N] = rd(xr[perm[c]]);
    else if (ps)
      for (int64_t c = 0; c < in; ++c) dst[c * N] = rd(xr[c]) * ps[c];
    else
      for (int64_t c = 0; c < in; ++c) dst[c * N] = rd(xr[c]);
    if (L.has_norm) {
      const float* wb = L.wbias.data_ptr<float>();
      float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t c = 0;
      for (; c + 8 <= in; c += 8)
        for (int i = 0; i < 8; ++i) s[i] += wb[c + i] * rd(xr[c + i]);
      for (; c < in; ++c) s[0] += wb[c] * rd(xr[c]);
      off[n] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    }
  }
}

int64_t kGemvMaxTokens = 8;  // GEMV up to this many tokens (set_gemv_max_tokens for measurements)

Tensor vq_gemv(const VQLayer& L, const IO& io) {
  const vn::IsaTable* T = isa();
  const int64_t N = io.N, in = L.in, out = L.out;
  Tensor y = new_y(io, out);
  float* xq = static_cast<float*>(t_x.get(size_t(in * N + 16) * 4));
  const int64_t ys = out + 16;
  float* yacc = static_cast<float*>(t_y.get(size_t(ys * N + 64) * 4));
  float* off = L.has_norm ? static_cast<float*>(t_misc.get(size_t(N + 16) * 4)) : nullptr;
  if (io.kind == 1)
    build_xq(L, reinterpret_cast<const uint16_t*>(io.xc.data_ptr()), N, xq, off);
  else
    build_xq(L, io.xc.data_ptr<float>(), N, xq, off);
  vn::VQCall c;
  c.xq = xq;
  c.xs = N;
  c.y = yacc;
  c.ys = ys;
  c.use_cb16 = L.gemv_cb16 && N == 1;
  c.touch_codebooks = g_touch != 0 && g_last_gemv.exchange(&L, std::memory_order_relaxed) != &L;
  c.prefetch = g_index_prefetch;
  const vn::VQArgs& A = L.a;
  const float* bias = L.has_bias ? L.bias.data_ptr<float>() : nullptr;
  void* yp = y.data_ptr();
  const int64_t chunks = threads_for(A.R * A.v * in * N, A.RB);
  run_chunks(A.RB, chunks, [&](int64_t b0, int64_t b1) {
    if (b1 <= b0) return;
    T->vq_main(A, c, b0, b1, 0, N);
    const int64_t o0 = b0 * vn::NR_LAYOUT * A.v, o1 = std::min<int64_t>(out, b1 * vn::NR_LAYOUT * A.v);
    T->vq_outliers(A, c, o0, o1, 0, N);
    T->finish(yacc, ys, off, bias, yp, out, io.kind, N, o0, o1);
  });
  return y;
}

// Prefill: tiles of row blocks are dequantized (perm, norm folded in) to T[in][tile] and multiplied by x.
int64_t g_tile_outputs = 480;  // target outputs per tile (tunable through set_tile for benchmarks)

void add_bias_rows(const Tensor& tmp, const float* bias, int64_t o0, int64_t tw, void* yp, int64_t out, int kind,
                   int64_t N) {
  if (kind == 1) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(tmp.data_ptr());
    uint16_t* d = static_cast<uint16_t*>(yp);
    for (int64_t n = 0; n < N; ++n) {
      if (!bias) {
        std::memcpy(d + n * out + o0, s + n * tw, size_t(tw) * 2);
      } else {
        for (int64_t j = 0; j < tw; ++j) {
          d[n * out + o0 + j] = f2bf(bf16f(s[n * tw + j]) + bias[o0 + j]);
        }
      }
    }
  } else {
    const float* s = tmp.data_ptr<float>();
    float* d = static_cast<float*>(yp);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < tw; ++j) d[n * out + o0 + j] = s[n * tw + j] + (bias ? bias[o0 + j] : 0.f);
  }
}

// 0 auto (GEMM micro-kernel when the CPU has AMX/oneDNN ukernels; else tiles + torch.mm, in fp32 for bf16 x where
// the CPU has no bf16 dot products), 1 tiles + torch.mm in x's dtype, 2 micro-kernel (when usable), 3 tiles +
// fp32 torch.mm for bf16 x
int g_prefill_mode = 0;
constexpr int64_t kKB = 256;  // input columns per micro-kernel call

bool brgemm_usable() {
  static const bool ok = [] {
    try {
      return at::native::cpublas::could_pack(at::kBFloat16);
    } catch (...) {
      return false;
    }
  }();
  return ok;
}

// bf16 prefill with the oneDNN batch-reduce GEMM micro-kernel (AMX): per tile of whole row blocks (~g_nb
// outputs), blocks of kKB stored columns of W (norm folded in) are dequantized straight into VNNI pairs (a small
// buffer that stays in L2) and accumulated into an fp32 [tokens, tile] block. With perm, x is gathered into stored
// column order once (cheaper than reading the index streams in original column order: measured).
int64_t g_nb = 192;
// perm in the micro-kernel path: 0 auto, 1 gather x into stored column order once, 2 read the index streams in
// original column order (measured: the latter wins while a block's index rows stay in L1, in <= 2048)
int g_gather = 0;

// bf16 prefill through fp32 GEMMs: on CPUs without bf16 dot-product instructions (no AVX-512 BF16, no AMX) torch's
// bf16 GEMMs widen every operand on the fly (measured on a Zen 3 with AVX2 only, 128 tokens, 1 thread: dense bf16
// F.linear 22-27 ms at 576x1536 / 1536x576, tiles + bf16 torch.mm 125-290 ms), while MKL's fp32 GEMM runs at full
// speed. The tiles hold the same bf16-exact weights widened to fp32 and x is widened once, so the products are the
// reference's; only the fp32 accumulation order differs. Outputs are rounded to bf16 once at the end.
bool prefill_fp32(int kind) {
  if (kind != 1) return false;
  if (g_prefill_mode == 3) return true;
  return g_prefill_mode == 0 && kCpuLevel < 2 && !brgemm_usable();
}

std::string prefill_path() {
  if (g_prefill_mode != 1 && g_prefill_mode != 3 && brgemm_usable()) return "brgemm";
  return prefill_fp32(1) ? "fp32" : "mm";
}

// y (bf16) = yw (fp32 [N, out]) + bias, rounded once.
void finish_fp32(const Tensor& yw, const float* bias, const Tensor& y, int64_t out) {
  if (bias) yw.add_(at::from_blob(const_cast<float*>(bias), {out}, at::kFloat));
  y.view({yw.size(0), out}).copy_(yw);
}

Tensor vq_prefill_brgemm(const VQLayer& L, const IO& io) {
  const vn::IsaTable* T = isa();
  const vn::VQArgs& A = L.a;
  const int64_t N = io.N, in = L.in, out = L.out;
  Tensor y = new_y(io, out);
  const int64_t block_out = vn::NR_LAYOUT * A.v;
  int64_t tb = std::max<int64_t>(1, (g_nb + block_out / 2) / block_out);
  const int64_t nthreads = at::in_parallel_region() ? 1 : at::get_num_threads();
  if ((A.RB + tb - 1) / tb < nthreads) tb = std::max<int64_t>(1, A.RB / nthreads);  // a tile for every thread
  const int64_t nb_max = tb * block_out, ntiles = (A.RB + tb - 1) / tb;
  const float* bias = L.has_bias ? L.bias.data_ptr<float>() : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  // K runs over stored columns (the index streams are read in order); x is gathered into that order once.
  vn::VQArgs As = A;
  const uint16_t* x = reinterpret_cast<const uint16_t*>(io.xc.data_ptr());
  const bool gather = L.has_perm && (g_gather == 1 || (g_gather == 0 && in > 2048));
  if (gather) {
    As.iperm = nullptr;
    uint16_t* xp = static_cast<uint16_t*>(t_x.get(size_t(N * in + 64) * 2));
    const int32_t* perm = L.perm.data_ptr<int32_t>();
    for (int64_t n = 0; n < N; ++n) {
      const uint16_t* src = x + n * in;
      uint16_t* dst = xp + n * in;
      for (int64_t c = 0; c < in; ++c) dst[c] = src[perm[c]];
    }
    x = xp;
  }
  const at::BFloat16* xa = reinterpret_cast<const at::BFloat16*>(x);
  const int64_t chunks = threads_for(A.R * A.v * in * N, ntiles);
  run_chunks(ntiles, chunks, [&](int64_t t0, int64_t t1) {
    uint16_t* B = static_cast<uint16_t*>(t_misc.get(size_t(kKB * nb_max + 2 * (block_out + 16) + 64) * 2));
    float* C = static_cast<float*>(t_y.get(size_t(N * nb_max + 16) * 4));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rb0 = t * tb, rb1 = std::min<int64_t>(A.RB, rb0 + tb);
      const int64_t o0 = rb0 * block_out, o1 = std::min<int64_t>(out, rb1 * block_out), nb = o1 - o0;
      std::memset(C, 0, size_t(N * nb) * 4);
      for (int64_t c0 = 0; c0 < in; c0 += kKB) {
        const int64_t kb = std::min<int64_t>(kKB, in - c0);
        T->vq_dequant_vnni(As, rb0, rb1, c0, c0 + kb, B, nb);
        at::native::cpublas::brgemm(N, nb, kb, in, nb, nb, true, xa + c0, reinterpret_cast<const at::BFloat16*>(B),
                                      C, true);
      }
      T->finish(C, nb, nullptr, bias ? bias + o0 : nullptr, yp + o0, out, 1, N, 0, nb);
    }
    at::native::cpublas::brgemm_release(true);
  });
  return y;
}

Tensor vq_prefill(const VQLayer& L, const IO& io) {
  const vn::IsaTable* T = isa();
  const vn::VQArgs& A = L.a;
  const int64_t N = io.N, in = L.in, out = L.out;
  const bool wide = prefill_fp32(io.kind);  // bf16 x through fp32 GEMMs
  const bool bf16 = io.kind == 1 && !wide;
  const int64_t esz = bf16 ? 2 : 4;
  Tensor y = new_y(io, out);
  const Tensor x2 = wide ? io.x2().to(at::kFloat) : io.x2();
  const Tensor yw = wide ? at::empty({N, out}, x2.options()) : Tensor();
  const int64_t block_out = vn::NR_LAYOUT * A.v;
  const int64_t tb = std::max<int64_t>(1, (g_tile_outputs + block_out / 2) / block_out);  // blocks per tile
  const int64_t ntiles = (A.RB + tb - 1) / tb;
  const int64_t tw_max = tb * block_out;
  const int64_t ldt = ((16 + tw_max + 16) + 31) / 32 * 32;
  const float* bias = L.has_bias ? L.bias.data_ptr<float>() : nullptr;
  void* yp = y.data_ptr();
  const at::ScalarType st = bf16 ? at::kBFloat16 : at::kFloat;
  const int64_t chunks = threads_for(A.R * A.v * in * N, ntiles);
  run_chunks(ntiles, chunks, [&](int64_t t0, int64_t t1) {
    char* buf = static_cast<char*>(t_tile.get(size_t(in * ldt * esz + 64)));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rb0 = t * tb, rb1 = std::min<int64_t>(A.RB, rb0 + tb);
      const int64_t o0 = rb0 * block_out, o1 = std::min<int64_t>(out, rb1 * block_out), tw = o1 - o0;
      void* Tp = buf + 16 * esz;
      T->vq_dequant(A, rb0, rb1, 0, in, true, Tp, ldt, bf16);
      Tensor Tv = at::from_blob(Tp, {in, tw}, {ldt, 1}, at::TensorOptions().dtype(st));
      if (wide) {
        Tensor ys = yw.narrow(1, o0, tw);
        at::mm_out(ys, x2, Tv);
      } else if (!bias) {
        Tensor ys = y.view({N, out}).narrow(1, o0, tw);
        at::mm_out(ys, x2, Tv);
      } else {
        Tensor tmp = at::mm(x2, Tv);
        add_bias_rows(tmp, bias, o0, tw, yp, out, io.kind, N);
      }
    }
  });
  // (norm is folded into T: W = Wp[:, perm] * scale + wbias, nothing left to add)
  if (wide) finish_fp32(yw, bias, y, out);
  return y;
}

Tensor vq_forward(const VQLayer& L, const Tensor& x) {
  at::NoGradGuard no_grad;
  IO io = make_io(x, L.in);
  Tensor y;
  if (io.N == 0)
    y = new_y(io, L.out);
  else if (io.N <= kGemvMaxTokens)
    y = vq_gemv(L, io);
  else if (io.kind == 1 && L.in % 2 == 0 && g_prefill_mode != 1 && g_prefill_mode != 3 && brgemm_usable())
    y = vq_prefill_brgemm(L, io);
  else
    y = vq_prefill(L, io);
  return shape_result(y, io);
}

// ------------------------------------------------------------------------------------------ scalar layer
struct ScalarLayer {
  int64_t in = 0, out = 0, bits = 0, gs = 0, Gn = 0, gsp = 0;
  bool nibble = true, has_bias = false;
  Tensor codes, scales, zeros, zs, bias;
  vn::ScalarArgs a;
};

std::shared_ptr<ScalarLayer> prepare_scalar(Tensor codes_packed, Tensor scales, Tensor zeros,
                                            c10::optional<Tensor> bias, int64_t bits, int64_t group_size,
                                            int64_t in_features) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(bits >= 1 && bits <= 8, "bits must be in 1..8, got ", bits);
  TORCH_CHECK(group_size >= 1, "group_size must be >= 1");
  TORCH_CHECK(codes_packed.dim() == 2 && codes_packed.scalar_type() == at::kInt, "codes_packed must be int32 2-D");
  auto L = std::make_shared<ScalarLayer>();
  const int64_t out = codes_packed.size(0), in = in_features;
  const int64_t gs = std::min<int64_t>(group_size, in), Gn = (in + gs - 1) / gs;
  const int64_t W = (in * bits + 31) / 32;
  TORCH_CHECK(codes_packed.size(1) == W, "codes_packed must be [out, ceil(in*bits/32)] = [", out, ", ", W, "]");
  TORCH_CHECK(scales.numel() == out * Gn && zeros.numel() == out * Gn, "scales / zeros must be [out, ",
              Gn, "]");
  L->in = in;
  L->out = out;
  L->bits = bits;
  L->gs = gs;
  L->Gn = Gn;
  L->gsp = (gs + 31) / 32 * 32;
  L->nibble = bits <= 4;
  const int64_t kp = Gn * L->gsp, cbytes = L->nibble ? 16 : 32;
  const int64_t row_bytes = kp / 32 * cbytes;
  L->codes = at::zeros({out, row_bytes}, at::kByte);
  {
    Tensor words = codes_packed.contiguous();
    std::vector<int64_t> ent(static_cast<size_t>(in));
    uint8_t* dst = L->codes.data_ptr<uint8_t>();
    for (int64_t o = 0; o < out; ++o) {
      unpack_rows(words.data_ptr<int32_t>() + o * W, 1, W, in, int(bits), ent.data());
      uint8_t* row = dst + o * row_bytes;
      for (int64_t j = 0; j < in; ++j) {
        const int64_t g = j / gs, pg = g * L->gsp + (j - g * gs), ch = pg / 32, jj = pg % 32;
        const uint8_t q = uint8_t(ent[size_t(j)]);
        if (L->nibble)
          row[ch * 16 + (jj & 15)] |= uint8_t(jj < 16 ? q : (q << 4));
        else
          row[pg] = q;
      }
    }
  }
  L->scales = scales.detach().to(at::kFloat).reshape({out, Gn}).contiguous();
  L->zeros = zeros.detach().to(at::kFloat).reshape({out, Gn}).contiguous();
  L->zs = (L->scales * L->zeros).contiguous();
  if (bias.has_value()) {
    L->bias = bias->detach().to(at::kFloat).reshape({-1}).contiguous();
    TORCH_CHECK(L->bias.numel() == out, "bias must have out_features elements");
    L->has_bias = true;
  }
  vn::ScalarArgs& a = L->a;
  a.n_in = in;
  a.out = out;
  a.gs = gs;
  a.Gn = Gn;
  a.gsp = L->gsp;
  a.row_bytes = row_bytes;
  a.kp = kp;
  a.nibble = L->nibble;
  a.codes = L->codes.data_ptr<uint8_t>();
  a.scales = L->scales.data_ptr<float>();
  a.zeros = L->zeros.data_ptr<float>();
  a.zs = L->zs.data_ptr<float>();
  return L;
}

template <typename XT>
void build_xg(const ScalarLayer& L, const XT* x, int64_t N, float* xg, float* xsum) {
  const int64_t in = L.in, gs = L.gs, gsp = L.gsp, kp = L.a.kp;
  for (int64_t n = 0; n < N; ++n) {
    const XT* xr = x + n * in;
    float* d = xg + n * kp;
    for (int64_t g = 0; g < L.Gn; ++g) {
      const int64_t j0 = g * gs, len = std::min<int64_t>(gs, in - j0);
      float* dg = d + g * gsp;
      float s = 0.f;
      for (int64_t i = 0; i < len; ++i) {
        float v;
        if constexpr (std::is_same<XT, float>::value)
          v = xr[j0 + i];
        else
          v = bf16f(xr[j0 + i]);
        dg[i] = v;
        s += v;
      }
      for (int64_t i = len; i < gsp; ++i) dg[i] = 0.f;
      if (xsum) xsum[n * L.Gn + g] = s;
    }
  }
}

Tensor scalar_gemv(const ScalarLayer& L, const IO& io) {
  const vn::IsaTable* T = isa();
  const int64_t N = io.N, out = L.out, kp = L.a.kp;
  Tensor y = new_y(io, out);
  float* xg = static_cast<float*>(t_x.get(size_t(kp * N + 16) * 4));
  float* xsum = static_cast<float*>(t_misc.get(size_t(L.Gn * N + 16) * 4));
  const int64_t ys = out + 16;
  float* yacc = static_cast<float*>(t_y.get(size_t(ys * N + 64) * 4));
  if (io.kind == 1)
    build_xg(L, reinterpret_cast<const uint16_t*>(io.xc.data_ptr()), N, xg, xsum);
  else
    build_xg(L, io.xc.data_ptr<float>(), N, xg, xsum);
  vn::ScalarCall c;
  c.xg = xg;
  c.xsum = xsum;
  c.y = yacc;
  c.ys = ys;
  const float* bias = L.has_bias ? L.bias.data_ptr<float>() : nullptr;
  void* yp = y.data_ptr();
  const int64_t blocks = (out + 3) / 4;
  const int64_t chunks = threads_for(out * kp * N, blocks);
  run_chunks(blocks, chunks, [&](int64_t b0, int64_t b1) {
    const int64_t o0 = b0 * 4, o1 = std::min<int64_t>(out, b1 * 4);
    if (o1 <= o0) return;
    T->sc_gemv(L.a, c, o0, o1, N);
    T->finish(yacc, ys, nullptr, bias, yp, out, io.kind, N, o0, o1);
  });
  return y;
}

Tensor scalar_prefill(const ScalarLayer& L, const IO& io) {
  const vn::IsaTable* T = isa();
  const int64_t N = io.N, in = L.in, out = L.out;
  const bool wide = prefill_fp32(io.kind);  // bf16 x through fp32 GEMMs
  const bool bf16 = io.kind == 1 && !wide;
  const int64_t esz = bf16 ? 2 : 4;
  Tensor y = new_y(io, out);
  const Tensor x2 = wide ? io.x2().to(at::kFloat) : io.x2();
  const Tensor yw = wide ? at::empty({N, out}, x2.options()) : Tensor();
  const int64_t tw_max = std::max<int64_t>(16, g_tile_outputs);
  const int64_t ntiles = (out + tw_max - 1) / tw_max;
  const int64_t ldw = (L.Gn * L.gs + 32 + 31) / 32 * 32;  // chunk stores run up to 31 past the last group
  const float* bias = L.has_bias ? L.bias.data_ptr<float>() : nullptr;
  void* yp = y.data_ptr();
  const at::ScalarType st = bf16 ? at::kBFloat16 : at::kFloat;
  const int64_t chunks = threads_for(out * in * N, ntiles);
  run_chunks(ntiles, chunks, [&](int64_t t0, int64_t t1) {
    char* buf = static_cast<char*>(t_tile.get(size_t(tw_max * ldw * esz + 64)));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t o0 = t * tw_max, o1 = std::min<int64_t>(out, o0 + tw_max), tw = o1 - o0;
      T->sc_dequant(L.a, o0, o1, buf, ldw, bf16);
      Tensor Wv = at::from_blob(buf, {tw, in}, {ldw, 1}, at::TensorOptions().dtype(st));
      if (wide) {
        Tensor ys = yw.narrow(1, o0, tw);
        at::mm_out(ys, x2, Wv.t());
      } else if (!bias) {
        Tensor ys = y.view({N, out}).narrow(1, o0, tw);
        at::mm_out(ys, x2, Wv.t());
      } else {
        Tensor tmp = at::mm(x2, Wv.t());
        add_bias_rows(tmp, bias, o0, tw, yp, out, io.kind, N);
      }
    }
  });
  if (wide) finish_fp32(yw, bias, y, out);
  return y;
}

// bf16 prefill of scalar codes with the oneDNN micro-kernel, transposed: y^T tile [64 outputs, tokens] =
// W tile [64, in] (dequantized row-major, exactly the reference's bf16 W) @ x^T, with x^T packed once per call
// into VNNI pairs (x viewed as 32-bit pairs of columns, transposed).
constexpr int64_t kScalarRows = 64, kScalarTokens = 128;

Tensor scalar_prefill_brgemm(const ScalarLayer& L, const IO& io) {
  const vn::IsaTable* T = isa();
  const int64_t N = io.N, in = L.in, out = L.out, half = in / 2;
  Tensor y = new_y(io, out);
  uint32_t* XT = static_cast<uint32_t*>(t_x.get(size_t(half * N + 64) * 4));
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(io.xc.data_ptr());
  for (int64_t k0 = 0; k0 < half; k0 += 64)
    for (int64_t n0 = 0; n0 < N; n0 += 64)
      for (int64_t n = n0; n < std::min<int64_t>(N, n0 + 64); ++n)
        for (int64_t k = k0; k < std::min<int64_t>(half, k0 + 64); ++k) XT[k * N + n] = x32[n * half + k];
  const at::BFloat16* B = reinterpret_cast<const at::BFloat16*>(XT);
  const int64_t ldw = (L.Gn * L.gs + 32 + 31) / 32 * 32;
  const int64_t ntiles = (out + kScalarRows - 1) / kScalarRows;
  const float* bias = L.has_bias ? L.bias.data_ptr<float>() : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t chunks = threads_for(out * in * N, ntiles);
  run_chunks(ntiles, chunks, [&](int64_t t0, int64_t t1) {
    uint16_t* Wt = static_cast<uint16_t*>(t_tile.get(size_t(kScalarRows * ldw + 64) * 2));
    float* C = static_cast<float*>(t_y.get(size_t(kScalarRows * kScalarTokens + 16) * 4));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t o0 = t * kScalarRows, o1 = std::min<int64_t>(out, o0 + kScalarRows), nr = o1 - o0;
      T->sc_dequant(L.a, o0, o1, Wt, ldw, true);
      for (int64_t m0 = 0; m0 < N; m0 += kScalarTokens) {
        const int64_t mb = std::min<int64_t>(kScalarTokens, N - m0);
        at::native::cpublas::brgemm(nr, mb, in, ldw, N, mb, false, reinterpret_cast<const at::BFloat16*>(Wt),
                                    B + 2 * m0, C, true);
        for (int64_t m = 0; m < mb; ++m) {
          uint16_t* yr = yp + (m0 + m) * out + o0;
          for (int64_t r = 0; r < nr; ++r) yr[r] = f2bf(C[r * mb + m] + (bias ? bias[o0 + r] : 0.f));
        }
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return y;
}

// Scalar codes: with the micro-kernel path available, the GEMV only wins up to 4 tokens (measured: at 8 tokens
// the GEMV is ~2x slower than dequantize + micro-kernel GEMM); without it, the GEMV runs up to 8 tokens.
int64_t g_scalar_gemv_max_mk = 4;
bool scalar_mk_ok(const ScalarLayer& L, const IO& io) {
  return io.kind == 1 && L.in % 2 == 0 && g_prefill_mode != 1 && g_prefill_mode != 3 && brgemm_usable();
}

Tensor scalar_forward(const ScalarLayer& L, const Tensor& x) {
  at::NoGradGuard no_grad;
  IO io = make_io(x, L.in);
  Tensor y;
  if (io.N == 0)
    y = new_y(io, L.out);
  else if (io.N <= kGemvMaxTokens && !(io.N > g_scalar_gemv_max_mk && scalar_mk_ok(L, io)))
    y = scalar_gemv(L, io);
  else if (scalar_mk_ok(L, io))
    y = scalar_prefill_brgemm(L, io);
  else
    y = scalar_prefill(L, io);
  return shape_result(y, io);
}

// ------------------------------------------------------------------------------------ activation quantization
// Fake quantization of a linear's input, exactly as vptq_core.quant.act_quant computes it in float32 (the same
// IEEE divisions, round half to even, then cast back to x's dtype), in one pass without autograd: the Python
// form costs ~10 small ops per call, tens of microseconds next to a GEMV of a few. mode 0: per token,
// symmetric (step = absmax / qmax); 1: per token, asymmetric (step = (max(hi, 0) - min(lo, 0)) / (2^b - 1),
// zero = round(-lo / step)); 2: per tensor, the static step ``scale``.
Tensor act_quant(const Tensor& x, int64_t mode, int64_t bits, double scale) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(x.device().is_cpu(), "act_quant needs a CPU tensor, got x on ", x.device());
  TORCH_CHECK(mode >= 0 && mode <= 2, "mode must be 0 (token), 1 (token_asym) or 2 (tensor), got ", mode);
  TORCH_CHECK(bits >= 2 && bits <= 15, "bits must be in 2..15, got ", bits);
  TORCH_CHECK(x.dim() >= 1, "x must have at least one dimension (features last)");
  TORCH_CHECK(mode != 2 || scale > 0, "the static scale must be positive, got ", scale);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  Tensor xc = bf16 || x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  Tensor y = at::empty_like(xc);
  const int64_t in = xc.size(-1), N = in > 0 ? xc.numel() / in : 0;
  const float s = float(scale);
  const int64_t chunks = threads_for(N * in * 8, N);
  const vn::IsaTable* T = isa();
  const int64_t esz = bf16 ? 2 : 4;
  const char* xp = static_cast<const char*>(xc.data_ptr());
  char* yp = static_cast<char*>(y.data_ptr());
  run_chunks(N, chunks, [&](int64_t n0, int64_t n1) {
    T->act_quant(xp + n0 * in * esz, yp + n0 * in * esz, n1 - n0, in, bf16, int(mode), int(bits), s);
  });
  return xc.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// ------------------------------------------------------------------------------------------ decoder step
// The operations around the linears of a llama-family decoder step (see decoder_body.h), on bf16 or fp32 CPU
// tensors; the rows of a batch share the thread pool in attend, the rest runs on one thread (small next to the linears).
bool dec_dtype(const Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be a CPU tensor, got one on ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, name,
              " must be bfloat16 or float32, got ", x.scalar_type());
  return x.scalar_type() == at::kBFloat16;
}

void dec_same(const Tensor& a, const Tensor& b, const char* na, const char* nb) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), na, " and ", nb, " must have the same dtype, got ",
              a.scalar_type(), " and ", b.scalar_type());
}

// RMSNorm of x ([..., d]) with weight w [d]; with delta, h = x + delta first, returned as well: (h, norm(h)).
std::vector<Tensor> rms_norm_op(const Tensor& x, const c10::optional<Tensor>& delta, const Tensor& w, double eps) {
  at::NoGradGuard no_grad;
  const bool d16 = dec_dtype(x, "x");
  dec_same(x, w, "x", "weight");
  const int64_t d = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == d, "weight must have shape [", d, "], got ", w.sizes());
  Tensor xc = x.contiguous(), wc = w.contiguous(), dc, h;
  if (delta) {
    dec_same(x, *delta, "x", "delta");
    TORCH_CHECK(delta->sizes() == x.sizes(), "delta must have x's shape ", x.sizes(), ", got ", delta->sizes());
    dc = delta->contiguous();
    h = at::empty_like(xc);
  }
  Tensor y = at::empty_like(xc);
  const int64_t n = d > 0 ? xc.numel() / d : 0;
  float* scratch = static_cast<float*>(t_misc.get(size_t(2 * d + 16) * 4));
  isa()->rms_norm(xc.data_ptr(), delta ? dc.data_ptr() : nullptr, delta ? h.data_ptr() : nullptr, wc.data_ptr(),
                  float(eps), n, d, d16, y.data_ptr(), scratch);
  if (delta) return {h, y};
  return {y};
}

Tensor silu_mul_op(const Tensor& g, const Tensor& u) {
  at::NoGradGuard no_grad;
  const bool d16 = dec_dtype(g, "gate");
  dec_same(g, u, "gate", "up");
  TORCH_CHECK(g.sizes() == u.sizes(), "gate and up must have the same shape, got ", g.sizes(), " and ", u.sizes());
  Tensor gc = g.contiguous(), uc = u.contiguous();
  Tensor y = at::empty_like(gc);
  isa()->silu_mul(gc.data_ptr(), uc.data_ptr(), gc.numel(), d16, y.data_ptr());
  return y;
}

// Nearest centroid of every row of X [n, d] (fp32) in a codebook given as CT [d, kp] (transposed, kp a multiple of 8)
// and csq [kp] (squared norms, +inf past the real centroids): int64 [n], the lowest index on ties.
Tensor nearest_op(const Tensor& X, const Tensor& CT, const Tensor& csq) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(X.dim() == 2 && X.scalar_type() == at::kFloat && X.device().is_cpu(),
              "X must be a 2-D float32 CPU tensor [n, d], got ", X.scalar_type(), " ", X.sizes());
  const int64_t n = X.size(0), d = X.size(1);
  TORCH_CHECK(d >= 1 && d <= 16, "vector length d must be 1..16, got ", d);
  TORCH_CHECK(CT.dim() == 2 && CT.size(0) == d && CT.size(1) % 8 == 0 && CT.size(1) > 0 &&
                  CT.scalar_type() == at::kFloat && CT.is_contiguous(),
              "CT must be a contiguous float32 [d, kp] tensor with kp a multiple of 8, got ", CT.scalar_type(), " ",
              CT.sizes());
  const int64_t kp = CT.size(1);
  TORCH_CHECK(csq.dim() == 1 && csq.size(0) == kp && csq.scalar_type() == at::kFloat && csq.is_contiguous(),
              "csq must be a contiguous float32 [", kp, "] tensor, got ", csq.scalar_type(), " ", csq.sizes());
  Tensor Xc = X.contiguous();
  Tensor out = at::empty({n}, X.options().dtype(at::kLong));
  const float* xp = Xc.data_ptr<float>();
  const float* ctp = CT.data_ptr<float>();
  const float* sp = csq.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t blocks = (n + 3) / 4;
  run_chunks(blocks, threads_for(n * kp * d, blocks), [&](int64_t b0, int64_t b1) {
    isa()->nearest(xp, d, ctp, sp, kp, b0 * 4, std::min<int64_t>(n, b1 * 4), op);
  });
  return out;
}

// ------------------------------------------------------------------------------ training: codebook gather / sum
// The trainable VQ linear's weight in stored column order, straight from the stored codes: codes [G, R, gs]
// (int16 read as uint16 patterns, int32 or int64), codebook [G * k, v] float32, and
//   W[r * v + j, g * gs + c] = codebook[g * k + codes[g, r, c], j]      for r * v + j < out.
// codebook_sum is its backward: grad_codebook[g * k + codes[g, r, c], j] += grad[r * v + j, g * gs + c], summed in
// one buffer per chunk of rows (chunks fixed by the thread count), then the buffers in chunk order.
template <typename I>
inline int64_t code_at(const I* p, int64_t i) {
  if constexpr (std::is_same_v<I, int16_t>)
    return int64_t(uint16_t(p[i]));
  else
    return int64_t(p[i]);
}

// nc: the rows of the codebook the codes index, or -1 where the caller makes the codebook (the gradient's sum).
void check_codes(const Tensor& codes, int64_t k, int64_t nc = -1) {
  TORCH_CHECK(codes.dim() == 3 && codes.device().is_cpu() && codes.is_contiguous() &&
                  (codes.scalar_type() == at::kShort || codes.scalar_type() == at::kInt ||
                   codes.scalar_type() == at::kLong),
              "codes must be a contiguous int16 / int32 / int64 CPU tensor [G, R, group_size], got ",
              codes.scalar_type(), " ", codes.sizes());
  TORCH_CHECK(k >= 1, "the codebook size k must be positive, got ", k);
  TORCH_CHECK(nc < 0 || codes.size(0) * k == nc, "the codebook must hold G * k = ", codes.size(0), " * ", k,
              " rows, got ", nc);
}

template <typename F>
void with_codes(const Tensor& codes, const F& f) {
  if (codes.scalar_type() == at::kShort)
    f(codes.data_ptr<int16_t>());
  else if (codes.scalar_type() == at::kInt)
    f(codes.data_ptr<int32_t>());
  else
    f(codes.data_ptr<int64_t>());
}

// Every code of the first ``rows`` rows of vectors in 0..k-1 (a bad code would read or write outside the
// codebook): one pass over the codes, a small part of a gather's time.
void check_range(const Tensor& codes, int64_t k, int64_t rows) {
  const int64_t G = codes.size(0), R = codes.size(1), gs = codes.size(2);
  bool bad = false;
  with_codes(codes, [&](const auto* ip) {
    for (int64_t g = 0; g < G && !bad; ++g)
      for (int64_t i = g * R * gs; i < (g * R + rows) * gs; ++i) bad |= uint64_t(code_at(ip, i)) >= uint64_t(k);
  });
  TORCH_CHECK(!bad, "codes must lie in 0..", k - 1, " (the codebook's rows per group); a code is out of range");
}

Tensor codebook_expand_op(const Tensor& codebook, const Tensor& codes, int64_t k, int64_t out) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(codebook.dim() == 2 && codebook.scalar_type() == at::kFloat && codebook.device().is_cpu(),
              "codebook must be a 2-D float32 CPU tensor [G * k, v], got ", codebook.scalar_type(), " ",
              codebook.sizes());
  check_codes(codes, k, codebook.size(0));
  const int64_t G = codes.size(0), R = codes.size(1), gs = codes.size(2), v = codebook.size(1), cols = G * gs;
  TORCH_CHECK(out >= 0 && out <= R * v, "out must be 0..", R * v, " (rows x vector length), got ", out);
  Tensor cb = codebook.contiguous();
  Tensor W = at::empty({out, cols}, codebook.options());
  const float* cp = cb.data_ptr<float>();
  float* wp = W.data_ptr<float>();
  const int64_t rows = (out + v - 1) / v;
  check_range(codes, k, rows);
  with_codes(codes, [&](const auto* ip) {
    run_chunks(rows, threads_for(rows * v * cols, rows), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t j = 0; j < v && r * v + j < out; ++j) {
          float* dst = wp + (r * v + j) * cols;
          for (int64_t g = 0; g < G; ++g) {
            const auto* code = ip + (g * R + r) * gs;
            const float* book = cp + g * k * v + j;
            for (int64_t c = 0; c < gs; ++c) dst[g * gs + c] = book[code_at(code, c) * v];
          }
        }
    });
  });
  return W;
}

Tensor codebook_sum_op(const Tensor& grad, const Tensor& codes, int64_t k, int64_t v) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(grad.dim() == 2 && grad.scalar_type() == at::kFloat && grad.device().is_cpu(),
              "grad must be a 2-D float32 CPU tensor [out, G * group_size], got ", grad.scalar_type(), " ",
              grad.sizes());
  TORCH_CHECK(v >= 1, "vector length must be positive, got ", v);
  check_codes(codes, k);
  const int64_t G = codes.size(0), R = codes.size(1), gs = codes.size(2), cols = G * gs, out = grad.size(0);
  TORCH_CHECK(grad.size(1) == cols && out <= R * v, "grad must be [at most ", R * v, ", ", cols, "], got ",
              grad.sizes());
  Tensor g = grad.contiguous();
  const float* gp = g.data_ptr<float>();
  const int64_t nc = G * k, rows = (out + v - 1) / v;
  check_range(codes, k, rows);
  const int64_t chunks = threads_for(rows * v * cols, rows);
  Tensor sums = at::zeros({chunks, nc, v}, grad.options());
  float* sp = sums.data_ptr<float>();
  with_codes(codes, [&](const auto* ip) {
    run_chunks(chunks, chunks, [&](int64_t c0, int64_t c1) {
      for (int64_t ch = c0; ch < c1; ++ch) {
        float* acc = sp + ch * nc * v;
        for (int64_t r = ch * rows / chunks; r < (ch + 1) * rows / chunks; ++r)
          for (int64_t j = 0; j < v && r * v + j < out; ++j) {
            const float* src = gp + (r * v + j) * cols;
            for (int64_t gi = 0; gi < G; ++gi) {
              const auto* code = ip + (gi * R + r) * gs;
              float* book = acc + gi * k * v + j;
              for (int64_t c = 0; c < gs; ++c) book[code_at(code, c) * v] += src[gi * gs + c];
            }
          }
      }
    });
  });
  if (chunks == 1) return sums[0];
  Tensor total = sums[0].clone();
  for (int64_t ch = 1; ch < chunks; ++ch) total.add_(sums[ch]);
  return total;
}

// q [B, t, nh * hd], k / v [B, t, kvh * hd] (the projections' outputs), cos / sin [t, hd] (or [1, t, hd]),
// caches [B, kvh, Lmax, hd] (or [kvh, Lmax, hd] for B = 1), written at positions pos .. pos + t - 1 of every row.
// Returns the attention output [B, t, nh * hd], ready for the output projection.
Tensor attend_op(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cos, const Tensor& sin,
                 Tensor& k_cache, Tensor& v_cache, int64_t pos, int64_t num_heads, double scale) {
  at::NoGradGuard no_grad;
  const bool d16 = dec_dtype(q, "q");
  for (const Tensor* x : std::initializer_list<const Tensor*>{&k, &v, &cos, &sin, &k_cache, &v_cache})
    dec_same(q, *x, "q", "k, v, cos, sin and the caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "the K and V caches must have the same shape");
  TORCH_CHECK(k_cache.dim() == 3 || k_cache.dim() == 4, "the caches must be [batch, kv_heads, max_len, head_dim], got ",
              k_cache.sizes());
  const int64_t B = k_cache.dim() == 4 ? k_cache.size(0) : 1;
  const int64_t kvh = k_cache.size(-3), Lmax = k_cache.size(-2), hd = k_cache.size(-1);
  TORCH_CHECK(num_heads > 0 && num_heads % kvh == 0, "num_heads (", num_heads, ") must be a multiple of the KV heads (",
              kvh, ")");
  TORCH_CHECK(hd % 2 == 0 && hd <= 512, "head_dim must be even and at most 512, got ", hd);
  TORCH_CHECK(q.dim() == 3 && q.size(0) == B, "q must be [", B, ", tokens, ", num_heads * hd, "], got ", q.sizes());
  const int64_t nh = num_heads, t = q.size(1), g = nh / kvh;
  TORCH_CHECK(q.size(2) == nh * hd, "q must be [", B, ", tokens, ", nh * hd, "], got ", q.sizes());
  TORCH_CHECK(k.numel() == B * t * kvh * hd && v.numel() == B * t * kvh * hd, "k and v must be [", B, ", ", t, ", ",
              kvh * hd, "], got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(cos.numel() == t * hd && sin.numel() == t * hd, "cos and sin must be [", t, ", ", hd, "]");
  TORCH_CHECK(pos >= 0 && pos + t <= Lmax, "positions ", pos, "..", pos + t - 1, " do not fit the cache of ", Lmax);
  TORCH_CHECK(g * t <= 512, "at most 512 query rows per KV head in one call, got ", g * t);
  Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  Tensor out = at::empty({B, t, nh * hd}, q.options());
  const int64_t L = pos + t, es = d16 ? 2 : 4;
  const size_t scratch_bytes = size_t(t * nh * hd + 3 * hd + g * t * (L + hd) + 64) * 4;
  auto row = [es](const Tensor& x, int64_t b, int64_t n) { return static_cast<char*>(x.data_ptr()) + b * n * es; };
  const vn::IsaTable* T = isa();
  // rows of a batch on the thread pool (one sequence's attention is small next to the linears)
  run_chunks(B, threads_for(B * L * t * nh * hd * 2, B), [&](int64_t b0, int64_t b1) {
    float* scratch = static_cast<float*>(t_misc.get(scratch_bytes));
    for (int64_t b = b0; b < b1; ++b)
      T->attend(row(qc, b, t * nh * hd), nh * hd, row(kc, b, t * kvh * hd), kvh * hd, row(vc, b, t * kvh * hd),
                kvh * hd, cc.data_ptr(), sc.data_ptr(), row(k_cache, b, kvh * Lmax * hd),
                row(v_cache, b, kvh * Lmax * hd), Lmax, pos, t, nh, kvh, hd, float(scale), d16,
                row(out, b, t * nh * hd), scratch);
  });
  return out;
}

#include "shared_input.h"

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vptq_core native CPU kernels (VQ lookup GEMV / dequantize + GEMM, scalar codes)";
  py::class_<VQLayer, std::shared_ptr<VQLayer>>(m, "VQLayer")
      .def("__call__", &vq_forward, py::arg("x"), py::call_guard<py::gil_scoped_release>())
      .def("forward", &vq_forward, py::arg("x"), py::call_guard<py::gil_scoped_release>())
      .def_readonly("in_features", &VQLayer::in)
      .def_readonly("out_features", &VQLayer::out)
      .def_readonly("vector_len", &VQLayer::v)
      .def_readonly("num_centroids", &VQLayer::k)
      .def_readonly("num_res_centroids", &VQLayer::kr)
      .def_readonly("group_num", &VQLayer::G)
      .def_readonly("group_size", &VQLayer::gs)
      .def_readonly("outlier_size", &VQLayer::osz)
      .def_readonly("codebook_bf16_exact", &VQLayer::cb_exact_bf16)
      .def_readwrite("gemv_bf16_codebook", &VQLayer::gemv_cb16)
      .def_readonly("indices", &VQLayer::idx)
      .def_property_readonly("index_bytes", [](const VQLayer& L) { return int64_t(L.idx.element_size()); })
      .def_readonly("res_indices", &VQLayer::ridx)
      .def_readonly("codebook", &VQLayer::cb32)
      .def_readonly("codebook_bf16", &VQLayer::cb16)
      .def_readonly("res_codebook", &VQLayer::rcb32)
      .def_readonly("outlier_indices", &VQLayer::oidx)
      .def_readonly("outlier_codebook", &VQLayer::ocb32)
      .def_readonly("perm", &VQLayer::perm)
      .def_readonly("bias", &VQLayer::bias)
      .def("__repr__", [](const VQLayer& L) {
        return "<native VQLayer " + std::to_string(L.out) + "x" + std::to_string(L.in) + " v" +
               std::to_string(L.v) + " k" + std::to_string(L.k) + (L.kr > 0 ? " res" + std::to_string(L.kr) : "") +
               (L.osz > 0 ? " outliers" + std::to_string(L.osz) : "") + ">";
      });
  py::class_<ScalarLayer, std::shared_ptr<ScalarLayer>>(m, "ScalarLayer")
      .def("__call__", &scalar_forward, py::arg("x"), py::call_guard<py::gil_scoped_release>())
      .def("forward", &scalar_forward, py::arg("x"), py::call_guard<py::gil_scoped_release>())
      .def("forward_act", [](const ScalarLayer& L, const Tensor& x, int64_t mode, int64_t bits, double scale) {
             return scalar_forward(L, act_quant(x, mode, bits, scale));
           }, py::arg("x"), py::arg("mode"), py::arg("bits"), py::arg("scale"),
           py::call_guard<py::gil_scoped_release>())
      .def_readonly("in_features", &ScalarLayer::in)
      .def_readonly("out_features", &ScalarLayer::out)
      .def_readonly("bits", &ScalarLayer::bits)
      .def_readonly("group_size", &ScalarLayer::gs)
      .def_readonly("codes", &ScalarLayer::codes)
      .def_readonly("scales", &ScalarLayer::scales)
      .def_readonly("zeros", &ScalarLayer::zeros)
      .def_readonly("bias", &ScalarLayer::bias)
      .def("__repr__", [](const ScalarLayer& L) {
        return "<native ScalarLayer " + std::to_string(L.out) + "x" + std::to_string(L.in) + " " +
               std::to_string(L.bits) + "-bit g" + std::to_string(L.gs) + ">";
      });
  m.def("prepare_vq", &prepare_vq, py::call_guard<py::gil_scoped_release>(), py::arg("spec"), py::arg("indices"), py::arg("centroids"),
        py::arg("res_centroids"), py::arg("outlier_indices"), py::arg("outlier_centroids"), py::arg("perm"),
        py::arg("weight_scale"), py::arg("weight_bias"), py::arg("bias"));
  m.def("prepare_scalar", &prepare_scalar, py::call_guard<py::gil_scoped_release>(), py::arg("codes_packed"), py::arg("scales"), py::arg("zeros"),
        py::arg("bias"), py::arg("bits"), py::arg("group_size"), py::arg("in_features"));
  m.def("vq_linear", [](const Tensor& x, const VQLayer& L) { return vq_forward(L, x); }, py::arg("x"),
        py::arg("layer"), py::call_guard<py::gil_scoped_release>());
  m.def("scalar_linear", [](const Tensor& x, const ScalarLayer& L) { return scalar_forward(L, x); },
        py::arg("x"), py::arg("layer"), py::call_guard<py::gil_scoped_release>());
  m.def("act_quant", &act_quant, py::arg("x"), py::arg("mode"), py::arg("bits"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm_op, py::arg("x"), py::arg("delta"), py::arg("weight"), py::arg("eps"),
        "RMSNorm as transformers rounds it; with delta: (x + delta, norm(x + delta))");
  m.def("nearest", &nearest_op, py::call_guard<py::gil_scoped_release>(), py::arg("X"), py::arg("CT"), py::arg("csq"),
        "nearest centroid of each row of X (codebook transposed and padded; lowest index on ties)");
  m.def("codebook_expand", &codebook_expand_op, py::call_guard<py::gil_scoped_release>(), py::arg("codebook"),
        py::arg("codes"), py::arg("k"), py::arg("out"),
        "W [out, G * group_size] in stored column order from codes [G, R, group_size] and codebook [G * k, v]");
  m.def("codebook_sum", &codebook_sum_op, py::call_guard<py::gil_scoped_release>(), py::arg("grad"),
        py::arg("codes"), py::arg("k"), py::arg("v"), "codebook_expand's backward: grad [out, G * group_size] -> [G * k, v]");
  m.def("silu_mul", &silu_mul_op, py::arg("gate"), py::arg("up"), "silu(gate) * up as transformers rounds it");
  m.def("attend", &attend_op, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cos"), py::arg("sin"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("pos"), py::arg("num_heads"), py::arg("scale"),
        "causal attention of new tokens fused with rotary embedding and the KV-cache write");
  m.def("vq_many", &vq_many, py::arg("layers"), py::arg("x"), py::arg("silu_mul") = false,
        py::call_guard<py::gil_scoped_release>(),
        "several VQ layers on one x in one call (one parallel region for the GEMV); silu_mul: [silu(y0) * y1]");
  m.def("scalar_many", &scalar_many, py::arg("layers"), py::arg("x"), py::arg("silu_mul") = false,
        py::arg("act_mode") = -1, py::arg("act_bits") = 8, py::arg("act_scale") = 0.0,
        py::call_guard<py::gil_scoped_release>(),
        "scalar_linear of several layers on one x (x fake-quantized once when act_mode >= 0); silu_mul as vq_many");
  m.def("set_isa", &set_isa, py::arg("name"));
  m.def("isa", []() { return std::string(isa()->name); });
  m.def("cpu_isa", &cpu_isa);
  m.def("set_parallel_macs", [](int64_t n) { g_parallel_macs = std::max<int64_t>(1, n); });
  m.def("set_gemv_max_tokens", [](int64_t n) { kGemvMaxTokens = std::max<int64_t>(0, n); });
  m.def("set_scalar_gemv_max_tokens", [](int64_t n) { g_scalar_gemv_max_mk = std::max<int64_t>(0, n); });
  m.def("set_gather", [](int64_t g) { g_gather = int(g); });
  m.def("set_nb", [](int64_t n) { g_nb = std::max<int64_t>(1, n); });
  m.def("set_cb16", [](int64_t m) { g_cb16 = int(m); });
  m.def("set_touch", [](int64_t m) { g_touch = int(m); });
  m.def("set_index8", [](int64_t m) { g_index8 = int(m); });
  m.def("set_index_prefetch", [](int64_t n) { g_index_prefetch = std::max<int64_t>(0, n); });
  m.def("set_tile", [](int64_t n) { g_tile_outputs = std::max<int64_t>(16, n); });
  m.def("set_prefill", [](const std::string& mode) {
    TORCH_CHECK(mode == "auto" || mode == "mm" || mode == "brgemm" || mode == "fp32",
                "prefill mode must be auto, mm, brgemm or fp32, got '", mode, "'");
    g_prefill_mode = mode == "mm" ? 1 : (mode == "brgemm" ? 2 : (mode == "fp32" ? 3 : 0));
    return prefill_path();
  });
}
