/* CPU decode of one sequence in C: one-row matrix products, y = W x (+ b), W row-major [n, k],
in fp32 or bf16 (bf16: the weight is widened to fp32 as it is read, sums in fp32, the result
rounded to bf16); and, around them, whole decoder layers (the second half of this file).

A decode step of one sequence is a chain of such products, and its speed is how fast the
weights stream from memory. Each thread takes a contiguous run of rows and reads each row
once, front to back, into four independent vector sums: one sequential stream per thread,
as a reduction over the same bytes reads. (Four rows at once, four streams a thread, read
about half as fast on the CPUs measured.) Built at start-up by lm_worker/cpu_kernels.py with
the machine's compiler (-O3 -march=native -fopenmp) and kept only where it is measured
faster than torch's kernels; OpenMP here is the runtime torch already loaded, so its threads
are torch's threads. */

#include <math.h>
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
    for (; i + 16 <= k; i += 16) a0 += load_w(w, i, bf16) * load(x + i); /* short rows */
    vec s = (a0 + a1) + (a2 + a3);
    for (int half = 8; half > 0; half /= 2) /* a tree: 4 dependent adds, not 16 */
        for (int j = 0; j < half; j++) s[j] += s[j + half];
    float acc = s[0];
    for (; i < k; i++) acc += weight(w, i, bf16) * x[i];
    return acc;
}

static void products(const float *w, const float *x, const float *b, float *y, long n, long k,
                     int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long r = 0; r < n; r++) y[r] = dot(w + r * k, x, k, 0) + (b ? b[r] : 0.0f);
}

void epd_gemv(const float *w, const float *x, const float *b, float *y, long n, long k,
              int threads) {
    products(w, x, b, y, n, k, threads);
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

/* ---- Decoder layers for one sequence ----------------------------------------------------------

A decode step of one sequence through Qwen2's decoder layers (fp32), all of it here:
    h = rms_norm(x) * norm1;  q, k, v = qkv_w h + qkv_b;  q, k rotated (rotary tables);
    k, v written into the sequence's slot of the paged cache;  a = attention(q, its keys);
    x += o_w a;  h = rms_norm(x) * norm2;  g, u = gate_up_w h;  x += down_w (silu(g) * u).
In torch each of those is an operator dispatched on its own: a few microseconds each, about 30
a layer, a quarter of a step of the bench's model where the products stream 300 MB. Here they
cost what their arithmetic costs; the products are the gemv above, on the same threads. The
operations and their order are torch's (lm_worker/attention.py, models/layers.py), so the
results agree to the rounding of sums taken in another order. */

struct epd_layer { /* one layer's tensors, fp32 and contiguous */
    const float *norm1;       /* [hidden] */
    const float *qkv_w;       /* [(heads + 2 kv_heads) head_dim, hidden]: q, k, v stacked */
    const float *qkv_b;       /* [(heads + 2 kv_heads) head_dim], or NULL */
    const float *o_w;         /* [hidden, heads head_dim] */
    const float *norm2;       /* [hidden] */
    const float *gate_up_w;   /* [2 intermediate, hidden]: gate, then up */
    const float *down_w;      /* [hidden, intermediate] */
    float *k_cache, *v_cache; /* [slots, kv_heads, head_dim]: slot = block * block_size + i */
};

struct epd_decoder {
    long num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale; /* RMSNorm's epsilon; attention's scale (head_dim ** -0.5) */
    const struct epd_layer *layers;
};

/* y = x / sqrt(mean(x * x) + eps) * weight, as models/layers.py's RMSNorm in fp32. */
static void rms_norm(const float *x, const float *weight, float *y, long n, float eps) {
    float scale = 1.0f / sqrtf(dot(x, x, n, 0) / (float)n + eps);
    for (long i = 0; i < n; i++) y[i] = x[i] * scale * weight[i];
}

/* One head rotated in place: x * cos + roll(x, half) * signed_sin (models/layers.py). */
static void rotate(float *x, const float *cos, const float *signed_sin, long d) {
    float rolled[d];
    long half = d / 2;
    for (long i = 0; i < d; i++) rolled[i] = x[(i + half) % d];
    for (long i = 0; i < d; i++) x[i] = x[i] * cos[i] + rolled[i] * signed_sin[i];
}

/* out[h] = softmax(q[h] . keys * scale) . values over the sequence's first `len` tokens, each
   query head h reading kv head h / (heads / kv_heads). `scores`: [heads, len] scratch. */
static void attend(const struct epd_decoder *m, const struct epd_layer *layer, const float *q,
                   const int64_t *block_table, long len, float *scores, float *out, int threads) {
    long d = m->head_dim, kvh = m->kv_heads, group = m->heads / kvh, bs = m->block_size;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long h = 0; h < m->heads; h++) {
        const float *qh = q + h * d;
        float *s = scores + h * len, *o = out + h * d, top = -INFINITY, total = 0.0f;
        long head = h / group;
        for (long t = 0; t < len; t++) {
            long slot = block_table[t / bs] * bs + t % bs;
            s[t] = dot(layer->k_cache + (slot * kvh + head) * d, qh, d, 0) * m->scale;
            top = s[t] > top ? s[t] : top;
        }
        for (long t = 0; t < len; t++) total += s[t] = expf(s[t] - top);
        for (long i = 0; i < d; i++) o[i] = 0.0f;
        for (long t = 0; t < len; t++) {
            long slot = block_table[t / bs] * bs + t % bs;
            const float *v = layer->v_cache + (slot * kvh + head) * d;
            for (long i = 0; i < d; i++) o[i] += s[t] * v[i];
        }
        for (long i = 0; i < d; i++) o[i] /= total;
    }
}

