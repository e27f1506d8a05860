// merge.cu: attention_split_merge, combining the split partials every
// attention kernel writes. A module of its own, one build per q / out dtype
// (CP_DTYPE) and sink choice (CP_SINKS): cupaged/ops/attention/kernels/merge.py
// MERGE and merge_defines, launched by launch.py after a step's split
// launches, whichever kernels wrote the partials. Its block (kThreads,
// kMinBlocks) and heads per block are defined once in merge.py (GEOMETRY)
// and read here through geometry.cuh (geom::merge).
//
// One block of kThreads (256) threads per (query, head): grid (queries, Hq).
// Launched dependent (Stream.launch; a programmatic dependent launch with
// CUPAGED_PDL=1 on sm_90 and later): before any global access it waits for
// the grid before it (ptx::grid_dependency_wait), the split kernel that
// wrote the partials and let it start early (ptx::launch_dependents).
// part_out [splits, queries, Hq, Dv] f32, part_lse [splits, queries, Hq] f32
//   -> out [queries, Hq, Dv] scalar_t, lse [queries, Hq] f32 (when write_lse).
// lse = log(sum_z exp(lse_z)), out = sum_z exp(lse_z - lse) * out_z; a split
// with lse -inf adds nothing; all empty gives out 0, lse -inf; a NaN partial
// gives NaN. With CP_SINKS the partials leave the head's sink out and the
// merge folds it in once (epi::normalize, epilogue.cuh): lse = log(exp(sink) +
// sum_z exp(lse_z)), out scaled to match; all empty then gives out 0, lse =
// the sink.
//
// Every split's loads are in flight at once: the row's Dv values are C
// chunks of 4 floats (16-byte loads when Dv is a multiple of 4 and the
// partials are 16-byte aligned; else C = Dv single floats); the block's
// threads form G = kThreads / C groups of C threads (G = 1 when C >= kThreads), group
// g takes splits g, g + G, ..., eight at a time: eight partial chunks and
// their LSEs are loaded before any is used, and summed as an online softmax
// (softmax_state.cuh; the loads unpredicated, a split past the last reading
// the batch's first split's row and dropped, so all of them issue before the
// first use). The groups' states then meet in shared memory. At Dv =
// 128 and 64 splits: 8 groups of 32 threads, 8 splits each, one round of
// eight loads per thread (the whole merge one L2 round trip deep).
// (Its few arguments stay positional: as fields of AttentionParams, loaded
// where used, they cost ptxas 8 more registers on sm_90.)
#include "../common.cuh"
#include "../plan_words.cuh"
#include "../ptx.cuh"
#include "../softmax_state.cuh"
#include "span.cuh"
#include "variant.cuh"
#include "epilogue.cuh"
#include "geometry.cuh"

