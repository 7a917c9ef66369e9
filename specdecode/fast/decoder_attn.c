/* specdecode/fast/decoder_attn.c -- attention for several (row, q head) pairs of one kv head at once
 * (included by decoder.c after decoder_ops.c).
 *
 * Grouped-query attention reads each kv head once per q head of its group, and a verify pass once per
 * row.  attend_pairs takes up to SD_ATT_PAIRS pairs that read the same kv head through the same cache
 * table and goes through the keys (then the values) once for all of them, a chunk of 16 at a time,
 * reading each row where the cache holds it (no copy), with a software prefetch through the block table.
 *
 * Per pair (AVX512):
 *   scores  each key's dot product with q: bf16, VDPBF16PS into 4 lanes per pair, 4 pairs per vector
 *           (dots16x4: q and k are bf16 values, so every product is exact and only the fp32 sums
 *           round), then a fixed 4-lane tree; fp32, one FMA per 16 elements into 16 lanes, then
 *           reduce16's fixed tree; times scale, soft cap;
 *   softmax max, exp512, the sum in 16-lane blocks of keys from lo (a sink, gpt-oss: its logit joins the
 *           max, and its exp the sum after the keys');
 *   values  in key order, fp32 FMAs of the weights and the widened values (bf16 -> fp32 is exact),
 *           the sums in registers within a chunk and in memory between chunks (exact), times 1 / sum.
 * For head_dim 64, 16 keys and 4 pairs cost 128 VDPBF16PS and a 48-op reduction for the scores (2 and
 * 0.75 per pair and key; one lane per element and pair, reduced per key and pair, was 2 + 2.8) and
 * 64 FMAs per pair for the values; widening the values is 2 ops per 32 elements, shared by the pairs.
 *
 * Batch invariance: a key's score is a function of q and that key only, the softmax and the value
 * sums run over the pair's keys lo..len-1 in a fixed order, so every output is bitwise that of the
 * pair alone, whichever pairs share the call, whatever the cache layout (paged or contiguous, block
 * size) or the thread.  Chunks that a pair sees only partly (its last one, one across cache blocks,
 * or one reaching into a tree's per-row path) are read for that pair alone, its rows past its end
 * replaced by zeros (the scores of those lanes are dropped, the values not read). */

#define SD_ATT_PAIRS 8                 /* a multiple of 4 (dots16x4's groups) */

typedef struct {
    const void *q;             /* [HD] model dtype (roped) */
    void *out;                 /* [HD] model dtype */
    int len, tbase;            /* logical keys lo..len-1; keys >= tbase are on the path tslots */
    const int32_t *tslots;
    float sink;                /* with has_sink: a logit that joins the softmax's max and denominator (gpt-oss) */
    int has_sink;
} att_pair;

/* Software prefetch of the keys (values) of kv head h, through the block table: into L1 two chunks
 * ahead and into L2 eight ahead (0: off).  Without it a row's blocks, scattered in a paged pool, are
 * read at a few GB/s.  scripts/measure/attention_micro.c (one thread, SmolLM2-135M's shapes, 8 rows of 1500
 * keys, AMD EPYC family 26 (Zen 5), CPU time, best of 4 alternating runs, before the stream below),
 * blocks scattered / in order: none 45.0 / 34.6 ms, L1 at 2 chunks 19.5 / 12.1, L1 at 4 17.4 / 10.8,
 * L1 at 2 + L2 at 8 16.8 / 10.4. */
#ifndef SD_ATT_PF_NEAR
#define SD_ATT_PF_NEAR 2
#endif
#ifndef SD_ATT_PF_FAR
#define SD_ATT_PF_FAR 8
#endif

static const float sd_zero_row[256] __attribute__((aligned(64)));   /* a key / value of zeros */

/* exp(x) of a sink's logit less the max (x <= 0), in fp32: one value per pair, the same on every path */
static inline float sink_exp(float x) { return expf(x); }

