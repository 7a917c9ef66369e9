/*
 * specdecode/fast/deltanet.c -- a Gated DeltaNet layer's token mixing for short passes (Qwen3.5,
 * specdecode/models/qwen3_5.py `_delta_net`, which keeps the eager torch form), included by kernels.c
 * after decoder.c (its ld16 / st16 / rnd / exp512 helpers).
 *
 * sd_deltanet takes the layer's input projection q|k|v|z|b|a of B rows x T tokens and, per (row, value
 * head), runs the causal depthwise conv1d window + silu, the q / k L2 norms (q scaled by dk^-0.5),
 * beta = sigmoid(b), decay = decay_rate * softplus(a + dt_bias), the gated delta rule token by token
 * on the float32 state, and the gated RMS norm rms_norm(out) * out_norm * silu(z). It reads the
 * incoming states and writes the states after the last token to a new buffer (a pass never changes
 * the cache), and writes what HybridCache.record keeps: the conv inputs and each token's
 * (q, k, v, decay, beta). Tokens past a row's width (padding) get decay 0 and beta 0, which leave
 * the state as it is.
 *
 * sd_delta_rule runs the same delta rule over given (q, k, v, decay, beta) -- the replay after a
 * rollback (HybridCache.truncate) -- through the same delta_token, so a state is the same bits
 * whether a pass or a replay computed it, and greedy speculative decoding stays plain decoding.
 *
 * Rounding points follow the eager path in the model dtype (bf16: rnd after silu of the conv,
 * sigmoid, the delta rule's output, the norm, its weight and the gate). Each (row, head, token) is
 * computed by the same instruction sequence whatever B and T are (fixed-order sums), so a row's
 * result never depends on the other rows or on the length of its pass. Threads split (row, head)
 * pairs.
 */

#define SD_DN_MAX_T 64          /* tokens per sd_deltanet call (the model's short passes are fewer) */

typedef struct {                /* one layer's constants: must match _Layer in deltanet.py */
    int hk, hv, dk, dv, kernel, tiled, bf;
    float eps;
    const float *conv_w;        /* [kernel, conv_dim] fp32 (the conv1d weight transposed) */
    const float *decay_rate;    /* [hv] -exp(A_log) */
    const float *dt_bias;       /* [hv] */
    const void *out_norm;       /* [dv] model dtype */
} sd_dn_layer;

static inline float dn_round(float x, int bf) {      /* to the model dtype and back (bf16: nearest even) */
    if (!bf || x != x) return x;
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, 4);
    return x;
}
static inline float dn_ld(const void *p, size_t i, int bf) {
    if (!bf) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const bf16 *)p)[i] << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}
/* 16 floats from p, lanes past n - i ... zero (a head's tail when its size is no multiple of 16) */
static inline __m512 dn_ldv(const float *p, int i, int n) { return _mm512_maskz_loadu_ps(lanes(n - i), p + i); }
static inline void dn_stv(float *p, int i, int n, __m512 v) { _mm512_mask_storeu_ps(p + i, lanes(n - i), v); }

/* silu(x) = x / (1 + exp(-x)) in place over n floats */
static inline void dn_silu(float *x, int n) {
    for (int i = 0; i < n; i += 16) {
        __m512 v = dn_ldv(x, i, n);
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), v));
        dn_stv(x, i, n, _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    }
}

/* sum of a[i] * b[i] over n: 16 lane sums in index order, then a fixed tree */
static inline float dn_dot(const float *a, const float *b, int n) {
    __m512 s = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) s = _mm512_fmadd_ps(dn_ldv(a, i, n), dn_ldv(b, i, n), s);
    return _mm512_reduce_add_ps(s);
}

/* a non-temporal store of 16 floats at a 64-byte aligned address */
static inline void dn_stream(float *p, __m512 v) {
#if defined(__AVX512F__)
    _mm512_stream_ps(p, v);
#else
    _mm256_stream_ps(p, sd_lo(v));
    _mm256_stream_ps(p + 8, sd_hi(v));
#endif
}

#if defined(__AVX512F__)
#define DN_JB 8                 /* 16-lane column blocks per sweep of the state (2 accumulators each): a head of 128 in one */
#else
#define DN_JB 2                 /* AVX2: SIMDe's 512-bit vectors are two registers each */
#endif

/* One token of the gated delta rule on one head (cache/recurrent.py delta_step):
 *   S' = S exp(g);  delta = beta (v - S'^T k);  Sn = S' + k delta^T;  out = S'^T q + (q . k) delta.
 * S [dk, dv] is read, Sn written (Sn may be S). out [dv]. */