namespace merge {
constexpr u32 kThreads = geom::merge::kThreads;
constexpr u32 kMinBlocks = geom::merge::kMinBlocks;  // the __launch_bounds__ minimum
static_assert(geom::merge::kHeadsPerBlock == 1, "one (query, head) per block: head blockIdx.y");
constexpr u32 kBatch = 8;  // splits a thread loads before using any

// Group g's online-softmax state and sum over its splits of chunk c (W floats).
template <u32 W>
__device__ __forceinline__ void sum_splits(const float* __restrict__ part_out, const float* __restrict__ part_lse,
                                           u64 stride, u64 rowi, u32 value_dim, u32 nsplit, u32 g, u32 G, u32 c,
                                           softmax::State& st, float (&acc)[W]) {
    st.clear();
#pragma unroll
    for (u32 i = 0; i < W; ++i) acc[i] = 0.0f;
    for (u32 z0 = g; z0 < nsplit; z0 += G * kBatch) {
        // Every load of the batch issues before any is used: unpredicated, a split past nsplit reading
        // split z0's row (in the arrays) and then dropped.
        float l2[kBatch], v[kBatch][W];
#pragma unroll
        for (u32 b = 0; b < kBatch; ++b) {
            const u32 z = z0 + b * G;
            const u64 row = (u64)(z < nsplit ? z : z0) * stride + rowi;
            l2[b] = part_lse[row];
            if constexpr (W == 4) {
                const float4 f = ldv(reinterpret_cast<const float4*>(part_out + row * value_dim) + c);
                v[b][0] = f.x;
                v[b][1] = f.y;
                v[b][2] = f.z;
                v[b][3] = f.w;
            } else {
                v[b][0] = part_out[row * value_dim + c];
            }
        }
#pragma unroll
        for (u32 b = 0; b < kBatch; ++b) {
            const bool in = z0 + b * G < nsplit;
            l2[b] = in ? l2[b] * softmax::kLog2e : neg_inf();
#pragma unroll
            for (u32 i = 0; i < W; ++i) v[b][i] = in ? v[b][i] : 0.0f;
        }
        float mb = neg_inf();
#pragma unroll
        for (u32 b = 0; b < kBatch; ++b) mb = fmaxf(mb, l2[b]);
        const float alpha = st.raise(mb);
        float psum = 0.0f;
#pragma unroll
        for (u32 i = 0; i < W; ++i) acc[i] *= alpha;
#pragma unroll
        for (u32 b = 0; b < kBatch; ++b) {
            const float w = softmax::rescale(l2[b], st.m);  // 0 for an empty split, NaN for a NaN one
            psum += w;
#pragma unroll
            for (u32 i = 0; i < W; ++i) acc[i] = fmaf(w, v[b][i], acc[i]);
        }
        st.add(alpha, psum);
    }
}

template <u32 W>
__device__ __forceinline__ void merge_row(const float* __restrict__ part_out, const float* __restrict__ part_lse,
                                          scalar_t* __restrict__ out, float* __restrict__ lse, u64 stride, u64 rowi,
                                          u32 value_dim, u32 nsplit, u32 write_lse, float* s_m, float* s_l,
                                          float* s_acc, float sink) {
    const u32 tid = threadIdx.x;
    const u32 C = (value_dim + W - 1) / W;  // chunks of the row
    const u32 G = C >= kThreads ? 1u : kThreads / C;
    const u32 g = G == 1 ? 0u : tid / C;
    const u32 c0 = G == 1 ? tid : tid - g * C;
    softmax::State st;
    float acc[W];
    if (G == 1) {  // every thread: chunks tid, tid + kThreads, ... over all splits
        for (u32 c = c0; c < C; c += kThreads) {
            sum_splits<W>(part_out, part_lse, stride, rowi, value_dim, nsplit, 0u, 1u, c, st, acc);
            const float inv = epi::normalize(st, sink);  // the head's sink, once (CP_SINKS)
#pragma unroll
            for (u32 i = 0; i < W; ++i)
                if (c * W + i < value_dim) out[rowi * value_dim + c * W + i] = from_float<scalar_t>(acc[i] * inv);
            if (c == 0 && write_lse) lse[rowi] = st.lse();
        }
        return;  // G is uniform over the block: no barrier below is skipped by some threads only
    }
    if (g < G) {
        sum_splits<W>(part_out, part_lse, stride, rowi, value_dim, nsplit, g, G, c0, st, acc);
        if (c0 == 0) {
            s_m[g] = st.m;
            s_l[g] = st.l;
        }
#pragma unroll
        for (u32 i = 0; i < W; ++i) s_acc[tid * W + i] = acc[i];
    }
    __syncthreads();
    if (tid < C) {  // group 0's threads: the groups' states as one
        float mx = neg_inf();
        for (u32 k = 0; k < G; ++k) mx = fmaxf(mx, s_m[k]);
        float total = 0.0f, o[W];
#pragma unroll
        for (u32 i = 0; i < W; ++i) o[i] = 0.0f;
        for (u32 k = 0; k < G; ++k) {
            const float w = softmax::rescale(s_m[k], mx);
            total += s_l[k] * w;
#pragma unroll
            for (u32 i = 0; i < W; ++i) o[i] = fmaf(w, s_acc[(k * C + tid) * W + i], o[i]);
        }
        softmax::State all = softmax::make_state(mx, total);
        const float inv = epi::normalize(all, sink);  // the head's sink, once (CP_SINKS)
#pragma unroll
        for (u32 i = 0; i < W; ++i)
            if (tid * W + i < value_dim) out[rowi * value_dim + tid * W + i] = from_float<scalar_t>(o[i] * inv);
        if (tid == 0 && write_lse) lse[rowi] = all.lse();
    }
}
}  // namespace merge

// kMinBlocks (4, merge.py MIN_BLOCKS) resident blocks of 256 threads by design: 64 registers, no spill on
// sm_80 / sm_86 / sm_89 / sm_90 (with the block size alone ptxas gave sm_86 / sm_89 72 registers and a 4-byte
// spill), and more of its loads in flight per SM.
extern "C" __global__ void __launch_bounds__(merge::kThreads, merge::kMinBlocks)
    attention_split_merge(const float* __restrict__ part_out, const float* __restrict__ part_lse,
                          scalar_t* __restrict__ out, float* __restrict__ lse, u32 queries, u32 q_heads, u32 value_dim,
                          u32 splits, u32 write_lse, const float* __restrict__ sinks) {
    __shared__ float s_m[merge::kThreads], s_l[merge::kThreads];  // each group's state
    __shared__ __align__(16) float s_acc[merge::kThreads * 4];  // and its sums
    // A dependent launch (launch.py): the split kernels before it may still run; wait for their
    // grid's completion before touching memory.
    ptx::grid_dependency_wait();
    const u32 qi = blockIdx.x, h = blockIdx.y;
    if (qi >= queries || h >= q_heads) return;  // the whole block: before any barrier
    const u32 nsplit = att::min_u32(splits, CP_MAX_SPLITS);
    const u64 stride = (u64)queries * q_heads;  // between splits, in (query, head) rows
    const u64 rowi = (u64)qi * q_heads + h;
    // sinks [q_heads] (natural units), read with CP_SINKS only; the log2-domain sink of head h
    const float sink = variant::kSinks ? sinks[h] * softmax::kLog2e : neg_inf();
    if (value_dim % 4 == 0 && (reinterpret_cast<u64>(part_out) & 15u) == 0)
        merge::merge_row<4>(part_out, part_lse, out, lse, stride, rowi, value_dim, nsplit, write_lse, s_m, s_l, s_acc,
                            sink);
    else
        merge::merge_row<1>(part_out, part_lse, out, lse, stride, rowi, value_dim, nsplit, write_lse, s_m, s_l, s_acc,
                            sink);
}