/* Addresses of keys (or values) j0..j0+15: whole chunk in one block -> consecutive rows of the block */
static inline void chunk_rows(const char *base, const sd_kv *kv, const int32_t *tab, int j0, int h, int esz,
                              const char **rows) {
    const char *r0 = base + kv_off(kv, tab, j0, h) * esz;
    for (int i = 0; i < 16; i++) rows[i] = r0 + (size_t)i * kv->key_stride * esz;
}
/* ... of pair p alone: its keys (through its tree path) up to its end, then rows of zeros */
static inline void pair_rows(const att_pair *p, const char *base, const sd_kv *kv, const int32_t *tab, int j0,
                             int nk, int h, int esz, const char **rows) {
    const int tbase = p->tbase;
    const int32_t *tslots = p->tslots;
    for (int i = 0; i < 16; i++)
        rows[i] = i < nk ? base + kv_off(kv, tab, KEY_SLOT(j0 + i), h) * esz : (const char *)sd_zero_row;
}
/* Prefetch the rows of kv head h for keys j0..j0+15 (those below end) into L1 (far = 0) or L2 */
static inline void prefetch_chunk(const char *base, const sd_kv *kv, const int32_t *tab, int j0, int end, int h,
                                  int rowbytes, int esz, int far) {
    const int n = end - j0 < 16 ? end - j0 : 16;
    for (int i = 0; i < n;) {
        const int j = j0 + i, in_blk = kv->block - j % kv->block;
        const char *r = base + kv_off(kv, tab, j, h) * esz;
        for (int k = 0; k < in_blk && i < n; k++, i++, r += kv->key_stride * esz)
            for (int b = 0; b < rowbytes; b += 64) {     /* inline asm: gcc drops _mm_prefetch here */
                if (far) __asm__ volatile("prefetcht1 %0" : : "m"(*(r + b)));
                else __asm__ volatile("prefetcht0 %0" : : "m"(*(r + b)));
            }
    }
}
/* A call reads the keys, then the values, of kv head h for keys lo..end-1: one stream of 2 * nc chunks
 * (c < nc: keys lo + 16 c.., else values lo + 16 (c - nc)..), prefetched as one, so the values' first
 * chunks arrive while the last keys are scored, and a call's first chunks are asked for at once. */
typedef struct {
    const char *kbase, *vbase;
    const sd_kv *kv;
    const int32_t *tab;
    int lo, end, nc, h, rowbytes, esz;
} att_stream;

static inline void stream_chunk(const att_stream *st, int c, int far) {
    if (c >= 2 * st->nc) return;
    const int v = c >= st->nc;
    prefetch_chunk(v ? st->vbase : st->kbase, st->kv, st->tab, st->lo + 16 * (c - v * st->nc), st->end, st->h,
                   st->rowbytes, st->esz, far);
}
/* at stream chunk c: chunk c + SD_ATT_PF_NEAR into L1, c + SD_ATT_PF_FAR into L2 (at the first chunk
 * of the keys or of the values, all before them too: the values may be read by another call) */
static inline void stream_ahead(const att_stream *st, int c) {
    if ((c == 0 || c == st->nc) && SD_ATT_PF_NEAR && SD_ATT_PF_FAR) {
        for (int i = c + 1; i < c + SD_ATT_PF_NEAR; i++) stream_chunk(st, i, 0);
        for (int i = c + SD_ATT_PF_NEAR + 1; i < c + SD_ATT_PF_FAR; i++) stream_chunk(st, i, 1);
    }
    if (SD_ATT_PF_NEAR) stream_chunk(st, c + SD_ATT_PF_NEAR, 0);
    if (SD_ATT_PF_FAR) stream_chunk(st, c + SD_ATT_PF_FAR, 1);
}

/* Keys of pair p in the chunk from j0 (0: past its end); *shared: the chunk is whole, in one cache
 * block and below p's tree path, so the rows of the chunk read for all pairs serve it. */
static inline int chunk_keys(const att_pair *p, int j0, int in_block, int *shared) {
    const int nk = p->len - j0 < 16 ? p->len - j0 : 16;
    *shared = nk == 16 && in_block && j0 + 16 <= p->tbase;
    return nk > 0 ? nk : 0;
}
/* The rows of keys (or values) pair p reads in the chunk from j0 (nk of them): the chunk's rows shared
 * by the pairs (`rows`, made on first use: *have_rows) or, where it is not shared, its own in `own`. */
static inline const char *const *pair_chunk(const att_pair *p, int shared, int nk, const char *base, const sd_kv *kv,
                                            const int32_t *tab, int j0, int h, int esz, const char **rows,
                                            int *have_rows, const char **own) {
    if (shared) {
        if (!*have_rows) chunk_rows(base, kv, tab, j0, h, esz, rows);
        *have_rows = 1;
        return rows;
    }
    pair_rows(p, base, kv, tab, j0, nk, h, esz, own);
    return own;
}

