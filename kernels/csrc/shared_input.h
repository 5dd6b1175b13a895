// Several layers on one input (q/k/v, gate/up of a decoder layer) in one call. Included by native.cpp inside its
// namespace, after the single-layer entry points it reuses.
//
// Up to the GEMV token limit the layers' row blocks form one range split over the thread pool, so a decode step
// opens one parallel region per group instead of one per layer (a region costs microseconds of wake-up and join,
// as long as the whole GEMV of a small k/v projection) and crosses from Python once. Each layer keeps its own
// folded input (its permutation and normalisation), accumulators and output, so the results are exactly those of
// the layers called one by one. Above the limit (prefill) the layers run one after the other.
#pragma once

// Scratch of one call, split into 64-byte aligned pieces.
struct ScratchCursor {
  char* p;
  template <typename T>
  T* take(int64_t n) {
    T* r = reinterpret_cast<T*>(p);
    p += ((size_t(n) * sizeof(T) + 63) / 64) * 64;
    return r;
  }
};

inline size_t aligned_bytes(int64_t n, size_t es) { return ((size_t(n) * es + 63) / 64) * 64; }

std::vector<Tensor> silu_mul_if(std::vector<Tensor> ys, bool silu) {
  if (!silu) return ys;
  TORCH_CHECK(ys.size() == 2, "silu_mul needs exactly two layers (gate, up), got ", ys.size());
  return {silu_mul_op(ys[0], ys[1])};
}

struct VQPart {
  const VQLayer* L;
  vn::VQCall c;
  float* off;
  Tensor y;
  int64_t u0;  // first unit (row block) of this layer in the joint range
};

std::vector<Tensor> vq_many(const std::vector<std::shared_ptr<VQLayer>>& layers, const Tensor& x, bool silu) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(!layers.empty(), "vq_many needs at least one layer");
  const int64_t in = layers[0]->in;
  for (const auto& L : layers) TORCH_CHECK(L->in == in, "the layers must share in_features: ", L->in, " != ", in);
  IO io = make_io(x, in);
  std::vector<Tensor> ys;
  if (io.N == 0 || io.N > kGemvMaxTokens) {
    for (const auto& L : layers) ys.push_back(vq_forward(*L, x));
    return silu_mul_if(std::move(ys), silu);
  }
  const int64_t N = io.N;
  size_t bytes = 64;
  for (const auto& L : layers)
    bytes += aligned_bytes(in * N + 16, 4) + aligned_bytes((L->out + 16) * N + 64, 4) + aligned_bytes(N + 16, 4);
  ScratchCursor cur{static_cast<char*>(t_x.get(bytes))};
  std::vector<VQPart> parts;
  int64_t units = 0, macs = 0;
  for (const auto& L : layers) {
    VQPart part;
    part.L = L.get();
    float* xq = cur.take<float>(in * N + 16);
    part.c.ys = L->out + 16;
    part.c.y = cur.take<float>(part.c.ys * N + 64);
    part.off = cur.take<float>(N + 16);
    if (io.kind == 1)
      build_xq(*L, reinterpret_cast<const uint16_t*>(io.xc.data_ptr()), N, xq, part.off);
    else
      build_xq(*L, io.xc.data_ptr<float>(), N, xq, part.off);
    part.c.xq = xq;
    part.c.xs = N;
    part.c.use_cb16 = L->gemv_cb16 && N == 1;
    part.c.touch_codebooks = g_touch != 0 && g_last_gemv.exchange(L.get(), std::memory_order_relaxed) != L.get();
    part.c.prefetch = g_index_prefetch;
    part.y = new_y(io, L->out);
    part.u0 = units;
    units += L->a.RB;
    macs += L->a.R * L->a.v * in * N;
    parts.push_back(part);
  }
  const vn::IsaTable* T = isa();
  run_chunks(units, threads_for(macs, units), [&](int64_t u0, int64_t u1) {
    for (const VQPart& part : parts) {
      const VQLayer& L = *part.L;
      const vn::VQArgs& A = L.a;
      const int64_t b0 = std::max<int64_t>(u0 - part.u0, 0), b1 = std::min<int64_t>(u1 - part.u0, A.RB);
      if (b1 <= b0) continue;
      T->vq_main(A, part.c, b0, b1, 0, N);
      const int64_t o0 = b0 * vn::NR_LAYOUT * A.v, o1 = std::min<int64_t>(L.out, b1 * vn::NR_LAYOUT * A.v);
      T->vq_outliers(A, part.c, o0, o1, 0, N);
      T->finish(part.c.y, part.c.ys, L.has_norm ? part.off : nullptr, L.has_bias ? L.bias.data_ptr<float>() : nullptr,
                part.y.data_ptr(), L.out, io.kind, N, o0, o1);
    }
  });
  for (const VQPart& part : parts) ys.push_back(shape_result(part.y, io));
  return silu_mul_if(std::move(ys), silu);
}

