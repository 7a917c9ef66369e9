/* specdecode/fast/quant16_avx2.c -- the 16-column quantized kernels of quant16.c on AVX2
 * (included by quant16.c in place of its AVX512 kernels when the CPU has no AVX512F).
 *
 * A 16-column group is two independent 8-column halves: every lane of the AVX512 kernels is one
 * column and no instruction mixes lanes, so each half runs the AVX512 kernel's instruction
 * sequence on 256-bit vectors (bytes 32h..32h+31 of every 64-byte vector, lanes 8h..8h+7 of every
 * scale vector). VPDPBUSD becomes VPMADDUBSW (+ VPADDW for as many as fit) + VPMADDWD, exact while a
 * weight byte is < 128 (the 4/5/6-bit formats; Q8_0 multiplies the signed weights instead, see
 * q8_16_group). The integer sums are exact and every row runs the same instruction sequence, so
 * each column's result is the same whatever the row count (batch invariant). */

typedef int32_t sd_i32u2 __attribute__((may_alias, aligned(1)));

static inline __m256i bcast4_8(const int8_t *p) { return _mm256_set1_epi32(*(const sd_i32u2 *)p); }

/* u8 * s8 products summed in pairs into 16-bit lanes (VPMADDUBSW): exact while |sum| < 2^15, which
 * the callers keep by how many they add before widening: |x| <= 127, so a pair is at most 3810 for
 * 4-bit u (8 pairs fit), 7874 for 5-bit (4 fit), 16002 for 6-bit (2 fit). Adding in 16 bits before
 * one VPMADDWD gives the same integer as widening every pair: only the integer sums' order changes. */
static inline __m256i pairs(__m256i u, const int8_t *x) { return _mm256_maddubs_epi16(u, bcast4_8(x)); }
static inline __m256i widen(__m256i p16) { return _mm256_madd_epi16(p16, _mm256_set1_epi16(1)); }


static inline __m256 cvtph8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256 cvtu8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 cvti8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256i ld32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 32 bits -> 32 bytes: byte i is `value` where bit i is set, else 0 */
static inline __m256i bits_to_bytes(uint32_t bits, __m256i value) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL,
                                                                  0x0202020202020202LL, 0x0303030303030303LL));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), value);
}

/* Q8_0, 8 columns x 32 k per block: int8 weights times int8 activations as |q| * (x with q's sign)
 * (VPSIGNB, then VPMADDUBSW: a pair is at most 2 * 128 * 127 < 2^15, exact), each pair sum widened.
 * The weight vector is the outer loop and rows the inner one, so only one weight vector and a
 * 32-bit sum per row are live.  No offset term: the integers are the weights themselves. */
