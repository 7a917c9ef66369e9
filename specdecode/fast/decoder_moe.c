/*
 * specdecode/fast/decoder_moe.c -- the gated MLP activation and the mixture-of-experts MLP of the fused
 * decoder (included by decoder.c, after sd_model and mm_part).
 *
 * A MoE layer (Qwen3-MoE, gpt-oss: models/moe.py has the eager form it follows) replaces the MLP by
 *   router logits = xn @ router^T (model dtype), top-k of them (ties: the lower expert id), their
 *   softmax probabilities over all experts, renormalised over the k when norm_topk, rounded to the
 *   model dtype; each routed expert's SwiGLU MLP on the rows routed to it; the rows' outputs times
 *   their weights summed in ascending expert id (rounding after each add, as transformers' index_add_
 *   in the model dtype), then added to the residual.
 * The expert matmuls are grouped by expert over the pass's rows: the rows routed to expert e are
 * gathered into one block (slots off[e] .. off[e+1]-1 of md->ex), so each routed expert's weights are
 * read once per pass, whatever the number of rows routed to it.  All experts' gate|up products run
 * between two barriers (each thread takes its columns of every expert), then the activation, then
 * all down products.
 * Batch invariance: the router and expert matmuls are row invariant (mm_part), routing and the sum
 * are per row in a fixed order, so a row's output does not depend on which other rows share the pass.
 */

#define SD_MOE_MAX_E 512        /* experts per layer */
#define SD_MOE_MAX_K 16         /* experts routed per token */

/* act[r] = rne(rne(silu(gate)) * up) (or gelu_tanh(gate) * up, or gpt-oss's clamped SwiGLU: act_kind 1)
 * for rows 0..rows-1 of gu = [gate | up]
 * (gate and up I wide each, row stride ldgu), act's row stride ldact; this thread's share. */
static void act_rows(const sd_model *md, const void *gu, int ldgu, int I, void *act, int ldact, int rows, int t,
                     int nt) {
    const int bf = md->is_bf16, CH = (I + 15) / 16;
    int a, b;
    range(rows * CH, t, nt, &a, &b);
    for (int u = a; u < b; u++) {
        int r = u / CH, i = (u % CH) * 16;
        __mmask16 m = lanes(I - i);
        __m512 g = ld16(gu, (size_t)r * ldgu + i, bf, m), up = ld16(gu, (size_t)r * ldgu + I + i, bf, m);
        if (md->act_kind == 1) {                 /* gpt-oss: rne((rne(up' + 1)) * rne(g' * rne(sigmoid(rne(g' * alpha))))) */
            const __m512 lim = _mm512_set1_ps(md->swiglu_limit), one = _mm512_set1_ps(1.f);
            g = _mm512_min_ps(g, lim);
            up = _mm512_max_ps(_mm512_min_ps(up, lim), _mm512_sub_ps(_mm512_setzero_ps(), lim));
            const __m512 ga = rnd(_mm512_mul_ps(g, _mm512_set1_ps(md->swiglu_alpha)), bf);
            const __m512 sg = rnd(_mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), ga)))), bf);
            st16(act, (size_t)r * ldact + i, bf, m, _mm512_mul_ps(rnd(_mm512_add_ps(up, one), bf), rnd(_mm512_mul_ps(g, sg), bf)));
            continue;
        }
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        if (md->gelu) {
            __m512 inner = _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(0.044715f), _mm512_mul_ps(_mm512_mul_ps(g, g), g)));
            __m512 th = tanh512(_mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), inner));
            s = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(_mm512_set1_ps(1.f), th));
        }
        st16(act, (size_t)r * ldact + i, bf, m, _mm512_mul_ps(rnd(s, bf), up));
    }
}

/* A pass's routing: row r's experts in ascending id (ex[r][j]), their weights (w[r][j], model dtype
 * values as floats), their slots in the gathered block (slot[r][j]); per expert its first slot
 * (off[e], off[E] = rows * k) and the row of every slot. */
typedef struct {
    int16_t ex[SD_MAX_T][SD_MOE_MAX_K];
    float w[SD_MAX_T][SD_MOE_MAX_K];
    int16_t slot[SD_MAX_T][SD_MOE_MAX_K];
    int32_t off[SD_MOE_MAX_E + 1];
    int16_t slot_row[SD_MAX_T * SD_MOE_MAX_K];
    int16_t used[SD_MOE_MAX_E];           /* the experts routed to, ascending */
    int n_used;
} moe_route;

