// The small per-token operations of a llama-family decoder step (included by kernels_body.h, so compiled once per
// instruction-set level; plain loops that the compiler vectorizes for the level's target). They reproduce
// transformers' own rounding: every tensor op of the reference rounds its result to the model dtype D (bf16 or
// fp32), and so does each step here (R below). Layouts are row-major; "D" buffers are uint16 (bf16) or float.

namespace dec {

// element i of a D buffer, read / written (the activation helpers of kernels_body.h)
static VN_FI float ld(const void* p, int64_t i, bool d16) { return act_rd(p, i, d16); }
static VN_FI void st(void* p, int64_t i, bool d16, float v) { act_wr(p, i, d16, v); }
static VN_FI float R(float v, bool d16) { return d16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

// Row of D into fp32.
static VN_FI void load_row(const void* p, int64_t n, bool d16, float* out) {
  if (d16) {
    const uint16_t* s = static_cast<const uint16_t*>(p);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u = uint32_t(s[i]) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      out[i] = f;
    }
  } else {
    std::memcpy(out, p, size_t(n) * 4);
  }
}

// exp(x) for x in [-87, 88] to ~2 ulp (Cody-Waite reduction, degree-7 Taylor); vectorizes in omp simd loops.
static VN_FI float exp_f(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = __builtin_nearbyintf(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = (int32_t(n) + 127) << 23;
  float s;
  std::memcpy(&s, &e, 4);
  return p * s;
}

// y[i] = R(w * R(h * rsqrt(mean(h^2) + eps))) per row of n x d, where h = x, or h = R(x + delta) (written to
// hsum) when delta is given: transformers' RMSNorm, with the residual add before it fused in.
static void rms_norm(const void* x, const void* delta, void* hsum, const void* w, float eps, int64_t n, int64_t d,
                     bool d16, void* y, float* scratch) {
  float* h = scratch;
  float* wf = scratch + d;
  load_row(w, d, d16, wf);
  for (int64_t r = 0; r < n; ++r) {
    load_row(d16 ? static_cast<const void*>(static_cast<const uint16_t*>(x) + r * d)
                 : static_cast<const void*>(static_cast<const float*>(x) + r * d), d, d16, h);
    if (delta) {
      for (int64_t i = 0; i < d; ++i) {
        h[i] = R(h[i] + ld(delta, r * d + i, d16), d16);
        st(hsum, r * d + i, d16, h[i]);
      }
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d; ++i) ss += h[i] * h[i];
    const float inv = 1.0f / __builtin_sqrtf(ss / float(d) + eps);
    for (int64_t i = 0; i < d; ++i) st(y, r * d + i, d16, R(wf[i] * R(h[i] * inv, d16), d16));
  }
}

// y = R(R(silu(g)) * u), n elements.
static void silu_mul(const void* g, const void* u, int64_t n, bool d16, void* y) {
  constexpr int64_t B = 256;
  float gf[B], uf[B];
  for (int64_t i0 = 0; i0 < n; i0 += B) {
    const int64_t m = std::min(B, n - i0);
    load_row(d16 ? static_cast<const void*>(static_cast<const uint16_t*>(g) + i0)
                 : static_cast<const void*>(static_cast<const float*>(g) + i0), m, d16, gf);
    load_row(d16 ? static_cast<const void*>(static_cast<const uint16_t*>(u) + i0)
                 : static_cast<const void*>(static_cast<const float*>(u) + i0), m, d16, uf);
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) gf[i] = gf[i] / (1.0f + exp_f(-gf[i]));
    for (int64_t i = 0; i < m; ++i) st(y, i0 + i, d16, R(R(gf[i], d16) * uf[i], d16));
  }
}

// Rotary embedding of one head (transformers' rotate_half convention): out = R(R(x * cos) + R(rot(x) * sin)),
// rot(x) = (-x2, x1).
static VN_FI void rope_head(const float* x, const float* c, const float* s, int64_t hd, bool d16, float* out) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    out[i] = R(R(x[i] * c[i], d16) + R(-x[i + half] * s[i], d16), d16);
    out[i + half] = R(R(x[i + half] * c[i + half], d16) + R(x[i] * s[i + half], d16), d16);
  }
}