#if defined(__AVX512F__)
/* One bf16 dot-product step on 16 fp32 lanes: lane l += q[2l+1] k[2l+1], then += q[2l] k[2l] (exact
 * products, each sum rounded): VDPBF16PS, or where the CPU lacks it the same two steps as FMAs. */
static inline __m512 dp_bf16(__m512 acc, __m512i q, __m512i k) {
#if defined(__AVX512BF16__)
    return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)k);
#else
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(q, hi)), _mm512_castsi512_ps(_mm512_and_si512(k, hi)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(q, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(k, 16)), acc);
#endif
}

/* The dot products of q with the 16 keys at kp[0..15], in key order.  bf16: 32 elements at a time,
 * lane l summing elements 2l and 2l+1 of each 32 (dp_bf16, element 2l+1 first) over the 32-element
 * units in order (an odd last 16 elements: a half unit); fp32: one FMA per 16 elements, in order.
 * Then reduce16's fixed tree over the 16 lanes.  A function of q and each key alone. */
static inline __m512 dots16(const __m512i *q, const char *const *kp, int HD, int bf, __m512i inv) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    if (bf) {
        const int U = HD / 32;
        for (int u = 0; u < U; u++)
            for (int i = 0; i < 16; i++)
                acc[i] = dp_bf16(acc[i], q[u], _mm512_loadu_si512(kp[i] + 64 * u));
        if (HD % 32)
            for (int i = 0; i < 16; i++)
                acc[i] = dp_bf16(acc[i], q[U], _mm512_maskz_loadu_epi16(0xffff, kp[i] + 64 * U));
    } else {
        for (int c = 0; c < HD / 16; c++)
            for (int i = 0; i < 16; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_castsi512_ps(q[c]), _mm512_loadu_ps((const float *)kp[i] + 16 * c), acc[i]);
    }
    return _mm512_permutexvar_ps(inv, reduce16(acc));
}

/* bf16 scores of up to 4 pairs at once (slots b = 0..3 of Qs) against the 16 keys at kp.  Qs[u]: the
 * pairs' q elements 8u..8u+7, slot b in 128-bit block b (zeros for an empty slot).  Lane l of block b
 * of key i's accumulator sums, over the HD/8 units u in order, dp_bf16's q[8u+2l+1] k[8u+2l+1] then
 * q[8u+2l] k[8u+2l] (k's 8 elements broadcast to the 4 blocks); then (l0 + l2) + (l1 + l3), the same
 * in-block operations in every block.  So slot b's scores are a function of its q and the keys alone,
 * whatever the other slots hold.  S[b] = slot b's 16 scores, in key order. */
static inline void dots16x4(const __m512i *Qs, const char *const *kp, int HD, __m512 S[4]) {
    __m512 acc[16], t[8], v[4];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int u = 0; u < HD / 8; u++) {
        const __m512i qv = Qs[u];
        for (int i = 0; i < 16; i++)
            acc[i] = dp_bf16(acc[i], qv, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(kp[i] + 16 * u))));
    }
    for (int j = 0; j < 8; j++)      /* block: [a0+a2, a1+a3, c0+c2, c1+c3], a: key j, c: key j + 8 */
        t[j] = _mm512_add_ps(_mm512_shuffle_ps(acc[j], acc[j + 8], 0x44), _mm512_shuffle_ps(acc[j], acc[j + 8], 0xee));
    for (int j = 0; j < 4; j++)      /* block: the sums of keys j, j + 8, j + 4, j + 12 */
        v[j] = _mm512_add_ps(_mm512_shuffle_ps(t[j], t[j + 4], 0x88), _mm512_shuffle_ps(t[j], t[j + 4], 0xdd));
    const __m512 lo01 = _mm512_shuffle_f32x4(v[0], v[1], 0x44), hi01 = _mm512_shuffle_f32x4(v[0], v[1], 0xee);
    const __m512 lo23 = _mm512_shuffle_f32x4(v[2], v[3], 0x44), hi23 = _mm512_shuffle_f32x4(v[2], v[3], 0xee);
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
    S[0] = _mm512_permutexvar_ps(order, _mm512_shuffle_f32x4(lo01, lo23, 0x88));   /* block b of v[0..3] */
    S[1] = _mm512_permutexvar_ps(order, _mm512_shuffle_f32x4(lo01, lo23, 0xdd));
    S[2] = _mm512_permutexvar_ps(order, _mm512_shuffle_f32x4(hi01, hi23, 0x88));
    S[3] = _mm512_permutexvar_ps(order, _mm512_shuffle_f32x4(hi01, hi23, 0xdd));
}