static inline __attribute__((always_inline)) void
q8_16_group(const uint8_t *grp, int K, const int8_t *xq, const float *dq, int R, float *out) {
    const int KB = K / 32, BB = leg16_bytes(GQ_Q8_016);           /* dq: one activation scale per block */
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int h = 0; h < 2; h++) {
        __m256 fs[4];
        float *o = out + 8 * h;
        for (int r = 0; r < R; r++) { _mm256_storeu_ps(o + 16 * r, _mm256_setzero_ps()); fs[r] = _mm256_setzero_ps(); }
        for (int b = 0; b < KB; b++) {
            const uint8_t *blk = grp + (size_t)b * BB, *q = blk + 32;    /* d[16] fp16 | q[8][64] (q + 128) */
            __m256i ia[4];
            for (int r = 0; r < R; r++) ia[r] = _mm256_setzero_si256();
            for (int G = 0; G < 8; G++) {
                const __m256i u = _mm256_xor_si256(ld32(q + 64 * G + 32 * h), flip), au = _mm256_abs_epi8(u);
                for (int r = 0; r < R; r++) {
                    const __m256i xs = _mm256_sign_epi8(bcast4_8(xq + (size_t)r * K + 32 * b + 4 * G), u);
                    ia[r] = _mm256_add_epi32(ia[r], widen(_mm256_maddubs_epi16(au, xs)));
                }
            }
            const __m256 dv = cvtph8(blk + 16 * h);
            for (int r = 0; r < R; r++)
                fs[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r]), _mm256_mul_ps(dv, _mm256_set1_ps(dq[(size_t)r * KB + b])),
                                        fs[r]);
            if ((b & 7) == 7 || b == KB - 1) {
                for (int r = 0; r < R; r++) {
                    _mm256_storeu_ps(o + 16 * r, _mm256_add_ps(fs[r], _mm256_loadu_ps(o + 16 * r)));
                    fs[r] = _mm256_setzero_ps();
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void
q4k16_group(const uint8_t *grp, int K, const int8_t *xq, const float *dq, const float *sums, int R, float *out) {
    const int NC = K / 256, KB = K / 32, QS = QS_STRIDE(K);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {
        float *o = out + 8 * h;           /* the row sums live in `out` (registers are short) */
        for (int r = 0; r < R; r++) _mm256_storeu_ps(o + 16 * r, _mm256_setzero_ps());
        for (int c = 0; c < NC; c++) {
            const uint8_t *sb = grp + (size_t)c * Q4K16_BYTES;
            const __m256 dv = cvtph8(sb + 16 * h), mv = cvtph8(sb + 32 + 16 * h);
            __m256 fs[4];
            for (int r = 0; r < R; r++) fs[r] = _mm256_setzero_ps();
            for (int j = 0; j < 8; j++) {
                const __m256 scj = _mm256_mul_ps(dv, cvtu8x8(sb + 64 + 16 * j + 8 * h));
                const __m256 mnj = _mm256_mul_ps(mv, cvtu8x8(sb + 192 + 16 * j + 8 * h));
                __m256i lo[4], hi[4];
                for (int t = 0; t < 4; t++) {
                    const __m256i v = ld32(sb + 320 + 256 * j + 64 * t + 32 * h);
                    lo[t] = _mm256_and_si256(v, m4);
                    hi[t] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                }
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = xq + (size_t)r * K + 256 * c + 32 * j;
                    __m256i p = _mm256_add_epi16(pairs(lo[0], xr), pairs(hi[0], xr + 4));   /* 4-bit: 8 pairs fit */
                    for (int t = 1; t < 4; t++)
                        p = _mm256_add_epi16(p, _mm256_add_epi16(pairs(lo[t], xr + 8 * t), pairs(hi[t], xr + 8 * t + 4)));
                    const __m256i ia = widen(p);
                    fs[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia),
                                            _mm256_mul_ps(scj, _mm256_set1_ps(dq[(size_t)r * KB + 8 * c + j])), fs[r]);
                    fs[r] = _mm256_fnmadd_ps(mnj, _mm256_set1_ps(sums[(size_t)r * QS + QS_SX(K) + 8 * c + j]), fs[r]);
                }
            }
            for (int r = 0; r < R; r++)
                _mm256_storeu_ps(o + 16 * r, _mm256_add_ps(fs[r], _mm256_loadu_ps(o + 16 * r)));
        }
    }
}

static inline __attribute__((always_inline)) void
q6k16_group(const uint8_t *grp, int K, const int8_t *xq, const float *dq, const float *sums, int R, float *out) {
    const int NC = K / 256, KB = K / 32, QS = QS_STRIDE(K);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        float *o = out + 8 * h;           /* the row sums live in `out` (registers are short) */
        for (int r = 0; r < R; r++) _mm256_storeu_ps(o + 16 * r, _mm256_setzero_ps());
        for (int c = 0; c < NC; c++) {
            const uint8_t *sb = grp + (size_t)c * Q6K16_BYTES;
            const __m256 dv = cvtph8(sb + 16 * h);
            __m256 fs[4];
            for (int r = 0; r < R; r++) fs[r] = _mm256_setzero_ps();
            for (int s = 0; s < 16; s++) {
                const __m256 scs = _mm256_mul_ps(dv, cvti8x8(sb + 32 + 16 * s + 8 * h));
                const __m256 off = _mm256_mul_ps(scs, _mm256_set1_ps(32.f));
                const uint8_t *q = sb + 288 + 192 * s;
                const __m256i a = ld32(q + 32 * h), b = ld32(q + 64 + 32 * h), hb = ld32(q + 128 + 32 * h);
                __m256i u[4];
                u[0] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m2));
                u[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m2));
                u[2] = _mm256_or_si256(_mm256_and_si256(b, m4), _mm256_and_si256(hb, m2));
                u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hb, 2), m2));
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = xq + (size_t)r * K + 256 * c + 16 * s;
                    /* 6-bit: 2 pairs fit in 16 bits */
                    const __m256i ia = _mm256_add_epi32(widen(_mm256_add_epi16(pairs(u[0], xr), pairs(u[2], xr + 8))),
                                                        widen(_mm256_add_epi16(pairs(u[1], xr + 4), pairs(u[3], xr + 12))));
                    fs[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia),
                                            _mm256_mul_ps(scs, _mm256_set1_ps(dq[(size_t)r * KB + 8 * c + s / 2])), fs[r]);
                    fs[r] = _mm256_fnmadd_ps(off, _mm256_set1_ps(sums[(size_t)r * QS + QS_SX16(K) + 16 * c + s]), fs[r]);
                }
            }
            for (int r = 0; r < R; r++)
                _mm256_storeu_ps(o + 16 * r, _mm256_add_ps(fs[r], _mm256_loadu_ps(o + 16 * r)));
        }
    }
}

