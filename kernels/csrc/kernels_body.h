// Kernel bodies, compiled once per instruction-set level. The including translation unit defines
//   VN_LEVEL  0 (plain C++), 1 (AVX2 + FMA) or 2 (AVX-512 F/BW/VL/DQ + BF16)
//   VN_NS     the namespace of this level,
// and sets the matching `#pragma GCC target` before including this file (after all system headers).
#include "common.h"

#if VN_LEVEL >= 1
#include <immintrin.h>
#endif
#include <cstring>
#include <algorithm>
#include <type_traits>

#define VN_FI __attribute__((always_inline)) inline
#define VN_UNROLL _Pragma("GCC unroll 16")

namespace vptq_native {
namespace VN_NS {

using std::int64_t;
using std::uint16_t;
using std::uint32_t;

static VN_FI float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static VN_FI uint16_t f32_to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <typename P>
static VN_FI P* opaque(P* p) {  // keeps GCC from re-splitting a hoisted base pointer into base + offset
  asm("" : "+r"(p));
  return p;
}

// ------------------------------------------------------------------------------------------ vector traits
// VT<VP>: one centroid (VP fp32 lanes). T = value, B = broadcast scalar.
template <int VP>
struct VT;

#if VN_LEVEL == 0
template <int VP>
struct VT {
  struct T {
    float a[VP];
  };
  using B = float;
  static VN_FI T zero() {
    T r;
    VN_UNROLL for (int i = 0; i < VP; ++i) r.a[i] = 0.f;
    return r;
  }
  static VN_FI B bc(float x) { return x; }
  static VN_FI T bcv(B x) {
    T r;
    VN_UNROLL for (int i = 0; i < VP; ++i) r.a[i] = x;
    return r;
  }
  static VN_FI T ld32(const float* p) {
    T r;
    VN_UNROLL for (int i = 0; i < VP; ++i) r.a[i] = p[i];
    return r;
  }
  static VN_FI T ld16(const uint16_t* p) {
    T r;
    VN_UNROLL for (int i = 0; i < VP; ++i) r.a[i] = bf16_to_f32(p[i]);
    return r;
  }
  static VN_FI T fma(T a, B b, T c) {
    VN_UNROLL for (int i = 0; i < VP; ++i) c.a[i] += a.a[i] * b;
    return c;
  }
  static VN_FI T add(T a, T b) {
    VN_UNROLL for (int i = 0; i < VP; ++i) a.a[i] += b.a[i];
    return a;
  }
  static VN_FI void st(float* p, T a) { VN_UNROLL for (int i = 0; i < VP; ++i) p[i] = a.a[i]; }
  static VN_FI void stn(float* p, T a, int n) {
    for (int i = 0; i < n; ++i) p[i] = a.a[i];
  }
  static VN_FI void st16(uint16_t* p, T a) { VN_UNROLL for (int i = 0; i < VP; ++i) p[i] = f32_to_bf16(a.a[i]); }
};
#else
// bf16 -> fp32 of 8 lanes from 16 bytes: broadcast the 16 bytes to both 128-bit halves, then move word i
// into the high half of dword i with one byte shuffle.
static VN_FI __m256 cvt8_bf16(const uint16_t* p) {
  const __m256i ctl = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7, -1, -1, 8, 9, -1, -1,
                                       10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
  __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_shuffle_epi8(v, ctl));
}
static VN_FI __m128i rnd_bf16_epi32(__m128i u) {  // fp32 bits -> bf16 bits in the low half of each dword
  __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
  return _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)), lsb), 16);
}
static VN_FI __m256i rnd_bf16_epi32(__m256i u) {
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
}
static VN_FI void st8_bf16(uint16_t* p, __m256 a) {
#if VN_LEVEL >= 2
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), (__m128i)_mm256_cvtneps_pbh(a));
#else
  __m256i r = rnd_bf16_epi32(_mm256_castps_si256(a));
  __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(lo, hi));
#endif
}
static VN_FI void st4_bf16(uint16_t* p, __m128 a) {
#if VN_LEVEL >= 2
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), (__m128i)_mm_cvtneps_pbh(a));
#else
  __m128i r = rnd_bf16_epi32(_mm_castps_si128(a));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(r, r));
#endif
}

