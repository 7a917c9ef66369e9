/*
 * specdecode/fast/decoder.c -- fused Llama/Qwen2/Qwen3/Mistral/Gemma decoder stack (included by kernels.c).
 *
 * sd_decoder_rows (and its batch-1 form sd_decoder_forward) runs embedding -> L x (rmsnorm, qkv(+bias), RoPE, KV-cache write, causal GQA
 * attention, o-proj + residual, rmsnorm, gate_up, silu*up, down + residual) for T <= 64 tokens in ONE
 * OpenMP parallel region with barriers between phases, leaving the hidden states (before the final
 * norm) in md->hid; sd_decoder_head runs final rmsnorm -> LM head on the rows that need logits.  Activations are kept in the model dtype (bf16 or fp32) with the eager path's rounding
 * points (after every projection, rmsnorm, rope product/sum, silu, silu*up, residual add).
 * Gemma 2 / 3 (sd_model's Gemma fields): scaled embeddings, fp32 (1 + w) norms, a norm on the o-proj and
 * down outputs before each residual add (sublayer_out), gelu_tanh*up, soft-capped scores and logits,
 * and each layer's own window and RoPE tables.  Row helpers and attention: decoder_ops.c.
 *
 * Batch invariance: every token row is computed by the same instruction sequence whatever T is:
 *   - matmuls: per-row accumulators, fixed k order (amx_part / avx512bf16_part / fp32_part);
 *   - attention for row t: scores over keys 0..start+t, each key's dot product a fixed fp32 sum
 *     of exact bf16 products (or fp32 FMAs), max, exp, sum in 16-lane blocks of keys starting at key
 *     0, weighted value sum in key order; no split of the key range across threads; several (row,
 *     head) pairs of one kv head share each chunk's reads (decoder_attn.c), never their sums;
 *   - rmsnorm / rope / silu: per row, fixed vector order.
 * Work is split between threads by output columns (matmuls) and by (row, head) units (attention),
 * which changes who computes a value, never how.
 */

/* token rows per call: a MoE model's passes (decoder.py MAX_MOE_T: a prefill chunk in one call reads each
 * routed expert once, however many of its rows route there); a dense model's decoder passes at most 64 */
#define SD_MAX_T 256

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
    /* Gemma 2 / 3 (specdecode/models/gemma.py); 0 / NULL for the other families */
    float embed_scale;               /* embeddings times this (a value of the model dtype); 0 = none */
    int norm_f32;                    /* every norm weight is fp32 (1 + stored weight) */
    const void *const *post_attn_norm, *const *post_mlp_norm;   /* [L] -> [D] norms of the attention /
                                        MLP output before its residual add, or NULL (then o / down add directly) */
    const int32_t *windows;          /* [L] window of each layer (0 = all), or NULL: `window` on every layer */
    const void *const *rope_cos_l, *const *rope_sin_l;          /* [L] each layer's RoPE tables, or NULL */
    float attn_softcap, final_softcap;                          /* cap * tanh(x / cap) of scores / logits; 0 = none */
    int gelu;                        /* MLP activation gelu(tanh approximation) instead of silu */
    /* mixture-of-experts layers (decoder_moe.c); E = 0 / NULL for none */
    int E, EK, EI, EIp, norm_topk;   /* experts, routed per token, expert intermediate size (padded: EIp) */
    const void *const *router_w;     /* [L] packed router [E, Dp], or NULL for a dense-MLP layer */
    const void *const *const *egu_w, *const *const *edn_w;     /* [L][E] packed gate|up [2EI, Dp], down [D, EIp] */
    const sd_qmat *const *const *egu_q, *const *const *edn_q;  /* [L][E] quantized ones, or NULL arrays */
    void *ex, *egu, *eact, *ey;      /* scratch [SD_MAX_T * EK, ld Dp / 2EI / EIp / D] */
    void *rlog;                      /* scratch [SD_MAX_T, E] router logits */
    int32_t *moe_count;              /* [L] out: distinct experts each layer's last pass read, or NULL */
    /* gpt-oss (specdecode/models/gpt_oss.py); NULL / 0 for the other families */
    const float *const *o_b;         /* [L] fp32 o-proj bias, or NULL */
    const float *const *sinks;       /* [L] -> [H] fp32 sink logit of each q head, or NULL */
    const float *const *router_b;    /* [L] fp32 router bias [E] (NULL entries: none), or NULL */
    const float *const *const *egu_b, *const *const *edn_b;   /* [L][E] fp32 expert biases, or NULL */
    int router_kind;                 /* 0: softmax over all experts then top-k; 1: top-k logits then their softmax */
    int act_kind;                    /* 0: silu (or gelu) * up; 1: clamped SwiGLU (swiglu_alpha, swiglu_limit) */
    float swiglu_alpha, swiglu_limit;
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

