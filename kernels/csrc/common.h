// Shared declarations of the native CPU kernels (no torch dependency: the ISA translation units and the
// standalone harness include only this and <immintrin.h>).
//
// Prepared VQ layout (built once by native.cpp from the public tensors):
//   * main vector rows r = 0..R-1 (R = ceil(out / v)) are grouped in blocks of NR_LAYOUT = 8 rows;
//     indices idx[g][rb][c][8] (c = column in group g, 0..gs-1), each entry the ELEMENT offset
//     (code * vp) of the centroid in its codebook, uint16 when every offset fits, else uint32; with codebooks
//     of at most 256 entries the code itself as uint8 (idx8: half the bytes of the stream a GEMV reads);
//     rows past R (last block) hold offset 0.
//   * codebooks padded to vp in {4, 8, 16} lanes per centroid (lanes >= v are 0) plus 16 spare lanes,
//     kept both as fp32 and as bf16 (exact when the centroids are bf16-representable, else rounded).
//   * an optional residual index stream / codebook with the same layout.
//   * outliers: oidx[ro][osz] (row-major, element offsets code * vpo) and an fp32 codebook.
//   * the GEMV input is xq[c][xs] (stored column order c = 0..in-1, xs >= tokens), already permuted and
//     scaled: xq[c][n] = x[n][perm[c]] * scale[perm[c]].
// Results are written compactly to yacc[n][o] (row stride ys); the caller adds norm offset and bias.
#pragma once
#include <cstddef>
#include <cstdint>