template <>
struct VT<4> {
  using T = __m128;
  using B = __m128;
  static VN_FI T zero() { return _mm_setzero_ps(); }
  static VN_FI B bc(float x) { return _mm_set1_ps(x); }
  static VN_FI T bcv(B x) { return x; }
  static VN_FI T ld32(const float* p) { return _mm_loadu_ps(p); }
  static VN_FI T ld16(const uint16_t* p) {  // word i -> the high half of dword i: one load, one unpack
    return _mm_castsi128_ps(
        _mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static VN_FI T fma(T a, B b, T c) { return _mm_fmadd_ps(a, b, c); }
  static VN_FI T add(T a, T b) { return _mm_add_ps(a, b); }
  static VN_FI void st(float* p, T a) { _mm_storeu_ps(p, a); }
  static VN_FI void stn(float* p, T a, int n) {
#if VN_LEVEL >= 2
    _mm_mask_storeu_ps(p, __mmask8((1u << n) - 1u), a);
#else
    __m128i m = _mm_cmpgt_epi32(_mm_set1_epi32(n), _mm_setr_epi32(0, 1, 2, 3));
    _mm_maskstore_ps(p, m, a);
#endif
  }
  static VN_FI void st16(uint16_t* p, T a) { st4_bf16(p, a); }
};

template <>
struct VT<8> {
  using T = __m256;
  using B = __m256;
  static VN_FI T zero() { return _mm256_setzero_ps(); }
  static VN_FI B bc(float x) { return _mm256_set1_ps(x); }
  static VN_FI T bcv(B x) { return x; }
  static VN_FI T ld32(const float* p) { return _mm256_loadu_ps(p); }
  static VN_FI T ld16(const uint16_t* p) { return cvt8_bf16(p); }
  static VN_FI T fma(T a, B b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static VN_FI T add(T a, T b) { return _mm256_add_ps(a, b); }
  static VN_FI void st(float* p, T a) { _mm256_storeu_ps(p, a); }
  static VN_FI void stn(float* p, T a, int n) {
#if VN_LEVEL >= 2
    _mm256_mask_storeu_ps(p, __mmask8((1u << n) - 1u), a);
#else
    __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_ps(p, m, a);
#endif
  }
  static VN_FI void st16(uint16_t* p, T a) { st8_bf16(p, a); }
};

#if VN_LEVEL >= 2
template <>
struct VT<16> {
  using T = __m512;
  using B = __m512;
  static VN_FI T zero() { return _mm512_setzero_ps(); }
  static VN_FI B bc(float x) { return _mm512_set1_ps(x); }
  static VN_FI T bcv(B x) { return x; }
  static VN_FI T ld32(const float* p) { return _mm512_loadu_ps(p); }
  static VN_FI T ld16(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static VN_FI T fma(T a, B b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static VN_FI T add(T a, T b) { return _mm512_add_ps(a, b); }
  static VN_FI void st(float* p, T a) { _mm512_storeu_ps(p, a); }
  static VN_FI void stn(float* p, T a, int n) { _mm512_mask_storeu_ps(p, __mmask16((1u << n) - 1u), a); }
  static VN_FI void st16(uint16_t* p, T a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(a));
  }
};
#else
template <>
struct VT<16> {
  struct T {
    __m256 a, b;
  };
  using B = __m256;
  static VN_FI T zero() { return T{_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static VN_FI B bc(float x) { return _mm256_set1_ps(x); }
  static VN_FI T bcv(B x) { return T{x, x}; }
  static VN_FI T ld32(const float* p) { return T{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static VN_FI T ld16(const uint16_t* p) { return T{cvt8_bf16(p), cvt8_bf16(p + 8)}; }
  static VN_FI T fma(T a, B b, T c) { return T{_mm256_fmadd_ps(a.a, b, c.a), _mm256_fmadd_ps(a.b, b, c.b)}; }
  static VN_FI T add(T a, T b) { return T{_mm256_add_ps(a.a, b.a), _mm256_add_ps(a.b, b.b)}; }
  static VN_FI void st(float* p, T a) {
    _mm256_storeu_ps(p, a.a);
    _mm256_storeu_ps(p + 8, a.b);
  }
  static VN_FI void stn(float* p, T a, int n) {
    if (n >= 8) {
      _mm256_storeu_ps(p, a.a);
      VT<8>::stn(p + 8, a.b, n - 8);
    } else {
      VT<8>::stn(p, a.a, n);
    }
  }
  static VN_FI void st16(uint16_t* p, T a) {
    st8_bf16(p, a.a);
    st8_bf16(p + 8, a.b);
  }
};
#endif
#endif  // VN_LEVEL

// ------------------------------------------------------------------------------------------ VQ GEMV
// Rows per call for a token tile TT (register budget: NR * TT accumulators).
template <int VP, int TT>
constexpr int vq_nr() {
#if VN_LEVEL >= 2
  return TT == 1 ? 16 : (TT == 2 ? 8 : 4);  // 16 = two index blocks per call
#elif VN_LEVEL == 1
  return VP == 16 ? (TT == 1 ? 4 : (TT == 2 ? 2 : 1)) : (TT == 1 ? 8 : (TT == 2 ? 4 : 2));
#else
  return TT == 1 ? 4 : 2;
#endif
}

// The GEMV's codebook (bf16 when C16, else fp32) and one centroid of it as fp32 lanes.
template <bool C16>
static VN_FI auto codebook(const uint16_t* cb16, const float* cb32) {
  if constexpr (C16)
    return cb16;
  else
    return cb32;
}
template <int VP>
static VN_FI typename VT<VP>::T ld_centroid(const uint16_t* p) {
  return VT<VP>::ld16(p);
}
template <int VP>
static VN_FI typename VT<VP>::T ld_centroid(const float* p) {
  return VT<VP>::ld32(p);
}

// Entry -> element offset of its centroid: uint8 entries hold the code, wider ones the offset itself.
template <int VP, typename IT>
static VN_FI int64_t eoff(IT e) {
  if constexpr (sizeof(IT) == 1)
    return int64_t(e) * VP;
  else
    return int64_t(e);
}

// NR rows (rb*8 + roff ..) x TT tokens (t0 ..) over all groups of the main columns. NR = 16 reads blocks rb
// and rb + 1 (the second only when rb + 1 < rb_end).
template <int VP, int TT, bool C16, typename IT, bool RES, bool ONE = false>
static void vq_rows(const VQArgs& A, const VQCall& C, int64_t rb, int roff, int64_t t0, int64_t rb_end) {
  constexpr int NR = ONE ? NR_LAYOUT : vq_nr<VP, TT>();  // ONE: the 8 rows of one block (an odd last block)
  const bool has2 = NR > NR_LAYOUT && rb + 1 < rb_end;
  using W = VT<VP>;
  using T = typename W::T;
  T acc[NR][TT];
  VN_UNROLL for (int r = 0; r < NR; ++r) VN_UNROLL for (int t = 0; t < TT; ++t) acc[r][t] = W::zero();
  const int64_t gs = A.gs, xs = C.xs;
  for (int64_t g = 0; g < A.G; ++g) {
    const int64_t base = ((g * A.RB + rb) * gs) * NR_LAYOUT + roff;
    const IT* p = static_cast<const IT*>(A.idx) + base;
    const IT* q = RES ? static_cast<const IT*>(A.ridx) + base : p;
    // p2[r] (r >= 8) = row r - 8 of block rb + 1, or a repeat of rows 0..7 when there is no second block
    const int64_t d2 = has2 ? gs * NR_LAYOUT - NR_LAYOUT : -NR_LAYOUT;
    const float* xg = C.xq + (A.osz + g * gs) * xs + t0;
    const auto* cb = opaque(codebook<C16>(A.cb16, A.cb32) + g * A.cb_gs);
    const auto* rcb = RES ? opaque(codebook<C16>(A.rcb16, A.rcb32) + g * A.rcb_gs) : cb;
    const IT* p2 = p + d2;
    const IT* q2 = q + d2;
    // Software prefetch of the index streams (C.prefetch bytes ahead, once per 64-byte line): without it the
    // streams ran at a fraction of memory speed once a decode step's layers no longer fit the last-level cache.
    const int64_t pf = C.prefetch;
    constexpr int64_t kLineCols = 64 / int64_t(NR_LAYOUT * sizeof(IT));  // columns per 64-byte line
    for (int64_t c = 0; c < gs; ++c) {
      if (pf > 0 && (c % kLineCols) == 0) {
        __builtin_prefetch(reinterpret_cast<const char*>(p) + pf, 0, 3);
        if (NR > NR_LAYOUT) __builtin_prefetch(reinterpret_cast<const char*>(p2) + pf, 0, 3);
        if (RES) {
          __builtin_prefetch(reinterpret_cast<const char*>(q) + pf, 0, 3);
          if (NR > NR_LAYOUT) __builtin_prefetch(reinterpret_cast<const char*>(q2) + pf, 0, 3);
        }
      }
      typename W::B xb[TT];
      VN_UNROLL for (int t = 0; t < TT; ++t) xb[t] = W::bc(xg[t]);
      VN_UNROLL for (int r = 0; r < NR; ++r) {
        T w = ld_centroid<VP>(cb + eoff<VP>(r < NR_LAYOUT ? p[r] : p2[r]));
        if (RES) w = W::add(w, ld_centroid<VP>(rcb + eoff<VP>(r < NR_LAYOUT ? q[r] : q2[r])));
        VN_UNROLL for (int t = 0; t < TT; ++t) acc[r][t] = W::fma(w, xb[t], acc[r][t]);
      }
      p += NR_LAYOUT;
      p2 += NR_LAYOUT;
      if (RES) {
        q += NR_LAYOUT;
        q2 += NR_LAYOUT;
      }
      xg += xs;
    }
  }
  const int64_t v = A.v;
  VN_UNROLL for (int t = 0; t < TT; ++t) {
    float* yrow = C.y + (t0 + t) * C.ys;
    VN_UNROLL for (int r = 0; r < NR; ++r) {
      const int64_t row = rb * NR_LAYOUT + roff + r;
      if (row >= A.R || (r >= NR_LAYOUT && !has2)) break;
      const int64_t o = row * v;
      if (r == NR - 1 || row == A.R - 1 || (r == NR_LAYOUT - 1 && !has2))
        W::stn(yrow + o, acc[r][t], int(std::min<int64_t>(v, A.out - o)));
      else
        W::st(yrow + o, acc[r][t]);  // the spill past v lanes is overwritten by the next row
    }
  }
}

#if VN_LEVEL >= 2
// AVX-512, VP 4 or 8, 2..8 tokens: G = 16 / VP tokens share one zmm (the centroid broadcast to every
// 128/256-bit part, the tokens' x in the parts), so one codebook load feeds S = ceil(nt / G) FMAs of 16 lanes.
template <int VP, int S>
constexpr int pk_nr() {
  return S <= 2 ? 8 : 4;
}

template <int VP, int S, bool RES>
static void vq_rows_pk(const VQArgs& A, const VQCall& C, int64_t rb, int roff, int64_t t0, int64_t nt) {
  constexpr int G = 16 / VP;
  constexpr int NR = pk_nr<VP, S>();
  __m512 acc[NR][S];
  VN_UNROLL for (int r = 0; r < NR; ++r) VN_UNROLL for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
  __m512i sel[S];
  VN_UNROLL for (int s = 0; s < S; ++s) {
    alignas(64) int32_t lanes[16];
    for (int l = 0; l < 16; ++l) lanes[l] = s * G + l / VP;
    sel[s] = _mm512_load_si512(lanes);
  }
  const int64_t gs = A.gs, xs = C.xs;
  for (int64_t g = 0; g < A.G; ++g) {
    const int64_t base = ((g * A.RB + rb) * gs) * NR_LAYOUT + roff;
    const uint16_t* p = static_cast<const uint16_t*>(A.idx) + base;  // pair kernels: uint16 offsets only
    const uint16_t* q = RES ? static_cast<const uint16_t*>(A.ridx) + base : p;
    const float* cb = opaque(A.cb32 + g * A.cb_gs);
    const float* rcb = RES ? opaque(A.rcb32 + g * A.rcb_gs) : cb;
    const float* xg = C.xq + (A.osz + g * gs) * xs + t0;
    for (int64_t c = 0; c < gs; ++c) {
      // x of tokens t0 .. t0 + 7 (lanes past nt belong to the next column: they only reach unused slots)
      const __m512 xr = _mm512_castps256_ps512(_mm256_loadu_ps(xg));
      __m512 xb[S];
      VN_UNROLL for (int s = 0; s < S; ++s) xb[s] = _mm512_permutexvar_ps(sel[s], xr);
      VN_UNROLL for (int r = 0; r < NR; ++r) {
        __m512 w = VP == 8 ? _mm512_broadcast_f32x8(_mm256_loadu_ps(cb + p[r]))
                           : _mm512_broadcast_f32x4(_mm_loadu_ps(cb + p[r]));
        if (RES)
          w = _mm512_add_ps(w, VP == 8 ? _mm512_broadcast_f32x8(_mm256_loadu_ps(rcb + q[r]))
                                       : _mm512_broadcast_f32x4(_mm_loadu_ps(rcb + q[r])));
        VN_UNROLL for (int s = 0; s < S; ++s) acc[r][s] = _mm512_fmadd_ps(w, xb[s], acc[r][s]);
      }
      p += NR_LAYOUT;
      if (RES) q += NR_LAYOUT;
      xg += xs;
    }
  }
  const int64_t v = A.v;
  alignas(64) float tmp[16];
  VN_UNROLL for (int s = 0; s < S; ++s) {
    VN_UNROLL for (int r = 0; r < NR; ++r) {
      const int64_t row = rb * NR_LAYOUT + roff + r;
      if (row >= A.R) break;
      const int64_t o = row * v;
      const int n = int(std::min<int64_t>(v, A.out - o));
      _mm512_store_ps(tmp, acc[r][s]);
      for (int l = 0; l < G; ++l) {
        const int64_t t = s * G + l;
        if (t >= nt) break;
        float* dst = C.y + (t0 + t) * C.ys + o;
        if (VP == 8) {
          const __m256 part = _mm256_load_ps(tmp + 8 * l);
          if (r == NR - 1 || row == A.R - 1)
            _mm256_mask_storeu_ps(dst, __mmask8((1u << n) - 1u), part);
          else
            _mm256_storeu_ps(dst, part);
        } else {
          const __m128 part = _mm_load_ps(tmp + 4 * l);
          if (r == NR - 1 || row == A.R - 1)
            _mm_mask_storeu_ps(dst, __mmask8((1u << n) - 1u), part);
          else
            _mm_storeu_ps(dst, part);
        }
      }
    }
  }
}

using PkFn = void (*)(const VQArgs&, const VQCall&, int64_t, int, int64_t, int64_t);
template <int VP, int S>
static PkFn pick_pk2(bool res) {
  return res ? &vq_rows_pk<VP, S, true> : &vq_rows_pk<VP, S, false>;
}
static PkFn pick_pk(int vp, int s, bool res, int* nr) {
  if (vp == 8) {
    switch (s) {
      case 1: *nr = pk_nr<8, 1>(); return pick_pk2<8, 1>(res);
      case 2: *nr = pk_nr<8, 2>(); return pick_pk2<8, 2>(res);
      case 3: *nr = pk_nr<8, 3>(); return pick_pk2<8, 3>(res);
      default: *nr = pk_nr<8, 4>(); return pick_pk2<8, 4>(res);
    }
  }
  if (s == 1) {
    *nr = pk_nr<4, 1>();
    return pick_pk2<4, 1>(res);
  }
  *nr = pk_nr<4, 2>();
  return pick_pk2<4, 2>(res);
}
#endif

using RowsFn = void (*)(const VQArgs&, const VQCall&, int64_t, int, int64_t, int64_t);

template <int VP, int TT, bool C16, typename IT>
static RowsFn pick_rows3(bool res, bool one) {
  if constexpr (vq_nr<VP, TT>() > NR_LAYOUT) {
    if (one) return res ? &vq_rows<VP, TT, C16, IT, true, true> : &vq_rows<VP, TT, C16, IT, false, true>;
  }
  return res ? &vq_rows<VP, TT, C16, IT, true> : &vq_rows<VP, TT, C16, IT, false>;
}
// iw: bytes per index entry (1, 2 or 4)
template <int VP, int TT, bool C16>
static RowsFn pick_rows_it(int iw, bool res, bool one) {
  if (iw == 4) return pick_rows3<VP, TT, C16, uint32_t>(res, one);
  if (iw == 1) return pick_rows3<VP, TT, C16, uint8_t>(res, one);
  return pick_rows3<VP, TT, C16, uint16_t>(res, one);
}
template <int VP, int TT>
static RowsFn pick_rows2(bool c16, int iw, bool res, bool one) {
  return c16 ? pick_rows_it<VP, TT, true>(iw, res, one) : pick_rows_it<VP, TT, false>(iw, res, one);
}
template <int VP>
static RowsFn pick_rows1(int tt, bool c16, int iw, bool res, bool one) {
  switch (tt) {
    case 1: return pick_rows2<VP, 1>(c16, iw, res, one);
    case 2: return pick_rows2<VP, 2>(c16, iw, res, one);
    default: return pick_rows2<VP, 4>(c16, iw, res, one);
  }
}
static int index_width(const VQArgs& A) { return A.idx8 ? 1 : (A.idx32 ? 4 : 2); }
static RowsFn pick_rows(int vp, int tt, bool c16, int iw, bool res, bool one = false) {
  switch (vp) {
    case 4: return pick_rows1<4>(tt, c16, iw, res, one);
    case 8: return pick_rows1<8>(tt, c16, iw, res, one);
    default: return pick_rows1<16>(tt, c16, iw, res, one);
  }
}
static int rows_per_call(int vp, int tt) {
  switch (vp) {
    case 4: return tt == 1 ? vq_nr<4, 1>() : (tt == 2 ? vq_nr<4, 2>() : vq_nr<4, 4>());
    case 8: return tt == 1 ? vq_nr<8, 1>() : (tt == 2 ? vq_nr<8, 2>() : vq_nr<8, 4>());
    default: return tt == 1 ? vq_nr<16, 1>() : (tt == 2 ? vq_nr<16, 2>() : vq_nr<16, 4>());
  }
}

// Reads one byte of every cache line of a codebook before the gather loop. In a decode step each layer's codebook
// was evicted from this core's caches since the last token; the gathers would bring it back one random line at a
// time with little overlap, while this loop's independent loads overlap as far as the core allows (prefetch
// instructions did not help here: most of a burst of them is dropped). -13% at 576x576 2-bit in a cold sequence
// of layers, 1 thread, Zen 3. native.cpp skips it for a layer called again right after itself.
static VN_FI void touch_lines(const void* p, int64_t bytes) {
  const volatile uint8_t* c = static_cast<const volatile uint8_t*>(p);
  for (int64_t i = 0; i < bytes; i += 64) (void)c[i];
}

static void vq_main(const VQArgs& A, const VQCall& C, int64_t rb0, int64_t rb1, int64_t t0, int64_t nt) {
  if (C.touch_codebooks) {
    const int64_t es = C.use_cb16 ? 2 : 4;
    touch_lines(C.use_cb16 ? static_cast<const void*>(A.cb16) : A.cb32, A.G * A.cb_gs * es);
    if (A.res) touch_lines(C.use_cb16 ? static_cast<const void*>(A.rcb16) : A.rcb32, A.G * A.rcb_gs * es);
  }
#if VN_LEVEL >= 2
  if (nt >= 2 && nt <= 8 && A.vp <= 8 && !A.idx32 && !A.idx8) {  // pair kernels: uint16 offsets only
    int nr = 8;
    const int G = int(16 / A.vp);
    PkFn fn = pick_pk(int(A.vp), int((nt + G - 1) / G), A.res, &nr);
    for (int64_t rb = rb0; rb < rb1; ++rb)
      for (int roff = 0; roff < NR_LAYOUT; roff += nr) {
        if (rb * NR_LAYOUT + roff >= A.R) break;
        fn(A, C, rb, roff, t0, nt);
      }
    return;
  }
#endif
  // token passes of 4, 2, 1
  int64_t passes[8][2];
  int np = 0;
  for (int64_t t = 0; t < nt;) {
    int64_t left = nt - t, tt = left >= 4 ? 4 : (left >= 2 ? 2 : 1);
    passes[np][0] = t0 + t;
    passes[np][1] = tt;
    ++np;
    t += tt;
  }
  RowsFn fns[8], fns1[8];  // fns1: one block's rows, for an odd last block of the two-block kernels
  int nrs[8];
  for (int i = 0; i < np; ++i) {
    fns[i] = pick_rows(int(A.vp), int(passes[i][1]), C.use_cb16, index_width(A), A.res);
    fns1[i] = pick_rows(int(A.vp), int(passes[i][1]), C.use_cb16, index_width(A), A.res, true);
    nrs[i] = rows_per_call(int(A.vp), int(passes[i][1]));
  }
  for (int64_t rb = rb0; rb < rb1; ++rb) {
    for (int i = 0; i < np; ++i) {
      if (nrs[i] > NR_LAYOUT) {  // two blocks per call: even block offsets only
        if ((rb - rb0) % 2 == 0) (rb + 1 < rb1 ? fns[i] : fns1[i])(A, C, rb, 0, passes[i][0], rb1);
        continue;
      }
      for (int roff = 0; roff < NR_LAYOUT; roff += nrs[i]) {
        if (rb * NR_LAYOUT + roff >= A.R) break;
        fns[i](A, C, rb, roff, passes[i][0], rb1);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------ outliers
// Up to 4 outlier rows ro0.. (fp32 codebook), TT tokens; adds into y for outputs in [o0, o1).
template <int VP, int TT, typename IT>
static void vq_orows(const VQArgs& A, const VQCall& C, int64_t ro0, int nrows, int64_t o0, int64_t o1,
                     int64_t t0) {
  constexpr int NR = 4;
  using W = VT<VP>;
  using T = typename W::T;
  T acc[NR][TT];
  VN_UNROLL for (int r = 0; r < NR; ++r) VN_UNROLL for (int t = 0; t < TT; ++t) acc[r][t] = W::zero();
  const IT* rows[NR];
  VN_UNROLL for (int r = 0; r < NR; ++r) {
    int64_t ro = std::min<int64_t>(ro0 + r, A.Ro - 1);
    rows[r] = static_cast<const IT*>(A.oidx) + ro * A.osz;
  }
  const float* cb = A.ocb32;
  const float* xg = C.xq + t0;
  for (int64_t c = 0; c < A.osz; ++c) {
    typename W::B xb[TT];
    VN_UNROLL for (int t = 0; t < TT; ++t) xb[t] = W::bc(xg[t]);
    VN_UNROLL for (int r = 0; r < NR; ++r) {
      T w = W::ld32(cb + rows[r][c]);
      VN_UNROLL for (int t = 0; t < TT; ++t) acc[r][t] = W::fma(w, xb[t], acc[r][t]);
    }
    xg += C.xs;
  }
  alignas(64) float tmp[16];
  for (int t = 0; t < TT; ++t) {
    float* yrow = C.y + (t0 + t) * C.ys;
    for (int r = 0; r < nrows; ++r) {
      W::st(tmp, acc[r][t]);
      const int64_t o = (ro0 + r) * A.vo;
      const int64_t lo = std::max<int64_t>(o, o0), hi = std::min<int64_t>(o + A.vo, o1);
      for (int64_t i = lo; i < hi; ++i) yrow[i] += tmp[i - o];
    }
  }
}

using ORowsFn = void (*)(const VQArgs&, const VQCall&, int64_t, int, int64_t, int64_t, int64_t);
template <int VP, typename IT>
static ORowsFn pick_orows2(int tt) {
  switch (tt) {
    case 1: return &vq_orows<VP, 1, IT>;
    case 2: return &vq_orows<VP, 2, IT>;
    default: return &vq_orows<VP, 4, IT>;
  }
}
template <int VP>
static ORowsFn pick_orows1(int tt, bool i32) {
  return i32 ? pick_orows2<VP, uint32_t>(tt) : pick_orows2<VP, uint16_t>(tt);
}

static void vq_outliers(const VQArgs& A, const VQCall& C, int64_t o0, int64_t o1, int64_t t0, int64_t nt) {
  if (A.osz <= 0 || o1 <= o0) return;
  const int64_t ro_begin = o0 / A.vo, ro_end = std::min<int64_t>(A.Ro, (o1 + A.vo - 1) / A.vo);
  for (int64_t t = 0; t < nt;) {
    int64_t left = nt - t, tt = left >= 4 ? 4 : (left >= 2 ? 2 : 1);
    ORowsFn fn;
    switch (A.vpo) {
      case 4: fn = pick_orows1<4>(int(tt), A.oidx32 != 0); break;
      case 8: fn = pick_orows1<8>(int(tt), A.oidx32 != 0); break;
      default: fn = pick_orows1<16>(int(tt), A.oidx32 != 0); break;
    }
    for (int64_t ro = ro_begin; ro < ro_end; ro += 4)
      fn(A, C, ro, int(std::min<int64_t>(4, ro_end - ro)), o0, o1, t0 + t);
    t += tt;
  }
}

// ------------------------------------------------------------------------------------------ VQ dequant
template <int VP, typename IT, bool RES, bool OUT16, bool NORM>
static void vq_deq(const VQArgs& A, int64_t rb0, int64_t rb1, int64_t c0, int64_t c1, const int32_t* rowmap,
                   void* Tv, int64_t ldt) {
  using W = VT<VP>;
  using E = typename std::conditional<OUT16, uint16_t, float>::type;
  const int64_t v = A.v, gs = A.gs, bstride = gs * NR_LAYOUT;
  E* T = static_cast<E*>(Tv);
  for (int64_t g = 0; g < A.G; ++g) {
    const int64_t gc0 = A.osz + g * gs;
    const int64_t jlo = std::max<int64_t>(c0 - gc0, 0), jhi = std::min<int64_t>(c1 - gc0, gs);
    if (jlo >= jhi) continue;
    const IT* pg = static_cast<const IT*>(A.idx) + (g * A.RB * gs) * NR_LAYOUT + rb0 * bstride;
    const IT* qg = RES ? static_cast<const IT*>(A.ridx) + (g * A.RB * gs) * NR_LAYOUT + rb0 * bstride : pg;
    const E* cb = opaque(codebook<OUT16>(A.cb16, A.cb32) + g * A.cb_gs);
    const E* rcb = RES ? opaque(codebook<OUT16>(A.rcb16, A.rcb32) + g * A.rcb_gs) : cb;
    for (int64_t j = jlo; j < jhi; ++j) {
      const int64_t c = gc0 + j;
      E* d = T + (rowmap ? rowmap[c] : c - c0) * ldt;
      const IT* p = pg + j * NR_LAYOUT;
      const IT* q = qg + j * NR_LAYOUT;
      const typename W::B sv = W::bc(NORM ? A.cscale[c] : 1.f);
      const typename W::T bv = W::bcv(W::bc(NORM ? A.cbias[c] : 0.f));
      // Whole blocks: rows past R hold offset 0 and land in the tile's right margin.
      for (int64_t rb = rb0; rb < rb1; ++rb) {
        VN_UNROLL for (int r = 0; r < NR_LAYOUT; ++r) {
          E* dst = d + r * v;
          if (!RES && !NORM) {
            std::memcpy(dst, cb + eoff<VP>(p[r]), VP * sizeof(E));
          } else {
            typename W::T w = ld_centroid<VP>(cb + eoff<VP>(p[r]));
            if (RES) w = W::add(w, ld_centroid<VP>(rcb + eoff<VP>(q[r])));
            if (NORM) w = W::fma(w, sv, bv);
            if (OUT16)
              W::st16(reinterpret_cast<uint16_t*>(dst), w);
            else
              W::st(reinterpret_cast<float*>(dst), w);
          }
        }
        d += NR_LAYOUT * v;
        p += bstride;
        if (RES) q += bstride;
      }
    }
  }
}

template <int VP, typename IT, bool OUT16, bool NORM>
static void vq_odeq(const VQArgs& A, int64_t o0, int64_t o1, int64_t obase, int64_t c0, int64_t c1,
                    const int32_t* rowmap, void* Tv, int64_t ldt) {
  using W = VT<VP>;
  const int64_t ro_begin = o0 / A.vo, ro_end = std::min<int64_t>(A.Ro, (o1 + A.vo - 1) / A.vo);
  for (int64_t c = c0; c < std::min<int64_t>(c1, A.osz); ++c) {
    const int64_t dr = rowmap ? rowmap[c] : c - c0;
    float* d32 = static_cast<float*>(Tv) + dr * ldt - obase;
    uint16_t* d16 = static_cast<uint16_t*>(Tv) + dr * ldt - obase;
    typename W::B sv = W::bc(NORM ? A.cscale[c] : 1.f), bv = W::bc(NORM ? A.cbias[c] : 0.f);
    for (int64_t ro = ro_begin; ro < ro_end; ++ro) {
      const IT e = static_cast<const IT*>(A.oidx)[ro * A.osz + c];
      const int64_t o = ro * A.vo;  // o - obase >= -(vo - 1): the caller keeps a left margin
      if (!NORM) {
        if (OUT16)
          std::memcpy(d16 + o, A.ocb16 + e, VP * 2);
        else
          std::memcpy(d32 + o, A.ocb32 + e, VP * 4);
      } else {
        typename W::T w = W::fma(W::ld32(A.ocb32 + e), sv, W::bcv(bv));
        if (OUT16)
          W::st16(d16 + o, w);
        else
          W::st(d32 + o, w);
      }
    }
  }
}

template <int VP, typename IT>
static void vq_deq_pick(const VQArgs& A, int64_t rb0, int64_t rb1, int64_t c0, int64_t c1, const int32_t* rm,
                        void* T, int64_t ldt, bool bf16) {
  const bool norm = A.cscale != nullptr;
#define VN_DEQ(R, O, N) vq_deq<VP, IT, R, O, N>(A, rb0, rb1, c0, c1, rm, T, ldt)
  if (bf16) {
    if (A.res) norm ? VN_DEQ(true, true, true) : VN_DEQ(true, true, false);
    else norm ? VN_DEQ(false, true, true) : VN_DEQ(false, true, false);
  } else {
    if (A.res) norm ? VN_DEQ(true, false, true) : VN_DEQ(true, false, false);
    else norm ? VN_DEQ(false, false, true) : VN_DEQ(false, false, false);
  }
#undef VN_DEQ
}
template <int VP, typename IT>
static void vq_odeq_pick(const VQArgs& A, int64_t o0, int64_t o1, int64_t c0, int64_t c1, const int32_t* rm,
                         void* T, int64_t ldt, bool bf16) {
  const bool norm = A.cscale != nullptr;
  if (bf16)
    norm ? vq_odeq<VP, IT, true, true>(A, o0, o1, o0, c0, c1, rm, T, ldt)
         : vq_odeq<VP, IT, true, false>(A, o0, o1, o0, c0, c1, rm, T, ldt);
  else
    norm ? vq_odeq<VP, IT, false, true>(A, o0, o1, o0, c0, c1, rm, T, ldt)
         : vq_odeq<VP, IT, false, false>(A, o0, o1, o0, c0, c1, rm, T, ldt);
}

static void vq_dequant(const VQArgs& A, int64_t rb0, int64_t rb1, int64_t c0, int64_t c1, bool use_rowmap,
                       void* T, int64_t ldt, bool bf16) {
  const int iw = index_width(A);
  const int32_t* rm = use_rowmap ? A.rowmap : nullptr;
#define VN_DEQ_IT(VP)                                                                   \
  (iw == 4   ? vq_deq_pick<VP, uint32_t>(A, rb0, rb1, c0, c1, rm, T, ldt, bf16)        \
   : iw == 1 ? vq_deq_pick<VP, uint8_t>(A, rb0, rb1, c0, c1, rm, T, ldt, bf16)         \
             : vq_deq_pick<VP, uint16_t>(A, rb0, rb1, c0, c1, rm, T, ldt, bf16))
  if (c1 > A.osz) {
    switch (A.vp) {
      case 4: VN_DEQ_IT(4); break;
      case 8: VN_DEQ_IT(8); break;
      default: VN_DEQ_IT(16); break;
    }
  }
#undef VN_DEQ_IT
  if (A.osz > 0 && c0 < A.osz) {
    const int64_t o0 = rb0 * NR_LAYOUT * A.v;
    const int64_t o1 = std::min<int64_t>(A.out, std::min<int64_t>(A.R, rb1 * NR_LAYOUT) * A.v);
    const bool o32 = A.oidx32 != 0;
    switch (A.vpo) {
      case 4: o32 ? vq_odeq_pick<4, uint32_t>(A, o0, o1, c0, c1, rm, T, ldt, bf16) : vq_odeq_pick<4, uint16_t>(A, o0, o1, c0, c1, rm, T, ldt, bf16); break;
      case 8: o32 ? vq_odeq_pick<8, uint32_t>(A, o0, o1, c0, c1, rm, T, ldt, bf16) : vq_odeq_pick<8, uint16_t>(A, o0, o1, c0, c1, rm, T, ldt, bf16); break;
      default: o32 ? vq_odeq_pick<16, uint32_t>(A, o0, o1, c0, c1, rm, T, ldt, bf16) : vq_odeq_pick<16, uint16_t>(A, o0, o1, c0, c1, rm, T, ldt, bf16); break;
    }
  }
}

// ------------------------------------------------------------------------------------------ VQ -> VNNI (GEMM path)
// B[(j - j0) / 2][o - o0][(j - j0) % 2] (bf16) = W[o][j] for ORIGINAL columns j in [j0, j1) (j1 - j0 even; stored
// column c = iperm[j]) and the outputs of blocks [rb0, rb1). Pairs of main columns take the fast path (two
// centroid loads, one word interleave, two stores per row); pairs with an outlier column go lane by lane.
template <int VP, typename IT, bool RES, bool NORM>
static void vnni_pair(const VQArgs& A, int64_t ca, int64_t cb_, int64_t rb0, int64_t rb1, uint16_t* d) {
  using W = VT<VP>;
  const int64_t bstride = A.gs * NR_LAYOUT, v2 = 2 * A.v, boff = rb0 * bstride;
  const IT* pa = static_cast<const IT*>(A.idx) + A.colpos[ca] + boff;
  const IT* pb = static_cast<const IT*>(A.idx) + A.colpos[cb_] + boff;
  const IT* qa = RES ? static_cast<const IT*>(A.ridx) + A.colpos[ca] + boff : pa;
  const IT* qb = RES ? static_cast<const IT*>(A.ridx) + A.colpos[cb_] + boff : pb;
  const int64_t ga = A.colgrp[ca], gb = A.colgrp[cb_];
  const uint16_t* cba = opaque(A.cb16 + ga * A.cb_gs);
  const uint16_t* cbb = opaque(A.cb16 + gb * A.cb_gs);
  const uint16_t* rcba = RES ? opaque(A.rcb16 + ga * A.rcb_gs) : cba;
  const uint16_t* rcbb = RES ? opaque(A.rcb16 + gb * A.rcb_gs) : cbb;
  const typename W::B s0 = W::bc(NORM ? A.cscale[ca] : 1.f), s1 = W::bc(NORM ? A.cscale[cb_] : 1.f);
  const typename W::T b0 = W::bcv(W::bc(NORM ? A.cbias[ca] : 0.f)), b1 = W::bcv(W::bc(NORM ? A.cbias[cb_] : 0.f));
  for (int64_t rb = rb0; rb < rb1; ++rb) {
    VN_UNROLL for (int r = 0; r < NR_LAYOUT; ++r) {
      uint16_t* dst = d + r * v2;
      alignas(32) uint16_t wa[16], wb[16];
      if (!RES && !NORM) {
        std::memcpy(wa, cba + eoff<VP>(pa[r]), VP * 2);
        std::memcpy(wb, cbb + eoff<VP>(pb[r]), VP * 2);
      } else {
        typename W::T a = W::ld16(cba + eoff<VP>(pa[r])), b = W::ld16(cbb + eoff<VP>(pb[r]));
        if (RES) {
          a = W::add(a, W::ld16(rcba + eoff<VP>(qa[r])));
          b = W::add(b, W::ld16(rcbb + eoff<VP>(qb[r])));
        }
        if (NORM) {
          a = W::fma(a, s0, b0);
          b = W::fma(b, s1, b1);
        }
        W::st16(wa, a);
        W::st16(wb, b);
      }
#if VN_LEVEL >= 1
      VN_UNROLL for (int h = 0; h < VP; h += 8) {
        // loads no wider than the stores that filled wa / wb (a wider load would miss store forwarding)
        __m128i va = VP == 4 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wa))
                             : _mm_loadu_si128(reinterpret_cast<const __m128i*>(wa + h));
        __m128i vb = VP == 4 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb))
                             : _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + h));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * h), _mm_unpacklo_epi16(va, vb));
        if (VP > 4) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * h + 8), _mm_unpackhi_epi16(va, vb));
      }
#else
      for (int t = 0; t < VP; ++t) {
        dst[2 * t] = wa[t];
        dst[2 * t + 1] = wb[t];
      }
#endif
    }
    d += NR_LAYOUT * v2;
    pa += bstride;
    pb += bstride;
    if (RES) {
      qa += bstride;
      qb += bstride;
    }
  }
}

// Element offset of the centroid of entry pos of an index stream of A's width.
static int64_t entry_offset(const VQArgs& A, const void* stream, int64_t pos) {
  if (A.idx8) return int64_t(static_cast<const uint8_t*>(stream)[pos]) * A.vp;
  if (A.idx32) return int64_t(static_cast<const uint32_t*>(stream)[pos]);
  return int64_t(static_cast<const uint16_t*>(stream)[pos]);
}

// Stored column c (any kind) into slot `half` of B rows, lane by lane, outputs [o0, o0 + nb).
static void vnni_single(const VQArgs& A, int64_t c, int64_t o0, int64_t nb, int half, uint16_t* brow) {
  const bool norm = A.cscale != nullptr;
  const float s = norm ? A.cscale[c] : 1.f, b = norm ? A.cbias[c] : 0.f;
  const int64_t o1 = std::min<int64_t>(A.out, o0 + nb);
  if (c < A.osz) {
    for (int64_t o = o0; o < o1; ++o) {
      const int64_t ro = o / A.vo, t = o - ro * A.vo;
      const int64_t e = A.oidx32 ? int64_t(static_cast<const uint32_t*>(A.oidx)[ro * A.osz + c])
                                 : int64_t(static_cast<const uint16_t*>(A.oidx)[ro * A.osz + c]);
      brow[2 * (o - o0) + half] = norm ? f32_to_bf16(A.ocb32[e + t] * s + b) : A.ocb16[e + t];
    }
    return;
  }
  const int64_t g = A.colgrp[c];
  for (int64_t o = o0; o < o1; ++o) {
    const int64_t r = o / A.v, t = o - r * A.v;
    const int64_t pos = A.colpos[c] + (r / NR_LAYOUT) * A.gs * NR_LAYOUT + r % NR_LAYOUT;
    const int64_t e = entry_offset(A, A.idx, pos);
    float w = A.cb32[g * A.cb_gs + e + t];
    if (A.res) {
      const int64_t er = entry_offset(A, A.ridx, pos);
      w += A.rcb32[g * A.rcb_gs + er + t];
    }
    brow[2 * (o - o0) + half] = (norm || A.res) ? f32_to_bf16(norm ? w * s + b : w) : A.cb16[g * A.cb_gs + e + t];
  }
}

using PairFn = void (*)(const VQArgs&, int64_t, int64_t, int64_t, int64_t, uint16_t*);
template <int VP, typename IT>
static PairFn pick_pair2(bool res, bool norm) {
  if (res) return norm ? &vnni_pair<VP, IT, true, true> : &vnni_pair<VP, IT, true, false>;
  return norm ? &vnni_pair<VP, IT, false, true> : &vnni_pair<VP, IT, false, false>;
}

static void vq_dequant_vnni(const VQArgs& A, int64_t rb0, int64_t rb1, int64_t j0, int64_t j1, uint16_t* B,
                            int64_t nb) {
  const bool norm = A.cscale != nullptr;
  const int iw = index_width(A);
  PairFn fn;
#define VN_PAIR_IT(VP)                                      \
  (iw == 4   ? pick_pair2<VP, uint32_t>(A.res, norm)       \
   : iw == 1 ? pick_pair2<VP, uint8_t>(A.res, norm)        \
             : pick_pair2<VP, uint16_t>(A.res, norm))
  switch (A.vp) {
    case 4: fn = VN_PAIR_IT(4); break;
    case 8: fn = VN_PAIR_IT(8); break;
    default: fn = VN_PAIR_IT(16); break;
  }
#undef VN_PAIR_IT
  const int64_t o0 = rb0 * NR_LAYOUT * A.v;
  for (int64_t j = j0; j < j1; j += 2) {
    uint16_t* brow = B + (j - j0) * nb;
    const int64_t ca = A.iperm ? A.iperm[j] : j, cb_ = A.iperm ? A.iperm[j + 1] : j + 1;
    if (ca >= A.osz && cb_ >= A.osz) {
      fn(A, ca, cb_, rb0, rb1, brow);
    } else {
      vnni_single(A, ca, o0, nb, 0, brow);
      vnni_single(A, cb_, o0, nb, 1, brow);
    }
  }
}

// ------------------------------------------------------------------------------------------ scalar codes
// Chunk = 32 codes. Nibble container: 16 bytes, byte b = code[b] | code[b + 16] << 4. Byte container: 32 bytes.
#if VN_LEVEL >= 2
struct SC {  // 16 codes per vector
  static constexpr int L = 16;
  using T = __m512;
  static VN_FI T zero() { return _mm512_setzero_ps(); }
  static VN_FI T bc(float x) { return _mm512_set1_ps(x); }
  static VN_FI T ldx(const float* p) { return _mm512_loadu_ps(p); }
  static VN_FI T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static VN_FI T add(T a, T b) { return _mm512_add_ps(a, b); }
  static VN_FI T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static VN_FI T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static VN_FI float hsum(T a) { return _mm512_reduce_add_ps(a); }
  // codes k*16 .. k*16+15 of a 32-code chunk
  template <bool NIB>
  static VN_FI void codes(const uint8_t* chunk, T& lo, T& hi) {
    if (NIB) {
      __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk)));
      lo = _mm512_cvtepi32_ps(_mm512_and_si512(d, _mm512_set1_epi32(15)));
      hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4));
    } else {
      lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk))));
      hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 16))));
    }
  }
  static VN_FI void st(float* p, T a) { _mm512_storeu_ps(p, a); }
  static VN_FI void st16(uint16_t* p, T a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(a));
  }
};
#elif VN_LEVEL == 1
struct SC {  // 8 codes per vector; a 32-code chunk is 4 vectors: (lo of bytes 0-7, lo 8-15, hi 0-7, hi 8-15)
  static constexpr int L = 8;
  using T = __m256;
  static VN_FI T zero() { return _mm256_setzero_ps(); }
  static VN_FI T bc(float x) { return _mm256_set1_ps(x); }
  static VN_FI T ldx(const float* p) { return _mm256_loadu_ps(p); }
  static VN_FI T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static VN_FI T add(T a, T b) { return _mm256_add_ps(a, b); }
  static VN_FI T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static VN_FI T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static VN_FI float hsum(T a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // codes 8*half .. of the low (k = 0) or high (k = 1) 16-code half: returns codes [8h, 8h+8) of
  // half lo (codes 0..15) in a, of half hi (codes 16..31) in b.
  template <bool NIB>
  static VN_FI void codes8(const uint8_t* chunk, int h, T& a, T& b) {
    if (NIB) {
      __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(chunk + 8 * h)));
      a = _mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(15)));
      b = _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4));
    } else {
      a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(chunk + 8 * h))));
      b = _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(chunk + 16 + 8 * h))));
    }
  }
  static VN_FI void st(float* p, T a) { _mm256_storeu_ps(p, a); }
  static VN_FI void st16(uint16_t* p, T a) { st8_bf16(p, a); }
};
#endif