/* Value rows are summed 32 elements at a time: bf16 as its even elements (x << 16) and its odd ones
 * (x & 0xffff0000) in two fp32 vectors, fp32 as two plain vectors; an odd last 16 elements in one. */
static inline void val32(const char *v, int u, int bf, __m512 *ev, __m512 *od) {
    if (bf) {
        const __m512i x = _mm512_loadu_si512(v + 2 * u);
        *ev = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        *od = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
    } else {
        *ev = _mm512_loadu_ps((const float *)v + u);
        *od = _mm512_loadu_ps((const float *)v + u + 16);
    }
}
static inline __m512 val16(const char *v, int u, int bf) {
    return bf ? bf16x16_to_ps(_mm256_loadu_si256((const __m256i *)(v + 2 * u))) : _mm512_loadu_ps((const float *)v + u);
}

/* of[p] += sum over keys i < nk in order of w[p][i] * value i (vp[i]), for NP pairs (a compile-time
 * count, so the accumulators stay in registers); of[p] holds the sums in val32's layout. */
static inline __attribute__((always_inline)) void vsum(float (*of)[256], const float *const *w, const char *const *vp,
                                                       int nk, int NP, int HD, int bf) {
    int u = 0;
    for (; u + 32 <= HD; u += 32) {
        __m512 a[SD_ATT_PAIRS][2];
        for (int p = 0; p < NP; p++) { a[p][0] = _mm512_load_ps(of[p] + u); a[p][1] = _mm512_load_ps(of[p] + u + 16); }
        for (int i = 0; i < nk; i++) {
            __m512 ev, od;
            val32(vp[i], u, bf, &ev, &od);
            for (int p = 0; p < NP; p++) {
                const __m512 wv = _mm512_set1_ps(w[p][i]);
                a[p][0] = _mm512_fmadd_ps(wv, ev, a[p][0]);
                a[p][1] = _mm512_fmadd_ps(wv, od, a[p][1]);
            }
        }
        for (int p = 0; p < NP; p++) { _mm512_store_ps(of[p] + u, a[p][0]); _mm512_store_ps(of[p] + u + 16, a[p][1]); }
    }
    if (u < HD) {
        __m512 a[SD_ATT_PAIRS];
        for (int p = 0; p < NP; p++) a[p] = _mm512_load_ps(of[p] + u);
        for (int i = 0; i < nk; i++) {
            const __m512 x = val16(vp[i], u, bf);
            for (int p = 0; p < NP; p++) a[p] = _mm512_fmadd_ps(_mm512_set1_ps(w[p][i]), x, a[p]);
        }
        for (int p = 0; p < NP; p++) _mm512_store_ps(of[p] + u, a[p]);
    }
}
static void vsum_n(float (*of)[256], const float *const *w, const char *const *vp, int nk, int np, int HD, int bf) {
#define SD_VSUM(N) case N: if (bf) vsum(of, w, vp, nk, N, HD, 1); else vsum(of, w, vp, nk, N, HD, 0); break;
    switch (np) { SD_VSUM(1) SD_VSUM(2) SD_VSUM(3) SD_VSUM(4) SD_VSUM(5) SD_VSUM(6) SD_VSUM(7) SD_VSUM(8) }
#undef SD_VSUM
}

/* Pair p's raw dot products d of keys j0..j0+nk-1: times scale, soft cap, into its scores and max */
static inline void score_out(__m512 d, int p, int nk, int j0, int lo, __m512 sv, float cap, float *scores,
                             int score_len, __m512 *mx) {
    __m512 s = _mm512_mul_ps(d, sv);
    if (cap > 0.f) s = _mm512_mul_ps(_mm512_set1_ps(cap), tanh512(_mm512_div_ps(s, _mm512_set1_ps(cap))));
    const __mmask16 m = lanes(nk);
    _mm512_mask_storeu_ps(scores + (size_t)p * score_len + (j0 - lo), m, s);
    mx[p] = _mm512_mask_max_ps(mx[p], m, mx[p], s);
}

