/* specdecode/fast/quant16.c -- 16-column interleaved quantized layouts and kernels (included by quant.c) */

/* ---------------------------------------------------------------- 16-column interleaved K formats
 *
 * For several rows (verify passes) the per-column kernel above spends ~4 instructions per 64
 * weights per row.  Q4_K and Q6_K matrices whose segments have a multiple of 16 rows are repacked
 * at load (losslessly: the same integers and fp16 / 6-bit / int8 scales) so that one VPDPBUSD
 * computes 16 columns x 4 k for one row against a broadcast of 4 activation bytes, and the scales
 * become 16-lane vectors (one lane per column):
 *
 *   Q4_K16, per 16 columns and 256 k (2368 bytes):  d[16] fp16 | dmin[16] fp16 | sc[8][16] u8 |
 *     mn[8][16] u8 | q[8 sub-blocks][4][64]: byte 4c+i of vector (j, t) holds u[c][32j+8t+i] in
 *     its low nibble and u[c][32j+8t+4+i] in its high nibble.
 *   Q6_K16, per 16 columns and 256 k (3360 bytes):  d[16] fp16 | sc[16][16] int8 |
 *     per 16-k sub-block s: lo[2][64] (nibbles of k4-groups (0,1) and (2,3)) | hi[64] (bits 2t,
 *     2t+1 of byte 4c+i: the high 2 bits of u[c][16s+4t+i]).
 *
 * Per row and 32 k: 8 VPDPBUSD into an int32 accumulator, one conversion, one FMA with the 16
 * columns' scales; the 16 lanes are the 16 outputs (no horizontal sum).  The same instruction
 * sequence for every row and any row count: batch invariant. */

#define Q4K16_BYTES 2368
#define Q6K16_BYTES 3360

/* Software prefetch (PREFETCHT2: into L2 on current Intel cores) in the quantized kernels, SD_QPREFETCH
 * bytes ahead of each block (0 = none; the dense kernels' prefetch() is tuned for bf16).  Set at build
 * time from SPECDECODE_QPREFETCH or the CPU's vendor (linear.py).
 *
 * The row loops are unrolled (`#pragma GCC unroll 8`, the block loops not): with R a constant of the
 * inlined call every accumulator then stays in a register; without it gcc 12 kept them on the stack and
 * 7-8 rows ran ~12% slower (2-core Sapphire Rapids, L2-resident Q4_K16 block, 187 -> 211 GMAC/s per
 * core at 8 rows).  The instructions per row and their order are unchanged, so are the results. */
#ifndef SD_QPREFETCH
#define SD_QPREFETCH 0
#endif
#if SD_QPREFETCH
#define qprefetch(p) __asm__ volatile("prefetcht2 %0" : : "m"(*((const char *)(p) + SD_QPREFETCH)))
#else
#define qprefetch(p) ((void)(p))
#endif

#if defined(__AVX512F__)
typedef int32_t sd_i32u __attribute__((may_alias, aligned(1)));
/* 4 activation bytes broadcast to 16 lanes (folds into VPDPBUSD's {1to16} memory operand) */
static inline __m512i bcast4(const int8_t *p) {
    return _mm512_set1_epi32(*(const sd_i32u *)p);
}