// Code j of a 32-code chunk (plain C++).
template <bool NIB>
static VN_FI int code_at(const uint8_t* chunk, int j) {
  if (NIB) return j < 16 ? (chunk[j] & 15) : (chunk[j - 16] >> 4);
  return chunk[j];
}

#if VN_LEVEL >= 1
// Software prefetch distance of the one-token scalar GEMV's code rows, in bytes ahead of each row being read.
// The rows are one sequential stream, yet the hardware prefetcher left this loop at ~5.6 GB/s against ~8 GB/s for
// dense bf16 (Zen 3, 1 thread): at 2-16 KB ahead a 151936x896 8-bit layer went from 0.74 to 0.41-0.52 of dense
// time, 4-bit from 0.38 to 0.27-0.35 (bench/kernels.py-style round robin, one process).
constexpr int64_t kScalarPrefetch = 4096;
// One token, NR rows: y = sum_g s_g * (sum_j q_j x_j) - sum_g zs_g * xsum_g.
template <bool NIB, int NR>
static void sc_rows1(const ScalarArgs& S, const ScalarCall& C, int64_t o, int nrows) {
  using T = SC::T;
  const int64_t cbytes = NIB ? 16 : 32;  // bytes per chunk
  const uint8_t* rows[NR];
  VN_UNROLL for (int r = 0; r < NR; ++r) rows[r] = S.codes + std::min<int64_t>(o + r, S.out - 1) * S.row_bytes;
  const float* sc[NR];
  const float* zs[NR];
  VN_UNROLL for (int r = 0; r < NR; ++r) {
    int64_t rr = std::min<int64_t>(o + r, S.out - 1);
    sc[r] = S.scales + rr * S.Gn;
    zs[r] = S.zs + rr * S.Gn;
  }
  T tot[NR];
  float zt[NR];
  VN_UNROLL for (int r = 0; r < NR; ++r) {
    tot[r] = SC::zero();
    zt[r] = 0.f;
  }
  const int64_t nch = S.gsp / 32;
  for (int64_t g = 0; g < S.Gn; ++g) {
    T a0[NR], a1[NR];
    VN_UNROLL for (int r = 0; r < NR; ++r) a0[r] = a1[r] = SC::zero();
    const float* xg = C.xg + g * S.gsp;
    const int64_t cb0 = g * nch * cbytes;
    for (int64_t k = 0; k < nch; ++k) {
      VN_UNROLL for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(rows[r] + cb0 + k * cbytes + kScalarPrefetch), _MM_HINT_T0);
#if VN_LEVEL >= 2
      T x0 = SC::ldx(xg + 32 * k), x1 = SC::ldx(xg + 32 * k + 16);
      VN_UNROLL for (int r = 0; r < NR; ++r) {
        T lo, hi;
        SC::codes<NIB>(rows[r] + cb0 + k * cbytes, lo, hi);
        a0[r] = SC::fma(lo, x0, a0[r]);
        a1[r] = SC::fma(hi, x1, a1[r]);
      }
#else
      VN_UNROLL for (int h = 0; h < 2; ++h) {
        T xa = SC::ldx(xg + 32 * k + 8 * h), xb = SC::ldx(xg + 32 * k + 16 + 8 * h);
        VN_UNROLL for (int r = 0; r < NR; ++r) {
          T a, b;
          SC::codes8<NIB>(rows[r] + cb0 + k * cbytes, h, a, b);
          a0[r] = SC::fma(a, xa, a0[r]);
          a1[r] = SC::fma(b, xb, a1[r]);
        }
      }
#endif
    }
    const float xsum = C.xsum[g];
    VN_UNROLL for (int r = 0; r < NR; ++r) {
      tot[r] = SC::fma(SC::add(a0[r], a1[r]), SC::bc(sc[r][g]), tot[r]);
      zt[r] += zs[r][g] * xsum;
    }
  }
  for (int r = 0; r < nrows; ++r) C.y[o + r] = SC::hsum(tot[r]) - zt[r];
}