#include "decoder_ops.c"
#include "decoder_attn.c"

/* One thread's share of y[M, N] (op) x[M, Kp] @ W^T: dispatch on quantized / dtype / AMX. */
static inline void mm_part(const sd_model *md, const void *x, int lda, const void *Wp, const sd_qmat *Wq,
                           const float *bias, void *y, int ldy, int M, int N, int Kp, int mode, int t, int nt,
                           int *cfg) {
    if (Wq) { qmm_part(Wq, (const bf16 *)x, lda, bias, y, ldy, M, mode, t, nt, cfg); return; }
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

#include "decoder_moe.c"

/* A sublayer's output projection x[T, K] @ W^T (+ bias) into the residual md->hid, then a barrier: added
 * directly (rne(hid + rne(out))), or when `post` (Gemma) through an RMSNorm first, via md->xn
 * (free by then: its zero padding past D stays untouched). */
static void sublayer_out(const sd_model *md, const void *x, int K, const void *Wp, const sd_qmat *Wq,
                         const float *bias, const void *post, int T, int t, int nt, int *cfg) {
    const int bf = md->is_bf16, esz = bf ? 2 : 4, D = md->D;
    if (!post) {
        mm_part(md, x, K, Wp, Wq, bias, md->hid, D, T, D, K, bf ? OUT_BF16_ADD : OUT_F32_ADD, t, nt, cfg);
#pragma omp barrier
        return;
    }
    mm_part(md, x, K, Wp, Wq, bias, md->xn, md->Dp, T, D, K, bf ? OUT_BF16 : OUT_F32, t, nt, cfg);
#pragma omp barrier
    int a, b;
    range(T, t, nt, &a, &b);
    for (int r = a; r < b; r++)
        rmsnorm_row((char *)md->xn + (size_t)r * md->Dp * esz, post, bf && !md->norm_f32,
                    (char *)md->hid + (size_t)r * D * esz, D, md->eps, bf, 1);
#pragma omp barrier
}

/* A batch of attention pairs: units u (row r, q head h) in kv-head-major order, u = kvh * T * grp +
 * r * grp + (h % grp), consecutive, of one kv head, one cache table and one first key lo. */
typedef struct {
    att_pair pr[SD_ATT_PAIRS];
    int n, kvh, lo, u0;
    const int32_t *tab;
} att_batch;

/* The batch starting at unit u (units below ub, at most SD_ATT_PAIRS); returns the unit after it.
 * sinks: the layer's [H] sink logits, or NULL */
static int att_next(const sd_model *md, const sd_kv *kv, const int32_t *pos, const int32_t *row_base,
                    int32_t (*path)[64], int T, int win, const float *sinks, int u, int ub, att_batch *bt) {
    const int bf = md->is_bf16, esz = bf ? 2 : 4, HD = md->HD, grp = md->H / md->KVH, per = T * grp;
    const int r0 = u % per / grp;
    bt->kvh = u / per;
    bt->u0 = u;
    bt->tab = kv->tables + (size_t)r0 * kv->table_width;
    bt->lo = win > 0 && pos[r0] + 1 > win ? pos[r0] + 1 - win : 0;
    if (ub > (bt->kvh + 1) * per) ub = (bt->kvh + 1) * per;
    for (bt->n = 0; u < ub && bt->n < SD_ATT_PAIRS; u++) {
        const int r = u % per / grp, h = bt->kvh * grp + u % grp;
        const int lo = win > 0 && pos[r] + 1 > win ? pos[r] + 1 - win : 0;
        const int32_t *tab = kv->tables + (size_t)r * kv->table_width;
        if (lo != bt->lo || (tab != bt->tab && memcmp(tab, bt->tab, sizeof(int32_t) * kv->table_width))) break;
        bt->pr[bt->n++] = (att_pair){(const char *)md->q + ((size_t)r * md->H * HD + (size_t)h * HD) * esz,
                                     (char *)md->att + ((size_t)r * md->Qp + (size_t)h * HD) * esz, pos[r] + 1,
                                     row_base[r], path[r], sinks ? sinks[h] : 0.f, sinks != NULL};
    }
    return u;
}

/* Attention when an even split of the units would divide a batch between two threads, which would
 * then both read its kv head (decode at batch 1: 9 q heads over 3 kv heads on 2 threads), and the
 * scores of all units fit the scratch (T * H <= nthreads * SD_ATT_PAIRS).  Each batch is two items, its
 * scores (reading the keys) and its values (reading the values), and the items of all batches in order
 * are split evenly between the threads: at batch 1, thread 0 takes kv head 0 and kv head 1's scores,
 * thread 1 kv head 1's values and kv head 2, so each reads half the cache and no byte twice.  A
 * batch's scores live at its units' own place in the scratch; a thread that owns the values of a
 * batch whose scores are on the thread before it does them last, after waiting for that thread's
 * flag, which the thread before raises first thing.  The items are computed as in attend_pairs, so
 * the bits do not depend on the schedule. */
#define SD_SPLIT_MAX 512              /* batches */
static void attention_split(const sd_model *md, const sd_kv *kv, const int32_t *pos, const int32_t *row_base,
                            int32_t (*path)[64], int T, int win, const float *sinks, int l, const char *kl,
                            const char *vl, int t,
                            int nt, float *scores, int score_len, int *ready) {
    const int bf = md->is_bf16, HD = md->HD, units = T * md->H;
    int starts[SD_SPLIT_MAX + 1], G = 0;
    for (int u = 0; u < units && G < SD_SPLIT_MAX; G++) {        /* the batches, as every thread sees them */
        att_batch bt;
        starts[G] = u;
        u = att_next(md, kv, pos, row_base, path, T, win, sinks, u, units, &bt);
    }
    starts[G] = units;
    int i0, i1;
    range(2 * G, t, nt, &i0, &i1);
    /* item i: batch i / 2, its scores (i even) or values (i odd) */
#define SD_ITEM(i) do {                                                                                  \
        att_batch bt;                                                                                   \
        att_next(md, kv, pos, row_base, path, T, win, sinks, starts[(i) / 2], starts[(i) / 2 + 1], &bt); \
        float *sc = scores + (size_t)bt.u0 * score_len;                                                 \
        if ((i) % 2 == 0) {                                                                             \
            attend_scores(bt.pr, bt.n, kl, vl, kv, bt.tab, bt.kvh, bt.lo, HD, md->scale, md->attn_softcap, \
                          bf, sc, score_len);                                                           \
            __atomic_store_n(&ready[(i) / 2], l + 1, __ATOMIC_RELEASE);                                  \
        } else {                                                                                        \
            while (__atomic_load_n(&ready[(i) / 2], __ATOMIC_ACQUIRE) < l + 1) _mm_pause();              \
            attend_values(bt.pr, bt.n, kl, vl, kv, bt.tab, bt.kvh, bt.lo, HD, bf, sc, score_len);       \
        }                                                                                               \
    } while (0)
    const int first = i1 > i0 && (i1 - 1) % 2 == 0 && i1 < 2 * G;     /* scores whose values are on t + 1 */
    const int last = i1 > i0 && i0 % 2 == 1;                           /* values whose scores are on t - 1 */
    if (first) SD_ITEM(i1 - 1);
    for (int i = i0 + last; i < i1 - first; i++) SD_ITEM(i);
    if (last) SD_ITEM(i0);
#undef SD_ITEM
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
 * nthreads * SD_ATT_PAIRS * score_len floats, score_len >= max(pos) + 17.  Returns 0, or -1 on bad arguments. */
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
    const int mode_out = bf ? OUT_BF16 : OUT_F32, wbf = bf && !md->norm_f32;
    reduce16_init();
    /* the split schedule (attention_split) where an even split of the units divides a batch of one
     * kv head and one row between two threads */
    int split = 0, ready[SD_SPLIT_MAX];
    if (nthreads > 1 && T * H <= nthreads * SD_ATT_PAIRS && T * H <= SD_SPLIT_MAX) {
        for (int t = 1; t < nthreads; t++) {
            int a, b;
            range(T * H, t, nthreads, &a, &b);
            split |= a > 0 && a < T * H && (a - 1) / grp == a / grp;
        }
        memset(ready, 0, sizeof ready);
    }
    moe_route route;                          /* shared by the pass's threads (filled by one of them) */
    if (md->E > SD_MOE_MAX_E || md->EK > SD_MOE_MAX_K || (md->E && md->EK > md->E)) return -1;

#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *sc = scores + (size_t)t * SD_ATT_PAIRS * score_len;
        int cfg = -1, a, b;
        /* embedding */
        range(T, t, nt, &a, &b);
        for (int r = a; r < b; r++) {
            const char *row = (const char *)md->embed + (size_t)tokens[r] * D * esz;
            if (md->embed_scale == 0.f) { memcpy(hid + (size_t)r * D * esz, row, (size_t)D * esz); continue; }
            for (int i = 0; i < D; i += 16)                  /* rne(embedding * scale) */
                st16(hid, (size_t)r * D + i, bf, lanes(D - i),
                     _mm512_mul_ps(ld16(row, i, bf, lanes(D - i)), _mm512_set1_ps(md->embed_scale)));
        }
#pragma omp barrier
        for (int l = 0; l < md->L; l++) {
            char *kl = kv->k[l], *vl = kv->v[l];
            const int win = md->windows ? md->windows[l] : md->window;
            const float *sinks = md->sinks ? md->sinks[l] : NULL;
            const void *rcos = md->rope_cos_l ? md->rope_cos_l[l] : md->rope_cos;
            const void *rsin = md->rope_sin_l ? md->rope_sin_l[l] : md->rope_sin;
            range(T, t, nt, &a, &b);
            for (int r = a; r < b; r++)
                rmsnorm_row(hid + (size_t)r * D * esz, md->attn_norm[l], wbf, xn + (size_t)r * md->Dp * esz, D, md->eps,
                            bf, 0);
#pragma omp barrier
            mm_part(md, xn, md->Dp, md->qkv_w[l], md->qkv_q ? md->qkv_q[l] : NULL, md->qkv_b[l], qkv, NQKV, T, NQKV, md->Dp, mode_out, t, nt, &cfg);
#pragma omp barrier
            /* RoPE on q and k heads, k/v into the cache */
            range(T * (H + 2 * KVH), t, nt, &a, &b);
            for (int u = a; u < b; u++) {
                int r = u / (H + 2 * KVH), h = u % (H + 2 * KVH), p = pos[r];
                const int32_t *tab = kv->tables + (size_t)r * kv->table_width;
                const char *src = qkv + ((size_t)r * NQKV + (size_t)h * HD) * esz;
                const char *cs = (const char *)rcos + (size_t)p * HD * esz;
                const char *sn = (const char *)rsin + (size_t)p * HD * esz;
                const void *nw = h < H ? (md->q_norm ? md->q_norm[l] : NULL)
                                       : h < H + KVH && md->k_norm ? md->k_norm[l] : NULL;
                _Alignas(64) char normed[256 * 4];
                if (nw) {                                   /* per-head RMSNorm (Qwen3), then RoPE */
                    rmsnorm_row(src, nw, wbf, normed, HD, md->eps, bf, 0);
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
            /* (row, q head) pairs in kv-head-major order, in batches that read one kv head through one
             * cache table (decoder_attn.c) */
            if (split) {
                attention_split(md, kv, pos, row_base, path, T, win, sinks, l, kl, vl, t, nt, scores, score_len, ready);
            } else {
                range(T * H, t, nt, &a, &b);              /* split evenly between threads */
                for (int u = a; u < b;) {
                    att_batch bt;
                    u = att_next(md, kv, pos, row_base, path, T, win, sinks, u, b, &bt);
                    attend_pairs(bt.pr, bt.n, kl, vl, kv, bt.tab, bt.kvh, bt.lo, HD, md->scale, md->attn_softcap, bf,
                                 sc, score_len);
                }
            }
#pragma omp barrier
            sublayer_out(md, att, md->Qp, md->o_w[l], md->o_q ? md->o_q[l] : NULL, md->o_b ? md->o_b[l] : NULL,
                         md->post_attn_norm ? md->post_attn_norm[l] : NULL, T, t, nt, &cfg);
            range(T, t, nt, &a, &b);
            for (int r = a; r < b; r++)
                rmsnorm_row(hid + (size_t)r * D * esz, md->mlp_norm[l], wbf, xn + (size_t)r * md->Dp * esz, D, md->eps,
                            bf, 0);
#pragma omp barrier
            if (md->router_w && md->router_w[l]) {
                moe_mlp(md, l, T, &route, t, nt, &cfg);
                continue;
            }
            mm_part(md, xn, md->Dp, md->gu_w[l], md->gu_q ? md->gu_q[l] : NULL, NULL, gu, 2 * I, T, 2 * I, md->Dp, mode_out, t, nt, &cfg);
#pragma omp barrier
            act_rows(md, gu, 2 * I, I, act, md->Ip, T, t, nt);
#pragma omp barrier
            sublayer_out(md, act, md->Ip, md->down_w[l], md->down_q ? md->down_q[l] : NULL, NULL,
                         md->post_mlp_norm ? md->post_mlp_norm[l] : NULL, T, t, nt, &cfg);
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
            rmsnorm_row((const char *)hidden + (size_t)r * D * esz, md->final_norm, bf && !md->norm_f32,
                        xn + (size_t)r * md->Dp * esz, D, md->eps, bf, 0);
#pragma omp barrier
        mm_part(md, xn, md->Dp, md->head_w, md->head_q, md->head_b, out, md->V, n, md->V, md->Dp,
                bf ? OUT_F32_VIA_BF16 : OUT_F32, t, nt, &cfg);
        if (md->final_softcap > 0.f) {                 /* cap * tanh(logit / cap), per 16 logits */
            const int CH = (md->V + 15) / 16;
            const __m512 cap = _mm512_set1_ps(md->final_softcap);
#pragma omp barrier
            range(n * CH, t, nt, &a, &b);
            for (int u = a; u < b; u++) {
                float *o = out + (size_t)(u / CH) * md->V + (u % CH) * 16;
                __mmask16 m = lanes(md->V - (u % CH) * 16);
                _mm512_mask_storeu_ps(o, m, _mm512_mul_ps(cap, tanh512(_mm512_div_ps(_mm512_maskz_loadu_ps(m, o), cap))));
            }
        }
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