/* The scores of n pairs sharing kv head h, cache table tab and first key lo, then their softmax
 * weights: pair p's exp(score - max) of keys lo..len-1 at scores[p * score_len + 0..len-lo-1], 1 / their
 * sum at scores[p * score_len + len - lo] (score_len >= the longest pair's len - lo + 16). */
static inline __attribute__((always_inline)) void att_scores_t(
        const att_pair *pr, int n, const char *kbase, const char *vbase, const sd_kv *kv, const int32_t *tab,
        int h, int lo, int HD, float scale, float cap, int bf, float *scores, int score_len) {
    const int esz = bf ? 2 : 4, rowbytes = HD * esz;
    __m512i qv[SD_ATT_PAIRS][16];                  /* fp32: q */
    __m512i qg[SD_ATT_PAIRS / 4][32], q1[SD_ATT_PAIRS][32];   /* bf16: pairs 4g..4g+3 in slots, pair p alone */
    __m512 mx[SD_ATT_PAIRS];
    int maxlen = lo;
    for (int p = 0; p < n; p++) {
        if (bf) {
            for (int u = 0; u < HD / 8; u++) {
                const __m128i x = _mm_loadu_si128((const __m128i *)((const bf16 *)pr[p].q + 8 * u));
                q1[p][u] = _mm512_maskz_broadcast_i32x4(0x000f, x);
                qg[p / 4][u] = p % 4 ? _mm512_mask_broadcast_i32x4(qg[p / 4][u], (__mmask16)(0x000f << 4 * (p % 4)), x) : q1[p][u];
            }
        } else {
            for (int c = 0; c < HD / 16; c++) qv[p][c] = _mm512_castps_si512(_mm512_loadu_ps((const float *)pr[p].q + 16 * c));
        }
        mx[p] = _mm512_set1_ps(-__builtin_inff());
        if (pr[p].len > maxlen) maxlen = pr[p].len;
    }
    const __m512i inv = _mm512_loadu_si512(reduce16_inv);
    const __m512 sv = _mm512_set1_ps(scale);
    const att_stream st = {kbase, vbase, kv, tab, lo, maxlen, (maxlen - lo + 15) / 16, h, rowbytes, esz};
    /* scores */
    for (int j0 = lo; j0 < maxlen; j0 += 16) {
        const int in_block = j0 % kv->block + 16 <= kv->block;
        stream_ahead(&st, (j0 - lo) / 16);
        const char *rows[16], *own[16];
        int have_rows = 0, nk[SD_ATT_PAIRS], shared[SD_ATT_PAIRS];
        for (int p = 0; p < n; p++) nk[p] = chunk_keys(&pr[p], j0, in_block, &shared[p]);
        for (int g = 0; g < n; g += 4) {
            const int gn = n - g < 4 ? n - g : 4;
            int all = bf;                             /* bf16: the group's pairs all share the chunk */
            for (int b = 0; b < gn; b++) all &= shared[g + b];
            if (all) {
                if (!have_rows) chunk_rows(kbase, kv, tab, j0, h, esz, rows);
                have_rows = 1;
                __m512 S[4];
                dots16x4(qg[g / 4], rows, HD, S);
                for (int b = 0; b < gn; b++) score_out(S[b], g + b, 16, j0, lo, sv, cap, scores, score_len, mx);
                continue;
            }
            for (int p = g; p < g + gn; p++) {        /* one pair at a time */
                if (!nk[p]) continue;
                const char *const *kp = pair_chunk(&pr[p], shared[p], nk[p], kbase, kv, tab, j0, h, esz, rows,
                                                   &have_rows, own);
                __m512 S[4];
                if (bf) dots16x4(q1[p], kp, HD, S);
                else S[0] = dots16(qv[p], kp, HD, bf, inv);
                score_out(S[0], p, nk[p], j0, lo, sv, cap, scores, score_len, mx);
            }
        }
    }
    /* softmax weights */
    for (int p = 0; p < n; p++) {
        float *sc = scores + (size_t)p * score_len;
        float top = _mm512_reduce_max_ps(mx[p]);
        if (pr[p].has_sink && pr[p].sink > top) top = pr[p].sink;
        const __m512 mv = _mm512_set1_ps(top);
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < pr[p].len - lo; j += 16) {
            const __mmask16 m = lanes(pr[p].len - lo - j);
            __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + j), mv));
            e = _mm512_maskz_mov_ps(m, e);
            _mm512_mask_storeu_ps(sc + j, m, e);
            sum = _mm512_add_ps(sum, e);
        }
        float total = _mm512_reduce_add_ps(sum);
        if (pr[p].has_sink) total += sink_exp(pr[p].sink - top);
        sc[pr[p].len - lo] = 1.0f / total;
    }
}