static void delta_token(const float *S, float *Sn, const float *q, const float *k, const float *v, float g,
                        float beta, float *out, int dk, int dv, int stream) {
    const float scale = expf(g), qk = dn_dot(q, k, dk);
    float delta[dv];
    const __m512 vs = _mm512_set1_ps(scale), vb = _mm512_set1_ps(beta), vqk = _mm512_set1_ps(qk);
    for (int j0 = 0; j0 < dv; j0 += 16 * DN_JB) {
        const int nb = (dv - j0 + 15) / 16 < DN_JB ? (dv - j0 + 15) / 16 : DN_JB;
        __m512 aq[DN_JB], ak[DN_JB];
        for (int u = 0; u < DN_JB; u++) aq[u] = ak[u] = _mm512_setzero_ps();
        for (int i = 0; i < dk; i++) {
            const float *row = S + (size_t)i * dv;
            const __m512 qi = _mm512_set1_ps(q[i]), ki = _mm512_set1_ps(k[i]);
            for (int u = 0; u < DN_JB; u++) {
                if (u < nb) {
                    __m512 s = dn_ldv(row, j0 + 16 * u, dv);
                    aq[u] = _mm512_fmadd_ps(qi, s, aq[u]);
                    ak[u] = _mm512_fmadd_ps(ki, s, ak[u]);
                }
            }
        }
        for (int u = 0; u < nb; u++) {
            const int j = j0 + 16 * u;
            __m512 d = _mm512_mul_ps(_mm512_sub_ps(dn_ldv(v, j, dv), _mm512_mul_ps(ak[u], vs)), vb);
            dn_stv(delta, j, dv, d);
            dn_stv(out, j, dv, _mm512_add_ps(_mm512_mul_ps(aq[u], vs), _mm512_mul_ps(vqk, d)));
        }
    }
    /* the last token of a pass streams its state out past the caches (no read for ownership of the new
     * buffer; the next pass reads it after a step's weights have gone through the caches anyway) */
    const int nt = stream && dv % 16 == 0 && ((uintptr_t)Sn & 63) == 0;
    for (int i = 0; i < dk; i++) {
        const float *row = S + (size_t)i * dv;
        float *dst = Sn + (size_t)i * dv;
        const __m512 ki = _mm512_set1_ps(k[i]);
        for (int j = 0; j < dv; j += 16) {
            __m512 y = _mm512_fmadd_ps(ki, dn_ldv(delta, j, dv), _mm512_mul_ps(dn_ldv(row, j, dv), vs));
            if (nt) dn_stream(dst + j, y);
            else dn_stv(dst, j, dv, y);
        }
    }
}

/* conv_out rows [n, K-1+T] <- the state rows [n, K-1], then the inputs (token-major, row stride ldp) */
#define DN_COPY_WINDOW(name, type)                                                                      \
    static void name(type *o, const type *st, const type *in, int n, int K1, int T, int ldp) {         \
        for (int c = 0; c < n; c++, o += K1 + T, st += K1) {                                            \
            for (int j = 0; j < K1; j++) o[j] = st[j];                                                  \
            for (int t = 0; t < T; t++) o[K1 + t] = in[(size_t)t * ldp + c];                            \
        }                                                                                               \
    }
DN_COPY_WINDOW(dn_copy_window16, bf16)
DN_COPY_WINDOW(dn_copy_window32, uint32_t)

/* The conv window of n channels c0.. of one row: win [K-1+T, n] (the conv state, then the T inputs;
 * K-1 more rows of scratch after it),
 * copied to conv_out [C, K-1+T] when not NULL; mixed [T, n] = rnd(silu(sum_j win[t+j] w[j])). */
