/* Attention kernel alone (attend_pairs of specdecode/fast/decoder_attn.c) on a synthetic paged bf16
 * cache shaped like SmolLM2-135M (30 layers, 3 kv heads x 3 q heads, head_dim 64, block 16), random
 * keys and values.  Built against a kernels.c source tree (e.g. another revision's, to compare):
 *   gcc -O3 -march=native -fopenmp -std=gnu11 -ffp-contract=off -mamx-tile -mamx-bf16 -mamx-int8 \
 *       -Wno-psabi -I specdecode/fast scripts/measure/attention_micro.c -o /tmp/am -lm
 *   /tmp/am CTX ROWS REPS [scatter [rowmajor]]
 * Prints the minimum and median over REPS of one decode step's attention (all layers, kv heads and
 * rows) in ms, and a checksum of the outputs.  scatter=1: the rows' blocks in a random order in the
 * pool; rowmajor=1: a row's kv heads one after the other (else a kv head's rows).  Environment:
 *   CPUTIME=1   this thread's CPU time instead of the wall clock (one thread: robust to a busy host)
 *   FLUSH=1     96 MB read between repetitions (the cache then comes from DRAM, as in a decode step
 *               that streams the weights too)
 *   THREADS=2   two threads, the decoder's plain split of the (row, q head) units (not attention_split)
 *   LAYERS=1    one layer (with CTX 1500 it stays in L2: the compute alone)
 *   G=8         8 q heads per kv head (8 pairs per call, as in a verify pass)
 *   KSCALE=x    keys uniform in +-x (default 2)
 *   HUGE=1      the pool on 2 MB pages;  HEADMAJOR=1  blocks [kv head][key][head_dim]
 *   CHECK=1     layer 0's outputs against attention in double precision */
#include "kernels.c"
#include <stdio.h>
#include <time.h>
#include <sys/mman.h>