/* out of n pairs = their values weighted by att_scores_t's weights, in key order, times 1 / sum */
static inline __attribute__((always_inline)) void att_values_t(
        const att_pair *pr, int n, const char *kbase, const char *vbase, const sd_kv *kv, const int32_t *tab,
        int h, int lo, int HD, int bf, const float *scores, int score_len) {
    const int esz = bf ? 2 : 4, rowbytes = HD * esz;
    float of[SD_ATT_PAIRS][256] __attribute__((aligned(64)));
    int maxlen = lo;
    for (int p = 0; p < n; p++) {
        for (int c = 0; c < HD; c += 16) _mm512_store_ps(of[p] + c, _mm512_setzero_ps());
        if (pr[p].len > maxlen) maxlen = pr[p].len;
    }
    const att_stream st = {kbase, vbase, kv, tab, lo, maxlen, (maxlen - lo + 15) / 16, h, rowbytes, esz};
    /* weighted values, keys in order */
    for (int j0 = lo; j0 < maxlen; j0 += 16) {
        const int in_block = j0 % kv->block + 16 <= kv->block;
        stream_ahead(&st, st.nc + (j0 - lo) / 16);
        const char *rows[16];
        const float *w[SD_ATT_PAIRS];
        int idx[SD_ATT_PAIRS], ns = 0;
        for (int p = 0; p < n; p++) {
            int shared;
            const int nk = chunk_keys(&pr[p], j0, in_block, &shared);
            if (!nk) continue;
            const float *wp = scores + (size_t)p * score_len + (j0 - lo);
            if (shared) { idx[ns] = p; w[ns++] = wp; continue; }
            const char *own[16];
            pair_rows(&pr[p], vbase, kv, tab, j0, nk, h, esz, own);
            vsum_n(&of[p], &wp, own, nk, 1, HD, bf);
        }
        if (!ns) continue;
        chunk_rows(vbase, kv, tab, j0, h, esz, rows);
        /* the pairs sharing the chunk: consecutive in pr when they are all of them (the usual case) */
        if (idx[ns - 1] - idx[0] == ns - 1) {
            vsum_n(&of[idx[0]], w, rows, 16, ns, HD, bf);
        } else {
            for (int k = 0; k < ns; k++) vsum_n(&of[idx[k]], &w[k], rows, 16, 1, HD, bf);
        }
    }
    /* out = sums * (1 / sum), back in element order */
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int p = 0; p < n; p++) {
        const __m512 iv = _mm512_set1_ps(scores[(size_t)p * score_len + pr[p].len - lo]);
        int u = 0;
        for (; u + 32 <= HD; u += 32) {
            __m512 a = _mm512_mul_ps(_mm512_load_ps(of[p] + u), iv), b = _mm512_mul_ps(_mm512_load_ps(of[p] + u + 16), iv);
            if (bf) {
                const __m512 ev = a, od = b;
                a = _mm512_permutex2var_ps(ev, lo_idx, od);
                b = _mm512_permutex2var_ps(ev, hi_idx, od);
            }
            st16(pr[p].out, u, bf, 0xffff, a);
            st16(pr[p].out, u + 16, bf, 0xffff, b);
        }
        if (u < HD) st16(pr[p].out, u, bf, 0xffff, _mm512_mul_ps(_mm512_load_ps(of[p] + u), iv));
    }
}

