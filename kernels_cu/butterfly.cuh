// butterfly.cuh: what a warp reduces across its lanes by xor butterflies
// (each level o: a lane combines its values with lane l ^ o's):
//   bfly::sum<kLanes, N>(v)  sums of N values over each group of kLanes
//                            lanes (a power of two; groups aligned: lanes
//                            with the same l / kLanes): for o = kLanes/2 ..
//                            1, for each i: v[i] += __shfl_xor_sync(full, v[i], o);
//   bfly::merge_rows<kFrom>(st, acc)  online-softmax states and their
//                            accumulators (softmax_state.cuh) merged across
//                            the groups of kFrom lanes: for o = kFrom, 2 kFrom,
//                            .. 16, for each head: the other lane's state
//                            merged in, acc = acc * a + other * b.
// Every lane computes each level from the values of the level before, as the
// shuffles give them, and both lanes of a pair get the same bits (float
// addition and fmaxf are commutative).
//
// On the GPU these are the shuffle loops above. On the CPU backend each is one
// warp collective (cupaged_shim.h: every lane posts its values, the last lane
// to arrive runs every level for the warp with the same expressions) instead
// of one collective per shuffle: the bits of the shuffle loop compiled for the
// CPU, a thread switch per lane instead of one per shuffle. Every lane of the
// warp calls them (the full mask).
#pragma once
#include "softmax_state.cuh"

namespace bfly {
#ifdef CUPAGED_CPU
namespace cpu {
// Each level pairs lane l with lane l | o (l & o == 0) and updates both from
// their values before the level, in place in the lanes' posted registers.
template <u32 kLanes, u32 N>
void sum_warp(void** lanes, unsigned, void*) {
    for (u32 o = kLanes / 2; o > 0; o >>= 1)
        for (u32 l = 0; l < 32; ++l) {
            if (l & o) continue;
            float* x = static_cast<float*>(lanes[l]);
            float* y = static_cast<float*>(lanes[l | o]);
            for (u32 i = 0; i < N; ++i) {
                const float xi = x[i], yi = y[i];
                x[i] = xi + yi;
                y[i] = yi + xi;
            }
        }
}

template <u32 kHeads, u32 kElems>
struct RowsLane {  // what one lane posts to merge_rows_warp
    softmax::State* st;
    float (*acc)[kElems];
};

template <u32 kFrom, u32 kHeads, u32 kElems>
void merge_rows_warp(void** lanes, unsigned, void*) {
    for (u32 o = kFrom; o < 32; o <<= 1)
        for (u32 l = 0; l < 32; ++l) {
            if (l & o) continue;
            const auto* x = static_cast<const RowsLane<kHeads, kElems>*>(lanes[l]);
            const auto* y = static_cast<const RowsLane<kHeads, kElems>*>(lanes[l | o]);
            for (u32 g = 0; g < kHeads; ++g) {
                const softmax::State sx = x->st[g], sy = y->st[g];
                float ax, bx, ay, by;
                x->st[g].merge(softmax::make_state(sy.m, sy.l), ax, bx);
                y->st[g].merge(softmax::make_state(sx.m, sx.l), ay, by);
                for (u32 i = 0; i < kElems; ++i) {
                    const float vx = x->acc[g][i], vy = y->acc[g][i];
                    x->acc[g][i] = vx * ax + vy * bx;
                    y->acc[g][i] = vy * ay + vx * by;
                }
            }
        }
}
}  // namespace cpu
#endif

template <u32 kLanes, u32 N>
__device__ __forceinline__ void sum(float* v) {
    static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "lanes: a power of two up to 32");
#ifdef CUPAGED_CPU
    if constexpr (kLanes > 1) cupaged_warp_collective(CP_FULL_MASK, v, &cpu::sum_warp<kLanes, N>, nullptr);
#else
#pragma unroll
    for (u32 o = kLanes / 2; o > 0; o >>= 1)
#pragma unroll
        for (u32 i = 0; i < N; ++i) v[i] += __shfl_xor_sync(CP_FULL_MASK, v[i], o);
#endif
}

template <u32 kFrom, u32 kHeads, u32 kElems>
__device__ __forceinline__ void merge_rows(softmax::State (&st)[kHeads], float (&acc)[kHeads][kElems]) {
    static_assert(kFrom >= 1 && kFrom <= 32 && (kFrom & (kFrom - 1)) == 0, "lanes: a power of two up to 32");
#ifdef CUPAGED_CPU
    if constexpr (kFrom < 32) {
        cpu::RowsLane<kHeads, kElems> me{st, acc};
        cupaged_warp_collective(CP_FULL_MASK, &me, &cpu::merge_rows_warp<kFrom, kHeads, kElems>, nullptr);
    }
#else
#pragma unroll
    for (u32 o = kFrom; o < 32; o <<= 1) {
#pragma unroll
        for (u32 g = 0; g < kHeads; ++g) {
            const float mo = __shfl_xor_sync(CP_FULL_MASK, st[g].m, o);
            const float lo = __shfl_xor_sync(CP_FULL_MASK, st[g].l, o);
            float a, b;
            st[g].merge(softmax::make_state(mo, lo), a, b);
#pragma unroll
            for (u32 i = 0; i < kElems; ++i) {
                const float other = __shfl_xor_sync(CP_FULL_MASK, acc[g][i], o);
                acc[g][i] = acc[g][i] * a + other * b;
            }
        }
    }
#endif
}
}  // namespace bfly