static void dn_conv(const sd_dn_layer *L, const void *cstate, const void *proj, int ldp, int c0, int n, int C,
                    int T, float *win, float *mixed, void *conv_out) {
    const int K1 = L->kernel - 1, W = K1 + T, bf = L->bf, esz = bf ? 2 : 4;
    const char *st = (const char *)cstate + (size_t)c0 * K1 * esz, *pr = (const char *)proj + (size_t)c0 * esz;
    float *flat = win + (size_t)W * n;                            /* the state [n, K-1] as floats */
    for (int i = 0; i < n * K1; i += 16) dn_stv(flat, i, n * K1, ld16(st, i, bf, lanes(n * K1 - i)));
    for (int c = 0; c < n; c++)                                   /* win[j, c] = state[c, j] */
        for (int j = 0; j < K1; j++) win[(size_t)j * n + c] = flat[(size_t)c * K1 + j];
    for (int t = 0; t < T; t++)                                   /* the inputs: token-major */
        for (int c = 0; c < n; c += 16)
            dn_stv(win + (size_t)(K1 + t) * n, c, n, ld16(pr, (size_t)t * ldp + c, bf, lanes(n - c)));
    if (conv_out) {                                               /* copies of the elements as they are */
        if (bf) dn_copy_window16((bf16 *)conv_out + (size_t)c0 * W, (const bf16 *)st, (const bf16 *)pr, n, K1, T, ldp);
        else dn_copy_window32((uint32_t *)conv_out + (size_t)c0 * W, (const uint32_t *)st, (const uint32_t *)pr, n,
                              K1, T, ldp);
    }
    for (int t = 0; t < T; t++) {
        float *m = mixed + (size_t)t * n;
        for (int c = 0; c < n; c += 16) {
            __m512 acc = _mm512_mul_ps(dn_ldv(win + t * n, c, n), dn_ldv(L->conv_w + c0, c, n));
            for (int j = 1; j <= K1; j++)
                acc = _mm512_add_ps(acc, _mm512_mul_ps(dn_ldv(win + (t + j) * n, c, n),
                                                       dn_ldv(L->conv_w + (size_t)j * C + c0, c, n)));
            dn_stv(m, c, n, acc);
        }
        dn_silu(m, n);
        if (bf)
            for (int c = 0; c < n; c += 16) dn_stv(m, c, n, round_bf16(dn_ldv(m, c, n)));
    }
}

/* x *= rsqrt(sum x^2 + 1e-6), then * scale (when not 1) */
static inline void dn_l2norm(float *x, int n, float scale) {
    const __m512 r = _mm512_set1_ps(1.f / sqrtf(dn_dot(x, x, n) + 1e-6f)), s = _mm512_set1_ps(scale);
    for (int i = 0; i < n; i += 16) {
        __m512 y = _mm512_mul_ps(dn_ldv(x, i, n), r);
        dn_stv(x, i, n, scale != 1.f ? _mm512_mul_ps(y, s) : y);
    }
}

/* Row b, value head h of a pass: see the file comment. */
static void dn_item(const sd_dn_layer *L, int b, int h, int T, const void *proj, int ldp, const void *cstate,
                    const float *S, int width, void *conv_out, float *qo, float *ko, float *vo, float *go,
                    float *bo, float *Sn, void *gated, float *work) {
    const int hk = L->hk, hv = L->hv, dk = L->dk, dv = L->dv, bf = L->bf, K1 = L->kernel - 1;
    const int C = 2 * hk * dk + hv * dv, group = hv / hk;
    const int kh = L->tiled ? h % hk : h / group;                       /* this value head's q / k head */
    const int owner = L->tiled ? h < hk : h % group == 0;               /* writes the q / k conv inputs */
    const size_t row_in = (size_t)b * T * ldp;
    float *win = work, *mq = win + (size_t)(2 * K1 + T) * (dk > dv ? dk : dv), *mk = mq + (size_t)T * dk, *mv = mk + (size_t)T * dk;
    float *out = mv + (size_t)T * dv, *z = out + dv;
    void *cout = conv_out ? (char *)conv_out + (size_t)b * C * (K1 + T) * (bf ? 2 : 4) : NULL;
    const char *pr = (const char *)proj + row_in * (bf ? 2 : 4);
    dn_conv(L, cstate, pr, ldp, kh * dk, dk, C, T, win, mq, owner ? cout : NULL);
    dn_conv(L, cstate, pr, ldp, hk * dk + kh * dk, dk, C, T, win, mk, owner ? cout : NULL);
    dn_conv(L, cstate, pr, ldp, 2 * hk * dk + h * dv, dv, C, T, win, mv, cout);
    const float qscale = (float)pow((double)dk, -0.5);                  /* as Python's dk ** -0.5 */
    const void *wn = L->out_norm;
    for (int t = 0; t < T; t++) {
        float *q = mq + (size_t)t * dk, *k = mk + (size_t)t * dk, *v = mv + (size_t)t * dv;
        dn_l2norm(q, dk, qscale);
        dn_l2norm(k, dk, 1.f);
        float beta = 0.f, g = 0.f;
        if (t < width) {
            const float bx = dn_ld(pr, (size_t)t * ldp + C + hv * dv + h, bf);
            const float ax = dn_ld(pr, (size_t)t * ldp + C + hv * dv + hv + h, bf) + L->dt_bias[h];
            beta = dn_round(1.f / (1.f + expf(-bx)), bf);
            g = L->decay_rate[h] * (ax > 20.f ? ax : log1pf(expf(ax)));      /* torch's softplus threshold */
        }
        const size_t th = ((size_t)b * T + t) * hv + h;                      /* (row, token, head) */
        memcpy(qo + th * dk, q, (size_t)dk * 4);
        memcpy(ko + th * dk, k, (size_t)dk * 4);
        memcpy(vo + th * dv, v, (size_t)dv * 4);
        go[th] = g;
        bo[th] = beta;
        delta_token(t ? Sn : S, Sn, q, k, v, g, beta, out, dk, dv, t == T - 1);
        /* gated RMS norm: rnd(rnd(rnd(rms_norm(rnd(out))) * w) * silu(z)) */
        const size_t zo = (size_t)t * ldp + C + h * dv;
        for (int j = 0; j < dv; j += 16) {
            dn_stv(out, j, dv, rnd(dn_ldv(out, j, dv), bf));
            dn_stv(z, j, dv, ld16(pr, zo + j, bf, lanes(dv - j)));
        }
        const __m512 r = _mm512_set1_ps(1.f / sqrtf(dn_dot(out, out, dv) / (float)dv + L->eps));
        dn_silu(z, dv);
        for (int j = 0; j < dv; j += 16) {
            const __mmask16 m = lanes(dv - j);
            __m512 normed = rnd(_mm512_mul_ps(rnd(_mm512_mul_ps(dn_ldv(out, j, dv), r), bf), ld16(wn, j, bf, m)), bf);
            st16(gated, th * dv + j, bf, m, _mm512_mul_ps(normed, dn_ldv(z, j, dv)));
        }
    }
}