static void attend_scores(const att_pair *pr, int n, const char *kbase, const char *vbase, const sd_kv *kv,
                          const int32_t *tab, int h, int lo, int HD, float scale, float cap, int bf,
                          float *scores, int score_len) {
    if (bf) att_scores_t(pr, n, kbase, vbase, kv, tab, h, lo, HD, scale, cap, 1, scores, score_len);
    else att_scores_t(pr, n, kbase, vbase, kv, tab, h, lo, HD, scale, cap, 0, scores, score_len);
}
static void attend_values(const att_pair *pr, int n, const char *kbase, const char *vbase, const sd_kv *kv,
                          const int32_t *tab, int h, int lo, int HD, int bf, const float *scores, int score_len) {
    if (bf) att_values_t(pr, n, kbase, vbase, kv, tab, h, lo, HD, 1, scores, score_len);
    else att_values_t(pr, n, kbase, vbase, kv, tab, h, lo, HD, 0, scores, score_len);
}

#else
/* AVX2 (no AVX512F): the same structure with 8-lane vectors and each key's dot product as in
 * decoder_ops.c's AVX2 helpers: one 8-lane FMA accumulation over q's HD/8 chunks in order, then hsum8,
 * times scale (soft cap: cap * tanhf(s / cap)); exp256 in 8-lane blocks of keys from lo (the padding
 * lanes -inf, so 0), their 8-lane sum and hsum8; the values in key order into 8-lane sums per 8
 * output elements, times 1 / sum.  A key's score and a value element's sum are functions of the pair
 * alone, so the chunking, the sharing of a chunk's rows between pairs and the prefetch change no bit
 * (these are the bits of the earlier one-pair-at-a-time AVX2 code, too). */
static void attend_scores(const att_pair *pr, int n, const char *kbase, const char *vbase, const sd_kv *kv,
                          const int32_t *tab, int h, int lo, int HD, float scale, float cap, int bf,
                          float *scores, int score_len) {
    const int C = HD / 8, esz = bf ? 2 : 4, rowbytes = HD * esz;   /* HD % 16 == 0, HD <= 256 */
    float qf[SD_ATT_PAIRS][256] __attribute__((aligned(32)));
    float mx[SD_ATT_PAIRS];
    int maxlen = lo;
    for (int p = 0; p < n; p++) {
        for (int c = 0; c < C; c++) _mm256_store_ps(qf[p] + 8 * c, ld8(pr[p].q, 8 * c, bf));
        mx[p] = -__builtin_inff();
        if (pr[p].len > maxlen) maxlen = pr[p].len;
    }
    const att_stream st = {kbase, vbase, kv, tab, lo, maxlen, (maxlen - lo + 15) / 16, h, rowbytes, esz};
    /* scores */
    for (int j0 = lo; j0 < maxlen; j0 += 16) {
        const int in_block = j0 % kv->block + 16 <= kv->block;
        stream_ahead(&st, (j0 - lo) / 16);
        const char *rows[16], *own[16];
        int have_rows = 0;
        for (int p = 0; p < n; p++) {
            int shared;
            const int nk = chunk_keys(&pr[p], j0, in_block, &shared);
            if (!nk) continue;
            const char *const *kp = pair_chunk(&pr[p], shared, nk, kbase, kv, tab, j0, h, esz, rows, &have_rows, own);
            float *sc = scores + (size_t)p * score_len + (j0 - lo);
            for (int i = 0; i < nk; i += 4) {             /* 4 keys at a time (rows past nk: zeros) */
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int c = 0; c < C; c++) {
                    const __m256 qv = _mm256_load_ps(qf[p] + 8 * c);
                    a0 = _mm256_fmadd_ps(qv, ld8(kp[i], 8 * c, bf), a0);
                    a1 = _mm256_fmadd_ps(qv, ld8(kp[i + 1], 8 * c, bf), a1);
                    a2 = _mm256_fmadd_ps(qv, ld8(kp[i + 2], 8 * c, bf), a2);
                    a3 = _mm256_fmadd_ps(qv, ld8(kp[i + 3], 8 * c, bf), a3);
                }
                const float d[4] = {hsum8(a0) * scale, hsum8(a1) * scale, hsum8(a2) * scale, hsum8(a3) * scale};
                for (int k = 0; k < 4 && i + k < nk; k++) {
                    const float v = cap > 0.f ? cap * tanhf(d[k] / cap) : d[k];   /* Gemma 2's soft cap */
                    sc[i + k] = v;
                    mx[p] = v > mx[p] ? v : mx[p];
                }
            }
        }
    }
    /* softmax weights */
    for (int p = 0; p < n; p++) {
        float *sc = scores + (size_t)p * score_len;
        const int len = pr[p].len - lo;
        for (int j = len; j < ((len + 7) & ~7); j++) sc[j] = -__builtin_inff();   /* pad: exp -> 0 below */
        const float top = pr[p].has_sink && pr[p].sink > mx[p] ? pr[p].sink : mx[p];
        const __m256 mv = _mm256_set1_ps(top), ninf = _mm256_set1_ps(-__builtin_inff());
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < len; j += 8) {
            const __m256 s = _mm256_loadu_ps(sc + j);
            const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(s, mv)), _mm256_cmp_ps(s, ninf, _CMP_NEQ_OQ));
            _mm256_storeu_ps(sc + j, e);
            sum = _mm256_add_ps(sum, e);
        }
        float total = hsum8(sum);
        if (pr[p].has_sink) total += sink_exp(pr[p].sink - top);
        sc[len] = 1.0f / total;
    }
}

