/*
 * specdecode/fast/decoder.c -- fused Llama/Qwen2 decoder stack for batch 1 (included by kernels.c).
 *
 * sd_decoder_rows (and its batch-1 form sd_decoder_forward) runs embedding -> L x (rmsnorm, qkv(+bias), RoPE, KV-cache write, causal GQA
 * attention, o-proj + residual, rmsnorm, gate_up, silu*up, down + residual) for T <= 64 tokens in ONE
 * OpenMP parallel region with barriers between phases, leaving the hidden states (before the final
 * norm) in md->hid; sd_decoder_head runs final rmsnorm -> LM head on the rows that need logits.  Activations are kept in the model dtype (bf16 or fp32) with the eager path's rounding
 * points (after every projection, rmsnorm, rope product/sum, silu, silu*up, residual add).
 *
 * Batch invariance: every token row is computed by the same instruction sequence whatever T is:
 *   - matmuls: per-row accumulators, fixed k order (amx_part / avx512bf16_part / fp32_part);
 *   - attention for row t: scores over keys 0..start+t in order, one 16-lane fp32 accumulator per
 *     dot product over head_dim chunks, max, exp, sum in 16-lane blocks of keys starting at key 0,
 *     weighted value sum in key order; no split of the key range across threads;
 *   - rmsnorm / rope / silu: per row, fixed vector order.
 * Work is split between threads by output columns (matmuls) and by (row, head) units (attention),
 * which changes who computes a value, never how.
 */

#define SD_MAX_T 64

typedef struct {
    int D, H, KVH, HD, I, V, L;     /* hidden, q heads, kv heads, head_dim, intermediate, vocab, layers */
    int is_bf16, use_amx;
    int Dp, Qp, Ip;                  /* padded K (row stride) of the inputs of qkv/gate_up/head, o, down */
    int rope_len;                    /* rows of the rope tables */
    float eps, scale;
    const void *embed;               /* [V, D] */
    const void *rope_cos, *rope_sin; /* [rope_len, HD] */
    const void *const *attn_norm;    /* [L] -> [D] */
    const void *const *mlp_norm;
    const void *const *qkv_w;        /* [L] packed [(H+2KVH)*HD, Dp] */
    const float *const *qkv_b;       /* [L] fp32 bias or NULL */
    const void *const *o_w;          /* [L] packed [D, Qp] */
    const void *const *gu_w;         /* [L] packed [2I, Dp] */
    const void *const *down_w;       /* [L] packed [D, Ip] */
    const void *final_norm;
    const void *head_w;              /* packed [V, Dp] */
    const float *head_b;             /* NULL */
    /* scratch (model dtype, zero padded), all [SD_MAX_T, ld] */
    void *hid;                       /* ld D */
    void *xn;                        /* ld Dp */
    void *qkv;                       /* ld (H+2KVH)*HD */
    void *q;                         /* ld H*HD (roped q) */
    void *att;                       /* ld Qp */
    void *gu;                        /* ld 2I */
    void *act;                       /* ld Ip */
    /* GGUF-quantized projections (quant.c), used instead of the packed ones where not NULL
     * (bf16 activations only): per layer sd_qmat pointers, or NULL arrays for none */
    const sd_qmat *const *qkv_q, *const *o_q, *const *gu_q, *const *down_q;
    const sd_qmat *head_q;
    /* Qwen3: RMSNorm weights [L] -> [HD] over each q / k head before RoPE, or NULL */
    const void *const *q_norm, *const *k_norm;
    int window;                      /* sliding window: a row at position p sees logical keys p-window+1..p; 0 = all */
} sd_model;

/* Where the cache keeps key/value j of kv head h for one token row (elements from a layer's base):
 *   tab[j / block] * block_stride + (j % block) * key_stride + h * head_stride
 * contiguous cache [B, KVH, max_len, HD]: block = max_len, tab = {batch row}, block_stride =
 *   KVH * max_len * HD, key_stride = HD, head_stride = max_len * HD;
 * paged pool [blocks, block, KVH, HD]: tab = the row's block table, block_stride = block * KVH * HD,
 *   key_stride = KVH * HD, head_stride = HD.  Attention reads keys in chunks of 16 in place when
 *   a chunk lies in one block (block % 16 == 0), else from a copy. */
