// layers.cpp: the CPU backend's row-wise layers for the engine at float32, host code (not kernels: the
// host=True paths of cupaged/ops/layers.py): RMSNorm, SwiGLU (silu(gate) * up) and the rotate-half rotary
// embedding by device positions. Built into the host library with products.cpp (cupaged/_runtime/host.py).
// On the calling thread: split over the worker pool they were slower in the engine (a 256-token SmolLM2 prefill
// on 2 cores, 0.432 s vs 0.397: the pool's threads wake and meet OpenBLAS's, still spinning after a product).
//
// Why: as NumPy expressions each of these is four to ten passes over its rows, with a temporary or a call per
// pass (a 256-token prefill of SmolLM2: 39 ms of 0.45 s; a batch-8 decode step: ~150 us a layer of call
// overhead). Here each row is read once and written once.
//
// Vectors: GCC vector extensions of kW floats; the library is compiled with the host's ISA flags
// (cupaged._runtime.cpu._host_isa_flags), so kW floats are one AVX-512 register there, two AVX2 or four SSE
// registers elsewhere. A row's tail (its length % kW) runs through the same vector code on a zero-padded copy,
// so every element gets the same operations, in the same order, wherever it falls.
//
// Numerics (float32, -ffp-contract=off: every operation rounds once, as written):
//   rms_norm: out = (x * (1 / sqrtf(ss / dim + eps))) * w, ss the row's sum of squares over kW lanes (element i
//             in lane i % kW, in order), the lanes added pairwise; a row's result never depends on other rows.
//   silu_mul: out = (g / (1 + exp(-g))) * u; exp by Cody-Waite reduction to [-ln2/2, ln2/2] and the degree-5
//             minimax polynomial of Cephes' expf (within ~2 ulp), its argument clamped to [-87.3, 88.7].
//   rope:     p = min(positions[r * stride], max_pos - 1); x1' = x1 * c - x2 * s, x2' = x2 * c + x1 * s with
//             c = cos[p][i], s = sin[p][i] for the pair (i, i + half): the NumPy path's operations.
//
// Layout: unit stride within a row; rows ld floats apart. rms_norm's x and out are [rows, heads, dim] (heads 1
// for [rows, dim]) and rope's x [rows, heads, dim], their rows ld and their heads hd floats apart (any strided
// view whose rows do not overlap, checked in cupaged/ops/layers.py: the q and k columns of a fused QKV buffer);
// silu_mul's gate_up and out rows ld apart; weight [dim], cos, sin [max_pos, dim / 2] contiguous.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kW = 16;
typedef float V __attribute__((vector_size(4 * kW)));
typedef int32_t Vi __attribute__((vector_size(4 * kW)));

inline V load(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }
inline V splat(float f) { return V{} + f; }

// n floats from p, zero-padded to a vector.
inline V load_tail(const float* p, int n) {
    float b[kW] = {};
    std::memcpy(b, p, sizeof(float) * n);
    return load(b);
}
inline void store_tail(float* p, V v, int n) {
    float b[kW];
    store(b, v);
    std::memcpy(p, b, sizeof(float) * n);
}

inline V exp_v(V x) {
    x = x < splat(-87.33654f) ? splat(-87.33654f) : x;
    x = x > splat(88.72283f) ? splat(88.72283f) : x;
    const V magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds |t| < 2^22 to an integer
    const V n = (x * splat(1.44269504f) + magic) - magic;
    const V r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
    V p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    const V e = (p * (r * r) + r) + splat(1.f);
    const Vi bits = (__builtin_convertvector(n, Vi) + 127) << 23;
    V scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return e * scale;
}

struct RowWork {  // cupaged/_runtime/host_layers.py RowArgs: the same fields, in this order
    const float* a;  // rms_norm: x; silu_mul: gate_up; rope: x (in place)
    const float* b;  // rms_norm: weight; rope: cos
    const float* c;  // rope: sin
    const uint32_t* pos;  // rope: positions
    float* out;  // rms_norm, silu_mul: out
    int64_t lda, ldo;  // a's and out's row pitch (floats)
    int64_t hda, hdo;  // rms_norm, rope: a's and out's head pitch (floats)
    int32_t rows, cols;  // rms_norm: dim; silu_mul: F (gate_up [rows, 2F]); rope: dim
    int32_t heads, stride;  // rms_norm, rope: heads a row; rope: positions' stride
    int32_t max_pos;  // rope: the tables' rows
    float eps;  // rms_norm
};

