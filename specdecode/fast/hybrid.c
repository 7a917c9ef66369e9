/*
 * specdecode/fast/hybrid.c -- Qwen3.5's whole layer stack on a short chain pass in one call
 * (specdecode/models/qwen3_5.py, fast/hybrid.py), included by kernels.c after deltanet.c and
 * rowops.c, whose pieces it runs in one OpenMP parallel region with barriers between phases.
 *
 * sd_hybrid_rows takes B rows of T tokens each (B * T <= SD_HY_MAX_T token rows, row-major: token row
 * r = b * T + t at position starts[b] + t) and runs embedding -> L x (fp32 (1 + w) RMS norm, the
 * token mixer, residual add, RMS norm, gate|up, silu * up, down + residual add), leaving the hidden
 * states before the final norm in `hid` [B * T, D]. The token mixer of a layer is
 *   - a Gated DeltaNet layer: the input projection q|k|v|z|b|a, then per (row, value head)
 *     deltanet.c's dn_item (conv window, norms, the delta rule on the row's fp32 state, the gated
 *     norm), then the out projection. What HybridCache.record keeps comes back in per-pass buffers
 *     stacked by recurrent layer (the row's states are only read: a pass never changes the cache);
 *   - a gated attention layer: q (with its gate) | k | v, q / k head norms + partial RoPE, the keys
 *     and values written at their slots of the paged cache, attention over the row's keys 0 ..
 *     starts[b] + t (decoder_attn.c's attend_pairs), the sigmoid gate, the o projection.
 * Every projection is a GGUF-quantized one (quant.c), activations bf16. The roundings and the
 * order of every sum are the per-layer native path's (deltanet.c, rowops.c, QuantLinear), so a
 * pass gives the same bits either way, and a row's bits never depend on the other rows or on T.
 */

#define SD_HY_MAX_T 64            /* token rows per call (hybrid.py MAX_ROWS: its scratch) */

typedef struct {                  /* must match _Hybrid in fast/hybrid.py */
    int D, I, L;                  /* hidden, intermediate, layers */
    int H, KVH, HD, rot;          /* attention layers: q heads, kv heads, head dim, rotary dims */
    int rope_len;                 /* rows of the RoPE tables */
    float eps, scale;
    const void *embed;            /* [V, D] bf16 */
    const void *rope_cos, *rope_sin;               /* [rope_len, rot] bf16 */
    const int32_t *kind;          /* [L] 1: DeltaNet, 0: attention */
    const int32_t *index;         /* [L] its recurrent layer, or its layer of the KV cache */
    const float *const *attn_norm, *const *mlp_norm;   /* [L] -> [D] fp32 (1 + w) */
    const sd_qmat *const *in_q;   /* [L] q|k|v|z|b|a, or q+gate|k|v */
    const sd_qmat *const *out_q;  /* [L] out / o projection */
    const sd_qmat *const *gu_q, *const *down_q;
    const float *const *q_norm, *const *k_norm;   /* [L] -> [HD] fp32, NULL on DeltaNet layers */
    const sd_dn_layer *const *dn; /* [L] a DeltaNet layer's constants, NULL on attention layers */
    /* scratch, [SD_HY_MAX_T, ld] bf16 each */
    void *xn;                     /* ld D */
    void *proj;                   /* ld the widest input projection */
    void *att;                    /* ld max(H * HD, hv * dv): attention or DeltaNet output */
    void *q;                      /* ld H * HD: normed, roped q */
    void *gu;                     /* ld 2 I */
    void *act;                    /* ld I */
} sd_hybrid;

typedef struct {                  /* one pass's recurrent side: must match _Recurrent in fast/hybrid.py */
    void *const *conv_state;      /* [Lr] the cache's [rows, conv_dim, K-1] */
    const int64_t *rows;          /* [B] cache rows */
    const int64_t *states;        /* [Lr * B] address of each (layer, row)'s [hv, dk, dv] fp32 state */
    const int32_t *widths;        /* [B] real tokens of each row */
    void *conv_out;               /* [Lr, B, conv_dim, K-1+T] bf16 */
    float *qo, *ko, *vo;          /* [Lr, B, T, hv, dk or dv] */
    float *go, *bo;               /* [Lr, B, T, hv] */
    const int64_t *finals;        /* [Lr * B] address of each (layer, row)'s [hv, dk, dv] fp32 state after the pass */
} sd_recurrent;

