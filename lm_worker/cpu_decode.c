/* One-row matrix products for CPU decode: y = W x (+ b), W row-major [n, k], in fp32 or bf16
(bf16: the weight is widened to fp32 as it is read, sums in fp32, the result rounded to bf16).

A decode step of one sequence is a chain of such products, and its speed is how fast the
weights stream from memory. Each thread takes a contiguous run of rows and reads each row
once, front to back, into four independent vector sums: one sequential stream per thread,
as a reduction over the same bytes reads. (Four rows at once, four streams a thread, read
about half as fast on the CPUs measured.) Built at start-up by lm_worker/cpu_kernels.py with
the machine's compiler (-O3 -march=native -fopenmp) and kept only where it is measured
faster than torch's kernels; OpenMP here is the runtime torch already loaded, so its threads
are torch's threads. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float vec __attribute__((vector_size(64))); /* 16 floats; split where vectors are narrower */
typedef uint16_t bf16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v); /* an unaligned load */
    return v;
}

static inline vec load_bf16(const uint16_t *p) { /* bf16 is the top half of an fp32 */
    bf16x16 h;
    memcpy(&h, p, sizeof h);
    u32x16 wide = __builtin_convertvector(h, u32x16) << 16;
    vec v;
    memcpy(&v, &wide, sizeof v);
    return v;
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest, ties to even (no NaN inputs) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* 16 weights from row w at i: fp32, or bf16 widened. `bf16` is a constant at each call site,
   so the compiler keeps one branch. */
static inline vec load_w(const void *w, long i, int bf16) {
    return bf16 ? load_bf16((const uint16_t *)w + i) : load((const float *)w + i);
}

static inline float weight(const void *w, long i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

static inline float dot(const void *w, const float *x, long k, int bf16) {
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    long i = 0;
    for (; i + 64 <= k; i += 64) {
        a0 += load_w(w, i, bf16) * load(x + i);
        a1 += load_w(w, i + 16, bf16) * load(x + i + 16);
        a2 += load_w(w, i + 32, bf16) * load(x + i + 32);
        a3 += load_w(w, i + 48, bf16) * load(x + i + 48);
    }
    vec s = (a0 + a1) + (a2 + a3);
    for (int half = 8; half > 0; half /= 2) /* a tree: 4 dependent adds, not 16 */
        for (int j = 0; j < half; j++) s[j] += s[j + half];
    float acc = s[0];
    for (; i < k; i++) acc += weight(w, i, bf16) * x[i];
    return acc;
}

void epd_gemv(const float *w, const float *x, const float *b, float *y, long n, long k,
              int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < n; r++) y[r] = dot(w + r * k, x, k, 0) + (b ? b[r] : 0.0f);
}

/* x, b and y in bf16 too; x is widened once, before the threads start. 0, or -1 when there
   is no memory for it. */
int epd_gemv_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *b, uint16_t *y, long n,
                  long k, int threads) {
    float *xf = malloc(k * sizeof *xf);
    if (!xf) return -1;
    for (long i = 0; i < k; i++) xf[i] = from_bf16(x[i]);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < n; r++)
        y[r] = to_bf16(dot(w + r * k, xf, k, 1) + (b ? from_bf16(b[r]) : 0.0f));
    free(xf);
    return 0;
}