// One row of rms_norm: o = x / sqrt(mean(x^2) + eps) * w.b over w.cols floats.
inline void rms_norm_row(const float* x, float* o, const RowWork& w) {
    const int dim = w.cols, full = dim - dim % kW;
    V acc{};
    for (int i = 0; i < full; i += kW) {
        const V v = load(x + i);
        acc += v * v;
    }
    if (full < dim) {
        const V v = load_tail(x + full, dim - full);
        acc += v * v;
    }
    float lanes[kW];
    store(lanes, acc);
    for (int s = kW / 2; s >= 1; s /= 2)
        for (int l = 0; l < s; l++) lanes[l] += lanes[l + s];
    const V inv = splat(1.f / sqrtf(lanes[0] / (float)dim + w.eps));
    for (int i = 0; i < full; i += kW) store(o + i, (load(x + i) * inv) * load(w.b + i));
    if (full < dim) {
        const int n = dim - full;
        store_tail(o + full, (load_tail(x + full, n) * inv) * load_tail(w.b + full, n), n);
    }
}

void rms_norm_rows(const RowWork& w) {
    for (int r = 0; r < w.rows; r++)
        for (int h = 0; h < w.heads; h++) rms_norm_row(w.a + w.lda * r + w.hda * h, w.out + w.ldo * r + w.hdo * h, w);
}

inline V silu_mul_v(V g, V u) { return (g / (splat(1.f) + exp_v(-g))) * u; }

void silu_mul_rows(const RowWork& w) {
    const int f = w.cols, full = f - f % kW;
    for (int r = 0; r < w.rows; r++) {
        const float* g = w.a + w.lda * r;
        const float* u = g + f;
        float* o = w.out + w.ldo * r;
        for (int i = 0; i < full; i += kW) store(o + i, silu_mul_v(load(g + i), load(u + i)));
        if (full < f) {
            const int n = f - full;
            store_tail(o + full, silu_mul_v(load_tail(g + full, n), load_tail(u + full, n)), n);
        }
    }
}

inline void rotate(float* x1, float* x2, const float* c, const float* s, int n) {
    const bool tail = n < kW;
    const V a = tail ? load_tail(x1, n) : load(x1), b = tail ? load_tail(x2, n) : load(x2);
    const V cv = tail ? load_tail(c, n) : load(c), sv = tail ? load_tail(s, n) : load(s);
    const V y1 = a * cv - b * sv, y2 = b * cv + a * sv;
    if (tail) {
        store_tail(x1, y1, n);
        store_tail(x2, y2, n);
    } else {
        store(x1, y1);
        store(x2, y2);
    }
}

void rope_rows(const RowWork& w) {
    const int half = w.cols / 2;
    float* base = const_cast<float*>(w.a);
    for (int r = 0; r < w.rows; r++) {
        uint32_t p = w.pos[(int64_t)r * w.stride];
        if (p > (uint32_t)(w.max_pos - 1)) p = (uint32_t)(w.max_pos - 1);
        const float* c = w.b + (int64_t)p * half;
        const float* s = w.c + (int64_t)p * half;
        for (int h = 0; h < w.heads; h++) {
            float* x = base + w.lda * r + w.hda * h;
            for (int i = 0; i < half; i += kW) rotate(x + i, x + half + i, c + i, s + i, half - i);
        }
    }
}

}  // namespace

#define CUPAGED_HOST_API extern "C" __attribute__((visibility("default"))) void

CUPAGED_HOST_API cupaged_host_rms_norm(const RowWork* w) { rms_norm_rows(*w); }
CUPAGED_HOST_API cupaged_host_silu_mul(const RowWork* w) { silu_mul_rows(*w); }
CUPAGED_HOST_API cupaged_host_rope(const RowWork* w) { rope_rows(*w); }
