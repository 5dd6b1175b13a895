// Nearest-centroid search for k-means and the VPTQ sweep (included by kernels_body.h, so compiled once per
// instruction-set level). Brute force over the whole codebook, which a SIMD loop does faster than a k-d tree at the
// sizes VPTQ uses (d <= 16, k <= 65536): each centroid's ||c||² - 2 x·c is one FMA per dimension, four queries share
// every codebook load, and the running minimum and its index stay in registers.
//
// CT [d][kp] is the codebook transposed (kp a multiple of 8), csq [kp] its squared norms, +inf in the padding, so
// padded centroids are never picked. Ties (equal distances) go to the lowest index, as torch.argmin's.

namespace srch {

// The lowest index among the lanes holding the smallest value.
static VN_FI int64_t first_min(const float* val, const int32_t* idx, int lanes) {
  float m = val[0];
  int64_t best = idx[0];
  for (int l = 1; l < lanes; ++l)
    if (val[l] < m || (val[l] == m && idx[l] < best)) {
      m = val[l];
      best = idx[l];
    }
  return best;
}

#if VN_LEVEL >= 1
// Queries i .. i + Q - 1, vectors of D dimensions.
template <int Q, int D>
static void near_block(const float* X, const float* CT, const float* csq, int64_t kp, int64_t i, int64_t* out) {
  constexpr int64_t d = D;
  alignas(32) float xm2[Q][16];
  for (int q = 0; q < Q; ++q)
    for (int64_t t = 0; t < d; ++t) xm2[q][t] = -2.0f * X[(i + q) * d + t];
  __m256 best[Q];
  __m256i bidx[Q];
  for (int q = 0; q < Q; ++q) {
    best[q] = _mm256_set1_ps(__builtin_inff());
    bidx[q] = _mm256_setzero_si256();
  }
  __m256i cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  for (int64_t c = 0; c < kp; c += 8) {
    __m256 acc[Q];
    const __m256 s = _mm256_loadu_ps(csq + c);
    for (int q = 0; q < Q; ++q) acc[q] = s;
    VN_UNROLL for (int t = 0; t < D; ++t) {
      const __m256 w = _mm256_loadu_ps(CT + t * kp + c);
      VN_UNROLL for (int q = 0; q < Q; ++q) acc[q] = _mm256_fmadd_ps(_mm256_broadcast_ss(&xm2[q][t]), w, acc[q]);
    }
    for (int q = 0; q < Q; ++q) {
      const __m256 lt = _mm256_cmp_ps(acc[q], best[q], _CMP_LT_OQ);
      best[q] = _mm256_blendv_ps(best[q], acc[q], lt);
      bidx[q] = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(bidx[q]), _mm256_castsi256_ps(cur), lt));
    }
    cur = _mm256_add_epi32(cur, step);
  }
  for (int q = 0; q < Q; ++q) {
    alignas(32) float v[8];
    alignas(32) int32_t ix[8];
    _mm256_store_ps(v, best[q]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ix), bidx[q]);
    out[i + q] = first_min(v, ix, 8);
  }
}

template <int D>
static void near_rows(const float* X, const float* CT, const float* csq, int64_t kp, int64_t q0, int64_t q1,
                      int64_t* out) {
  int64_t i = q0;
  for (; i + 4 <= q1; i += 4) near_block<4, D>(X, CT, csq, kp, i, out);
  for (; i < q1; ++i) near_block<1, D>(X, CT, csq, kp, i, out);
}
#endif

static void nearest(const float* X, int64_t d, const float* CT, const float* csq, int64_t kp, int64_t q0,
                    int64_t q1, int64_t* out) {
#if VN_LEVEL >= 1
  using Fn = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t*);
  static const Fn fns[16] = {&near_rows<1>,  &near_rows<2>,  &near_rows<3>,  &near_rows<4>,
                             &near_rows<5>,  &near_rows<6>,  &near_rows<7>,  &near_rows<8>,
                             &near_rows<9>,  &near_rows<10>, &near_rows<11>, &near_rows<12>,
                             &near_rows<13>, &near_rows<14>, &near_rows<15>, &near_rows<16>};
  fns[d - 1](X, CT, csq, kp, q0, q1, out);
#else
  for (int64_t i = q0; i < q1; ++i) {
    float m = __builtin_inff();
    int64_t best = 0;
    for (int64_t c = 0; c < kp; ++c) {
      float a = csq[c];
      for (int64_t t = 0; t < d; ++t) a += -2.0f * X[i * d + t] * CT[t * kp + c];
      if (a < m) {
        m = a;
        best = c;
      }
    }
    out[i] = best;
  }
#endif
}

}  // namespace srch