static inline __attribute__((always_inline)) void
leg16_group(int type, const uint8_t *grp, int K, const int8_t *xq, const float *dq, const float *sums, int R,
            float *out) {
    if (type == GQ_Q8_016) { q8_16_group(grp, K, xq, dq, R, out); return; }   /* signed weights */
    const int QS = QS_STRIDE(K), KB = K / 32, BB = leg16_bytes(type);          /* dq: one activation scale per block */
    const int has_m = type == GQ_Q4_116 || type == GQ_Q5_116, five = type == GQ_Q5_016 || type == GQ_Q5_116;
    const float center = type == GQ_Q4_016 ? -8.f : type == GQ_Q5_016 ? -16.f : 0.f;
    const __m256i m4 = _mm256_set1_epi8(0x0F), b16 = _mm256_set1_epi8(16);
    for (int h = 0; h < 2; h++) {
        __m256 fs[4];
        float *o = out + 8 * h;           /* the row sums live in `out` (registers are short) */
        for (int r = 0; r < R; r++) { _mm256_storeu_ps(o + 16 * r, _mm256_setzero_ps()); fs[r] = _mm256_setzero_ps(); }
        for (int b = 0; b < KB; b++) {
            const uint8_t *blk = grp + (size_t)b * BB;
            const __m256 dv = cvtph8(blk + 16 * h);
            const __m256 ov = has_m ? cvtph8(blk + 32 + 16 * h) : _mm256_mul_ps(dv, _mm256_set1_ps(center));
            const uint8_t *q = blk + 32 + 32 * has_m;
            __m256i u[8];
            for (int t = 0; t < 4; t++) {
                const __m256i v = ld32(q + 64 * t + 32 * h);
                u[2 * t] = _mm256_and_si256(v, m4);
                u[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
            if (five)
                for (int G = 0; G < 8; G++) {
                    uint32_t hb;
                    memcpy(&hb, q + 256 + 8 * G + 4 * h, 4);
                    u[G] = _mm256_or_si256(u[G], bits_to_bytes(hb, b16));
                }
            for (int r = 0; r < R; r++) {
                const int8_t *xr = xq + (size_t)r * K + 32 * b;
                /* 4-bit: all 8 pairs fit in 16 bits; 5-bit: 4 */
                __m256i pa = pairs(u[0], xr), pb = pairs(u[1], xr + 4);
                for (int G = 2; G < 8; G += 2) {
                    pa = _mm256_add_epi16(pa, pairs(u[G], xr + 4 * G));
                    pb = _mm256_add_epi16(pb, pairs(u[G + 1], xr + 4 * G + 4));
                }
                const __m256i ia = five ? _mm256_add_epi32(widen(pa), widen(pb)) : widen(_mm256_add_epi16(pa, pb));
                const float *sr = sums + (size_t)r * QS + QS_SX(K) + b;        /* sum(x) * scale */
                fs[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(dv, _mm256_set1_ps(dq[(size_t)r * KB + b])),
                                        fs[r]);
                fs[r] = _mm256_fmadd_ps(ov, _mm256_set1_ps(sr[0]), fs[r]);
            }
            if ((b & 7) == 7 || b == KB - 1) {
                for (int r = 0; r < R; r++) {
                    _mm256_storeu_ps(o + 16 * r, _mm256_add_ps(fs[r], _mm256_loadu_ps(o + 16 * r)));
                    fs[r] = _mm256_setzero_ps();
                }
            }
        }
    }
}
