/* One-row matrix products for CPU decode: y = W x (+ b), W row-major [n, k], fp32.

A decode step of one sequence is a chain of such products, and its speed is how fast the
weights stream from memory. Each thread takes a contiguous run of rows and reads each row
once, front to back, into four independent vector sums: one sequential stream per thread,
as a reduction over the same bytes reads. (Four rows at once, four streams a thread, read
about half as fast on the CPUs measured.) Built at start-up by lm_worker/cpu_kernels.py with
the machine's compiler (-O3 -march=native -fopenmp) and kept only where it is measured
faster than torch's kernels; OpenMP here is the runtime torch already loaded, so its threads
are torch's threads. */

#include <string.h>

typedef float vec __attribute__((vector_size(64))); /* 16 floats; split where vectors are narrower */

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v); /* an unaligned load */
    return v;
}

static inline float dot(const float *w, const float *x, long k) {
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    long i = 0;
    for (; i + 64 <= k; i += 64) {
        a0 += load(w + i) * load(x + i);
        a1 += load(w + i + 16) * load(x + i + 16);
        a2 += load(w + i + 32) * load(x + i + 32);
        a3 += load(w + i + 48) * load(x + i + 48);
    }
    vec s = (a0 + a1) + (a2 + a3);
    for (int half = 8; half > 0; half /= 2) /* a tree: 4 dependent adds, not 16 */
        for (int j = 0; j < half; j++) s[j] += s[j + half];
    float acc = s[0];
    for (; i < k; i++) acc += w[i] * x[i];
    return acc;
}

void epd_gemv(const float *w, const float *x, const float *b, float *y, long n, long k,
              int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < n; r++) y[r] = dot(w + r * k, x, k) + (b ? b[r] : 0.0f);
}
