/* specdecode/fast/quant_dequant.c -- exact dequantization (included by quant.c) */

/* ---------------------------------------------------------------- exact dequantization */

/* One row of K weights -> fp32, with the same float operations as the gguf package's numpy
 * dequantize (so the values are bitwise the same): used for the token embedding and references. */
static void q_dequant_row(int type, const uint8_t *row, int K, float *out) {
    switch (type) {
    case GQ_Q4_0: case GQ_Q4_1: case GQ_Q5_0: case GQ_Q5_1: {
        const int bs = type == GQ_Q4_0 ? 18 : type == GQ_Q4_1 ? 20 : type == GQ_Q5_0 ? 22 : 24;
        const int has_m = type == GQ_Q4_1 || type == GQ_Q5_1, five = type == GQ_Q5_0 || type == GQ_Q5_1;
        for (int b = 0; b < K / 32; b++) {
            const uint8_t *blk = row + (size_t)b * bs, *qs = blk + 2 + 2 * has_m + 4 * five;
            const float d = h2f(blk), m = has_m ? h2f(blk + 2) : 0.f;
            uint32_t qh = 0;
            if (five) memcpy(&qh, blk + 2 + 2 * has_m, 4);
            for (int i = 0; i < 32; i++) {
                int q = (i < 16 ? qs[i] & 0xF : qs[i - 16] >> 4) | (five ? (int)((qh >> i) & 1) << 4 : 0);
                out[32 * b + i] = has_m ? d * (float)q + m : d * (float)(q - (five ? 16 : 8));
            }
        }
        break;
    }
    case GQ_Q8_0:
        for (int b = 0; b < K / 32; b++) {
            const uint8_t *blk = row + (size_t)b * 34;
            const float d = h2f(blk);
            for (int i = 0; i < 32; i++) out[32 * b + i] = (float)(int8_t)blk[2 + i] * d;
        }
        break;
    case GQ_MXFP4: {            /* as gguf's MXFP4.dequantize_blocks: the scale times the doubled e2m1 value */
        static const int8_t kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
        for (int b = 0; b < K / 32; b++) {
            const uint8_t *blk = row + (size_t)b * 17;
            const float d = e8m0_half(blk[0]);
            for (int i = 0; i < 32; i++) out[32 * b + i] = d * (float)kv[i < 16 ? blk[1 + i] & 0xF : blk[1 + i - 16] >> 4];
        }
        break;
    }
    case GQ_I8: {
        float s;
        memcpy(&s, row, 4);
        for (int i = 0; i < K; i++) out[i] = (float)(int8_t)row[4 + i] * s;
        break;
    }
    case GQ_Q4_K: case GQ_Q5_K: {
        const int five = type == GQ_Q5_K;
        for (int c = 0; c < K / 256; c++) {
            const uint8_t *blk = row + (size_t)c * (five ? 176 : 144), *qs = blk + (five ? 48 : 16), *qh = blk + 16;
            const float d = h2f(blk), dmin = h2f(blk + 2);
            for (int j = 0; j < 8; j++) {
                int sc, mn;
                scale_min_k4(j, blk + 4, &sc, &mn);
                const float s = d * (float)sc, o = dmin * (float)mn;
                for (int l = 0; l < 32; l++) {
                    int q = (j & 1) ? qs[32 * (j >> 1) + l] >> 4 : qs[32 * (j >> 1) + l] & 0xF;
                    if (five) q |= ((qh[l] >> j) & 1) << 4;
                    out[256 * c + 32 * j + l] = s * (float)q - o;
                }
            }
        }
        break;
    }
    case GQ_Q6_K:
        for (int c = 0; c < K / 256; c++) {
            const uint8_t *blk = row + (size_t)c * 210;
            const float d = h2f(blk + 208);
            const int8_t *sc = (const int8_t *)(blk + 192);
            for (int n = 0; n < 2; n++)
                for (int l = 0; l < 32; l++) {
                    const uint8_t *ql = blk + 64 * n, h = blk[128 + 32 * n + l];
                    const int q[4] = {(ql[l] & 0xF) | ((h & 3) << 4), (ql[l + 32] & 0xF) | (((h >> 2) & 3) << 4),
                                      (ql[l] >> 4) | (((h >> 4) & 3) << 4), (ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)};
                    for (int t = 0; t < 4; t++) {
                        const int idx = 128 * n + 32 * t + l;
                        out[256 * c + idx] = (d * (float)sc[idx / 16]) * (float)(q[t] - 32);
                    }
                }
        }
        break;
    default:
        memset(out, 0, (size_t)K * 4);
    }
}

/* rows [0, n) of a segment (type, row_bytes, K) -> out [n, K] fp32.  Returns 0, or -1. */
int sd_qdequant(const uint8_t *data, int type, long row_bytes, int K, long n, float *out, int nthreads) {
    if (!q_block_ok(type) || K % 32 || ((type == GQ_Q4_K || type == GQ_Q5_K || type == GQ_Q6_K) && K % 256)) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long r = 0; r < n; r++) q_dequant_row(type, data + (size_t)r * row_bytes, K, out + (size_t)r * K);
    return 0;
}