typedef struct {
    void *const *k, *const *v;       /* [L] layer bases */
    const int32_t *tables;           /* [rows][table_width] block ids per token row */
    int table_width, block;
    long block_stride, key_stride, head_stride;
} sd_kv;

static inline size_t kv_off(const sd_kv *kv, const int32_t *tab, int j, int h) {
    return (size_t)tab[j / kv->block] * kv->block_stride + (size_t)(j % kv->block) * kv->key_stride
           + (size_t)h * kv->head_stride;
}

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

/* out[0:D] = rne(x * rsqrt(mean(x^2) + eps) * w)   (torch's fused rms_norm: one rounding) */
static void rmsnorm_row(const void *x, const void *w, void *out, int D, float eps, int bf) {
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < D; i += 16) {
        __m512 v = ld16(x, i, bf, lanes(D - i));
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    float r = 1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(_mm512_reduce_add_ps(ss) / (float)D + eps)));
    __m512 rv = _mm512_set1_ps(r);
    for (int i = 0; i < D; i += 16) {
        __mmask16 m = lanes(D - i);
        st16(out, i, bf, m, _mm512_mul_ps(_mm512_mul_ps(ld16(x, i, bf, m), rv), ld16(w, i, bf, m)));
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
 * cache slot; model dtype), q [HD] (model dtype), out [HD].  scores: scratch of >= len - lo + 16 floats.
 * Keys go in chunks of 16 starting at key lo (0, or the first key of a sliding window: a function of
 * the row's position only), so logical key j's dot product always takes slot (j - lo) % 16 of the
 * same tree, whatever the cache layout and wherever a tree put the key: a tree node's row is
 * computed exactly as the same path verified as a chain. */
static void attend(const void *q, const char *kbase, const char *vbase, const sd_kv *kv, const int32_t *tab,
                   int tbase, const int32_t *tslots,
                   int h, int lo, int len, int HD, float scale, int bf, float *scores, void *out) {
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

/* One thread's share of y[M, N] (op) x[M, Kp] @ W^T: dispatch on quantized / dtype / AMX. */
static inline void mm_part(const sd_model *md, const void *x, int lda, const void *Wp, const sd_qmat *Wq,
                           const float *bias, void *y, int ldy, int M, int N, int Kp, int mode, int t, int nt,
                           int *cfg) {
    if (Wq) { qmm_part(Wq, (const bf16 *)x, lda, bias, y, ldy, M, mode, t, nt); return; }
    int g0, g1;
    split((N + 31) / 32, t, nt, &g0, &g1);
    if (!md->is_bf16) fp32_part((const float *)x, lda, (const float *)Wp, bias, (float *)y, ldy, M, N, Kp, mode, g0, g1);
    else if (md->use_amx) amx_part((const bf16 *)x, lda, (const bf16 *)Wp, bias, y, ldy, M, N, Kp, mode, g0, g1, cfg);
    else avx512bf16_part((const bf16 *)x, lda, (const bf16 *)Wp, bias, y, ldy, M, N, Kp, mode, g0, g1);
}

/* Even split of n units: [a, b) for thread t of nt. */
static inline void range(int n, int t, int nt, int *a, int *b) {
    *a = (int)((long)n * t / nt);
    *b = (int)((long)n * (t + 1) / nt);
}

/* General form: token rows r = 0..T-1 (T <= SD_MAX_T), row r is token tokens[r] at RoPE position
 * pos[r] of its own sequence, written to cache slot slot[r] (NULL: slot = pos), whose cache is
 * addressed through kv->tables + r * kv->table_width; rows of one sequence come in slot order.
 * Row r sees the keys at slots 0..tbase[r]-1 and, for each bit i set in tmask[r], the key at slot
 * tbase[r] + i (its own included: every row's key/value is written before any attention); in
 * that order they are its logical keys 0..pos[r], so popcount(tmask[r]) == pos[r] - tbase[r] + 1.
 * tbase NULL: a chain, row r sees slots 0..pos[r].  With md->window > 0 only the last window of
 * those logical keys are attended to.  (The per-pass description is built in
 * specdecode/forward.py.)  The hidden states of the T rows are left in md->hid.  scores:
 * nthreads * score_len floats, score_len >= max(pos) + 17.  Returns 0, or -1 on bad arguments. */
int sd_decoder_rows(const sd_model *md, const int64_t *tokens, const int32_t *pos, const int32_t *slot,
                    const int32_t *tbase, const uint64_t *tmask, int T, const sd_kv *kv,
                    int score_len, float *scores, int nthreads) {
    if (T < 1 || T > SD_MAX_T || kv->block < 1) return -1;
    int32_t path[SD_MAX_T][64], row_base[SD_MAX_T], row_slot[SD_MAX_T];
    for (int r = 0; r < T; r++) {
        if (pos[r] < 0 || pos[r] >= md->rope_len || pos[r] + 17 > score_len) return -1;
        row_slot[r] = slot ? slot[r] : pos[r];
        row_base[r] = tbase ? tbase[r] : 0x7fffffff;
        if (!tbase) continue;
        int count = 0;
        for (int i = 0; i < 64; i++)
            if (tmask[r] >> i & 1) path[r][count++] = tbase[r] + i;
        if (tbase[r] < 0 || row_slot[r] < 0 || count != pos[r] - tbase[r] + 1) return -1;
    }
    const int bf = md->is_bf16, esz = bf ? 2 : 4;
    const int D = md->D, H = md->H, KVH = md->KVH, HD = md->HD, I = md->I;
    const int NQKV = (H + 2 * KVH) * HD, QS = H * HD, grp = H / KVH;
    char *hid = md->hid, *xn = md->xn, *qkv = md->qkv, *qb = md->q, *att = md->att, *gu = md->gu, *act = md->act;
    const int mode_res = bf ? OUT_BF16_ADD : OUT_F32_ADD, mode_out = bf ? OUT_BF16 : OUT_F32;
    reduce16_init();

#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *sc = scores + (size_t)t * score_len;
        int cfg = -1, a, b;
        /* embedding */
        range(T, t, nt, &a, &b);
        for (int r = a; r < b; r++)
            memcpy(hid + (size_t)r * D * esz, (const char *)md->embed + (size_t)tokens[r] * D * esz, (size_t)D * esz);
#pragma omp barrier
        for (int l = 0; l < md->L; l++) {
            char *kl = kv->k[l], *vl = kv->v[l];
            range(T, t, nt, &a, &b);
            for (int r = a; r < b; r++)
                rmsnorm_row(hid + (size_t)r * D * esz, md->attn_norm[l], xn + (size_t)r * md->Dp * esz, D, md->eps, bf);
#pragma omp barrier
            mm_part(md, xn, md->Dp, md->qkv_w[l], md->qkv_q ? md->qkv_q[l] : NULL, md->qkv_b[l], qkv, NQKV, T, NQKV, md->Dp, mode_out, t, nt, &cfg);
#pragma omp barrier
            /* RoPE on q and k heads, k/v into the cache */
            range(T * (H + 2 * KVH), t, nt, &a, &b);
            for (int u = a; u < b; u++) {
                int r = u / (H + 2 * KVH), h = u % (H + 2 * KVH), p = pos[r];
                const int32_t *tab = kv->tables + (size_t)r * kv->table_width;
                const char *src = qkv + ((size_t)r * NQKV + (size_t)h * HD) * esz;
                const char *cs = (const char *)md->rope_cos + (size_t)p * HD * esz;
                const char *sn = (const char *)md->rope_sin + (size_t)p * HD * esz;
                const void *nw = h < H ? (md->q_norm ? md->q_norm[l] : NULL)
                                       : h < H + KVH && md->k_norm ? md->k_norm[l] : NULL;
                _Alignas(64) char normed[256 * 4];
                if (nw) {                                   /* per-head RMSNorm (Qwen3), then RoPE */
                    rmsnorm_row(src, nw, normed, HD, md->eps, bf);
                    src = normed;
                }
                if (h < H)
                    rope_head(src, cs, sn, qb + ((size_t)r * QS + (size_t)h * HD) * esz, HD, bf);
                else if (h < H + KVH)
                    rope_head(src, cs, sn, kl + kv_off(kv, tab, row_slot[r], h - H) * esz, HD, bf);
                else
                    memcpy(vl + kv_off(kv, tab, row_slot[r], h - H - KVH) * esz, src, (size_t)HD * esz);
            }
#pragma omp barrier
            range(T * H, t, nt, &a, &b);
            for (int u = a; u < b; u++) {
                int r = u / H, h = u % H;
                int lo = md->window > 0 && pos[r] + 1 > md->window ? pos[r] + 1 - md->window : 0;
                attend(qb + ((size_t)r * QS + (size_t)h * HD) * esz, kl, vl, kv,
                       kv->tables + (size_t)r * kv->table_width, row_base[r], path[r], h / grp, lo, pos[r] + 1,
                       HD, md->scale, bf, sc,
                       att + ((size_t)r * md->Qp + (size_t)h * HD) * esz);
            }
#pragma omp barrier
            mm_part(md, att, md->Qp, md->o_w[l], md->o_q ? md->o_q[l] : NULL, NULL, hid, D, T, D, md->Qp, mode_res, t, nt, &cfg);
#pragma omp barrier
            range(T, t, nt, &a, &b);
            for (int r = a; r < b; r++)
                rmsnorm_row(hid + (size_t)r * D * esz, md->mlp_norm[l], xn + (size_t)r * md->Dp * esz, D, md->eps, bf);
#pragma omp barrier
            mm_part(md, xn, md->Dp, md->gu_w[l], md->gu_q ? md->gu_q[l] : NULL, NULL, gu, 2 * I, T, 2 * I, md->Dp, mode_out, t, nt, &cfg);
#pragma omp barrier
            /* act = rne(rne(silu(gate)) * up) */
            {
                const int CH = (I + 15) / 16;
                range(T * CH, t, nt, &a, &b);
                for (int u = a; u < b; u++) {
                    int r = u / CH, i = (u % CH) * 16;
                    __mmask16 m = lanes(I - i);
                    __m512 g = ld16(gu, (size_t)r * 2 * I + i, bf, m), up = ld16(gu, (size_t)r * 2 * I + I + i, bf, m);
                    __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
                    st16(act, (size_t)r * md->Ip + i, bf, m, _mm512_mul_ps(rnd(s, bf), up));
                }
            }
#pragma omp barrier
            mm_part(md, act, md->Ip, md->down_w[l], md->down_q ? md->down_q[l] : NULL, NULL, hid, D, T, D, md->Ip, mode_res, t, nt, &cfg);
#pragma omp barrier
        }
        if (cfg >= 0) _tile_release();
    }
    return 0;
}

/* The LM head: hidden[n, D] (model dtype, rows as sd_decoder_rows leaves them in md->hid: before the
 * final norm) -> final rmsnorm -> logits out[n, V] fp32, n <= SD_MAX_T.  Each row is computed as in
 * a pass of any size (batch invariant).  Returns 0, or -1 on bad arguments. */
int sd_decoder_head(const sd_model *md, const void *hidden, int n, float *out, int nthreads) {
    if (n < 1 || n > SD_MAX_T) return -1;
    const int bf = md->is_bf16, esz = bf ? 2 : 4, D = md->D;
    char *xn = md->xn;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int cfg = -1, a, b;
        range(n, t, nt, &a, &b);
        for (int r = a; r < b; r++)
            rmsnorm_row((const char *)hidden + (size_t)r * D * esz, md->final_norm, xn + (size_t)r * md->Dp * esz,
                        D, md->eps, bf);
#pragma omp barrier
        mm_part(md, xn, md->Dp, md->head_w, md->head_q, md->head_b, out, md->V, n, md->V, md->Dp,
                bf ? OUT_F32_VIA_BF16 : OUT_F32, t, nt, &cfg);
        if (cfg >= 0) _tile_release();
    }
    return 0;
}

/* Batch 1, contiguous cache: tokens[T] (T <= SD_MAX_T) at positions start..start+T-1.  kc/vc: per
 * layer, batch row 0 of the cache [KVH, max_len, HD].  Hidden states are left in md->hid.
 * scores: nthreads * (max_len + 16) floats.  Returns 0, or -1 on bad arguments. */
int sd_decoder_forward(const sd_model *md, const int64_t *tokens, int T, int start,
                       void *const *kc, void *const *vc, int max_len, float *scores, int nthreads) {
    if (T < 1 || T > SD_MAX_T || start < 0 || start + T > max_len || start + T > md->rope_len)
        return -1;
    int32_t pos[SD_MAX_T], tables[SD_MAX_T];
    for (int r = 0; r < T; r++) { pos[r] = start + r; tables[r] = 0; }
    sd_kv kv = {kc, vc, tables, 1, max_len, 0, md->HD, (long)max_len * md->HD};
    return sd_decoder_rows(md, tokens, pos, NULL, NULL, NULL, T, &kv, max_len + 16, scores, nthreads);
}
