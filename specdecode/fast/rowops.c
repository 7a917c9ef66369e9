/*
 * specdecode/fast/rowops.c -- per-row pieces of a layer that runs eagerly around native projections
 * (Qwen3.5, specdecode/models/qwen3_5.py; fast/rowops.py calls them), included by kernels.c after
 * decoder.c (rmsnorm_row, rope_head, exp512). Each replaces several torch ops on a decode step and
 * rounds where the eager path rounds (model dtype bf16 or fp32); each row is computed alone, in a
 * fixed order, so its bits never depend on the other rows.
 */

/* out[r] = rms_norm(x[r]) * w (fp32 weight, one rounding) for rows r = (i, j), i < n0, j < n1, at
 * x + i * s0 + j * s1 (a head of a fused projection: strided rows); out is [n0 * n1, D] contiguous.
 * rot > 0: then RoPE (rotate-half, the eager path's roundings) on the first rot dims of each row, with
 * the cos / sin row (i % cos_rows) of tables [cos_rows, rot] in the model dtype. */
void sd_rows_rms_norm(const void *x, int n0, long s0, int n1, long s1, int D, const float *w, float eps, int bf,
                      const void *cos, const void *sin, int cos_rows, int rot, void *out) {
    const int esz = bf ? 2 : 4;
    for (int i = 0; i < n0; i++)
        for (int j = 0; j < n1; j++) {
            char *o = (char *)out + ((size_t)i * n1 + j) * D * esz;
            rmsnorm_row((const char *)x + ((size_t)i * s0 + (size_t)j * s1) * esz, w, 0, o, D, eps, bf, 0);
            if (rot) {
                const size_t c = (size_t)(i % cos_rows) * rot * esz;
                rope_head(o, (const char *)cos + c, (const char *)sin + c, o, rot, bf);
            }
        }
}

/* sum[r] = rnd(h[r] + d[r]) (the residual add; sum may be h), then out[r] = rms_norm(sum[r]) * w as
 * above; h, d, sum, out [rows, D] contiguous. */
void sd_add_rms_norm(const void *h, const void *d, int rows, int D, const float *w, float eps, int bf, void *sum,
                     void *out) {
    const int esz = bf ? 2 : 4;
    for (int r = 0; r < rows; r++) {
        const size_t o = (size_t)r * D * esz;
        for (int i = 0; i < D; i += 16) {
            __mmask16 m = lanes(D - i);
            st16((char *)sum + o, i, bf, m, _mm512_add_ps(ld16((const char *)h + o, i, bf, m),
                                                          ld16((const char *)d + o, i, bf, m)));
        }
        rmsnorm_row((char *)sum + o, w, 0, (char *)out + o, D, eps, bf, 0);
    }
}

/* out[r] = rnd(rnd(silu(gu[r, :I])) * gu[r, I:]) (SwiGLU on a fused gate|up projection): gu [rows,
 * 2I], out [rows, I]. */
void sd_silu_mul(const void *gu, int rows, int I, int bf, void *out) {
    const int esz = bf ? 2 : 4;
    for (int r = 0; r < rows; r++) {
        const char *g = (const char *)gu + (size_t)r * 2 * I * esz, *u = g + (size_t)I * esz;
        char *o = (char *)out + (size_t)r * I * esz;
        for (int i = 0; i < I; i += 16) {
            __mmask16 m = lanes(I - i);
            __m512 v = ld16(g, i, bf, m);
            __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), v));
            __m512 s = rnd(_mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e)), bf);
            st16(o, i, bf, m, _mm512_mul_ps(s, ld16(u, i, bf, m)));
        }
    }
}

/* out[r] = rnd(a[r] * rnd(sigmoid(g[r]))) (gated attention's output gate): a, out [n0 * n1, D]
 * contiguous, the gate rows strided as sd_rows_rms_norm's x. */
