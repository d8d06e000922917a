/* CPU decode in C: one-row matrix products, y = W x (+ b), W row-major [n, k], in fp32 or bf16
(bf16: the weight is widened to fp32 as it is read, sums in fp32, the result rounded to bf16);
and, around them, whole decoder layers for decode steps of a few sequences (the second half of
this file, called by lm_worker/cpu_decode.py).

A decode step of one sequence is a chain of such products, and its speed is how fast the
weights stream from memory. Each thread takes a contiguous run of rows and reads each row
once, front to back, into four independent vector sums: one sequential stream per thread,
as a reduction over the same bytes reads. (Four rows at once, four streams a thread, read
about half as fast on the CPUs measured.) Built at start-up by lm_worker/cpu_kernels.py with
the machine's compiler (-O3 -march=native -fopenmp) and kept only where it is measured
faster than torch's kernels; OpenMP here is the runtime torch already loaded, so its threads
are torch's threads. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Floats a vector: 16 (512 bits) or 8 (256 bits). lm_worker/cpu_kernels.py builds both and keeps
   the one that streams weights faster here: on a 2-core Zen 4 the 256-bit products read 1.4x
   faster than the 512-bit ones, with the same arithmetic. */
#ifndef EPD_VEC
#define EPD_VEC 16
#endif
#define V EPD_VEC
typedef float vec __attribute__((vector_size(4 * V)));
typedef float half8 __attribute__((vector_size(32)));
typedef float quarter4 __attribute__((vector_size(16)));
typedef uint16_t bf16vec __attribute__((vector_size(2 * V)));
typedef uint32_t u32vec __attribute__((vector_size(4 * V)));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v); /* an unaligned load */
    return v;
}