static int use_cputime;    /* CPUTIME=1: this thread's CPU time (one thread: robust to preemption on a busy host) */
static double now(void) {
    struct timespec t;
    clock_gettime(use_cputime ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
static uint16_t tobf(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16); }

int main(int argc, char **argv) {
    const int ctx = argc > 1 ? atoi(argv[1]) : 1500, R = argc > 2 ? atoi(argv[2]) : 1, reps = argc > 3 ? atoi(argv[3]) : 50;
    const int shuffle = argc > 4 && atoi(argv[4]), rowmajor = argc > 5 && atoi(argv[5]);
    const int L = getenv("LAYERS") ? atoi(getenv("LAYERS")) : 30, KVH = 3, G = getenv("G") ? atoi(getenv("G")) : 3, HD = 64, BS = 16, len = ctx + 1;
    const int nb = (len + BS - 1) / BS, NB = R * nb + 1;
    const size_t blk = (size_t)BS * KVH * HD;
    const float kscale = getenv("KSCALE") ? atof(getenv("KSCALE")) : 2.f;   /* keys uniform in +-kscale */
    uint16_t **K = malloc(sizeof(void *) * L), **V = malloc(sizeof(void *) * L);
    uint32_t seed = 1;
    for (int l = 0; l < L; l++) {
        const size_t bytes = (NB * blk * 2 + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
        K[l] = aligned_alloc(2u << 20, bytes); V[l] = aligned_alloc(2u << 20, bytes);
        if (getenv("HUGE")) { madvise(K[l], bytes, MADV_HUGEPAGE); madvise(V[l], bytes, MADV_HUGEPAGE); }
        for (size_t i = 0; i < NB * blk; i++) {
            seed = seed * 1664525u + 1013904223u; K[l][i] = tobf(((int)(seed >> 9) - (1 << 22)) / (float)(1 << 22) * kscale);
            seed = seed * 1664525u + 1013904223u; V[l][i] = tobf(((int)(seed >> 9) - (1 << 22)) / (float)(1 << 22));
        }
    }
    int32_t *tables = malloc(sizeof(int32_t) * R * nb), *perm = malloc(sizeof(int32_t) * R * nb);
    for (int i = 0; i < R * nb; i++) perm[i] = 1 + i;
    for (int i = R * nb - 1; shuffle && i > 0; i--) { seed = seed * 1664525u + 1013904223u; int j = seed % (i + 1), t = perm[i]; perm[i] = perm[j]; perm[j] = t; }
    for (int i = 0; i < R * nb; i++) tables[i] = perm[i];
    sd_kv kv = {(void *const *)K, (void *const *)V, tables, nb, BS, (long)blk, KVH * HD, HD};
    if (getenv("HEADMAJOR")) { kv.key_stride = HD; kv.head_stride = (long)BS * HD; }   /* blocks [KVH][BS][HD] */
    uint16_t *q = malloc(2 * R * KVH * G * HD), *out = malloc(2 * R * KVH * G * HD);
    for (int i = 0; i < R * KVH * G * HD; i++) { seed = seed * 1664525u + 1013904223u; q[i] = tobf(((int)(seed >> 9) - (1 << 22)) / (float)(1 << 22) * 3.f); }
    float *scores = aligned_alloc(64, sizeof(float) * 2 * SD_ATT_PAIRS * (len + 32));
    reduce16_init();
    double *t = malloc(sizeof(double) * reps);
    use_cputime = getenv("CPUTIME") != NULL;
    const int nth = getenv("THREADS") ? atoi(getenv("THREADS")) : 1;
    const size_t flush_n = getenv("FLUSH") ? (size_t)96 << 18 : 0;    /* 96 MB of floats read between reps */
    float *flush = flush_n ? malloc(flush_n * sizeof(float)) : NULL, sink = 0;
    for (size_t i = 0; i < flush_n; i++) flush[i] = 1.f;
    for (int it = 0; it < reps; it++) {
        if (flush) sink += sd_read_bw(flush, flush_n, nth);
        double t0 = now();
        if (nth == 1) {
            for (int l = 0; l < L; l++)
                for (int u = 0; u < KVH * R; u++) {
                    const int h = rowmajor ? u % KVH : u / R, r = rowmajor ? u / KVH : u % R;
                    att_pair pr[SD_ATT_PAIRS];
                    for (int g = 0; g < G; g++) {
                        size_t o = ((size_t)(r * KVH + h) * G + g) * HD;
                        pr[g] = (att_pair){q + o, out + o, len, 0x7fffffff, NULL};
                    }
                    attend_pairs(pr, G, (const char *)K[l], (const char *)V[l], &kv, tables + (size_t)r * nb, h, 0, HD,
                                 0.125f, 0.f, 1, scores, len + 32);
                }
        } else {
            /* the decoder's plain split (decoder.c): (row, q head) units kv-head-major, an even range per thread */
#pragma omp parallel num_threads(nth)
            {
                const int t = omp_get_thread_num(), nt = omp_get_num_threads(), H = KVH * G, per = R * G;
                float *sc = scores + (size_t)t * SD_ATT_PAIRS * (len + 32);
                for (int l = 0; l < L; l++) {
                    int a, b;
                    range(R * H, t, nt, &a, &b);
                    const int k0 = a / per, k1 = b > a ? (b - 1) / per : k0 - 1;
                    for (int s = 0; s <= k1 - k0; s++) {
                        const int kvh = k0 + s;
                        const int sa = a > kvh * per ? a : kvh * per, sb = b < (kvh + 1) * per ? b : (kvh + 1) * per;
                        for (int u = sa; u < sb;) {
                            att_pair pr[SD_ATT_PAIRS];
                            const int r0 = u % per / G;
                            int n = 0;
                            for (; u < sb && n < SD_ATT_PAIRS && u % per / G == r0; u++) {
                                const int g = u % G;
                                size_t o = ((size_t)(r0 * KVH + kvh) * G + g) * HD;
                                pr[n++] = (att_pair){q + o, out + o, len, 0x7fffffff, NULL};
                            }
                            attend_pairs(pr, n, (const char *)K[l], (const char *)V[l], &kv, tables + (size_t)r0 * nb, kvh,
                                         0, HD, 0.125f, 0.f, 1, sc, len + 32);
                        }
                    }
#pragma omp barrier
                }
            }
        }
        t[it] = (now() - t0) * 1e3;
    }
    if (getenv("CHECK")) {     /* layer 0 against attention in double precision, rounded to bf16 once */
        long miss = 0, total = 0;
        double maxerr = 0, sumerr = 0;
        for (int r = 0; r < R; r++)
            for (int h = 0; h < KVH; h++)
                for (int g = 0; g < G; g++) {
                    const size_t o = ((size_t)(r * KVH + h) * G + g) * HD;
                    att_pair pr = {q + o, out + o, len, 0x7fffffff, NULL};
                    attend_pairs(&pr, 1, (const char *)K[0], (const char *)V[0], &kv, tables + (size_t)r * nb, h, 0, HD,
                                 0.125f, 0.f, 1, scores, len + 32);
                    double *sc = malloc(sizeof(double) * len), mxs = -1e300, den = 0;
                    for (int j = 0; j < len; j++) {
                        const uint16_t *kj = K[0] + kv_off(&kv, tables + (size_t)r * nb, j, h);
                        double d = 0;
                        for (int e = 0; e < HD; e++) {
                            uint32_t a = (uint32_t)q[o + e] << 16, b = (uint32_t)kj[e] << 16;
                            float fa, fb; memcpy(&fa, &a, 4); memcpy(&fb, &b, 4);
                            d += (double)fa * fb;
                        }
                        sc[j] = d * 0.125;
                        if (sc[j] > mxs) mxs = sc[j];
                    }
                    for (int j = 0; j < len; j++) { sc[j] = exp(sc[j] - mxs); den += sc[j]; }
                    for (int e = 0; e < HD; e++) {
                        double acc = 0;
                        for (int j = 0; j < len; j++) {
                            uint32_t b = (uint32_t)V[0][kv_off(&kv, tables + (size_t)r * nb, j, h) + e] << 16;
                            float fb; memcpy(&fb, &b, 4);
                            acc += sc[j] * fb;
                        }
                        const double ref = acc / den;
                        uint32_t u = (uint32_t)out[o + e] << 16;
                        float got; memcpy(&got, &u, 4);
                        const double ulp = fabs(ref) > 0 ? ldexp(1.0, ilogb(ref) - 7) : 1e-45;
                        const double err = fabs(got - ref) / ulp;    /* in bf16 ulps of the reference */
                        miss += out[o + e] != tobf((float)ref);
                        maxerr = err > maxerr ? err : maxerr;
                        sumerr += err;
                        total++;
                    }
                    free(sc);
                }
        printf("check vs double: %ld of %ld outputs differ from the rounded reference, error max %.3f mean %.4f bf16 ulp\n",
               miss, total, maxerr, sumerr / total);
    }
    double sum = 0;
    for (int i = 0; i < R * KVH * G * HD; i++) { uint32_t u = (uint32_t)out[i] << 16; float f; memcpy(&f, &u, 4); sum += f * (1 + i % 7); }
    qsort(t, reps, sizeof(double), cmp);
    if (sink == 1.f) printf(" ");
    printf("ctx %d rows %d: min %.4f ms  median %.4f ms  (%.1f GB/s at min)  checksum %.6f\n", ctx, R, t[0], t[reps / 2],
           (double)L * KVH * R * len * HD * 2 * 2 / t[0] / 1e6, sum);
    return 0;
}