/* A DeltaNet layer's token mixing for all (row, value head) items, this thread's share */
static void hy_delta_net(const sd_hybrid *md, const sd_recurrent *rc, const sd_dn_layer *L, int li, int B, int T,
                         int ldp, float *work, int t, int nt) {
    const int hv = L->hv, dk = L->dk, dv = L->dv, K1 = L->kernel - 1;
    const int C = 2 * L->hk * dk + hv * dv;
    const size_t bt = (size_t)B * T;
    int a, b;
    range(B * hv, t, nt, &a, &b);
    for (int it = a; it < b; it++) {
        const int row = it / hv, h = it % hv;
        const void *cstate = (const char *)rc->conv_state[li] + (size_t)rc->rows[row] * C * K1 * 2;
        const float *S = (const float *)(intptr_t)rc->states[(size_t)li * B + row] + (size_t)h * dk * dv;
        dn_item(L, row, h, T, md->proj, ldp, cstate, S, rc->widths[row],
                (char *)rc->conv_out + (size_t)li * B * C * (K1 + T) * 2,
                rc->qo + (size_t)li * bt * hv * dk, rc->ko + (size_t)li * bt * hv * dk,
                rc->vo + (size_t)li * bt * hv * dv, rc->go + (size_t)li * bt * hv, rc->bo + (size_t)li * bt * hv,
                (float *)(intptr_t)rc->finals[(size_t)li * B + row] + (size_t)h * dk * dv, md->att, work);
    }
    _mm_sfence();                 /* the streamed final states are visible to the caller */
}

/* Gated attention layer l between its q|k|v projection (in md->proj) and its o projection (from
 * md->att): head norms + RoPE, cache writes, attention, the gate. Barriers inside. */
static void hy_attention(const sd_hybrid *md, const sd_kv *kv, int l, const int64_t *starts, int B, int T, int N,
                         float *scores, int score_len, int t, int nt) {
    const int H = md->H, KVH = md->KVH, HD = md->HD, grp = H / KVH, M = B * T;
    char *kl = kv->k[md->index[l]], *vl = kv->v[md->index[l]];      /* the layer's place in the cache */
    const char *proj = md->proj;
    int a, b;
    range(M * (H + 2 * KVH), t, nt, &a, &b);
    for (int u = a; u < b; u++) {       /* q (its first HD of 2 HD), k: norm, then RoPE on rot dims; v: copied */
        const int r = u / (H + 2 * KVH), h = u % (H + 2 * KVH), p = (int)starts[r / T] + r % T;
        const int32_t *tab = kv->tables + (size_t)(r / T) * kv->table_width;
        const char *cs = (const char *)md->rope_cos + (size_t)p * md->rot * 2;
        const char *sn = (const char *)md->rope_sin + (size_t)p * md->rot * 2;
        char *dst;
        if (h < H) {
            dst = (char *)md->q + ((size_t)r * H + h) * HD * 2;
            rmsnorm_row(proj + ((size_t)r * N + (size_t)h * 2 * HD) * 2, md->q_norm[l], 0, dst, HD, md->eps, 1, 0);
        } else if (h < H + KVH) {
            dst = kl + kv_off(kv, tab, p, h - H) * 2;
            rmsnorm_row(proj + ((size_t)r * N + (size_t)2 * H * HD + (size_t)(h - H) * HD) * 2, md->k_norm[l], 0, dst,
                        HD, md->eps, 1, 0);
        } else {
            memcpy(vl + kv_off(kv, tab, p, h - H - KVH) * 2,
                   proj + ((size_t)r * N + (size_t)(2 * H + KVH) * HD + (size_t)(h - H - KVH) * HD) * 2, (size_t)HD * 2);
            continue;
        }
        rope_head(dst, cs, sn, dst, md->rot, 1);
    }
#pragma omp barrier
    /* attention: items (row, kv head, chunk of SD_ATT_PAIRS (token, q head) pairs), as sd_chain_attention */
    const int per = T * grp, chunks = (per + SD_ATT_PAIRS - 1) / SD_ATT_PAIRS;
    range(B * KVH * chunks, t, nt, &a, &b);
    for (int it = a; it < b; it++) {
        const int row = it / (KVH * chunks), kvh = it / chunks % KVH, c0 = it % chunks * SD_ATT_PAIRS;
        att_pair pr[SD_ATT_PAIRS];
        int n = 0;
        for (int u = c0; u < per && n < SD_ATT_PAIRS; u++, n++) {
            const int tok = u / grp, h = kvh * grp + u % grp, len = (int)starts[row] + tok + 1;
            const size_t at = (((size_t)row * T + tok) * H + h) * HD * 2;
            pr[n] = (att_pair){(const char *)md->q + at, (char *)md->att + at, len, len, NULL};
        }
        attend_pairs(pr, n, kl, vl, kv, kv->tables + (size_t)row * kv->table_width, kvh, 0, HD, md->scale, 0.f, 1,
                     scores, score_len);
    }
#pragma omp barrier
    range(M * H, t, nt, &a, &b);          /* att = rnd(att * rnd(sigmoid(gate))) */
    for (int u = a; u < b; u++) {
        const int r = u / H, h = u % H;
        char *o = (char *)md->att + (size_t)u * HD * 2;
        const char *g = proj + ((size_t)r * N + (size_t)h * 2 * HD + HD) * 2;
        for (int k = 0; k < HD; k += 16) {
            __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), ld16(g, k, 1, 0xffff)));
            __m512 s = round_bf16(_mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e)));
            st16(o, k, 1, 0xffff, _mm512_mul_ps(ld16(o, k, 1, 0xffff), s));
        }
    }
