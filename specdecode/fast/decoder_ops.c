/*
 * specdecode/fast/decoder_ops.c -- the per-row pieces of the fused decoder (included by decoder.c):
 * dtype <-> fp32 vector helpers, exp / tanh, RMSNorm, RoPE and the AVX2 helpers of attention.  Each is
 * elementwise or a fixed-order reduction over one row, so a row's result never depends on the others.
 */

/* ---- element helpers: model dtype <-> fp32 vectors of 16 (masked) */
static inline __m512 ld16(const void *p, size_t i, int bf, __mmask16 m) {
    if (bf) return bf16x16_to_ps(_mm256_maskz_loadu_epi16(m, (const bf16 *)p + i));
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}
static inline void st16(void *p, size_t i, int bf, __mmask16 m, __m512 v) {
    if (bf) _mm256_mask_storeu_epi16((bf16 *)p + i, m, (__m256i)_mm512_cvtneps_pbh(v));
    else _mm512_mask_storeu_ps((float *)p + i, m, v);
}
static inline __m512 rnd(__m512 v, int bf) { return bf ? round_bf16(v) : v; }
static inline __mmask16 lanes(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

/* exp(x) for fp32 lanes: Cody-Waite range reduction + degree-6 polynomial + scalef (~2 ulp).
 * Elementwise, so results do not depend on lane position.  The constants, shared with exp256: */
#define SD_EXP_HI 88.7f                      /* input clamp */
#define SD_EXP_LO (-104.f)
#define SD_EXP_LOG2E 1.44269504088896341f
#define SD_EXP_LN2_HI 0.693359375f           /* ln 2 = HI + LO (Cody-Waite) */
#define SD_EXP_LN2_LO (-2.12194440e-4f)
#define SD_EXP_P0 1.9875691500E-4f           /* polynomial, highest degree first */
#define SD_EXP_P1 1.3981999507E-3f
#define SD_EXP_P2 8.3334519073E-3f
#define SD_EXP_P3 4.1665795894E-2f
#define SD_EXP_P4 1.6666665459E-1f
#define SD_EXP_P5 5.0000001201E-1f
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(SD_EXP_HI)), _mm512_set1_ps(SD_EXP_LO));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(SD_EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(SD_EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(SD_EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(SD_EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(SD_EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(SD_EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(SD_EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(SD_EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(SD_EXP_P5));
    __m512 r2 = _mm512_mul_ps(r, r);
    p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* tanh(x) = 1 - 2 / (exp(2x) + 1) for fp32 lanes (elementwise; saturates to +-1). */
static inline __m512 tanh512(__m512 x) {
    __m512 e = exp512(_mm512_add_ps(x, x));
    return _mm512_sub_ps(_mm512_set1_ps(1.f), _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, _mm512_set1_ps(1.f))));
}

/* out[0:D] = rne(x * rsqrt(mean(x^2) + eps) * w)   (torch's fused rms_norm: one rounding); w in the
 * model dtype (wbf = bf) or fp32 (wbf = 0: Gemma's 1 + weight).  add: out = rne(out + that), the norm
 * of a sublayer's output added to the residual (Gemma's post-attention / post-feedforward norms). */
static void rmsnorm_row(const void *x, const void *w, int wbf, void *out, int D, float eps, int bf, int add) {
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < D; i += 16) {
        __m512 v = ld16(x, i, bf, lanes(D - i));
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    float r = 1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(_mm512_reduce_add_ps(ss) / (float)D + eps)));
    __m512 rv = _mm512_set1_ps(r);
    for (int i = 0; i < D; i += 16) {
        __mmask16 m = lanes(D - i);
        __m512 y = _mm512_mul_ps(_mm512_mul_ps(ld16(x, i, bf, m), rv), ld16(w, i, wbf, m));
        st16(out, i, bf, m, add ? _mm512_add_ps(ld16(out, i, bf, m), rnd(y, bf)) : y);
    }
}

/* RoPE (rotate-half) of one head vector x[HD] -> out[HD], rounding like q*cos + rotate_half(q)*sin */
static void rope_head(const void *x, const void *cs, const void *sn, void *out, int HD, int bf) {
    const int half = HD / 2;
    for (int i = 0; i < half; i += 16) {
        __mmask16 m = lanes(half - i);
        __m512 x1 = ld16(x, i, bf, m), x2 = ld16(x, half + i, bf, m);
        __m512 c1 = ld16(cs, i, bf, m), c2 = ld16(cs, half + i, bf, m);
        __m512 s1 = ld16(sn, i, bf, m), s2 = ld16(sn, half + i, bf, m);
        __m512 o1 = _mm512_sub_ps(rnd(_mm512_mul_ps(x1, c1), bf), rnd(_mm512_mul_ps(x2, s1), bf));
        __m512 o2 = _mm512_add_ps(rnd(_mm512_mul_ps(x2, c2), bf), rnd(_mm512_mul_ps(x1, s2), bf));
        st16(out, i, bf, m, o1);
        st16(out, half + i, bf, m, o2);
    }
}

/* Sum each of 16 vectors: returns r with lane l = sum of the lanes of v[perm[l]] (a fixed tree). */
static inline __m512 reduce16(__m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xee));
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xdd));
    for (int i = 0; i < 2; i++)
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[i], x[i + 2], 0x44), _mm512_shuffle_ps(x[i], x[i + 2], 0xee));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xdd));
}

static int32_t reduce16_inv[16];   /* lane of reduce16's result that holds vector j */
static void reduce16_init(void) {
    if (reduce16_inv[1]) return;
    __m512 v[16];
    float r[16];
    for (int i = 0; i < 16; i++) v[i] = _mm512_set1_ps((float)i);
    _mm512_storeu_ps(r, reduce16(v));
    for (int l = 0; l < 16; l++) reduce16_inv[(int)(r[l] / 16.f)] = l;
}

/* Cache slot of logical key j of a row: keys below the row's tree base are at their own slot; key
 * tbase + i (i = 0, 1, ...) is the i-th node on the row's path, at slot tslots[i]. */
#define KEY_SLOT(j) ((j) < tbase ? (j) : tslots[(j) - tbase])

/* Attention (decoder_attn.c) for one query row and one q head runs over logical keys/values lo..len-1
 * of kv head h, addressed through the cache table with KEY_SLOT mapping a logical key to its cache
 * slot.  Keys go in chunks of 16 starting at key lo (0, or the first key of a sliding window: a
 * function of the row's position only), and each key's score is a function of q and that key alone,
 * wherever the cache or a tree put it: a tree node's row is computed exactly as the same path
 * verified as a chain. */
#if !defined(__AVX512F__)
/* AVX2 (no AVX512F) helpers of that attention, 8 lanes (SIMDe's 512-bit emulation spills 32
 * accumulators there and was ~10x slower). */
static inline __m256 ld8(const void *p, size_t i, int bf) {
    if (bf) return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const bf16 *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* exp512's polynomial on 8 lanes; 2^n applied as two exact power-of-two factors (n in [-150, 128]) */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(SD_EXP_HI)), _mm256_set1_ps(SD_EXP_LO));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(SD_EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(SD_EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(SD_EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(SD_EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SD_EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SD_EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SD_EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SD_EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(SD_EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1), rest = _mm256_sub_epi32(ni, half);
    const __m256i bias = _mm256_set1_epi32(127);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23)));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23)));
}

#endif