static inline vec load_bf16(const uint16_t *p) { /* bf16 is the top half of an fp32 */
    bf16vec h;
    memcpy(&h, p, sizeof h);
    u32vec wide = __builtin_convertvector(h, u32vec) << 16;
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

/* V weights from row w at i: fp32, or bf16 widened. `bf16` is a constant at each call site,
   so the compiler keeps one branch. */
static inline vec load_w(const void *w, long i, int bf16) {
    return bf16 ? load_bf16((const uint16_t *)w + i) : load((const float *)w + i);
}

static inline float weight(const void *w, long i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* The sum of a vector's lanes as a tree of halves (3 or 4 dependent adds), in registers. */
static inline float hsum(vec v) {
#if V == 16
    half8 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    half8 s8 = lo + hi;
#else
    half8 s8 = v;
#endif
    quarter4 q0, q1;
    memcpy(&q0, &s8, sizeof q0);
    memcpy(&q1, (const char *)&s8 + sizeof q0, sizeof q1);
    quarter4 s4 = q0 + q1;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* w . x over k values, w fp32 or bf16. `short_dot` (a constant at each call site) sums the
   lanes with `hsum`; otherwise the same tree is written as a loop over the lanes, which gcc 12
   compiles to a spill and a loop over the stack. That costs the attention's 64-wide key dots
   and the products of several rows (`dot_rows`: one sum per row and sequence) more than their
   arithmetic, but the one-row products read 2-4% faster with it (each measured alternately in
   one process, two builds), so they keep it. The sums are the same bit for bit. */
static inline float dot(const void *w, const float *x, long k, int bf16, int short_dot) {
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    long i = 0;
    for (; i + 4 * V <= k; i += 4 * V) {
        a0 += load_w(w, i, bf16) * load(x + i);
        a1 += load_w(w, i + V, bf16) * load(x + i + V);
        a2 += load_w(w, i + 2 * V, bf16) * load(x + i + 2 * V);
        a3 += load_w(w, i + 3 * V, bf16) * load(x + i + 3 * V);
    }
    for (; i + V <= k; i += V) a0 += load_w(w, i, bf16) * load(x + i); /* short rows */
    vec s = (a0 + a1) + (a2 + a3);
    float acc;
    if (short_dot) {
        acc = hsum(s);
    } else {
        for (int half = V / 2; half > 0; half /= 2) /* a tree: log2(V) dependent adds */
            for (int j = 0; j < half; j++) s[j] += s[j + half];
        acc = s[0];
    }
    for (; i < k; i++) acc += weight(w, i, bf16) * x[i];
    return acc;
}

/* y = W x (+ b) in fp32, W and b in fp32 or (bf16) bf16. */
#define PRODUCTS(BF16)                                                                      \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                       \
    for (long r = 0; r < n; r++)                                                            \
        y[r] = dot((const char *)w + r * row, x, k, BF16, 0) + (b ? weight(b, r, BF16) : 0.0f);

static void products(const void *w, const float *x, const void *b, float *y, long n, long k,
                     int bf16, int threads) {
    size_t row = k * (bf16 ? 2 : 4);
    if (bf16) { /* a constant in each loop: one kind of load in it */
        PRODUCTS(1)
    } else {
        PRODUCTS(0)
    }
}

void epd_gemv(const float *w, const float *x, const float *b, float *y, long n, long k,
              int threads) {
    products(w, x, b, y, n, k, 0, threads);
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
        y[r] = to_bf16(dot(w + r * k, xf, k, 1, 0) + (b ? from_bf16(b[r]) : 0.0f));
    free(xf);
    return 0;
}

/* ---- Decoder layers for a few sequences ---------------------------------------------------------

A decode step of one to eight sequences (one new token each) through Qwen2's decoder layers,
all of it here, for each sequence:
    h = rms_norm(x) * norm1;  q, k, v = qkv_w h + qkv_b;  (Qwen3: each q and k head
    rms-normed);  q, k rotated (rotary tables);
    k, v written into the sequence's slot of the paged cache;  a = attention(q, its keys);
    x += o_w a;  h = rms_norm(x) * norm2;  g, u = gate_up_w h;  x += down_w (silu(g) * u)
    (a sparse MoE layer: the router's top_k experts' SwiGLUs, weighted: `moe`);
then the final norm. In torch each of those is an operator dispatched on its own: a few
microseconds each, about 30 a layer, a quarter of a step of the bench's model where the
products stream 300 MB. Here they cost what their arithmetic costs. The products read each
weight row once for all the step's sequences (`dot_rows`): two sequences cost about what one
does, where torch's batch kernels read a few rows at half the rate or less. The operations and
their order are torch's (lm_worker/attention.py, models/layers.py), so the results agree to
the rounding of sums taken in another order. In bf16 (weights, KV cache, input and output)
the arithmetic is fp32, each value rounded to bf16 where torch's would be a bf16 tensor.

The same layers serve the batch-invariant forward (`epd_forward_tokens`, lm.batch_invariant):
any number of tokens, prefill and decode alike, each token's products the one-row product's
sums, so that nothing a token gets depends on the other tokens of its step. */

#define MAX_SEQS 8

/* out[s] = w . x[s] for the rows x[0 .. S-1] (each k long, one after another): the weight row
   is loaded once for all of them. S and bf16 are constants where products_for() calls it. */
static inline __attribute__((always_inline)) void dot_rows(const void *w, const float *x, long k,
                                                           int S, int bf16, float *out) {
    vec a[MAX_SEQS][2];
    for (int s = 0; s < S; s++) a[s][0] = a[s][1] = (vec){0};
    long i = 0;
    for (; i + 2 * V <= k; i += 2 * V) {
        vec w0 = load_w(w, i, bf16), w1 = load_w(w, i + V, bf16);
        for (int s = 0; s < S; s++) {
            a[s][0] += w0 * load(x + s * k + i);
            a[s][1] += w1 * load(x + s * k + i + V);
        }
    }
    for (int s = 0; s < S; s++) {
        out[s] = hsum(a[s][0] + a[s][1]);
        for (long j = i; j < k; j++) out[s] += weight(w, j, bf16) * x[s * k + j];
    }
}

#define ROWS(S, BF16)                                                                       \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                       \
    for (long r = 0; r < n; r++) {                                                          \
        float o[S];                                                                         \
        dot_rows((const char *)w + r * row, x, k, S, BF16, o);                              \
        for (int s = 0; s < S; s++) y[s * n + r] = o[s] + (b ? weight(b, r, BF16) : 0.0f);  \
    }
#define ROWS_CASE(S)                                                                        \
    case S:                                                                                 \
        if (bf16) {                                                                         \
            ROWS(S, 1)                                                                      \
        } else {                                                                            \
            ROWS(S, 0)                                                                      \
        }                                                                                   \
        break;

/* y[s] = W x[s] (+ b) for the step's S sequences, in fp32: y [S, n], x [S, k]. */
static void products_for(int S, const void *w, const float *x, const void *b, float *y, long n,
                         long k, int bf16, int threads) {
    size_t row = k * (bf16 ? 2 : 4);
    switch (S) {
    case 1: products(w, x, b, y, n, k, bf16, threads); break; /* four sums a row: one stream */
    ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
    }
}

/* y[s] = W x[s] (+ b) for any number S of rows, each value the one-row product's sum
   (`products`) bit for bit: what a row gets does not depend on how many others come with it
   (the batch-invariant forward). The rows go in tiles, so a tile's inputs stay in cache while
   the weights stream past them once a tile. */
#define EACH_TILE 16
static void products_each(long S, const void *w, const float *x, const void *b, float *y, long n,
                          long k, int bf16, int threads) {
    size_t row = k * (bf16 ? 2 : 4);
    for (long s0 = 0; s0 < S; s0 += EACH_TILE) {
        long s1 = s0 + EACH_TILE < S ? s0 + EACH_TILE : S;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (long r = 0; r < n; r++) {
            const void *wr = (const char *)w + r * row;
            float bias = b ? weight(b, r, bf16) : 0.0f;
            if (bf16)
                for (long s = s0; s < s1; s++) y[s * n + r] = dot(wr, x + s * k, k, 1, 0) + bias;
            else
                for (long s = s0; s < s1; s++) y[s * n + r] = dot(wr, x + s * k, k, 0, 0) + bias;
        }
    }
}

struct epd_layer { /* one layer's tensors, contiguous, fp32 or (the decoder's bf16) bf16 */
    const void *norm1;        /* [hidden] */
    const void *qkv_w;        /* [(heads + 2 kv_heads) head_dim, hidden]: q, k, v stacked */
    const void *qkv_b;        /* [(heads + 2 kv_heads) head_dim], or NULL */
    const void *o_w;          /* [hidden, heads head_dim] */
    const void *norm2;        /* [hidden] */
    const void *gate_up_w;    /* [2 intermediate, hidden]: gate, then up */
    const void *down_w;       /* [hidden, intermediate] */
    void *k_cache, *v_cache;  /* [slots, kv_heads, head_dim]: slot = block * block_size + i */
    /* Qwen3: each query and key head RMS-normalised before the rotary ([head_dim]), or NULL */
    const void *q_norm, *k_norm;
    /* A sparse MoE layer (Qwen3-VL-MoE): the router [experts, hidden] and the experts'
       gate_up [experts, 2 moe_intermediate, hidden] and down [experts, hidden,
       moe_intermediate], in place of gate_up_w / down_w; NULL: a dense MLP. */
    const void *router_w, *experts_gate_up, *experts_down;
};

struct epd_decoder {
    long num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale; /* RMSNorm's epsilon; attention's scale (head_dim ** -0.5) */
    const struct epd_layer *layers;
    const void *final_norm; /* [hidden] */
    /* Rotary: frequency j < head_dim / 2 turns with inv_freq[j] (fp32) times the position on
       axis freq_axis[j] (M-RoPE: time, height, width; one axis for plain RoPE). */
    const float *inv_freq;
    const int32_t *freq_axis;
    long bf16; /* the layers' tensors, the KV cache, input and output in bf16 */
    /* A whole step (epd_decode_step): the token embedding table and the LM head (no bias),
       each [vocab, hidden]; NULL where the model offers none. */
    const void *embed, *head;
    long vocab;
    /* Its MoE layers' sizes (0 experts: none): top_k experts a token, renormalised when
       norm_topk. */
    long num_experts, top_k, moe_intermediate, norm_topk;
    /* Tensor parallelism (models/parallel.py): this process holds a shard of every layer (its
       heads, its part of the MLP), and after o and after down the ranks' partial sums are added
       in place over `n` floats by this call (into Python's process group); NULL: whole. */
    void (*all_reduce)(float *x, long n);
};

/* The step's tokens: S of them; token s belongs to the sequence whose block table is row
   rows[s] of `tables` (NULL rows: row s; table_stride apart, max_blocks wide), sees lens[s]
   keys (itself the last: it is written at key lens[s] - 1), and has its position on axis a at
   positions[a * position_stride + s]. A decode step has one token a sequence; the
   batch-invariant forward also takes prefill tokens, several a sequence. */
struct epd_seqs {
    long S;
    const int64_t *tables;
    long table_stride, max_blocks;
    const int64_t *lens;
    const int64_t *positions;
    long position_stride;
    const int64_t *rows;
};

static inline long row_of(const struct epd_seqs *q, long s) { return q->rows ? q->rows[s] : s; }

static inline long slot_of(const struct epd_seqs *q, long r, long t, long bs) {
    return q->tables[r * q->table_stride + t / bs] * bs + t % bs;
}

/* A value as a bf16 tensor of torch's would hold it (bf16), or as it is. */
static inline float rnd(float v, int bf16) { return bf16 ? from_bf16(to_bf16(v)) : v; }

/* y = rms_norm(x) * weight, as models/layers.py's RMSNorm: in fp32 x * scale * weight; in
   bf16 the normalised x rounded, then its product with the weight. */
static void rms_norm(const float *x, const void *w, float *y, long n, float eps, int bf16) {
    float scale = 1.0f / sqrtf(dot(x, x, n, 0, 0) / (float)n + eps);
    for (long i = 0; i < n; i++) y[i] = rnd(rnd(x[i] * scale, bf16) * weight(w, i, bf16), bf16);
}

/* A token's rotary tables (models/qwen2_vl/rope.py, then models/layers.py's rotary_tables):
   cos [d] and the sine with its first half negated, from its positions (one per axis). */
static void rotary_tables(const struct epd_decoder *m, const struct epd_seqs *seqs, long s,
                          float *cos, float *signed_sin) {
    long half = m->head_dim / 2;
    for (long j = 0; j < half; j++) {
        float angle = (float)seqs->positions[m->freq_axis[j] * seqs->position_stride + s];
        angle *= m->inv_freq[j];
        cos[j] = cos[j + half] = rnd(cosf(angle), m->bf16);
        signed_sin[j + half] = rnd(sinf(angle), m->bf16);
        signed_sin[j] = -signed_sin[j + half];
    }
}

/* One head rotated in place: x * cos + roll(x, half) * signed_sin (models/layers.py). */
static void rotate(float *x, const float *cos, const float *signed_sin, long d, int bf16) {
    float rolled[d];
    long half = d / 2;
    for (long i = 0; i < d; i++) rolled[i] = rnd(x[(i + half) % d] * signed_sin[i], bf16);
    for (long i = 0; i < d; i++) x[i] = rnd(rnd(x[i] * cos[i], bf16) + rolled[i], bf16);
}

/* n values into dst at `at` (fp32, or rounded to bf16): a token's keys or values into its
   cache slot, the step's output. */
static void store(void *dst, long at, const float *v, long n, int bf16) {
    if (!bf16) {
        memcpy((float *)dst + at, v, n * sizeof *v);
        return;
    }
    for (long i = 0; i < n; i++) ((uint16_t *)dst)[at + i] = to_bf16(v[i]);
}

/* For each token s and query head h: out = softmax(q . keys * scale) . values over the keys
   the token sees, in order, head h reading kv head h / (heads / kv_heads): each token's own
   sums, whatever else the step holds. q [S, (heads + 2 kv_heads) head_dim] (its q part is
   read), out [S, heads head_dim], scores [threads, longest] scratch (a thread's row); slots
   [rows, longest]: each sequence's cache slots (`slot_of`, once a step, not per key, head and
   layer). */
static void attend(const struct epd_decoder *m, const struct epd_layer *layer,
                   const struct epd_seqs *seqs, const long *slots, const float *q, long longest,
                   float *scores, float *out, int threads) {
    long d = m->head_dim, heads = m->heads, kvh = m->kv_heads, group = heads / kvh;
    long q_stride = (heads + 2 * kvh) * d;
    int bf16 = m->bf16;
    size_t item = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long sh = 0; sh < seqs->S * heads; sh++) {
        long s = sh / heads, h = sh % heads, head = h / group, len = seqs->lens[s];
        const float *qh = q + s * q_stride + h * d;
        float *sc = scores + omp_get_thread_num() * longest, *o = out + s * heads * d + h * d;
        const long *slot = slots + row_of(seqs, s) * longest;
        float top = -INFINITY, total = 0.0f;
        for (long t = 0; t < len; t++) {
            long at = (slot[t] * kvh + head) * d;
            const void *key = (const char *)layer->k_cache + at * item;
            sc[t] = (bf16 ? dot(key, qh, d, 1, 1) : dot(key, qh, d, 0, 1)) * m->scale;
            top = sc[t] > top ? sc[t] : top;
        }
        for (long t = 0; t < len; t++) total += sc[t] = expf(sc[t] - top);
        for (long i = 0; i < d; i++) o[i] = 0.0f;
        for (long t = 0; t < len; t++) {
            long at = (slot[t] * kvh + head) * d;
            for (long i = 0; i < d; i++) o[i] += sc[t] * weight(layer->v_cache, at + i, bf16);
        }
        for (long i = 0; i < d; i++) o[i] = rnd(o[i] / total, bf16);
    }
}

/* Every layer on the step's tokens, then the final norm. The tokens come in as their
   embeddings x_in [S, hidden], or (x_in NULL) as their ids, looked up in m->embed; out gets
   the final norm's output [S, hidden] (num_sample < 0), or the LM head's logits (fp32, or
   bf16 in a bf16 decoder): of every token where ids are given, else of the num_sample >= 0
   tokens `sample` lists ([num_sample, vocab]). `invariant`: products of any number of
   tokens, each token's the one-row product's sums (products_each), so what a token gets does
   not depend on the rest of the step; else the step is a decode of 1 .. MAX_SEQS sequences,
   its products reading each weight row once for all of them (products_for). 0; -1 when there
   is no memory for the scratch, -2 when a length does not fit its table or S is out of range. */
/* x += moe(h) for one token (models/qwen3_vl/language_model.py's SparseMoE, routed path):
   softmax of the router's logits in fp32, the top_k kept (renormalised when norm_topk, then
   rounded to the model's dtype), each chosen expert's SwiGLU weighted and summed in expert
   order from zero, then the residual add. buf: scratch of experts + 2 moe_intermediate + 2 n. */
static void moe(const struct epd_decoder *m, const struct epd_layer *layer, const float *h,
                float *x, float *buf, int threads) {
    long n = m->hidden, E = m->num_experts, K = m->top_k, I = m->moe_intermediate;
    int bf16 = (int)m->bf16;
    size_t item = bf16 ? 2 : 4;
    float *logits = buf, *gu = logits + E, *y = gu + 2 * I, *out = y + n;
    products(layer->router_w, h, NULL, logits, E, n, bf16, threads);
    float top = -INFINITY, sum = 0.0f;
    for (long e = 0; e < E; e++) {
        logits[e] = rnd(logits[e], bf16);
        top = logits[e] > top ? logits[e] : top;
    }
    for (long e = 0; e < E; e++) sum += (logits[e] = expf(logits[e] - top));
    for (long e = 0; e < E; e++) logits[e] /= sum; /* the probabilities */
    long chosen[64];
    float chosen_w[64], total = 0.0f;
    for (long j = 0; j < K; j++) { /* the K largest, first index first among equals */
        long best = -1;
        for (long e = 0; e < E; e++) {
            int taken = 0;
            for (long i = 0; i < j; i++) taken |= chosen[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        chosen[j] = best;
        chosen_w[j] = logits[best];
        total += logits[best];
    }
    for (long j = 0; j < K; j++)
        chosen_w[j] = rnd(m->norm_topk ? chosen_w[j] / total : chosen_w[j], bf16);
    for (long i = 0; i < n; i++) out[i] = 0.0f;
    for (long e = 0; e < E; e++) { /* in expert order, as the routed path adds them */
        long j = 0;
        while (j < K && chosen[j] != e) j++;
        if (j == K) continue;
        const char *w_gu = (const char *)layer->experts_gate_up + e * 2 * I * n * item;
        const char *w_dn = (const char *)layer->experts_down + e * n * I * item;
        products(w_gu, h, NULL, gu, 2 * I, n, bf16, threads);
        for (long i = 0; i < I; i++) {
            float g = rnd(gu[i], bf16);
            gu[i] = rnd(rnd(g / (1.0f + expf(-g)), bf16) * rnd(gu[I + i], bf16), bf16);
        }
        products(w_dn, gu, NULL, y, n, I, bf16, threads);
        for (long i = 0; i < n; i++)
            out[i] = rnd(out[i] + rnd(rnd(y[i], bf16) * chosen_w[j], bf16), bf16);
    }
    for (long i = 0; i < n; i++) x[i] = rnd(out[i] + x[i], bf16);
}

static int decode(const struct epd_decoder *m, const struct epd_seqs *seqs, const void *x_in,
                  const int64_t *ids, const int64_t *sample, long num_sample, void *out,
                  int invariant, int threads) {
    long n = m->hidden, d = m->head_dim, heads = m->heads, kvh = m->kv_heads, S = seqs->S;
    long inter = m->intermediate, qkv_rows = (heads + 2 * kvh) * d, bs = m->block_size;
    long longest = 0, num_rows = 0;
    int bf16 = m->bf16;
    if (S < 1 || (!invariant && S > MAX_SEQS)) return -2;
    for (long s = 0; s < S; s++) {
        long len = seqs->lens[s], r = row_of(seqs, s);
        if (len < 1 || (len - 1) / bs >= seqs->max_blocks || r < 0) return -2;
        longest = len > longest ? len : longest;
        num_rows = r + 1 > num_rows ? r + 1 : num_rows;
    }
    long heads_out = ids ? S : num_sample; /* rows of logits (< 0: the hidden states out) */
    long logits = heads_out > 0 && bf16 ? heads_out * m->vocab : 0; /* bf16: fp32 first */
    float *x = malloc(
        (S * (2 * n + 2 * d + qkv_rows + heads * d + 2 * inter) + threads * longest + logits) *
        sizeof *x);
    long *slot_table = malloc((num_rows * longest + num_rows) * sizeof *slot_table);
    float *moe_buf = malloc((m->num_experts + 2 * m->moe_intermediate + 2 * n) * sizeof *moe_buf);
    if (!x || !slot_table || !moe_buf || m->top_k > 64) {
        free(x);
        free(slot_table);
        free(moe_buf);
        return -1;
    }
    long *known = slot_table + num_rows * longest; /* a sequence's slots so far */
    memset(known, 0, num_rows * sizeof *known);
    for (long s = 0; s < S; s++) { /* each sequence's slots, up to its last token's */
        long r = row_of(seqs, s);
        for (; known[r] < seqs->lens[s]; known[r]++)
            slot_table[r * longest + known[r]] = slot_of(seqs, r, known[r], bs);
    }
    float *h = x + S * n, *cos = h + S * n, *signed_sin = cos + S * d, *qkv = signed_sin + S * d;
    float *att = qkv + S * qkv_rows, *gate_up = att + S * heads * d;
    float *scores = gate_up + S * 2 * inter;
#define PRODUCTS_OF(T, w, in, b, y, rows, k)                                                \
    (invariant ? products_each(T, w, in, b, y, rows, k, bf16, threads)                      \
               : products_for(T, w, in, b, y, rows, k, bf16, threads))
    for (long s = 0; s < S; s++) /* the residual streams */
        for (long i = 0; i < n; i++)
            x[s * n + i] =
                ids ? weight(m->embed, ids[s] * n + i, bf16) : weight(x_in, s * n + i, bf16);
    for (long s = 0; s < S; s++) rotary_tables(m, seqs, s, cos + s * d, signed_sin + s * d);
    long kv = kvh * d; /* one token's keys (or values) in a layer */
    for (long l = 0; l < m->num_layers; l++) {
        const struct epd_layer *layer = m->layers + l;
        for (long s = 0; s < S; s++) rms_norm(x + s * n, layer->norm1, h + s * n, n, m->eps, bf16);
        PRODUCTS_OF(S, layer->qkv_w, h, layer->qkv_b, qkv, qkv_rows, n);
        for (long s = 0; s < S; s++) {
            float *row = qkv + s * qkv_rows;
            long slot = slot_table[row_of(seqs, s) * longest + seqs->lens[s] - 1]; /* its own */
            for (long i = 0; bf16 && i < qkv_rows; i++) row[i] = rnd(row[i], 1);
            for (long head = 0; layer->q_norm && head < heads + kvh; head++) /* per head */
                rms_norm(row + head * d, head < heads ? layer->q_norm : layer->k_norm,
                         row + head * d, d, m->eps, bf16);
            for (long head = 0; head < heads + kvh; head++) /* q's heads, then k's */
                rotate(row + head * d, cos + s * d, signed_sin + s * d, d, bf16);
            store(layer->k_cache, slot * kv, row + heads * d, kv, bf16);
            store(layer->v_cache, slot * kv, row + heads * d + kv, kv, bf16);
        }
        attend(m, layer, seqs, slot_table, qkv, longest, scores, att, threads);
        PRODUCTS_OF(S, layer->o_w, att, NULL, h, n, heads * d);
        if (m->all_reduce) m->all_reduce(h, S * n);
        for (long i = 0; i < S * n; i++) x[i] = rnd(rnd(h[i], bf16) + x[i], bf16);
        for (long s = 0; s < S; s++) rms_norm(x + s * n, layer->norm2, h + s * n, n, m->eps, bf16);
        if (layer->router_w) { /* a sparse MoE layer: each token its own experts */
            for (long s = 0; s < S; s++) moe(m, layer, h + s * n, x + s * n, moe_buf, threads);
            continue;
        }
        PRODUCTS_OF(S, layer->gate_up_w, h, NULL, gate_up, 2 * inter, n);
        for (long s = 0; s < S; s++) { /* silu(g) * u, into g's place */
            float *g = gate_up + s * 2 * inter, *u = g + inter;
            for (long i = 0; i < inter; i++) {
                float gi = rnd(g[i], bf16);
                g[i] = rnd(rnd(gi / (1.0f + expf(-gi)), bf16) * rnd(u[i], bf16), bf16);
            }
        }
        for (long s = 0; s < S; s++) /* down's input rows: each sequence's g, packed */
            memmove(gate_up + s * inter, gate_up + s * 2 * inter, inter * sizeof *x);
        PRODUCTS_OF(S, layer->down_w, gate_up, NULL, h, n, inter);
        if (m->all_reduce) m->all_reduce(h, S * n);
        for (long i = 0; i < S * n; i++) x[i] = rnd(rnd(h[i], bf16) + x[i], bf16);
    }
    for (long s = 0; s < S; s++) rms_norm(x + s * n, m->final_norm, h + s * n, n, m->eps, bf16);
    if (heads_out < 0) {
        store(out, 0, h, S * n, bf16);
    } else if (heads_out > 0) {
        if (!ids) /* the sampled tokens' rows, packed (x is free now) */
            for (long i = 0; i < num_sample; i++)
                memcpy(x + i * n, h + sample[i] * n, n * sizeof *x);
        float *y = bf16 ? scores + threads * longest : out;
        PRODUCTS_OF(heads_out, m->head, ids ? h : x, NULL, y, m->vocab, n);
        if (bf16) store(out, 0, y, heads_out * m->vocab, 1);
    }
#undef PRODUCTS_OF
    free(x);
    free(slot_table);
    free(moe_buf);
    return 0;
}

int epd_decode_layers(const struct epd_decoder *m, const struct epd_seqs *seqs, const void *x_in,
                      void *out, int threads) {
    return decode(m, seqs, x_in, NULL, NULL, -1, out, 0, threads);
}

/* A whole decode step: the tokens `ids` [S] through the embedding table, every layer, the final
   norm and the LM head, into logits [S, vocab]. As decode(); -3 when the model offers no
   embedding table or head, -4 when an id is not in the table. */
int epd_decode_step(const struct epd_decoder *m, const struct epd_seqs *seqs, const int64_t *ids,
                    void *logits, int threads) {
    if (!m->embed || !m->head) return -3;
    for (long s = 0; s < seqs->S; s++)
        if (ids[s] < 0 || ids[s] >= m->vocab) return -4;
    return decode(m, seqs, NULL, ids, NULL, 0, logits, 0, threads);
}

/* The batch-invariant forward (lm_worker/cpu_decode.py's `InvariantForward`): any tokens,
   decode and prefill alike, from their embeddings x_in [S, hidden] through every layer, the
   final norm and the LM head, into the logits [num_sample, vocab] of the tokens `sample`
   lists. Each token's sums are the same whatever the step holds besides it (products_each,
   and attention per token over its own keys). As decode(); -3 when the model offers no head,
   -4 when a sampled index is not a token of the step. */
int epd_forward_tokens(const struct epd_decoder *m, const struct epd_seqs *seqs, const void *x_in,
                       const int64_t *sample, long num_sample, void *logits, int threads) {
    if (!m->head) return -3;
    for (long i = 0; i < num_sample; i++)
        if (sample[i] < 0 || sample[i] >= seqs->S) return -4;
    if (num_sample < 0) return -4;
    return decode(m, seqs, x_in, NULL, sample, num_sample, logits, 1, threads);
}