// Attention of t new tokens at positions pos .. pos + t - 1 (causal), fused with the rotary embedding of q and k
// and the KV-cache write. q [t][nh * hd] (row stride qs), k / v [t][kvh * hd] (strides ks / vs), cos / sin
// [t][hd], caches Kc / Vc [kvh][Lmax][hd], out [t][nh * hd]; all D. Query head j reads KV head j / (nh / kvh).
// Scores and softmax in fp32; for bf16 the unnormalised probabilities are rounded to bf16 before they weight V
// (as torch's CPU flash attention does for reduced types). scratch: >= t*nh*hd + 2*hd + (nh/kvh)*t*(pos+t+hd).
static void attend(const void* q, int64_t qs, const void* k, int64_t ks, const void* v, int64_t vs, const void* cos,
                   const void* sin, void* Kc, void* Vc, int64_t Lmax, int64_t pos, int64_t t, int64_t nh, int64_t kvh,
                   int64_t hd, float scale, bool d16, void* out, float* scratch) {
  const int64_t g = nh / kvh, L = pos + t, rows = g * t;
  float* qr = scratch;                  // [t][nh][hd] rotated queries
  float* xf = qr + t * nh * hd;         // [hd] one loaded row
  float* cs = xf + hd;                  // [2 * hd] cos, sin of one token
  float* sc = cs + 2 * hd;              // [rows][L] scores / probabilities
  float* acc = sc + rows * L;           // [rows][hd]
  const size_t es = d16 ? 2 : 4;
  auto at = [es](const void* p, int64_t i) { return static_cast<const char*>(p) + i * int64_t(es); };
  auto atw = [es](void* p, int64_t i) { return static_cast<char*>(p) + i * int64_t(es); };
  for (int64_t i = 0; i < t; ++i) {
    load_row(at(cos, i * hd), hd, d16, cs);
    load_row(at(sin, i * hd), hd, d16, cs + hd);
    float kr[512];
    for (int64_t h = 0; h < kvh; ++h) {
      load_row(at(k, i * ks + h * hd), hd, d16, xf);
      rope_head(xf, cs, cs + hd, hd, d16, kr);
      void* kd = atw(Kc, (h * Lmax + pos + i) * hd);
      for (int64_t e = 0; e < hd; ++e) st(kd, e, d16, kr[e]);
      std::memcpy(atw(Vc, (h * Lmax + pos + i) * hd), at(v, i * vs + h * hd), size_t(hd) * es);
    }
    for (int64_t h = 0; h < nh; ++h) {
      load_row(at(q, i * qs + h * hd), hd, d16, xf);
      rope_head(xf, cs, cs + hd, hd, d16, qr + (i * nh + h) * hd);
    }
  }
  for (int64_t h = 0; h < kvh; ++h) {
    // row r = (i, a): token i, query head h * g + a; it sees keys [0, pos + i].
    for (int64_t j = 0; j < L; ++j) {
      load_row(at(Kc, (h * Lmax + j) * hd), hd, d16, xf);
      for (int64_t i = 0; i < t; ++i) {
        if (j > pos + i) continue;
        for (int64_t a = 0; a < g; ++a) {
          const float* qv = qr + (i * nh + h * g + a) * hd;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t e = 0; e < hd; ++e) dot += qv[e] * xf[e];
          sc[(i * g + a) * L + j] = dot * scale;
        }
      }
    }
    float sums[512];
    for (int64_t i = 0; i < t; ++i) {
      const int64_t n = pos + i + 1;
      for (int64_t a = 0; a < g; ++a) {
        float* s = sc + (i * g + a) * L;
        float m = s[0];
        for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          const float p = exp_f(s[j] - m);
          sum += p;
          s[j] = p;
        }
        if (d16)
          for (int64_t j = 0; j < n; ++j) s[j] = R(s[j], true);
        sums[i * g + a] = sum;
      }
    }
    std::fill(acc, acc + rows * hd, 0.f);
    for (int64_t j = 0; j < L; ++j) {
      load_row(at(Vc, (h * Lmax + j) * hd), hd, d16, xf);
      for (int64_t i = 0; i < t; ++i) {
        if (j > pos + i) continue;
        for (int64_t a = 0; a < g; ++a) {
          const float p = sc[(i * g + a) * L + j];
          float* ac = acc + (i * g + a) * hd;
#pragma omp simd
          for (int64_t e = 0; e < hd; ++e) ac[e] += p * xf[e];
        }
      }
    }
    for (int64_t i = 0; i < t; ++i)
      for (int64_t a = 0; a < g; ++a) {
        const float inv = 1.0f / sums[i * g + a];
        const float* ac = acc + (i * g + a) * hd;
        void* o = atw(out, i * nh * hd + (h * g + a) * hd);
        for (int64_t e = 0; e < hd; ++e) st(o, e, d16, ac[e] * inv);
      }
  }
}

}  // namespace dec