// TT tokens, NR rows, dequantize-on-the-fly: w = (q - z) * s, acc[r][t] += w * x_t.
template <bool NIB, int NR, int TT>
static void sc_rowsT(const ScalarArgs& S, const ScalarCall& C, int64_t o, int nrows) {
  using T = SC::T;
  [[maybe_unused]] constexpr int L = SC::L;
  const int64_t cbytes = NIB ? 16 : 32;
  const uint8_t* rows[NR];
  const float* sc[NR];
  const float* zr[NR];
  VN_UNROLL for (int r = 0; r < NR; ++r) {
    int64_t rr = std::min<int64_t>(o + r, S.out - 1);
    rows[r] = S.codes + rr * S.row_bytes;
    sc[r] = S.scales + rr * S.Gn;
    zr[r] = S.zeros + rr * S.Gn;
  }
  T acc[NR][TT];
  VN_UNROLL for (int r = 0; r < NR; ++r) VN_UNROLL for (int t = 0; t < TT; ++t) acc[r][t] = SC::zero();
  const int64_t nch = S.gsp / 32;
  for (int64_t g = 0; g < S.Gn; ++g) {
    T s[NR], z[NR];
    VN_UNROLL for (int r = 0; r < NR; ++r) {
      s[r] = SC::bc(sc[r][g]);
      z[r] = SC::bc(zr[r][g]);
    }
    const int64_t cb0 = g * nch * cbytes;
    for (int64_t k = 0; k < nch; ++k) {
      const int64_t xo = g * S.gsp + 32 * k;
#if VN_LEVEL >= 2
      T w0[NR], w1[NR];
      VN_UNROLL for (int r = 0; r < NR; ++r) {
        T lo, hi;
        SC::codes<NIB>(rows[r] + cb0 + k * cbytes, lo, hi);
        w0[r] = SC::mul(SC::sub(lo, z[r]), s[r]);
        w1[r] = SC::mul(SC::sub(hi, z[r]), s[r]);
      }
      VN_UNROLL for (int t = 0; t < TT; ++t) {
        const float* xt = C.xg + t * S.kp + xo;
        T x0 = SC::ldx(xt), x1 = SC::ldx(xt + L);
        VN_UNROLL for (int r = 0; r < NR; ++r) acc[r][t] = SC::fma(w1[r], x1, SC::fma(w0[r], x0, acc[r][t]));
      }
#else
      VN_UNROLL for (int h = 0; h < 2; ++h) {
        T w0[NR], w1[NR];
        VN_UNROLL for (int r = 0; r < NR; ++r) {
          T a, b;
          SC::codes8<NIB>(rows[r] + cb0 + k * cbytes, h, a, b);
          w0[r] = SC::mul(SC::sub(a, z[r]), s[r]);
          w1[r] = SC::mul(SC::sub(b, z[r]), s[r]);
        }
        VN_UNROLL for (int t = 0; t < TT; ++t) {
          const float* xt = C.xg + t * S.kp + xo + 8 * h;
          T x0 = SC::ldx(xt), x1 = SC::ldx(xt + 16);
          VN_UNROLL for (int r = 0; r < NR; ++r) acc[r][t] = SC::fma(w1[r], x1, SC::fma(w0[r], x0, acc[r][t]));
        }
      }
#endif
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < nrows; ++r) C.y[t * C.ys + o + r] = SC::hsum(acc[r][t]);
}
#endif

// Plain C++ versions (level 0) and generic fallbacks.
template <bool NIB>
static void sc_rows_plain(const ScalarArgs& S, const ScalarCall& C, int64_t o, int64_t nt) {
  const uint8_t* row = S.codes + o * S.row_bytes;
  const int64_t cbytes = NIB ? 16 : 32, nch = S.gsp / 32;
  for (int64_t t = 0; t < nt; ++t) {
    const float* x = C.xg + t * S.kp;
    float total = 0.f;
    for (int64_t g = 0; g < S.Gn; ++g) {
      const float s = S.scales[o * S.Gn + g], z = S.zeros[o * S.Gn + g];
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t k = 0; k < nch; ++k) {
        const uint8_t* ch = row + (g * nch + k) * cbytes;
        const float* xk = x + g * S.gsp + 32 * k;
        for (int j = 0; j < 32; ++j) acc[j & 7] += (float(code_at<NIB>(ch, j)) - z) * s * xk[j];
      }
      total += ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
    C.y[t * C.ys + o] = total;
  }
}

static void sc_gemv(const ScalarArgs& S, const ScalarCall& C, int64_t o0, int64_t o1, int64_t nt) {
#if VN_LEVEL >= 1
  if (nt == 1) {
    constexpr int NR = 4;
    for (int64_t o = o0; o < o1; o += NR) {
      int nr = int(std::min<int64_t>(NR, o1 - o));
      S.nibble ? sc_rows1<true, NR>(S, C, o, nr) : sc_rows1<false, NR>(S, C, o, nr);
    }
    return;
  }
  for (int64_t t = 0; t < nt;) {
    const int64_t left = nt - t, tt = left >= 4 ? 4 : (left >= 2 ? 2 : 1);
    ScalarCall Ct = C;
    Ct.xg = C.xg + t * S.kp;
    Ct.y = C.y + t * C.ys;
    for (int64_t o = o0; o < o1;) {
      if (tt == 4) {
        int nr = int(std::min<int64_t>(2, o1 - o));
        S.nibble ? sc_rowsT<true, 2, 4>(S, Ct, o, nr) : sc_rowsT<false, 2, 4>(S, Ct, o, nr);
        o += 2;
      } else if (tt == 2) {
        int nr = int(std::min<int64_t>(4, o1 - o));
        S.nibble ? sc_rowsT<true, 4, 2>(S, Ct, o, nr) : sc_rowsT<false, 4, 2>(S, Ct, o, nr);
        o += 4;
      } else {
        int nr = int(std::min<int64_t>(4, o1 - o));
        S.nibble ? sc_rowsT<true, 4, 1>(S, Ct, o, nr) : sc_rowsT<false, 4, 1>(S, Ct, o, nr);
        o += 4;
      }
    }
    t += tt;
  }
#else
  for (int64_t o = o0; o < o1; ++o) S.nibble ? sc_rows_plain<true>(S, C, o, nt) : sc_rows_plain<false>(S, C, o, nt);
#endif
}

template <bool NIB, bool OUT16>
static void sc_deq(const ScalarArgs& S, int64_t o0, int64_t o1, void* Wv, int64_t ldw) {
  const int64_t cbytes = NIB ? 16 : 32, nch = S.gsp / 32;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = S.codes + o * S.row_bytes;
    float* w32 = static_cast<float*>(Wv) + (o - o0) * ldw;
    uint16_t* w16 = static_cast<uint16_t*>(Wv) + (o - o0) * ldw;
    for (int64_t g = 0; g < S.Gn; ++g) {
      const float s = S.scales[o * S.Gn + g], z = S.zeros[o * S.Gn + g];
      for (int64_t k = 0; k < nch; ++k) {
        const uint8_t* ch = row + (g * nch + k) * cbytes;
        const int64_t col = g * S.gs + 32 * k;  // writes past the group end are overwritten by the next group
#if VN_LEVEL >= 2
        SC::T lo, hi, sv = SC::bc(s), zv = SC::bc(z);
        SC::codes<NIB>(ch, lo, hi);
        lo = SC::mul(SC::sub(lo, zv), sv);
        hi = SC::mul(SC::sub(hi, zv), sv);
        if (OUT16) {
          SC::st16(w16 + col, lo);
          SC::st16(w16 + col + 16, hi);
        } else {
          SC::st(w32 + col, lo);
          SC::st(w32 + col + 16, hi);
        }
#elif VN_LEVEL == 1
        SC::T sv = SC::bc(s), zv = SC::bc(z);
        for (int h = 0; h < 2; ++h) {
          SC::T a, b;
          SC::codes8<NIB>(ch, h, a, b);
          a = SC::mul(SC::sub(a, zv), sv);
          b = SC::mul(SC::sub(b, zv), sv);
          if (OUT16) {
            SC::st16(w16 + col + 8 * h, a);
            SC::st16(w16 + col + 16 + 8 * h, b);
          } else {
            SC::st(w32 + col + 8 * h, a);
            SC::st(w32 + col + 16 + 8 * h, b);
          }
        }
#else
        for (int j = 0; j < 32; ++j) {
          float w = (float(code_at<NIB>(ch, j)) - z) * s;
          if (OUT16)
            w16[col + j] = f32_to_bf16(w);
          else
            w32[col + j] = w;
        }
#endif
      }
    }
  }
}

