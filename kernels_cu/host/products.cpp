// products.cpp: the CPU backend's few-row products, out [M, N] = x [M, K] @ w [N, K]^T (or out +=), host code
// (not a kernel: the engine's projections on the CPU backend, cupaged/ops/layers.py). Built into the host library
// with layers.cpp (cupaged/_runtime/host.py; host_products.py its Python side), which calls the runtime's worker
// pool (cupaged_rt_parallel) to split N over its threads.
//
// Why not BLAS: at a decode step's few rows a product is a stream of the weight (M x K x N x 4 bytes of weight
// for 2 M FLOP per element); BLAS packs the weight into its panel layout first (a second pass over it) and runs
// its small-matrix kernel on one thread. This reads each weight row once, straight from the weight, into
// MB x J accumulators (MB rows of x against J rows of w at once, one vector of K each: 16 floats with AVX-512,
// 8 with AVX2, 4 otherwise), and reduces each accumulator across its lanes at the end of the row. With MB >= 4
// a group's compute hides less of the weight's latency, so it prefetches the rows kPrefetchRows ahead. Rows of
// M above kMaxBlock run in blocks of kMaxBlock over the same J rows of w (still in L1).
//
// Numerics: each out element is one row of x against one row of w, summed as V lanes of K / V fused
// multiply-adds each (k in order within a lane), then the lanes pairwise; the K % V tail in order after. The
// same element gets the same bits whatever M, the block it falls in, N or the split over threads (a row's tokens
// never depend on its batch neighbours). accumulate adds that sum to out (out + s, one rounding).
//
// Layout: x rows of K contiguous floats, ldx apart; w rows of K contiguous floats, ldw apart; out rows of N
// contiguous floats, ldo apart (all in floats). Threads: part p of parts takes the p-th run of columns, a
// multiple of J wide (whole w rows, so no two threads write one element).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

extern "C" int cupaged_rt_parallel(void (*task)(void*, unsigned, unsigned), void* ctx, unsigned parts);

namespace {

struct Product {  // cupaged/_runtime/host_products.py ProductArgs: the same fields, in this order
    const float* x;
    const float* w;
    float* out;
    int64_t ldx, ldw, ldo;
    int32_t m, k, n, accumulate;
};

constexpr int kMaxBlock = 8;
constexpr int kPrefetchRows = 4;

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx2,fma")
namespace avx512 {
constexpr int kW = 16, kAcc = 16;  // 32 vector registers
typedef float V __attribute__((vector_size(4 * kW)));
__attribute__((always_inline)) inline void in_register(V& v) { asm("" : "+v"(v)); }
__attribute__((always_inline)) inline V madd(V a, V b, V c) {
    return (V)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
#include "products_isa.h"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
constexpr int kW = 8, kAcc = 8;  // 16 vector registers
typedef float V __attribute__((vector_size(4 * kW)));
__attribute__((always_inline)) inline void in_register(V& v) { asm("" : "+x"(v)); }
__attribute__((always_inline)) inline V madd(V a, V b, V c) {
    return (V)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#include "products_isa.h"
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace baseline {  // SSE2 on x86-64; any other CPU's 16-byte vectors
constexpr int kW = 4, kAcc = 8;
typedef float V __attribute__((vector_size(4 * kW)));
__attribute__((always_inline)) inline void in_register(V&) {}
__attribute__((always_inline)) inline V madd(V a, V b, V c) { return a * b + c; }  // -ffp-contract=off: two roundings
#include "products_isa.h"
}  // namespace baseline

using Runner = void (*)(const Product&, int, int);

Runner pick() {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")) return avx512::run;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return avx2::run;
#endif
    return baseline::run;
}

const Runner g_run = pick();

// The column quantum of a split: whole groups of J for every shape (8 is a multiple of each J used).
constexpr int kSplitQuantum = 8;

void part(void* ctx, unsigned index, unsigned parts) {
    const Product& p = *static_cast<const Product*>(ctx);
    const int64_t chunks = (p.n + kSplitQuantum - 1) / kSplitQuantum;
    const int n0 = (int)(chunks * index / parts * kSplitQuantum);
    const int n1 = (int)(chunks * (index + 1) / parts * kSplitQuantum);
    g_run(p, n0, n1 < p.n ? n1 : p.n);
}

}  // namespace

// The product p describes on `parts` threads of the CPU worker pool (1: the calling thread alone). 0, or 1 when
// the pool could not start (cupaged_rt_last_error says why).
extern "C" __attribute__((visibility("default"))) int cupaged_host_product(const Product* p, unsigned parts) {
    if (p->m <= 0 || p->n <= 0) return 0;
    if (parts <= 1) {
        g_run(*p, 0, p->n);
        return 0;
    }
    return cupaged_rt_parallel(part, const_cast<Product*>(p), parts);
}
