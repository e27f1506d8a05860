// Kernels for tests/runtime/test_butterfly.py: kernels_cu/butterfly.cuh's
// helpers beside the shuffle loops they stand for (one shuffle a value a level),
// so the test can check that both give the same bits on the CPU backend.
#include "../../../kernels_cu/common.cuh"
#include "../../../kernels_cu/softmax_state.cuh"
#include "../../../kernels_cu/butterfly.cuh"

constexpr u32 kN = 6;  // values per lane
constexpr u32 kHeads = 3, kElems = 4;

// in, out: [threads, kN]. Lane groups of LANES lanes.
template <u32 kLanes, bool kHelper>
__device__ void sums(const float* in, float* out) {
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    float v[kN];
    for (u32 i = 0; i < kN; ++i) v[i] = in[t * kN + i];
    if constexpr (kHelper) {
        bfly::sum<kLanes, kN>(v);
    } else {
        for (u32 o = kLanes / 2; o > 0; o >>= 1)
            for (u32 i = 0; i < kN; ++i) v[i] += __shfl_xor_sync(CP_FULL_MASK, v[i], o);
    }
    for (u32 i = 0; i < kN; ++i) out[t * kN + i] = v[i];
}

#define SUMS(L)                                                                                        \
    extern "C" __global__ void sum_helper_##L(const float* in, float* out) { sums<L, true>(in, out); } \
    extern "C" __global__ void sum_shuffles_##L(const float* in, float* out) { sums<L, false>(in, out); }
SUMS(2)
SUMS(8)
SUMS(32)

// m, l: [threads, kHeads]; acc: [threads, kHeads, kElems]; merged across lane groups of FROM lanes.
template <u32 kFrom, bool kHelper>
__device__ void merges(float* m, float* l, float* acc) {
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    softmax::State st[kHeads];
    float a[kHeads][kElems];
    for (u32 g = 0; g < kHeads; ++g) {
        st[g] = softmax::make_state(m[t * kHeads + g], l[t * kHeads + g]);
        for (u32 i = 0; i < kElems; ++i) a[g][i] = acc[(t * kHeads + g) * kElems + i];
    }
    if constexpr (kHelper) {
        bfly::merge_rows<kFrom>(st, a);
    } else {
        for (u32 o = kFrom; o < 32; o <<= 1)
            for (u32 g = 0; g < kHeads; ++g) {
                const float mo = __shfl_xor_sync(CP_FULL_MASK, st[g].m, o);
                const float lo = __shfl_xor_sync(CP_FULL_MASK, st[g].l, o);
                float x, y;
                st[g].merge(softmax::make_state(mo, lo), x, y);
                for (u32 i = 0; i < kElems; ++i) {
                    const float other = __shfl_xor_sync(CP_FULL_MASK, a[g][i], o);
                    a[g][i] = a[g][i] * x + other * y;
                }
            }
    }
    for (u32 g = 0; g < kHeads; ++g) {
        m[t * kHeads + g] = st[g].m;
        l[t * kHeads + g] = st[g].l;
        for (u32 i = 0; i < kElems; ++i) acc[(t * kHeads + g) * kElems + i] = a[g][i];
    }
}

#define MERGES(F)                                                                                               \
    extern "C" __global__ void merge_helper_##F(float* m, float* l, float* acc) { merges<F, true>(m, l, acc); } \
    extern "C" __global__ void merge_shuffles_##F(float* m, float* l, float* acc) { merges<F, false>(m, l, acc); }
MERGES(1)
MERGES(4)
MERGES(16)