static inline float bf16_to_f32(bf16 v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float to_model(float v, int bf) {
    if (!bf) return v;
    float out[16];
    _mm512_storeu_ps(out, round_bf16(_mm512_set1_ps(v)));
    return out[0];
}

/* Routing of rows 0..T-1 from their router logits (model dtype, row stride E): router_kind 0, the
 * softmax over all experts then the top k (renormalised when norm_topk); 1 (gpt-oss), the top k logits
 * then the softmax over those k. */
static void moe_route_rows(const sd_model *md, const void *logits, int T, moe_route *rt) {
    const int E = md->E, K = md->EK, bf = md->is_bf16;
    int count[SD_MOE_MAX_E] = {0};
    for (int r = 0; r < T; r++) {
        float l[SD_MOE_MAX_E], top[SD_MOE_MAX_K];
        int pick[SD_MOE_MAX_K];
        for (int e = 0; e < E; e++)
            l[e] = bf ? bf16_to_f32(((const bf16 *)logits)[(size_t)r * E + e]) : ((const float *)logits)[(size_t)r * E + e];
        float mx = l[0], sum = 0.f;
        for (int e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
        if (md->router_kind == 0)
            for (int e = 0; e < E; e++) sum += expf(l[e] - mx);
        for (int j = 0; j < K; j++) {           /* the k largest logits, ties to the lower id */
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= pick[i] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            pick[j] = best;
            top[j] = md->router_kind == 0 ? expf(l[best] - mx) / sum : expf(l[best] - mx);
        }
        if (md->router_kind == 1) {              /* the softmax over the k (the first is the max) */
            for (int j = 0; j < K; j++) sum += top[j];
            for (int j = 0; j < K; j++) top[j] /= sum;
        }
        float norm = 0.f;
        for (int j = 0; j < K; j++) norm += top[j];
        for (int j = 0; j < K; j++) {            /* insertion into ascending expert id */
            const float w = to_model(md->norm_topk ? top[j] / norm : top[j], bf);
            int i = j;
            while (i > 0 && rt->ex[r][i - 1] > pick[j]) {
                rt->ex[r][i] = rt->ex[r][i - 1];
                rt->w[r][i] = rt->w[r][i - 1];
                i--;
            }
            rt->ex[r][i] = (int16_t)pick[j];
            rt->w[r][i] = w;
        }
        for (int j = 0; j < K; j++) count[rt->ex[r][j]]++;
    }
    rt->off[0] = 0;
    rt->n_used = 0;
    for (int e = 0; e < E; e++) {
        rt->off[e + 1] = rt->off[e] + count[e];
        if (count[e]) rt->used[rt->n_used++] = (int16_t)e;
        count[e] = 0;
    }
    for (int r = 0; r < T; r++)                   /* slots of one expert in row order */
        for (int j = 0; j < K; j++) {
            const int e = rt->ex[r][j], s = rt->off[e] + count[e]++;
            rt->slot[r][j] = (int16_t)s;
            rt->slot_row[s] = (int16_t)r;
        }
}

/* Layer l's MoE MLP on the normed rows md->xn, added to md->hid; ends after a barrier.  rt: shared by
 * the threads (filled by one). */
static void moe_mlp(const sd_model *md, int l, int T, moe_route *rt, int t, int nt, int *cfg) {
    const int bf = md->is_bf16, esz = bf ? 2 : 4, D = md->D, Dp = md->Dp, EI = md->EI, EIp = md->EIp;
    const int mode_out = bf ? OUT_BF16 : OUT_F32;
    char *ex = md->ex, *egu = md->egu, *eact = md->eact, *ey = md->ey;
    mm_part(md, md->xn, Dp, md->router_w[l], NULL, md->router_b ? md->router_b[l] : NULL, md->rlog, md->E, T, md->E, Dp,
            mode_out, t, nt, cfg);
#pragma omp barrier
#pragma omp single
    {
        moe_route_rows(md, md->rlog, T, rt);
        if (md->moe_count) md->moe_count[l] = rt->n_used;
    }
    const int S = T * md->EK;
    int a, b;
    range(S, t, nt, &a, &b);
    for (int s = a; s < b; s++)                   /* gather: slot s <- its row's normed input */
        memcpy(ex + (size_t)s * Dp * esz, (const char *)md->xn + (size_t)rt->slot_row[s] * Dp * esz, (size_t)Dp * esz);
#pragma omp barrier
    for (int i = 0; i < rt->n_used; i++) {
        const int e = rt->used[i], s0 = rt->off[e], n = rt->off[e + 1] - s0;
        mm_part(md, ex + (size_t)s0 * Dp * esz, Dp, md->egu_w ? md->egu_w[l][e] : NULL, md->egu_q ? md->egu_q[l][e] : NULL,
                md->egu_b ? md->egu_b[l][e] : NULL, egu + (size_t)s0 * 2 * EI * esz, 2 * EI, n, 2 * EI, Dp, mode_out, t, nt, cfg);
    }
#pragma omp barrier
    act_rows(md, egu, 2 * EI, EI, eact, EIp, S, t, nt);
#pragma omp barrier
    for (int i = 0; i < rt->n_used; i++) {
        const int e = rt->used[i], s0 = rt->off[e], n = rt->off[e + 1] - s0;
        mm_part(md, eact + (size_t)s0 * EIp * esz, EIp, md->edn_w ? md->edn_w[l][e] : NULL,
                md->edn_q ? md->edn_q[l][e] : NULL, md->edn_b ? md->edn_b[l][e] : NULL, ey + (size_t)s0 * D * esz, D, n, D, EIp, mode_out, t, nt, cfg);
    }
#pragma omp barrier
    /* hid[r] = rne(hid[r] + sum over its experts, ascending, of rne(y * w)), rounding after each add */
    const int CH = (D + 15) / 16;
    range(T * CH, t, nt, &a, &b);
    for (int u = a; u < b; u++) {
        const int r = u / CH, i = (u % CH) * 16;
        const __mmask16 m = lanes(D - i);
        __m512 acc = _mm512_setzero_ps();
        for (int j = 0; j < md->EK; j++) {
            const __m512 v = rnd(_mm512_mul_ps(ld16(ey, (size_t)rt->slot[r][j] * D + i, bf, m),
                                               _mm512_set1_ps(rt->w[r][j])), bf);
            acc = j ? rnd(_mm512_add_ps(acc, v), bf) : v;
        }
        st16(md->hid, (size_t)r * D + i, bf, m, _mm512_add_ps(ld16(md->hid, (size_t)r * D + i, bf, m), acc));
    }
#pragma omp barrier
}