static inline __attribute__((always_inline)) void
q4k16_group(const uint8_t *grp, int K, const int8_t *xq, const float *dq, const float *sums, int R, float *out) {
    const int NC = K / 256, KB = K / 32, QS = QS_STRIDE(K);
    __m512 acc[SD_QROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < NC; c++) {
        const uint8_t *sb = grp + (size_t)c * Q4K16_BYTES;
        for (int p = 0; p < Q4K16_BYTES; p += 64) qprefetch(sb + p);
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 32)));
#pragma GCC unroll 1
        for (int j = 0; j < 8; j++) {
            const __m512 scj = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sb + 64 + 16 * j)))));
            const __m512 mnj = _mm512_mul_ps(mv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sb + 192 + 16 * j)))));
            __m512i lo[4], hi[4];
            for (int t = 0; t < 4; t++) {
                const __m512i v = _mm512_loadu_si512(sb + 320 + 256 * j + 64 * t);
                lo[t] = _mm512_and_si512(v, m4);
                hi[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const int8_t *xr = xq + (size_t)r * K + 256 * c + 32 * j;
                __m512i ia = _mm512_setzero_si512(), ib = _mm512_setzero_si512();   /* two chains (exact ints) */
                for (int t = 0; t < 4; t++) {
                    ia = _mm512_dpbusd_epi32(ia, lo[t], bcast4(xr + 8 * t));
                    ib = _mm512_dpbusd_epi32(ib, hi[t], bcast4(xr + 8 * t + 4));
                }
                ia = _mm512_add_epi32(ia, ib);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(scj, _mm512_set1_ps(dq[(size_t)r * KB + 8 * c + j])),
                                         acc[r]);
                acc[r] = _mm512_fnmadd_ps(mnj, _mm512_set1_ps(sums[(size_t)r * QS + QS_SX(K) + 8 * c + j]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

static inline __attribute__((always_inline)) void
q6k16_group(const uint8_t *grp, int K, const int8_t *xq, const float *dq, const float *sums, int R, float *out) {
    const int NC = K / 256, KB = K / 32, QS = QS_STRIDE(K);
    __m512 acc[SD_QROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x30);
    for (int c = 0; c < NC; c++) {
        const uint8_t *sb = grp + (size_t)c * Q6K16_BYTES;
        for (int p = 0; p < Q6K16_BYTES; p += 64) qprefetch(sb + p);
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
#pragma GCC unroll 1
        for (int s = 0; s < 16; s++) {
            const __m512 scs = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sb + 32 + 16 * s)))));
            const __m512 off = _mm512_mul_ps(scs, _mm512_set1_ps(32.f));
            const uint8_t *q = sb + 288 + 192 * s;
            const __m512i a = _mm512_loadu_si512(q), b = _mm512_loadu_si512(q + 64), h = _mm512_loadu_si512(q + 128);
            __m512i u[4];
            u[0] = _mm512_or_si512(_mm512_and_si512(a, m4), _mm512_and_si512(_mm512_slli_epi16(h, 4), m2));
            u[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), m4), _mm512_and_si512(_mm512_slli_epi16(h, 2), m2));
            u[2] = _mm512_or_si512(_mm512_and_si512(b, m4), _mm512_and_si512(h, m2));
            u[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), m4), _mm512_and_si512(_mm512_srli_epi16(h, 2), m2));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const int8_t *xr = xq + (size_t)r * K + 256 * c + 16 * s;
                __m512i ia = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], bcast4(xr));
                __m512i ib = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], bcast4(xr + 4));
                ia = _mm512_dpbusd_epi32(ia, u[2], bcast4(xr + 8));
                ib = _mm512_dpbusd_epi32(ib, u[3], bcast4(xr + 12));
                ia = _mm512_add_epi32(ia, ib);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(scs, _mm512_set1_ps(dq[(size_t)r * KB + 8 * c + s / 2])),
                                         acc[r]);
                acc[r] = _mm512_fnmadd_ps(off, _mm512_set1_ps(sums[(size_t)r * QS + QS_SX16(K) + 16 * c + s]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

#endif

/* The 32-block formats 16 columns at a time, per block of 32 k (the file's bytes, rearranged):
 *   d[16] fp16 | m[16] fp16 (Q4_1, Q5_1) | 4-bit: q[4][64] as Q4_K16's sub-block; 5-bit: then
 *   hb[8] u64 masks (bit 4c+i of mask G: the high bit of u[c][4G+i]); Q8_0: q[8][64] with byte
 *   4c+i of vector G = q[c][4G+i] ^ 0x80 (u = q + 128). */
static inline int leg16_bytes(int type) {
    return type == GQ_Q4_016 ? 288 : type == GQ_Q4_116 ? 320 : type == GQ_Q5_016 ? 352 : type == GQ_Q5_116 ? 384 : 544;
}

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void
leg16_group(int type, const uint8_t *grp, int K, const int8_t *xq, const float *dq, const float *sums, int R,
            float *out) {
    const int QS = QS_STRIDE(K), KB = K / 32, BB = leg16_bytes(type);
    const int has_m = type == GQ_Q4_116 || type == GQ_Q5_116, five = type == GQ_Q5_016 || type == GQ_Q5_116;
    /* activations: one scale per block (dq[r][b], Q_BLOCK).  Without a min the sign offset enters the
     * exact integer sum (sum(u x) + offset * sum(x)); with one, its term is m * (sum(x) * scale) */
    const int slot = type == GQ_Q4_016 ? 0 : type == GQ_Q5_016 ? 1 : 2;
    const float *sx = sums + QS_SX(K);
    const sd_i32a *c32 = (const sd_i32a *)(sums + QS_C32(K, slot));
    __m512 acc[SD_QROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0F), b16 = _mm512_set1_epi8(16);
    for (int b = 0; b < KB; b++) {
        const uint8_t *blk = grp + (size_t)b * BB;
        for (int p = 0; p < BB; p += 64) qprefetch(blk + p);
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 mv = has_m ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32))) : dv;
        const uint8_t *q = blk + 32 + 32 * has_m;
        __m512i u[8];
        if (type == GQ_Q8_016) {
            for (int G = 0; G < 8; G++) u[G] = _mm512_loadu_si512(q + 64 * G);
        } else {
            for (int t = 0; t < 4; t++) {
                const __m512i v = _mm512_loadu_si512(q + 64 * t);
                u[2 * t] = _mm512_and_si512(v, m4);
                u[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
            if (five)
                for (int G = 0; G < 8; G++) {
                    uint64_t hb;
                    memcpy(&hb, q + 256 + 8 * G, 8);
                    u[G] = _mm512_or_si512(u[G], _mm512_maskz_mov_epi8(_cvtu64_mask64(hb), b16));
                }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xq + (size_t)r * K + 32 * b;
            __m512i ia = _mm512_setzero_si512(), ib = _mm512_setzero_si512();   /* two chains (exact ints) */
            for (int G = 0; G < 8; G += 2) {
                ia = _mm512_dpbusd_epi32(ia, u[G], bcast4(xr + 4 * G));
                ib = _mm512_dpbusd_epi32(ib, u[G + 1], bcast4(xr + 4 * G + 4));
            }
            ia = _mm512_add_epi32(ia, ib);
            const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(dq[(size_t)r * KB + b]));
            if (has_m) {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), scale, acc[r]);
                acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[(size_t)r * QS + b]), acc[r]);
            } else {
                ia = _mm512_add_epi32(ia, _mm512_set1_epi32(c32[(size_t)r * QS + b]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), scale, acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

#else
#include "quant16_avx2.c"   /* the three kernels above on 8-column halves */
#endif

#include "quant16_amx.c"    /* the same kernels on AMX int8 tiles, for verify passes */

/* Rows sharing one decode of a weight block: 8 with AVX512's 32 vector registers (per row an fp32
 * partial sum and accumulator, plus the decoded block: no spills), 4 with AVX2's 16. */
#if defined(__AVX512F__)
#define Q16_SHARE 8
#define Q16_CASES(CALL) case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break;
#else
#define Q16_SHARE 4
#define Q16_CASES(CALL) default: CALL(4); break;
#endif

static void leg16_rows(int type, const uint8_t *grp, int K, const int8_t *xq, const float *dq, const float *sums,
                       int R, float *out) {
#define LEG16_CALL(n) leg16_group(T_, grp, K, xq, dq, sums, n, out)
#define LEG16(T)                                                                                      \
    {                                                                                                 \
    enum { T_ = T };                                                                                  \
    switch (R) {                                                                                      \
    case 1: LEG16_CALL(1); break;                                                                     \
    case 2: LEG16_CALL(2); break;                                                                     \
    case 3: LEG16_CALL(3); break;                                                                     \
    case 4: LEG16_CALL(4); break;                                                                     \
    Q16_CASES(LEG16_CALL)                                                                             \
    }                                                                                                 \
    }
    switch (type) {
    case GQ_Q4_016: LEG16(GQ_Q4_016) break;
    case GQ_Q4_116: LEG16(GQ_Q4_116) break;
    case GQ_Q5_016: LEG16(GQ_Q5_016) break;
    case GQ_Q5_116: LEG16(GQ_Q5_116) break;
    default: LEG16(GQ_Q8_016) break;
    }
#undef LEG16
#undef LEG16_CALL
}

static void sd_repack16_legacy(int type, const uint8_t *src, long row_bytes, int K, long n, uint8_t *dst) {
    const int KB = K / 32, has_m = type == GQ_Q4_1 || type == GQ_Q5_1, five = type == GQ_Q5_0 || type == GQ_Q5_1;
    const int bs = type == GQ_Q4_0 ? 18 : type == GQ_Q4_1 ? 20 : type == GQ_Q5_0 ? 22 : type == GQ_Q5_1 ? 24 : 34;
    const int BB = 16 * bs;
    for (long g = 0; g < n / 16; g++)
        for (int b = 0; b < KB; b++) {
            uint8_t *o = dst + ((size_t)g * KB + b) * BB, *q = o + 32 + 32 * has_m;
            memset(o, 0, (size_t)BB);
            for (int col = 0; col < 16; col++) {
                const uint8_t *blk = src + (size_t)(16 * g + col) * row_bytes + (size_t)b * bs;
                memcpy(o + 2 * col, blk, 2);
                if (has_m) memcpy(o + 32 + 2 * col, blk + 2, 2);
                if (type == GQ_Q8_0) {
                    for (int k = 0; k < 32; k++) q[64 * (k / 4) + 4 * col + k % 4] = blk[2 + k] ^ 0x80;
                    continue;
                }
                const uint8_t *qs = blk + 2 + 2 * has_m + 4 * five;
                uint32_t qh = 0;
                if (five) memcpy(&qh, blk + 2 + 2 * has_m, 4);
                for (int k = 0; k < 32; k++) {
                    const int u = k < 16 ? qs[k] & 0xF : qs[k - 16] >> 4, G = k / 4, i = k % 4;
                    uint8_t *byte = q + 64 * (G >> 1) + 4 * col + i;
                    *byte |= (uint8_t)((G & 1) ? u << 4 : u);
                    if (five && ((qh >> k) & 1)) q[256 + 8 * G + (4 * col + i) / 8] |= (uint8_t)(1u << ((4 * col + i) % 8));
                }
            }
        }
}

#define Q4K_CALL(n) q4k16_group(grp, K, xq, dq, sums, n, out)
#define Q6K_CALL(n) q6k16_group(grp, K, xq, dq, sums, n, out)
#define Q16_FOR(CALL)                                                                                 \
    switch (R) {                                                                                      \
    case 1: CALL(1); break;                                                                           \
    case 2: CALL(2); break;                                                                           \
    case 3: CALL(3); break;                                                                           \
    case 4: CALL(4); break;                                                                           \
    Q16_CASES(CALL)                                                                                   \
    }

static void q16_group(int type, const uint8_t *grp, int K, const int8_t *xq, const float *dq, const float *sums,
                      int R, float *out) {
    if (type == GQ_Q4_K16) { Q16_FOR(Q4K_CALL) }
    else { Q16_FOR(Q6K_CALL) }
}

/* Bytes of one 16-column group of an interleaved segment over K; 0 for the file layouts. */
static size_t q16_group_bytes(int type, int K) {
    switch (type) {
    case GQ_Q4_K16: return (size_t)(K / 256) * Q4K16_BYTES;
    case GQ_Q6_K16: return (size_t)(K / 256) * Q6K16_BYTES;
    case GQ_Q4_016: case GQ_Q4_116: case GQ_Q5_016: case GQ_Q5_116: case GQ_Q8_016:
        return (size_t)(K / 32) * leg16_bytes(type);
    default: return 0;
    }
}

/* R activation rows (any count) against one 16-column group -> out[R][16]; Q16_SHARE rows share a
 * decode (more would spill registers). */
static void q16_rows(int type, const uint8_t *grp, int K, const int8_t *xq, const float *dq, const float *sums,
                     int R, float *out) {
    const int KB = K / 32, QS = QS_STRIDE(K);
    for (int r0 = 0; r0 < R; r0 += Q16_SHARE) {
        const int rr = R - r0 < Q16_SHARE ? R - r0 : Q16_SHARE;
        const int8_t *x = xq + (size_t)r0 * K;
        const float *d = dq + (size_t)r0 * KB, *sm = sums + (size_t)r0 * QS;
        if (type == GQ_Q4_K16 || type == GQ_Q6_K16) q16_group(type, grp, K, x, d, sm, rr, out + 16 * r0);
        else leg16_rows(type, grp, K, x, d, sm, rr, out + 16 * r0);
    }
}

/* Repack rows [16g, 16g+16) of a Q4_K / Q6_K segment (file layout, row_bytes each) into the
 * interleaved layout above; dst holds n/16 groups of (K/256) super-blocks. */
void sd_repack16(int type, const uint8_t *src, long row_bytes, int K, long n, uint8_t *dst) {
    if (type != GQ_Q4_K && type != GQ_Q6_K) { sd_repack16_legacy(type, src, row_bytes, K, n, dst); return; }
    const int NC = K / 256;
    for (long g = 0; g < n / 16; g++)
        for (int c = 0; c < NC; c++) {
            if (type == GQ_Q4_K) {
                uint8_t *o = dst + ((size_t)g * NC + c) * Q4K16_BYTES;
                for (int col = 0; col < 16; col++) {
                    const uint8_t *blk = src + (size_t)(16 * g + col) * row_bytes + (size_t)c * 144, *qs = blk + 16;
                    memcpy(o + 2 * col, blk, 2);
                    memcpy(o + 32 + 2 * col, blk + 2, 2);
                    for (int j = 0; j < 8; j++) {
                        int sc, mn;
                        scale_min_k4(j, blk + 4, &sc, &mn);
                        o[64 + 16 * j + col] = (uint8_t)sc;
                        o[192 + 16 * j + col] = (uint8_t)mn;
                        for (int t = 0; t < 4; t++)
                            for (int i = 0; i < 4; i++) {
                                const int l0 = 8 * t + i, l1 = 8 * t + 4 + i;   /* within sub-block j */
                                const int u0 = (j & 1) ? qs[32 * (j >> 1) + l0] >> 4 : qs[32 * (j >> 1) + l0] & 0xF;
                                const int u1 = (j & 1) ? qs[32 * (j >> 1) + l1] >> 4 : qs[32 * (j >> 1) + l1] & 0xF;
                                o[320 + 256 * j + 64 * t + 4 * col + i] = (uint8_t)(u0 | (u1 << 4));
                            }
                    }
                }
            } else {   /* Q6_K */
                uint8_t *o = dst + ((size_t)g * NC + c) * Q6K16_BYTES;
                for (int col = 0; col < 16; col++) {
                    const uint8_t *blk = src + (size_t)(16 * g + col) * row_bytes + (size_t)c * 210;
                    memcpy(o + 2 * col, blk + 208, 2);
                    for (int sidx = 0; sidx < 16; sidx++) o[32 + 16 * sidx + col] = blk[192 + sidx];
                    for (int k = 0; k < 256; k++) {       /* u = q + 32 in 0..63, ggml's Q6_K order */
                        const int n = k / 128, t = (k % 128) / 32, l = k % 32;
                        const uint8_t *ql = blk + 64 * n, hb = blk[128 + 32 * n + l];
                        const int lo = (t == 0) ? ql[l] & 0xF : (t == 1) ? ql[l + 32] & 0xF : (t == 2) ? ql[l] >> 4 : ql[l + 32] >> 4;
                        const int hi2 = (hb >> (2 * t)) & 3;
                        const int sidx = k / 16, grp4 = (k % 16) / 4, i = k % 4;
                        uint8_t *q = o + 288 + 192 * sidx;
                        uint8_t *lob = q + 64 * (grp4 >> 1) + 4 * col + i;
                        *lob = (grp4 & 1) ? (uint8_t)((*lob & 0x0F) | (lo << 4)) : (uint8_t)((*lob & 0xF0) | lo);
                        uint8_t *hib = q + 128 + 4 * col + i;
                        *hib = (uint8_t)((*hib & ~(3 << (2 * grp4))) | (hi2 << (2 * grp4)));
                    }
                }
            }
        }
}