struct ScalarPart {
  const ScalarLayer* L;
  vn::ScalarCall c;
  Tensor y;
  int64_t u0;  // first unit (block of 4 outputs) of this layer in the joint range
};

// act_mode < 0: x as it is; else x fake-quantized once (act_quant(x, act_mode, act_bits, act_scale)) for all.
std::vector<Tensor> scalar_many(const std::vector<std::shared_ptr<ScalarLayer>>& layers, const Tensor& x, bool silu,
                                int64_t act_mode, int64_t act_bits, double act_scale) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(!layers.empty(), "scalar_many needs at least one layer");
  const int64_t in = layers[0]->in;
  for (const auto& L : layers) TORCH_CHECK(L->in == in, "the layers must share in_features: ", L->in, " != ", in);
  const Tensor xa = act_mode >= 0 ? act_quant(x, act_mode, act_bits, act_scale) : x;
  IO io = make_io(xa, in);
  std::vector<Tensor> ys;
  bool gemv = io.N > 0;
  for (const auto& L : layers)
    gemv = gemv && io.N <= kGemvMaxTokens && !(io.N > g_scalar_gemv_max_mk && scalar_mk_ok(*L, io));
  if (!gemv) {
    for (const auto& L : layers) ys.push_back(scalar_forward(*L, xa));
    return silu_mul_if(std::move(ys), silu);
  }
  const int64_t N = io.N;
  size_t bytes = 64;
  for (const auto& L : layers)
    bytes += aligned_bytes(L->a.kp * N + 16, 4) + aligned_bytes(L->Gn * N + 16, 4) +
             aligned_bytes((L->out + 16) * N + 64, 4);
  ScratchCursor cur{static_cast<char*>(t_x.get(bytes))};
  std::vector<ScalarPart> parts;
  int64_t units = 0, macs = 0;
  for (const auto& L : layers) {
    ScalarPart part;
    part.L = L.get();
    float* xg = cur.take<float>(L->a.kp * N + 16);
    float* xsum = cur.take<float>(L->Gn * N + 16);
    part.c.ys = L->out + 16;
    part.c.y = cur.take<float>(part.c.ys * N + 64);
    if (io.kind == 1)
      build_xg(*L, reinterpret_cast<const uint16_t*>(io.xc.data_ptr()), N, xg, xsum);
    else
      build_xg(*L, io.xc.data_ptr<float>(), N, xg, xsum);
    part.c.xg = xg;
    part.c.xsum = xsum;
    part.y = new_y(io, L->out);
    part.u0 = units;
    units += (L->out + 3) / 4;
    macs += L->out * L->a.kp * N;
    parts.push_back(part);
  }
  const vn::IsaTable* T = isa();
  run_chunks(units, threads_for(macs, units), [&](int64_t u0, int64_t u1) {
    for (const ScalarPart& part : parts) {
      const ScalarLayer& L = *part.L;
      const int64_t blocks = (L.out + 3) / 4;
      const int64_t b0 = std::max<int64_t>(u0 - part.u0, 0), b1 = std::min<int64_t>(u1 - part.u0, blocks);
      const int64_t o0 = b0 * 4, o1 = std::min<int64_t>(L.out, b1 * 4);
      if (o1 <= o0) continue;
      T->sc_gemv(L.a, part.c, o0, o1, N);
      T->finish(part.c.y, part.c.ys, nullptr, L.has_bias ? L.bias.data_ptr<float>() : nullptr, part.y.data_ptr(),
                L.out, io.kind, N, o0, o1);
    }
  });
  for (const ScalarPart& part : parts) ys.push_back(shape_result(part.y, io));
  return silu_mul_if(std::move(ys), silu);
}