namespace vptq_native {

constexpr int NR_LAYOUT = 8;  // vector rows per index block

struct VQArgs {
  // shape
  int64_t n_in = 0, out = 0, v = 0, vp = 0, G = 0, gs = 0, R = 0, RB = 0;
  int idx32 = 0;  // main/residual offsets are uint32 (else uint16)
  int idx8 = 0;   // main/residual entries are uint8 CODES (offset = code * vp): codebooks of at most 256 entries
  bool res = false;
  const void* idx = nullptr;   // [G][RB][gs][8]
  const void* ridx = nullptr;  // same layout (residual)
  const float* cb32 = nullptr;
  const float* rcb32 = nullptr;
  const uint16_t* cb16 = nullptr;
  const uint16_t* rcb16 = nullptr;
  int64_t cb_gs = 0, rcb_gs = 0;  // elements between group codebooks
  // outliers
  int64_t osz = 0, vo = 0, vpo = 0, Ro = 0;
  int oidx32 = 0;
  const void* oidx = nullptr;  // [Ro][osz]
  const float* ocb32 = nullptr;
  const uint16_t* ocb16 = nullptr;
  // prefill only: stored column c goes to row rowmap[c] of the dequantized tile (perm; null = identity),
  // scaled by cscale[c] and shifted by cbias[c] (norm, already permuted; null = none)
  const int32_t* rowmap = nullptr;
  const float* cscale = nullptr;
  const float* cbias = nullptr;
  const int32_t* iperm = nullptr;   // original column j -> stored column (inverse of perm; null = identity)
  const int32_t* colpos = nullptr;  // stored main column c -> offset of its entries in block 0 of idx
  const int32_t* colgrp = nullptr;  // stored main column c -> group
};

// One GEMV call: tokens [t0, t0 + nt) of xq (token stride 1, column stride xs), rows of blocks [rb0, rb1).
struct VQCall {
  const float* xq = nullptr;
  int64_t xs = 1;
  float* y = nullptr;  // y[n][o], token stride ys; only outputs of the given rows are written
  int64_t ys = 0;
  bool use_cb16 = false;  // GEMV reads the bf16 codebooks
  bool touch_codebooks = true;  // read every line of the codebooks once before the gathers (vq_main)
  int64_t prefetch = 0;  // software prefetch distance of the index streams in bytes (0 = none; vq_rows)
};

// Scalar (RTN/GPTQ/LRQ) codes, prepared: each group of gs columns is padded to gsp (multiple of 32) codes;
// container nibble (bits <= 4: 32 codes = 16 bytes, byte b = code[b] | code[b+16] << 4) or byte (bits > 4).
// Row o occupies row_bytes bytes. scales / zeros are fp32 [out][Gn]; zs = scales * zeros.
struct ScalarArgs {
  int64_t n_in = 0, out = 0, gs = 0, Gn = 0, gsp = 0, row_bytes = 0, kp = 0;  // kp = Gn * gsp
  int nibble = 1;
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;  // [out][Gn]
  const float* zeros = nullptr;   // [out][Gn]
  const float* zs = nullptr;      // [out][Gn]
};

// Input for scalar GEMV: xg[n][kp] (group-padded, zeros in padding), token stride kp; xsum[n][Gn].
struct ScalarCall {
  const float* xg = nullptr;
  const float* xsum = nullptr;
  float* y = nullptr;
  int64_t ys = 0;
};

// Function table of one instruction-set level.
struct IsaTable {
  const char* name;
  // Main rows of blocks [rb0, rb1) for tokens [t0, t0 + nt): y[t][o] = sum over main columns.
  void (*vq_main)(const VQArgs&, const VQCall&, int64_t rb0, int64_t rb1, int64_t t0, int64_t nt);
  // Outlier rows covering outputs [o0, o1): y[t][o] += outlier part (only o in [o0, o1) touched).
  void (*vq_outliers)(const VQArgs&, const VQCall&, int64_t o0, int64_t o1, int64_t t0, int64_t nt);
  // Prefill: dequantize blocks [rb0, rb1) x stored columns [c0, c1) into T[i][o - o0] (i = perm[c] when
  // use_rowmap, else c - c0; row stride ldt), W * scale + bias applied per column, bf16 (uint16) or fp32. Every
  // row of T must have >= 16 writable elements before column 0 and after column (rb1 - rb0) * 8 * v.
  void (*vq_dequant)(const VQArgs&, int64_t rb0, int64_t rb1, int64_t c0, int64_t c1, bool use_rowmap, void* T,
                     int64_t ldt, bool bf16);
  // GEMM micro-kernel path: B[(j - j0) / 2][o - o0][(j - j0) % 2] = W[o][j] in bf16 (original column order, perm
  // and norm applied) for j in [j0, j1) (j1 - j0 even), outputs of blocks [rb0, rb1) (o0 = rb0 * 8 * v); nb =
  // outputs per B row. Whole blocks are written: B needs 2 * (8 * v + 16) spare elements after the last row.
  void (*vq_dequant_vnni)(const VQArgs&, int64_t rb0, int64_t rb1, int64_t c0, int64_t c1, uint16_t* B, int64_t nb);
  // Scalar GEMV rows [o0, o1), tokens [0, nt).
  void (*sc_gemv)(const ScalarArgs&, const ScalarCall&, int64_t o0, int64_t o1, int64_t nt);
  // Scalar prefill: W[o - o0][j] = scales * (codes - zeros), row stride ldw (>= n_in + 32), bf16 or fp32.
  void (*sc_dequant)(const ScalarArgs&, int64_t o0, int64_t o1, void* W, int64_t ldw, bool bf16);
  // y[n][o] (dtype) = acc[n][o] + off[n] + bias[o] for o in [o0, o1); out_kind 0 fp32, 1 bf16.
  void (*finish)(const float* acc, int64_t as, const float* off, const float* bias, void* y, int64_t ys,
                 int out_kind, int64_t nt, int64_t o0, int64_t o1);
  // Activation fake quantization of rows [0, nt) of x[nt][in] into y (same dtype: bf16 when bf16, else fp32),
  // as vptq_core.quant.act_quant computes it in fp32: mode 0 per token symmetric, 1 per token asymmetric,
  // 2 static step ``scale``.
  void (*act_quant)(const void* x, void* y, int64_t nt, int64_t in, bool bf16, int mode, int bits, float scale);
  // Decoder-step operations (decoder_body.h): RMSNorm with an optional fused residual add, SiLU(g) * u, and
  // attention fused with rotary embedding and the KV-cache write.
  void (*rms_norm)(const void* x, const void* delta, void* hsum, const void* w, float eps, int64_t n, int64_t d,
                   bool d16, void* y, float* scratch);
  void (*silu_mul)(const void* g, const void* u, int64_t n, bool d16, void* y);
  void (*attend)(const void* q, int64_t qs, const void* k, int64_t ks, const void* v, int64_t vs, const void* cos,
                 const void* sin, void* Kc, void* Vc, int64_t Lmax, int64_t pos, int64_t t, int64_t nh, int64_t kvh,
                 int64_t hd, float scale, bool d16, void* out, float* scratch);
  // Nearest centroid of queries [q0, q1) of X [n][d] (fp32): CT [d][kp] the codebook transposed (kp a multiple of
  // 8), csq [kp] its squared norms (+inf in the padding); the lowest index on ties (search_body.h).
  void (*nearest)(const float* X, int64_t d, const float* CT, const float* csq, int64_t kp, int64_t q0, int64_t q1,
                  int64_t* out);
};

const IsaTable* isa_scalar();
const IsaTable* isa_avx2();
const IsaTable* isa_avx512();

}  // namespace vptq_native