/* Every layer on one sequence's new token: x [hidden] in place (the residual stream), cos /
   signed_sin [head_dim] its rotary tables, block_table the sequence's blocks, *seq_len its
   tokens with the new one, max_blocks the table's width. 0; -1 when there is no memory for
   the scratch, -2 when *seq_len does not fit the table. */
int epd_decode_layers(const struct epd_decoder *m, float *x, const float *cos,
                      const float *signed_sin, const int64_t *block_table, long max_blocks,
                      const int64_t *seq_len, int threads) {
    long n = m->hidden, d = m->head_dim, heads = m->heads, kvh = m->kv_heads;
    long inter = m->intermediate, len = *seq_len, pos = len - 1;
    long qkv_rows = (heads + 2 * kvh) * d;
    if (len < 1 || pos / m->block_size >= max_blocks) return -2;
    long slot = block_table[pos / m->block_size] * m->block_size + pos % m->block_size;
    float *h = malloc((n + qkv_rows + heads * d + 2 * inter + heads * len) * sizeof *h);
    if (!h) return -1;
    float *qkv = h + n, *att = qkv + qkv_rows, *gate_up = att + heads * d;
    float *scores = gate_up + 2 * inter;
    for (long l = 0; l < m->num_layers; l++) {
        const struct epd_layer *layer = m->layers + l;
        rms_norm(x, layer->norm1, h, n, m->eps);
        products(layer->qkv_w, h, layer->qkv_b, qkv, qkv_rows, n, threads);
        for (long head = 0; head < heads + kvh; head++) /* q's heads, then k's */
            rotate(qkv + head * d, cos, signed_sin, d);
        memcpy(layer->k_cache + slot * kvh * d, qkv + heads * d, kvh * d * sizeof *h);
        memcpy(layer->v_cache + slot * kvh * d, qkv + (heads + kvh) * d, kvh * d * sizeof *h);
        attend(m, layer, qkv, block_table, len, scores, att, threads);
        products(layer->o_w, att, NULL, h, n, heads * d, threads);
        for (long i = 0; i < n; i++) x[i] += h[i];
        rms_norm(x, layer->norm2, h, n, m->eps);
        products(layer->gate_up_w, h, NULL, gate_up, 2 * inter, n, threads);
        for (long i = 0; i < inter; i++) /* silu(g) * u */
            gate_up[i] = gate_up[i] / (1.0f + expf(-gate_up[i])) * gate_up[inter + i];
        products(layer->down_w, gate_up, NULL, h, n, inter, threads);
        for (long i = 0; i < n; i++) x[i] += h[i];
    }
    free(h);
    return 0;
}