static void sc_dequant(const ScalarArgs& S, int64_t o0, int64_t o1, void* W, int64_t ldw, bool bf16) {
  if (S.nibble)
    bf16 ? sc_deq<true, true>(S, o0, o1, W, ldw) : sc_deq<true, false>(S, o0, o1, W, ldw);
  else
    bf16 ? sc_deq<false, true>(S, o0, o1, W, ldw) : sc_deq<false, false>(S, o0, o1, W, ldw);
}

// ------------------------------------------------------------------------------------------ finish
static void finish(const float* acc, int64_t as, const float* off, const float* bias, void* y, int64_t ys,
                   int out_kind, int64_t nt, int64_t o0, int64_t o1) {
  for (int64_t t = 0; t < nt; ++t) {
    const float* a = acc + t * as;
    const float ofs = off ? off[t] : 0.f;
    if (out_kind == 0) {
      float* yr = static_cast<float*>(y) + t * ys;
      if (bias)
        for (int64_t o = o0; o < o1; ++o) yr[o] = a[o] + ofs + bias[o];
      else
        for (int64_t o = o0; o < o1; ++o) yr[o] = a[o] + ofs;
    } else {
      uint16_t* yr = static_cast<uint16_t*>(y) + t * ys;
      int64_t o = o0;
#if VN_LEVEL >= 1
      const __m256 vo = _mm256_set1_ps(ofs);
      for (; o + 8 <= o1; o += 8) {
        __m256 s = _mm256_add_ps(_mm256_loadu_ps(a + o), vo);
        if (bias) s = _mm256_add_ps(s, _mm256_loadu_ps(bias + o));
        st8_bf16(yr + o, s);
      }
#endif
      for (; o < o1; ++o) yr[o] = f32_to_bf16(a[o] + ofs + (bias ? bias[o] : 0.f));
    }
  }
}

