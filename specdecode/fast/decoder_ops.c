/*
 * specdecode/fast/decoder_ops.c -- the per-row pieces of the fused decoder (included by decoder.c):
 * dtype <-> fp32 vector helpers, exp / tanh, RMSNorm, RoPE and one (row, head) of attention.  Each is
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
 * Elementwise, so results do not depend on lane position. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
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

/* Attention for one query row and one q head over logical keys/values lo..len-1 of kv head h
 * (addressed through kv/tab from the layer bases kbase/vbase, KEY_SLOT mapping a logical key to its
 * cache slot; model dtype), q [HD] (model dtype), out [HD]; scores soft-capped when cap > 0.  scores: scratch of >= len - lo + 16 floats.
 * Keys go in chunks of 16 starting at key lo (0, or the first key of a sliding window: a function of
 * the row's position only), so logical key j's dot product always takes slot (j - lo) % 16 of the
 * same tree, whatever the cache layout and wherever a tree put the key: a tree node's row is
 * computed exactly as the same path verified as a chain. */
static void attend(const void *q, const char *kbase, const char *vbase, const sd_kv *kv, const int32_t *tab,
                   int tbase, const int32_t *tslots,
                   int h, int lo, int len, int HD, float scale, float cap, int bf, float *scores, void *out) {
    const int C = HD / 16;                 /* HD % 16 == 0, HD <= 256 */
    __m512 qv[16];
    for (int c = 0; c < C; c++) qv[c] = ld16(q, 16 * c, bf, 0xffff);
    const __m512i inv = _mm512_loadu_si512(reduce16_inv);
    const __m512 sv = _mm512_set1_ps(scale);
    const int esz = bf ? 2 : 4;
    __m512 mxv = _mm512_set1_ps(-__builtin_inff());
    char tail[16 * 256 * 4] __attribute__((aligned(64)));
    for (int j0 = lo; j0 < len; j0 += 16) {
        const int nk = len - j0 < 16 ? len - j0 : 16;
        const char *kb = kbase + kv_off(kv, tab, j0, h) * esz;
        size_t ks = (size_t)kv->key_stride;
        if (nk < 16 || j0 % kv->block + 16 > kv->block || j0 + 16 > tbase) {
            /* last partial chunk, a chunk across cache blocks or reaching into a tree: a
             * (zero-padded) copy, same arithmetic */
            if (nk < 16) memset(tail, 0, (size_t)16 * HD * esz);
            for (int i = 0; i < nk; i++)
                memcpy(tail + (size_t)i * HD * esz, kbase + kv_off(kv, tab, KEY_SLOT(j0 + i), h) * esz, (size_t)HD * esz);
            kb = tail;
            ks = (size_t)HD;
        }
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (int c = 0; c < C; c++)
            for (int i = 0; i < 16; i++)
                acc[i] = _mm512_fmadd_ps(qv[c], ld16(kb, (size_t)i * ks + 16 * c, bf, 0xffff), acc[i]);
        __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(inv, reduce16(acc)), sv);
        if (cap > 0.f)                     /* Gemma 2: cap * tanh(score / cap) */
            s = _mm512_mul_ps(_mm512_set1_ps(cap), tanh512(_mm512_div_ps(s, _mm512_set1_ps(cap))));
        __mmask16 m = lanes(nk);
        _mm512_mask_storeu_ps(scores + (j0 - lo), m, s);
        mxv = _mm512_mask_max_ps(mxv, m, mxv, s);
    }
    __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mxv)), sum = _mm512_setzero_ps();
    for (int j = 0; j < len - lo; j += 16) {
        __mmask16 m = lanes(len - lo - j);
        __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + j), mv));
        p = _mm512_maskz_mov_ps(m, p);
        _mm512_mask_storeu_ps(scores + j, m, p);
        sum = _mm512_add_ps(sum, p);
    }
    __m512 invs = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    __m512 o[16];
    for (int c = 0; c < C; c++) o[c] = _mm512_setzero_ps();
    for (int j = lo; j < len; j++) {
        __m512 p = _mm512_set1_ps(scores[j - lo]);
        const char *vj = vbase + kv_off(kv, tab, KEY_SLOT(j), h) * esz;
        for (int c = 0; c < C; c++) o[c] = _mm512_fmadd_ps(p, ld16(vj, 16 * c, bf, 0xffff), o[c]);
    }
    for (int c = 0; c < C; c++) st16(out, 16 * c, bf, 0xffff, _mm512_mul_ps(o[c], invs));
}

