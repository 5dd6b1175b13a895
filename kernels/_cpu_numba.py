"""numba kernels behind ``kernels.cpu`` (import through ``kernels.cpu._kernels()``, which sets the compile flags).

Index arithmetic is done in uint64 on purpose: numba adds negative-index wraparound checks to signed
indices, which blocks vectorisation of the centroid loads.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.extending import intrinsic

U1, U2, U3, U4, U5, U6, U7 = (np.uint64(i) for i in range(1, 8))
U8, U9, U10, U11, U12, U13, U14, U15 = (np.uint64(i) for i in range(8, 16))
U32 = np.uint64(32)
F0 = np.float32(0.0)


@njit(inline="always", fastmath=True)
def _fma8(a, cb, e, xc):
    return (
        a[0] + cb[e] * xc, a[1] + cb[e + U1] * xc, a[2] + cb[e + U2] * xc, a[3] + cb[e + U3] * xc,
        a[4] + cb[e + U4] * xc, a[5] + cb[e + U5] * xc, a[6] + cb[e + U6] * xc, a[7] + cb[e + U7] * xc,
    )


@njit(inline="always", fastmath=True)
def _fma16(a, cb, e, xc):
    return (
        a[0] + cb[e] * xc, a[1] + cb[e + U1] * xc, a[2] + cb[e + U2] * xc, a[3] + cb[e + U3] * xc,
        a[4] + cb[e + U4] * xc, a[5] + cb[e + U5] * xc, a[6] + cb[e + U6] * xc, a[7] + cb[e + U7] * xc,
        a[8] + cb[e + U8] * xc, a[9] + cb[e + U9] * xc, a[10] + cb[e + U10] * xc, a[11] + cb[e + U11] * xc,
        a[12] + cb[e + U12] * xc, a[13] + cb[e + U13] * xc, a[14] + cb[e + U14] * xc, a[15] + cb[e + U15] * xc,
    )


@njit(inline="always")
def _zeros8():
    return (F0, F0, F0, F0, F0, F0, F0, F0)


@njit(inline="always")
def _zeros16():
    return (F0, F0, F0, F0, F0, F0, F0, F0, F0, F0, F0, F0, F0, F0, F0, F0)


@njit(inline="always")
def _store(y, n, r, v, out, a):
    o = r * v
    for t in range(v):
        if o + t < out:
            y[n, o + t] = a[t]


@njit(fastmath=True, cache=True)
def _block8(n, r0, xp, words, cb, rcb, y, v, ib, rbits, osz):
    """4 vector rows r0..r0+3 (v <= 8) of token n, all groups; rows past the end are computed on row R-1."""
    G, R, _ = words.shape
    out = y.shape[1]
    gs = (xp.shape[1] - osz) // G
    T = ib + rbits
    mask = np.uint64((1 << T) - 1)
    imask = np.uint64((1 << ib) - 1)
    uib = np.uint64(ib)
    uT = np.uint64(T)
    uv = np.uint64(v)
    r1 = min(r0 + 1, R - 1)
    r2 = min(r0 + 2, R - 1)
    r3 = min(r0 + 3, R - 1)
    a = _zeros8()
    b = _zeros8()
    c_ = _zeros8()
    d = _zeros8()
    for g in range(G):
        wa = words[g, r0]
        wb = words[g, r1]
        wc = words[g, r2]
        wd = words[g, r3]
        cbg = cb[g]
        base = osz + g * gs
        xr = xp[n, base:base + gs]
        ba = bb = bc = bd = np.uint64(0)
        nbits = 0
        w = np.uint64(0)
        if rbits == 0:
            for col in range(gs):
                if nbits < T:
                    sh = np.uint64(nbits)
                    ba |= np.uint64(wa[w]) << sh
                    bb |= np.uint64(wb[w]) << sh
                    bc |= np.uint64(wc[w]) << sh
                    bd |= np.uint64(wd[w]) << sh
                    w += U1
                    nbits += 32
                xc = xr[col]
                a = _fma8(a, cbg, (ba & mask) * uv, xc)
                b = _fma8(b, cbg, (bb & mask) * uv, xc)
                c_ = _fma8(c_, cbg, (bc & mask) * uv, xc)
                d = _fma8(d, cbg, (bd & mask) * uv, xc)
                ba >>= uT
                bb >>= uT
                bc >>= uT
                bd >>= uT
                nbits -= T
        else:
            rcbg = rcb[g]
            for col in range(gs):
                if nbits < T:
                    sh = np.uint64(nbits)
                    ba |= np.uint64(wa[w]) << sh
                    bb |= np.uint64(wb[w]) << sh
                    bc |= np.uint64(wc[w]) << sh
                    bd |= np.uint64(wd[w]) << sh
                    w += U1
                    nbits += 32
                xc = xr[col]
                ea = ba & mask
                eb = bb & mask
                ec = bc & mask
                ed = bd & mask
                a = _fma8(_fma8(a, cbg, (ea & imask) * uv, xc), rcbg, (ea >> uib) * uv, xc)
                b = _fma8(_fma8(b, cbg, (eb & imask) * uv, xc), rcbg, (eb >> uib) * uv, xc)
                c_ = _fma8(_fma8(c_, cbg, (ec & imask) * uv, xc), rcbg, (ec >> uib) * uv, xc)
                d = _fma8(_fma8(d, cbg, (ed & imask) * uv, xc), rcbg, (ed >> uib) * uv, xc)
                ba >>= uT
                bb >>= uT
                bc >>= uT
                bd >>= uT
                nbits -= T
    _store(y, n, r0, v, out, a)
    if r0 + 1 < R:
        _store(y, n, r0 + 1, v, out, b)
    if r0 + 2 < R:
        _store(y, n, r0 + 2, v, out, c_)
    if r0 + 3 < R:
        _store(y, n, r0 + 3, v, out, d)


@njit(fastmath=True, cache=True)
def _block16(n, r0, xp, words, cb, rcb, y, v, ib, rbits, osz):
    """2 vector rows r0, r0+1 (8 < v <= 16) of token n, all groups."""
    G, R, _ = words.shape
    out = y.shape[1]
    gs = (xp.shape[1] - osz) // G
    T = ib + rbits
    mask = np.uint64((1 << T) - 1)
    imask = np.uint64((1 << ib) - 1)
    uib = np.uint64(ib)
    uT = np.uint64(T)
    uv = np.uint64(v)
    r1 = min(r0 + 1, R - 1)
    a = _zeros16()
    b = _zeros16()
    for g in range(G):
        wa = words[g, r0]
        wb = words[g, r1]
        cbg = cb[g]
        rcbg = rcb[g] if rbits > 0 else rcb[0]
        base = osz + g * gs
        xr = xp[n, base:base + gs]
        ba = bb = np.uint64(0)
        nbits = 0
        w = np.uint64(0)
        for col in range(gs):
            if nbits < T:
                sh = np.uint64(nbits)
                ba |= np.uint64(wa[w]) << sh
                bb |= np.uint64(wb[w]) << sh
                w += U1
                nbits += 32
            xc = xr[col]
            ea = ba & mask
            eb = bb & mask
            a = _fma16(a, cbg, (ea & imask) * uv, xc)
            b = _fma16(b, cbg, (eb & imask) * uv, xc)
            if rbits > 0:
                a = _fma16(a, rcbg, (ea >> uib) * uv, xc)
                b = _fma16(b, rcbg, (eb >> uib) * uv, xc)
            ba >>= uT
            bb >>= uT
            nbits -= T
    _store(y, n, r0, v, out, a)
    if r0 + 1 < R:
        _store(y, n, r0 + 1, v, out, b)


@njit(fastmath=True, cache=True)
def _row_generic(n, r, xp, words, cb, rcb, y, v, ib, rbits, osz):
    """One vector row of any length (v > 16)."""
    G, R, _ = words.shape
    out = y.shape[1]
    gs = (xp.shape[1] - osz) // G
    T = ib + rbits
    mask = np.uint64((1 << T) - 1)
    imask = np.uint64((1 << ib) - 1)
    acc = np.zeros(v, np.float32)
    for g in range(G):
        wr = words[g, r]
        base = osz + g * gs
        buf = np.uint64(0)
        nbits = 0
        w = 0
        for col in range(gs):
            if nbits < T:
                buf |= np.uint64(wr[w]) << np.uint64(nbits)
                w += 1
                nbits += 32
            e = buf & mask
            i0 = (e & imask) * np.uint64(v)
            xc = xp[n, base + col]
            for t in range(v):
                acc[t] += cb[g, i0 + np.uint64(t)] * xc
            if rbits > 0:
                i1 = (e >> np.uint64(ib)) * np.uint64(v)
                for t in range(v):
                    acc[t] += rcb[g, i1 + np.uint64(t)] * xc
            buf >>= np.uint64(T)
            nbits -= T
    for t in range(v):
        if r * v + t < out:
            y[n, r * v + t] = acc[t]


@njit(fastmath=True, cache=True)
def _main_blocks(b0, b1, xp, words, cb, rcb, y, v, ib, rbits, osz):
    for n in range(xp.shape[0]):
        for blk in range(b0, b1):
            if v <= 8:
                _block8(n, blk * 4, xp, words, cb, rcb, y, v, ib, rbits, osz)
            elif v <= 16:
                _block16(n, blk * 2, xp, words, cb, rcb, y, v, ib, rbits, osz)
            else:
                _row_generic(n, blk, xp, words, cb, rcb, y, v, ib, rbits, osz)


@njit(parallel=True, fastmath=True, cache=True)
def _main_parallel(nchunks, nblocks, xp, words, cb, rcb, y, v, ib, rbits, osz):
    for ch in prange(nchunks):
        _main_blocks(ch * nblocks // nchunks, (ch + 1) * nblocks // nchunks, xp, words, cb, rcb, y, v, ib, rbits,
                     osz)


@intrinsic
def _f32_ptr(typingctx, address):
    """intp address of float32 data -> float32* (torch tensors are passed by data_ptr to skip conversions)."""
    sig = types.CPointer(types.float32)(types.intp)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.float32)))

    return sig, codegen


@intrinsic
def _i16_ptr(typingctx, address):
    """intp address of 16-bit data (bf16 patterns) -> int16*."""
    sig = types.CPointer(types.int16)(types.intp)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.int16)))

    return sig, codegen


@njit(cache=True)
def _load_x(x_addr, n, n_in, bf16):
    """fp32 [n, n_in] activations from a contiguous fp32 or bf16 buffer at ``x_addr``."""
    if bf16:
        return _bf16_to_f32(carray(_i16_ptr(x_addr), (n, n_in)))
    return carray(_f32_ptr(x_addr), (n, n_in))


@njit(cache=True)
def _store_y(y, y_addr, bf16):
    """Write fp32 results [n, out] to the contiguous fp32 or bf16 buffer at ``y_addr``."""
    if bf16:
        _f32_to_bf16(y, carray(_i16_ptr(y_addr), y.shape))
    else:
        carray(_f32_ptr(y_addr), y.shape)[:, :] = y


@njit(cache=True)
def _bf16_to_f32(xh):
    """int16 [N, n] holding bf16 bit patterns -> float32 [N, n]."""
    bits = np.empty(xh.shape, np.uint32)
    for n in range(xh.shape[0]):
        for i in range(xh.shape[1]):
            bits[n, i] = np.uint32(np.uint16(xh[n, i])) << np.uint32(16)
    return bits.view(np.float32)


@njit(cache=True)
def _f32_to_bf16(y, yh):
    """float32 [N, n] -> int16 bf16 bit patterns, round to nearest even."""
    bits = y.view(np.uint32)
    for n in range(y.shape[0]):
        for i in range(y.shape[1]):
            u = bits[n, i]
            rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            yh[n, i] = np.int16(np.uint16(rounded))


@njit(fastmath=True, cache=True)
def vq_gemv(x_addr, y_addr, N, n_in, out, bf16_io, words, cb, rcb, oidx, ocb, perm, scale, wbias, bias, v, ib, rbits,
            osz, vo, has_perm, has_norm, has_bias, nthreads):
    """y [N, out] = Wp @ (x*scale)[perm] + dot(wbias, x) + bias (see kernels.cpu).

    x and y are contiguous [N, in] / [N, out] buffers at the given addresses, bf16 when ``bf16_io`` else fp32.
    """
    x = _load_x(x_addr, N, n_in, bf16_io)
    y = np.empty((N, out), np.float32)
    R = words.shape[1]
    xp = np.empty((N, n_in), np.float32)
    offset = np.zeros(N, np.float32)
    for n in range(N):
        for i in range(n_in):
            j = perm[i] if has_perm else i
            val = x[n, j]
            if has_norm:
                val *= scale[j]
            xp[n, i] = val
        if has_norm:
            s = np.float32(0.0)
            for i in range(n_in):
                s += wbias[i] * x[n, i]
            offset[n] = s
    rows_per_block = 4 if v <= 8 else (2 if v <= 16 else 1)
    nblocks = (R + rows_per_block - 1) // rows_per_block
    # Small layers are not worth a parallel region (~3 us to start on 2 threads).
    nchunks = min(nthreads, max(1, (nblocks * rows_per_block * v * n_in * N) // 65536))
    if nchunks <= 1:
        _main_blocks(0, nblocks, xp, words, cb, rcb, y, v, ib, rbits, osz)
    else:
        _main_parallel(nchunks, nblocks, xp, words, cb, rcb, y, v, ib, rbits, osz)
    if osz > 0:
        uvo = np.uint64(vo)
        acc = np.zeros(vo, np.float32)
        for n in range(N):
            for r in range(oidx.shape[0]):
                acc[:] = 0.0
                for col in range(osz):
                    e = np.uint64(oidx[r, col]) * uvo
                    xc = xp[n, col]
                    for t in range(vo):
                        acc[t] += ocb[e + np.uint64(t)] * xc
                for t in range(vo):
                    if r * vo + t < out:
                        y[n, r * vo + t] += acc[t]
    if has_norm or has_bias:
        for n in range(N):
            for o in range(out):
                val = offset[n]
                if has_bias:
                    val += bias[o]
                y[n, o] += val
    _store_y(y, y_addr, bf16_io)


@njit(fastmath=True, cache=True)
def _scalar_rows(o0, o1, x, codes, scales, zs, bias, y, bits, group_size, has_bias, xsum):
    """Rows o0..o1, four at a time (four independent accumulation chains; rows past o1 recompute o1-1)."""
    N, n_in = x.shape
    G = scales.shape[1]
    mask = np.uint64((1 << bits) - 1)
    ub = np.uint64(bits)
    lut = np.arange(1 << bits).astype(np.float32)  # code -> float by a load (cheaper than int->float converts)
    for n in range(N):
        xr = x[n]
        for oa in range(o0, o1, 4):
            ob = min(oa + 1, o1 - 1)
            oc = min(oa + 2, o1 - 1)
            od = min(oa + 3, o1 - 1)
            ra = codes[oa]
            rb = codes[ob]
            rc = codes[oc]
            rd = codes[od]
            ba = bb = bc = bd = np.uint64(0)
            nbits = 0
            w = np.uint64(0)
            ta = tb = tc = td = np.float32(0.0)
            for g in range(G):
                j0 = g * group_size
                j1 = min(n_in, j0 + group_size)
                sa = sb = sc = sd = np.float32(0.0)
                for j in range(j0, j1):
                    if nbits < bits:
                        sh = np.uint64(nbits)
                        ba |= np.uint64(ra[w]) << sh
                        bb |= np.uint64(rb[w]) << sh
                        bc |= np.uint64(rc[w]) << sh
                        bd |= np.uint64(rd[w]) << sh
                        w += U1
                        nbits += 32
                    xj = xr[j]
                    sa += lut[ba & mask] * xj
                    sb += lut[bb & mask] * xj
                    sc += lut[bc & mask] * xj
                    sd += lut[bd & mask] * xj
                    ba >>= ub
                    bb >>= ub
                    bc >>= ub
                    bd >>= ub
                    nbits -= bits
                xs = xsum[n, g]
                ta += scales[oa, g] * sa - zs[oa, g] * xs
                tb += scales[ob, g] * sb - zs[ob, g] * xs
                tc += scales[oc, g] * sc - zs[oc, g] * xs
                td += scales[od, g] * sd - zs[od, g] * xs
            for o, total in ((oa, ta), (oa + 1, tb), (oa + 2, tc), (oa + 3, td)):
                if o < o1:
                    y[n, o] = total + (bias[o] if has_bias else np.float32(0.0))


@njit(parallel=True, fastmath=True, cache=True)
def _scalar_parallel(nchunks, x, codes, scales, zs, bias, y, bits, group_size, has_bias, xsum):
    out = codes.shape[0]
    for ch in prange(nchunks):
        _scalar_rows(ch * out // nchunks, (ch + 1) * out // nchunks, x, codes, scales, zs, bias, y, bits, group_size,
                     has_bias, xsum)


@njit(fastmath=True, cache=True)
def scalar_gemv(x_addr, y_addr, N, n_in, bf16_io, codes, scales, zs, bias, bits, group_size, has_bias, nthreads):
    """y[n, o] = sum_g scales[o,g] * sum_{j in g} codes[o,j] x[n,j] - (scales*zeros)[o,g] * sum_{j in g} x[n,j]."""
    x = _load_x(x_addr, N, n_in, bf16_io)
    out = codes.shape[0]
    y = np.empty((N, out), np.float32)
    G = scales.shape[1]
    xsum = np.zeros((N, G), np.float32)
    for n in range(N):
        for j in range(n_in):
            xsum[n, j // group_size] += x[n, j]
    nchunks = min(nthreads, max(1, (out * n_in * N) // 65536))
    if nchunks <= 1:
        _scalar_rows(0, out, x, codes, scales, zs, bias, y, bits, group_size, has_bias, xsum)
    else:
        _scalar_parallel(nchunks, x, codes, scales, zs, bias, y, bits, group_size, has_bias, xsum)
    _store_y(y, y_addr, bf16_io)


@intrinsic
def _bf16_bits(typingctx, value):
    """float32 -> int16 bf16 bit pattern, round to nearest even (NaN payloads are not preserved)."""
    sig = types.int16(types.float32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        u = builder.bitcast(args[0], i32)
        lsb = builder.and_(builder.lshr(u, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        rounded = builder.add(builder.add(u, ir.Constant(i32, 0x7FFF)), lsb)
        return builder.trunc(builder.lshr(rounded, ir.Constant(i32, 16)), ir.IntType(16))

    return sig, codegen


@njit(cache=True)
def _bf16_row(src, dst):
    """dst[i] (int16 bf16 pattern) = round-to-nearest-even(src[i]) for a float32 row."""
    bits = src.view(np.uint32)
    for i in range(src.shape[0]):
        u = bits[i]
        dst[i] = np.int16(np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)))


@njit(fastmath=True, cache=True)
def _dequant_rows(r0, r1, o_base, out, words, cb, rcb, oidx, ocb, w, w16, v, ib, rbits, osz, vo, bf16):
    """Vector rows r0..r1 of every group (main columns), then the outlier block for the same output rows.

    Output row ``o`` (< out) goes to buffer row ``o - o_base``. Each packed row is decoded once into a
    scratch array of codebook offsets; then every output row ``r*v + t`` is written contiguously.
    """
    G, R, _ = words.shape
    n_in = w16.shape[1] if bf16 else w.shape[1]
    gs = (n_in - osz) // G
    T = ib + rbits
    mask = np.uint64((1 << T) - 1)
    imask = np.uint64((1 << ib) - 1)
    uv = np.uint64(v)
    row_f32 = np.empty(max(gs, osz), np.float32)
    for g in range(G):
        cbg = cb[g]
        rcbg = rcb[g] if rbits > 0 else rcb[0]
        col0 = osz + g * gs
        for r in range(r0, r1):
            row = words[g, r]
            nv = min(v, out - r * v)  # rows of this vector that exist (the last one may be cut)
            buf = np.uint64(0)
            nbits = 0
            wi = np.uint64(0)
            for col in range(gs):
                if nbits < T:
                    buf |= np.uint64(row[wi]) << np.uint64(nbits)
                    wi += U1
                    nbits += 32
                e = buf & mask
                i0 = (e & imask) * uv
                i1 = (e >> np.uint64(ib)) * uv
                c = col0 + col
                o = r * v - o_base
                for t in range(nv):
                    value = cbg[i0 + np.uint64(t)]
                    if rbits > 0:
                        value += rcbg[i1 + np.uint64(t)]
                    if bf16:
                        w16[o + t, c] = _bf16_bits(value)
                    else:
                        w[o + t, c] = value
                buf >>= np.uint64(T)
                nbits -= T
    if osz > 0:
        # output rows [r0*v, min(out, r1*v)) belong to this call; outlier rows are vo long
        o_lo = r0 * v
        o_hi = min(out, r1 * v)
        uvo = np.uint64(vo)
        for o in range(o_lo, o_hi):
            orow = o // vo
            ut = np.uint64(o - orow * vo)
            for col in range(osz):
                row_f32[col] = ocb[np.uint64(oidx[orow, col]) * uvo + ut]
            if bf16:
                _bf16_row(row_f32[:osz], w16[o - o_base, :osz])
            else:
                w[o - o_base, :osz] = row_f32[:osz]


@njit(parallel=True, cache=True)
def _dequant_parallel(nchunks, r_begin, r_end, out, words, cb, rcb, oidx, ocb, w, w16, v, ib, rbits, osz, vo, bf16):
    n = r_end - r_begin
    for ch in prange(nchunks):
        _dequant_rows(r_begin + ch * n // nchunks, r_begin + (ch + 1) * n // nchunks, r_begin * v, out, words, cb,
                      rcb, oidx, ocb, w, w16, v, ib, rbits, osz, vo, bf16)


@njit(cache=True)
def vq_dequant(w_addr, r_begin, r_end, out, n_in, bf16, words, cb, rcb, oidx, ocb, v, ib, rbits, osz, vo, nthreads):
    """Rows [r_begin*v, min(out, r_end*v)) of the stored-order weight Wp [out, n_in] (outlier columns first)
    into the contiguous fp32 or bf16 buffer at ``w_addr`` (its row 0 is output row r_begin*v)."""
    rows = min(out, r_end * v) - r_begin * v
    if bf16:
        w16 = carray(_i16_ptr(w_addr), (rows, n_in))
        w = np.empty((1, 1), np.float32)
    else:
        w = carray(_f32_ptr(w_addr), (rows, n_in))
        w16 = np.empty((1, 1), np.int16)
    nchunks = min(nthreads, max(1, (rows * n_in) // 65536), r_end - r_begin)
    if nchunks <= 1:
        _dequant_rows(r_begin, r_end, r_begin * v, out, words, cb, rcb, oidx, ocb, w, w16, v, ib, rbits, osz, vo,
                      bf16)
    else:
        _dequant_parallel(nchunks, r_begin, r_end, out, words, cb, rcb, oidx, ocb, w, w16, v, ib, rbits, osz, vo,
                          bf16)


@njit(fastmath=True, cache=True)
def _scalar_rows_aligned(o0, o1, xt, codes, scales, zs, bias, y, bits, group_size, has_bias, xsum):
    """Rows o0..o1 when codes never straddle words (32 % bits == 0): for each shift k the column loop is
    contiguous (codes word w, xt[n, k, w] = x[n, w*per + k]) and vectorises."""
    N, per, W = xt.shape
    G = scales.shape[1]
    m = np.uint32((1 << bits) - 1)
    for n in range(N):
        for o in range(o0, o1):
            row = codes[o]
            total = np.float32(0.0)
            for g in range(G):
                w0 = (g * group_size) // per
                w1 = W if g == G - 1 else ((g + 1) * group_size) // per
                acc = np.float32(0.0)
                rowg = row[w0:w1]
                for k in range(per):
                    sh = np.uint32(k * bits)
                    xk = xt[n, k, w0:w1]
                    for w in range(rowg.shape[0]):
                        acc += np.float32(np.int32((rowg[w] >> sh) & m)) * xk[w]
                total += scales[o, g] * acc - zs[o, g] * xsum[n, g]
            if has_bias:
                total += bias[o]
            y[n, o] = total


@njit(parallel=True, fastmath=True, cache=True)
def _scalar_aligned_parallel(nchunks, xt, codes, scales, zs, bias, y, bits, group_size, has_bias, xsum):
    out = codes.shape[0]
    for ch in prange(nchunks):
        _scalar_rows_aligned(ch * out // nchunks, (ch + 1) * out // nchunks, xt, codes, scales, zs, bias, y, bits,
                             group_size, has_bias, xsum)


@njit(fastmath=True, cache=True)
def scalar_gemv_aligned(x_addr, y_addr, N, n_in, bf16_io, codes, scales, zs, bias, bits, group_size, has_bias,
                        nthreads):
    """``scalar_gemv`` for bits in {1, 2, 4, 8} with group_size a multiple of 32 // bits (or one group)."""
    x = _load_x(x_addr, N, n_in, bf16_io)
    out, W = codes.shape
    per = 32 // bits
    G = scales.shape[1]
    xt = np.zeros((N, per, W), np.float32)
    xsum = np.zeros((N, G), np.float32)
    for n in range(N):
        for j in range(n_in):
            xt[n, j % per, j // per] = x[n, j]
            xsum[n, j // group_size] += x[n, j]
    y = np.empty((N, out), np.float32)
    nchunks = min(nthreads, max(1, (out * n_in * N) // 131072))
    if nchunks <= 1:
        _scalar_rows_aligned(0, out, xt, codes, scales, zs, bias, y, bits, group_size, has_bias, xsum)
    else:
        _scalar_aligned_parallel(nchunks, xt, codes, scales, zs, bias, y, bits, group_size, has_bias, xsum)
    _store_y(y, y_addr, bf16_io)


_VQ_SIG = (
    "void(intp, intp, int64, int64, int64, boolean, uint32[:, :, ::1], float32[:, ::1], float32[:, ::1], "
    "uint16[:, ::1], float32[::1], int64[::1], float32[::1], float32[::1], float32[::1], "
    "int64, int64, int64, int64, int64, boolean, boolean, boolean, int64)"
)
_SCALAR_SIG = (
    "void(intp, intp, int64, int64, boolean, uint32[:, ::1], float32[:, ::1], float32[:, ::1], float32[::1], "
    "int64, int64, boolean, int64)"
)


_DEQUANT_SIG = (
    "void(intp, int64, int64, int64, int64, boolean, uint32[:, :, ::1], float32[:, ::1], float32[:, ::1], "
    "uint16[:, ::1], float32[::1], int64, int64, int64, int64, int64, int64)"
)


def compile_all() -> None:
    """Compile (or load from the on-disk cache) the kernels; ``kernels.cpu`` calls this with SLP vectorisation
    on and loop vectorisation off (gathers made by the loop vectoriser are slower than scalar loads here)."""
    vq_gemv.compile(_VQ_SIG)
    scalar_gemv.compile(_SCALAR_SIG)
    vq_dequant.compile(_DEQUANT_SIG)


def compile_vectorised() -> None:
    """Kernels whose inner loops are contiguous: compiled with numba's default (loop-vectorising) flags."""
    scalar_gemv_aligned.compile(_SCALAR_SIG)