static void attend_values(const att_pair *pr, int n, const char *kbase, const char *vbase, const sd_kv *kv,
                          const int32_t *tab, int h, int lo, int HD, int bf, const float *scores, int score_len) {
    const int C = HD / 8, esz = bf ? 2 : 4, rowbytes = HD * esz;
    float of[SD_ATT_PAIRS][256] __attribute__((aligned(32)));
    int maxlen = lo;
    for (int p = 0; p < n; p++) {
        for (int c = 0; c < C; c++) _mm256_store_ps(of[p] + 8 * c, _mm256_setzero_ps());
        if (pr[p].len > maxlen) maxlen = pr[p].len;
    }
    const att_stream st = {kbase, vbase, kv, tab, lo, maxlen, (maxlen - lo + 15) / 16, h, rowbytes, esz};
    /* weighted values, keys in order, 32 output elements at a time */
    for (int j0 = lo; j0 < maxlen; j0 += 16) {
        const int in_block = j0 % kv->block + 16 <= kv->block;
        stream_ahead(&st, st.nc + (j0 - lo) / 16);
        const char *rows[16], *own[16];
        int have_rows = 0;
        for (int p = 0; p < n; p++) {
            int shared;
            const int nk = chunk_keys(&pr[p], j0, in_block, &shared);
            if (!nk) continue;
            const char *const *vp = pair_chunk(&pr[p], shared, nk, vbase, kv, tab, j0, h, esz, rows, &have_rows, own);
            const float *w = scores + (size_t)p * score_len + (j0 - lo);
            for (int c0 = 0; c0 < C; c0 += 4) {
                const int cn = C - c0 < 4 ? C - c0 : 4;
                __m256 o[4];
                for (int c = 0; c < cn; c++) o[c] = _mm256_load_ps(of[p] + 8 * (c0 + c));
                for (int i = 0; i < nk; i++) {
                    const __m256 wv = _mm256_set1_ps(w[i]);
                    for (int c = 0; c < cn; c++) o[c] = _mm256_fmadd_ps(wv, ld8(vp[i], 8 * (c0 + c), bf), o[c]);
                }
                for (int c = 0; c < cn; c++) _mm256_store_ps(of[p] + 8 * (c0 + c), o[c]);
            }
        }
    }
    for (int p = 0; p < n; p++) {
        const __m256 iv = _mm256_set1_ps(scores[(size_t)p * score_len + pr[p].len - lo]);
        for (int c = 0; c < C; c++) {
            const __m256 y = _mm256_mul_ps(_mm256_load_ps(of[p] + 8 * c), iv);
            if (bf) {
                const __m256i r = sd_bf16_round8(y);
                _mm_storeu_si128((__m128i *)((bf16 *)pr[p].out + 8 * c),
                                 _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
            } else {
                _mm256_storeu_ps((float *)pr[p].out + 8 * c, y);
            }
        }
    }
}
#endif

/* Both halves in one call: the attention of n pairs (the usual schedule, decoder.c) */
static void attend_pairs(const att_pair *pr, int n, const char *kbase, const char *vbase, const sd_kv *kv,
                         const int32_t *tab, int h, int lo, int HD, float scale, float cap, int bf,
                         float *scores, int score_len) {
    attend_scores(pr, n, kbase, vbase, kv, tab, h, lo, HD, scale, cap, bf, scores, score_len);
    attend_values(pr, n, kbase, vbase, kv, tab, h, lo, HD, bf, scores, score_len);
}