#pragma omp barrier
}

/* One chain pass of B rows x T tokens (see the file comment). tokens [B * T]; starts [B]; kv: the
 * attention layers' paged cache (tables [B, table_width]); rc: the recurrent layers' states and the
 * pass's outputs for HybridCache; hid [B * T, D] bf16 gets the hidden states. Returns 0, or -1 on
 * bad arguments. */
int sd_hybrid_rows(const sd_hybrid *md, const int64_t *tokens, const int64_t *starts, int B, int T, const sd_kv *kv,
                   const sd_recurrent *rc, void *hid, int nthreads) {
    if (B < 1 || T < 1 || B * T > SD_HY_MAX_T || T > SD_DN_MAX_T || md->HD % 16 || md->HD > 256 || md->H % md->KVH)
        return -1;
    long maxlen = 0;
    for (int b = 0; b < B; b++) {
        if (starts[b] < 0 || starts[b] + T > md->rope_len || (starts[b] + T + kv->block - 1) / kv->block > kv->table_width)
            return -1;
        if (starts[b] + T > maxlen) maxlen = starts[b] + T;
    }
    const int D = md->D, I = md->I, M = B * T;
    const int score_len = (int)((maxlen + 17 + 15) / 16 * 16);
    int dk = 0, dv = 0, K1 = 0;                   /* the DeltaNet work buffer of one (row, head) item */
    for (int l = 0; l < md->L; l++)
        if (md->kind[l]) { dk = md->dn[l]->dk; dv = md->dn[l]->dv; K1 = md->dn[l]->kernel - 1; break; }
    const size_t work_len = (size_t)(2 * K1 + T) * (dk > dv ? dk : dv) + (size_t)T * (2 * dk + dv) + 2 * (size_t)dv;
    reduce16_init();
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *scores = aligned_alloc(64, (size_t)SD_ATT_PAIRS * score_len * sizeof(float));
        float *work = malloc(work_len * sizeof(float));
        int cfg = -1, a, b;
        range(M, t, nt, &a, &b);
        for (int r = a; r < b; r++)
            memcpy((char *)hid + (size_t)r * D * 2, (const char *)md->embed + (size_t)tokens[r] * D * 2, (size_t)D * 2);
#pragma omp barrier
        for (int l = 0; l < md->L; l++) {
            const sd_qmat *in = md->in_q[l];
            range(M, t, nt, &a, &b);
            for (int r = a; r < b; r++)
                rmsnorm_row((char *)hid + (size_t)r * D * 2, md->attn_norm[l], 0, (char *)md->xn + (size_t)r * D * 2, D,
                            md->eps, 1, 0);
#pragma omp barrier
            qmm_part(in, md->xn, D, NULL, md->proj, in->N, M, OUT_BF16, t, nt, &cfg);
#pragma omp barrier
            if (md->kind[l]) {
                hy_delta_net(md, rc, md->dn[l], md->index[l], B, T, in->N, work, t, nt);
#pragma omp barrier
            } else {
                hy_attention(md, kv, l, starts, B, T, in->N, scores, score_len, t, nt);
            }
            qmm_part(md->out_q[l], md->att, md->out_q[l]->K, NULL, hid, D, M, OUT_BF16_ADD, t, nt, &cfg);
#pragma omp barrier
            range(M, t, nt, &a, &b);
            for (int r = a; r < b; r++)
                rmsnorm_row((char *)hid + (size_t)r * D * 2, md->mlp_norm[l], 0, (char *)md->xn + (size_t)r * D * 2, D,
                            md->eps, 1, 0);
#pragma omp barrier
            qmm_part(md->gu_q[l], md->xn, D, NULL, md->gu, 2 * I, M, OUT_BF16, t, nt, &cfg);
#pragma omp barrier
            const int CH = (I + 15) / 16;             /* act = rnd(rnd(silu(gate)) * up) */
            range(M * CH, t, nt, &a, &b);
            for (int u = a; u < b; u++) {
                const int r = u / CH, i = (u % CH) * 16;
                const __mmask16 m = lanes(I - i);
                const char *g = (const char *)md->gu + (size_t)r * 2 * I * 2;
                __m512 v = ld16(g, i, 1, m);
                __m512 s = round_bf16(_mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f),
                                                                     exp512(_mm512_sub_ps(_mm512_setzero_ps(), v)))));
                st16(md->act, (size_t)r * I + i, 1, m, _mm512_mul_ps(s, ld16(g, (size_t)I + i, 1, m)));
            }
#pragma omp barrier
            qmm_part(md->down_q[l], md->act, I, NULL, hid, D, M, OUT_BF16_ADD, t, nt, &cfg);
#pragma omp barrier
        }
        if (cfg >= 0) _tile_release();
        free(work);
        free(scores);
    }
    return 0;
}
