/* specdecode/fast/decoder_attn.c -- attention for several (row, q head) pairs of one kv head at once
 * (included by decoder.c after decoder_ops.c).
 *
 * Grouped-query attention reads each kv head once per q head of its group, and a verify pass once per
 * row: the 1.5B Qwen2 target (12 q heads over 2 kv heads) read every cached key and value 6 times per
 * row.  Past a few hundred tokens that traffic, and the bf16 -> fp32 widening of every key and value
 * element, cost as much as the matmuls of a small model.  attend_pairs takes up to SD_ATT_PAIRS pairs
 * that read the same kv head through the same cache table, and widens each whole chunk of 16 keys (and
 * of 16 values) into an fp32 buffer once for all of them.
 *
 * Batch invariance: each pair runs the one-(row, head) contract of decoder_ops.c (chunks of 16 keys
 * from key lo, the fma order over head_dim chunks, reduce16, max, exp512, sum, the weighted value sum
 * in key order with the accumulator kept in memory between chunks, which stores and reloads fp32
 * exactly) with the same operations whichever pairs share a call, so every output is bitwise that of
 * the pair alone.  Chunks that a pair sees only partly (its last one, one across cache blocks, or one
 * reaching into a tree's per-row path) are read for that pair alone. */

#define SD_ATT_PAIRS 8

typedef struct {
    const void *q;             /* [HD] model dtype (roped) */
    void *out;                 /* [HD] model dtype */
    int len, tbase;            /* logical keys lo..len-1; keys >= tbase are on the path tslots */
    const int32_t *tslots;
} att_pair;

#if defined(__AVX512F__)
/* keys (or values) j0..j0+15 of kv head h, whole and in one block, widened to fp32 rows of HD */
static inline void widen_chunk(const char *base, const sd_kv *kv, const int32_t *tab, int j0, int h, int HD,
                               int bf, float *dst) {
    const int esz = bf ? 2 : 4;
    const char *src = base + kv_off(kv, tab, j0, h) * esz;
    if (j0 % kv->block + 48 <= kv->block)         /* the chunk after next, when in the same block */
        for (int i = 32; i < 48; i++)
            for (int b = 0; b < HD * esz; b += 64) _mm_prefetch(src + (size_t)i * kv->key_stride * esz + b, _MM_HINT_T0);
    for (int i = 0; i < 16; i++)
        for (int c = 0; c < HD; c += 16)
            _mm512_store_ps(dst + (size_t)i * HD + c, ld16(src, (size_t)i * kv->key_stride + c, bf, 0xffff));
}

/* Keys of pair p in the chunk from j0 (0: past its end); *shared: the chunk is whole, in one cache
 * block and below p's tree path, so the chunk widened once for all pairs serves it. */
static inline int chunk_keys(const att_pair *p, int j0, int in_block, int *shared) {
    const int nk = p->len - j0 < 16 ? p->len - j0 : 16;
    *shared = nk == 16 && in_block && j0 + 16 <= p->tbase;
    return nk > 0 ? nk : 0;
}