// ------------------------------------------------------------------------------------------ activations
// Each value: q = round_half_even(x / step) (+ zero, clamped), (q - zero) * step, in fp32 with the same IEEE
// divisions as torch, then rounded to bf16 when x is bf16. Row reductions (absmax, min, max) are exact in any
// order.
constexpr float kActEps = 1e-8f;

static VN_FI float act_rd(const void* x, int64_t j, bool bf16) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[j]) : static_cast<const float*>(x)[j];
}
static VN_FI void act_wr(void* y, int64_t j, bool bf16, float v) {
  if (bf16)
    static_cast<uint16_t*>(y)[j] = f32_to_bf16(v);
  else
    static_cast<float*>(y)[j] = v;
}
#if VN_LEVEL >= 1
static VN_FI __m256 act_ld8(const void* x, int64_t j, bool bf16) {
  return bf16 ? cvt8_bf16(static_cast<const uint16_t*>(x) + j) : _mm256_loadu_ps(static_cast<const float*>(x) + j);
}
static VN_FI void act_st8(void* y, int64_t j, bool bf16, __m256 v) {
  if (bf16)
    st8_bf16(static_cast<uint16_t*>(y) + j, v);
  else
    _mm256_storeu_ps(static_cast<float*>(y) + j, v);
}
static VN_FI float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
#endif