/* One pass of a DeltaNet layer over B rows x T tokens (T <= SD_DN_MAX_T): see the file comment.
 *   proj [B, T, ldp] model dtype: q|k|v (conv_dim), z (hv*dv), b (hv), a (hv), then anything
 *   conv_state: the cache's [rows, conv_dim, K-1] (model dtype), read at rows[b]
 *   states[b]: the address of row b's [hv, dk, dv] fp32 state;  widths[b]: its real tokens
 * Outputs: conv_out [B, conv_dim, K-1+T] (model dtype), qo / ko [B, T, hv, dk], vo [B, T, hv, dv],
 * go / bo [B, T, hv] fp32, final [B, hv, dk, dv] fp32, gated [B, T, hv*dv] (model dtype).
 * Returns 0, or -1 when T is out of range. */
int sd_deltanet(const sd_dn_layer *L, int B, int T, const void *proj, int ldp, const void *conv_state,
                const int64_t *rows, const int64_t *states, const int32_t *widths, void *conv_out, float *qo,
                float *ko, float *vo, float *go, float *bo, float *final, void *gated, int nt) {
    if (T < 1 || T > SD_DN_MAX_T) return -1;
    const int hv = L->hv, dk = L->dk, dv = L->dv, K1 = L->kernel - 1, esz = L->bf ? 2 : 4;
    const int C = 2 * L->hk * dk + hv * dv;
    const size_t per = (size_t)(2 * K1 + T) * (dk > dv ? dk : dv) + (size_t)T * (2 * dk + dv) + 2 * (size_t)dv;
    const int items = B * hv;
    #pragma omp parallel num_threads(nt < items ? nt : items)
    {
        float *work = malloc(per * sizeof(float));
        #pragma omp for schedule(static)
        for (int it = 0; it < items; it++) {
            const int b = it / hv, h = it % hv;
            const void *cstate = (const char *)conv_state + (size_t)rows[b] * C * K1 * esz;
            const float *S = (const float *)(intptr_t)states[b] + (size_t)h * dk * dv;
            dn_item(L, b, h, T, proj, ldp, cstate, S, widths[b], conv_out, qo, ko, vo, go, bo,
                    final + ((size_t)b * hv + h) * dk * dv, gated, work);
        }
        free(work);
        _mm_sfence();                 /* the streamed states are visible before the call returns */
    }
    return 0;
}

/* The delta rule over T given tokens of one row (HybridCache's replay): S [H, dk, dv] is read, Sn
 * [H, dk, dv] gets the state after the last token; q, k [T, H, dk], v [T, H, dv], g, beta [T, H]. */
void sd_delta_rule(const float *S, float *Sn, int T, int H, int dk, int dv, const float *q, const float *k,
                   const float *v, const float *g, const float *beta, int nt) {
    #pragma omp parallel num_threads(nt < H ? nt : H)
    {
        float *out = malloc((size_t)dv * sizeof(float));
        #pragma omp for schedule(static)
        for (int h = 0; h < H; h++) {
            const size_t sh = (size_t)h * dk * dv;
            for (int t = 0; t < T; t++) {
                const size_t th = (size_t)t * H + h;
                delta_token(t ? Sn + sh : S + sh, Sn + sh, q + th * dk, k + th * dk, v + th * dv, g[th], beta[th],
                            out, dk, dv, t == T - 1);
            }
        }
        free(out);
        _mm_sfence();
    }
}