/* Attention for n pairs sharing kv head h, cache table tab and first key lo; scores: n * score_len floats */
static void attend_pairs(const att_pair *pr, int n, const char *kbase, const char *vbase, const sd_kv *kv,
                         const int32_t *tab, int h, int lo, int HD, float scale, float cap, int bf,
                         float *scores, int score_len) {
    const int C = HD / 16, esz = bf ? 2 : 4;
    float qf[SD_ATT_PAIRS][256] __attribute__((aligned(64)));
    float of[SD_ATT_PAIRS][256] __attribute__((aligned(64)));
    float buf[16 * 256] __attribute__((aligned(64)));     /* a shared chunk, fp32 */
    float own[16 * 256] __attribute__((aligned(64)));     /* one pair's partial chunk, fp32 (zero padded) */
    __m512 mx[SD_ATT_PAIRS], invs[SD_ATT_PAIRS];
    int maxlen = lo;
    for (int p = 0; p < n; p++) {
        for (int c = 0; c < C; c++) _mm512_store_ps(qf[p] + 16 * c, ld16(pr[p].q, 16 * c, bf, 0xffff));
        mx[p] = _mm512_set1_ps(-__builtin_inff());
        if (pr[p].len > maxlen) maxlen = pr[p].len;
    }
    const __m512i inv = _mm512_loadu_si512(reduce16_inv);
    const __m512 sv = _mm512_set1_ps(scale);
    /* scores */
    for (int j0 = lo; j0 < maxlen; j0 += 16) {
        const int in_block = j0 % kv->block + 16 <= kv->block;
        int widened = 0;
        for (int p = 0; p < n; p++) {
            const int tbase = pr[p].tbase;
            const int32_t *tslots = pr[p].tslots;
            int shared;
            const int nk = chunk_keys(&pr[p], j0, in_block, &shared);
            if (!nk) continue;
            const float *kb = buf;
            if (shared) {
                if (!widened) widen_chunk(kbase, kv, tab, j0, h, HD, bf, buf);
                widened = 1;
            } else {                          /* this pair's keys alone, zero padded */
                for (int i = 0; i < 16; i++)
                    for (int c = 0; c < HD; c += 16)
                        _mm512_store_ps(own + (size_t)i * HD + c, i < nk
                            ? ld16(kbase + kv_off(kv, tab, KEY_SLOT(j0 + i), h) * esz, c, bf, 0xffff)
                            : _mm512_setzero_ps());
                kb = own;
            }
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int c = 0; c < C; c++) {
                const __m512 qv = _mm512_load_ps(qf[p] + 16 * c);
                for (int i = 0; i < 16; i++)
                    acc[i] = _mm512_fmadd_ps(qv, _mm512_load_ps(kb + (size_t)i * HD + 16 * c), acc[i]);
            }
            __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(inv, reduce16(acc)), sv);
            if (cap > 0.f)
                s = _mm512_mul_ps(_mm512_set1_ps(cap), tanh512(_mm512_div_ps(s, _mm512_set1_ps(cap))));
            const __mmask16 m = lanes(nk);
            _mm512_mask_storeu_ps(scores + (size_t)p * score_len + (j0 - lo), m, s);
            mx[p] = _mm512_mask_max_ps(mx[p], m, mx[p], s);
        }
    }
    /* softmax weights */
    for (int p = 0; p < n; p++) {
        float *sc = scores + (size_t)p * score_len;
        const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx[p]));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < pr[p].len - lo; j += 16) {
            const __mmask16 m = lanes(pr[p].len - lo - j);
            __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + j), mv));
            e = _mm512_maskz_mov_ps(m, e);
            _mm512_mask_storeu_ps(sc + j, m, e);
            sum = _mm512_add_ps(sum, e);
        }
        invs[p] = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
        for (int c = 0; c < C; c++) _mm512_store_ps(of[p] + 16 * c, _mm512_setzero_ps());
    }
    /* weighted values, keys in order */
    for (int j0 = lo; j0 < maxlen; j0 += 16) {
        const int in_block = j0 % kv->block + 16 <= kv->block;
        int widened = 0;
        for (int p = 0; p < n; p++) {
            const int tbase = pr[p].tbase;
            const int32_t *tslots = pr[p].tslots;
            int shared;
            const int nk = chunk_keys(&pr[p], j0, in_block, &shared);
            if (!nk) continue;
            const float *sc = scores + (size_t)p * score_len + (j0 - lo);
            __m512 o[16];
            for (int c = 0; c < C; c++) o[c] = _mm512_load_ps(of[p] + 16 * c);
            if (shared) {
                if (!widened) widen_chunk(vbase, kv, tab, j0, h, HD, bf, buf);
                widened = 1;
                for (int i = 0; i < 16; i++) {
                    const __m512 w = _mm512_set1_ps(sc[i]);
                    for (int c = 0; c < C; c++) o[c] = _mm512_fmadd_ps(w, _mm512_load_ps(buf + (size_t)i * HD + 16 * c), o[c]);
                }
            } else {
                for (int i = 0; i < nk; i++) {
                    const __m512 w = _mm512_set1_ps(sc[i]);
                    const char *vj = vbase + kv_off(kv, tab, KEY_SLOT(j0 + i), h) * esz;
                    for (int c = 0; c < C; c++) o[c] = _mm512_fmadd_ps(w, ld16(vj, 16 * c, bf, 0xffff), o[c]);
                }
            }
            for (int c = 0; c < C; c++) _mm512_store_ps(of[p] + 16 * c, o[c]);
        }
    }
    for (int p = 0; p < n; p++)
        for (int c = 0; c < C; c++)
            st16(pr[p].out, 16 * c, bf, 0xffff, _mm512_mul_ps(_mm512_load_ps(of[p] + 16 * c), invs[p]));
}

#else
/* AVX2: decoder_ops.c's attend() pair by pair (the same contract; no shared widening yet) */
static void attend_pairs(const att_pair *pr, int n, const char *kbase, const char *vbase, const sd_kv *kv,
                         const int32_t *tab, int h, int lo, int HD, float scale, float cap, int bf,
                         float *scores, int score_len) {
    (void)score_len;
    for (int p = 0; p < n; p++)
        attend(pr[p].q, kbase, vbase, kv, tab, pr[p].tbase, pr[p].tslots, h, lo, pr[p].len, HD, scale, cap, bf,
               scores, pr[p].out);
}
#endif