static void act_quant(const void* x, void* y, int64_t nt, int64_t in, bool bf16, int mode, int bits, float scale) {
  const float qmax = float((1 << (bits - 1)) - 1), levels = float((1 << bits) - 1);
  const int64_t esz = bf16 ? 2 : 4;
  for (int64_t n = 0; n < nt; ++n) {
    const void* xr = static_cast<const char*>(x) + n * in * esz;
    void* yr = static_cast<char*>(y) + n * in * esz;
    // the row's grid: step, zero, and the clamp range [lo_q, hi_q] of the levels (+ zero)
    float lo = 0.f, hi = 0.f;
    if (mode != 2) {
      int64_t j = 0;
#if VN_LEVEL >= 1
      __m256 vlo = _mm256_setzero_ps(), vhi = _mm256_setzero_ps();
      for (; j + 8 <= in; j += 8) {
        const __m256 v = act_ld8(xr, j, bf16);
        vlo = _mm256_min_ps(vlo, v);
        vhi = _mm256_max_ps(vhi, v);
      }
      lo = -hmax8(_mm256_sub_ps(_mm256_setzero_ps(), vlo));
      hi = hmax8(vhi);
#endif
      for (; j < in; ++j) {
        const float v = act_rd(xr, j, bf16);
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
    }
    float step, zero = 0.f, qlo = -qmax, qhi = qmax;
    if (mode == 0) {
      step = std::max(std::max(hi, -lo) / qmax, kActEps);
    } else if (mode == 1) {
      step = std::max((hi - lo) / levels, kActEps);
      zero = __builtin_nearbyintf(-lo / step);
      qlo = 0.f;
      qhi = levels;
    } else {
      step = scale;
    }
    int64_t j = 0;
#if VN_LEVEL >= 1
    const __m256 vs = _mm256_set1_ps(step), vz = _mm256_set1_ps(zero), vl = _mm256_set1_ps(qlo),
                 vh = _mm256_set1_ps(qhi);
    for (; j + 8 <= in; j += 8) {
      __m256 q = _mm256_round_ps(_mm256_div_ps(act_ld8(xr, j, bf16), vs), _MM_FROUND_TO_NEAREST_INT |
                                                                                _MM_FROUND_NO_EXC);
      q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, vz), vl), vh);
      act_st8(yr, j, bf16, _mm256_mul_ps(_mm256_sub_ps(q, vz), vs));
    }
#endif
    for (; j < in; ++j) {
      const float q = std::min(std::max(__builtin_nearbyintf(act_rd(xr, j, bf16) / step) + zero, qlo), qhi);
      act_wr(yr, j, bf16, (q - zero) * step);
    }
  }
}

#include "decoder_body.h"
#include "search_body.h"

static const IsaTable kTable = {
#if VN_LEVEL >= 2
    "avx512",
#elif VN_LEVEL == 1
    "avx2",
#else
    "scalar",
#endif
    &vq_main, &vq_outliers, &vq_dequant, &vq_dequant_vnni, &sc_gemv, &sc_dequant, &finish, &act_quant,
    &dec::rms_norm, &dec::silu_mul, &dec::attend, &srch::nearest};

}  // namespace VN_NS
}  // namespace vptq_native