void sd_sigmoid_gate(const void *a, const void *g, int n0, long s0, int n1, long s1, int D, int bf, void *out) {
    const int esz = bf ? 2 : 4;
    for (int i = 0; i < n0; i++)
        for (int j = 0; j < n1; j++) {
            const size_t r = ((size_t)i * n1 + j) * D;
            const char *gr = (const char *)g + ((size_t)i * s0 + (size_t)j * s1) * esz;
            for (int k = 0; k < D; k += 16) {
                __mmask16 m = lanes(D - k);
                __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), ld16(gr, k, bf, m)));
                __m512 s = rnd(_mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e)), bf);
                st16(out, r + k, bf, m, _mm512_mul_ps(ld16(a, r + k, bf, m), s));
            }
        }
}

/* A short chain pass's attention over a cache (decoder_attn.c's attend_pairs, no window, no cap): writes
 * the pass's keys and values k, v [B, T, KVH, HD] at slots starts[b] + t, then out [B, T, H, HD] =
 * softmax(q k^T * scale) v for q [B, T, H, HD] (all contiguous, model dtype), token t of row b seeing
 * keys 0 .. starts[b] + t. The cache: layer bases kbase / vbase and a CacheLayout's geometry (tables
 * [B, tw] int32). Returns 0, or -1 on bad arguments. */
int sd_chain_attention(const void *q, const void *k, const void *v, void *kbase, void *vbase, const int32_t *tables,
                       int tw, int block, long block_stride, long key_stride, long head_stride, int B, int T, int H,
                       int KVH, int HD, const int64_t *starts, float scale, int bf, void *out, int nt) {
    if (HD % 16 || HD > 256 || H % KVH || T < 1) return -1;
    const int esz = bf ? 2 : 4, group = H / KVH;
    long maxlen = 0;
    for (int b = 0; b < B; b++) {
        if (starts[b] < 0 || (starts[b] + T + block - 1) / block > tw) return -1;
        if (starts[b] + T > maxlen) maxlen = starts[b] + T;
    }
    const sd_kv kv = {NULL, NULL, tables, tw, block, block_stride, key_stride, head_stride};
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < KVH; h++) {
                const size_t src = (((size_t)b * T + t) * KVH + h) * HD * esz;
                const size_t dst = kv_off(&kv, tables + (size_t)b * tw, (int)starts[b] + t, h) * esz;
                memcpy((char *)kbase + dst, (const char *)k + src, (size_t)HD * esz);
                memcpy((char *)vbase + dst, (const char *)v + src, (size_t)HD * esz);
            }
    reduce16_init();
    const int per = T * group, chunks = (per + SD_ATT_PAIRS - 1) / SD_ATT_PAIRS, items = B * KVH * chunks;
    const int score_len = (int)((maxlen + 17 + 15) / 16 * 16);
    #pragma omp parallel num_threads(nt < items ? nt : items)
    {
        float *scores = aligned_alloc(64, (size_t)SD_ATT_PAIRS * score_len * sizeof(float));
        #pragma omp for schedule(static)
        for (int it = 0; it < items; it++) {
            const int b = it / (KVH * chunks), kvh = it / chunks % KVH, c0 = it % chunks * SD_ATT_PAIRS;
            att_pair pr[SD_ATT_PAIRS];
            int n = 0;
            for (int u = c0; u < per && n < SD_ATT_PAIRS; u++, n++) {   /* pair u: token u / group, head */
                const int t = u / group, h = kvh * group + u % group, len = (int)starts[b] + t + 1;
                const size_t at = (((size_t)b * T + t) * H + h) * HD * esz;
                pr[n] = (att_pair){(const char *)q + at, (char *)out + at, len, len, NULL};
            }
            attend_pairs(pr, n, kbase, vbase, &kv, tables + (size_t)b * tw, kvh, 0, HD, scale, 0.f, bf, scores,
                         score_len);
        }
        free(scores);
    }
    return 0;
}
