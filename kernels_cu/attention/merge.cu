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
// Every split's loads are in flight at once, and the splits meet in
// registers: a warp's lanes are kGroups (8) split groups of kQuad (4) lanes,
// lane (s, c) taking splits s, s + 8, ..., s + 56 (every split up to
// CP_MAX_SPLITS in one batch) of chunk c of the row. The row's Dv values
// are C chunks of 4 floats (16-byte loads when Dv is a multiple of 4 and
// the partials are 16-byte aligned; else C = Dv single floats); warp w takes
// chunks 4 w .. 4 w + 3, then those kPass (32) further, ... For each, a
// lane loads its eight splits' LSEs and chunks together, before using any
// (unpredicated: a split past the last reads the last split's row, and
// counts with weight 0 and values 0), sums them as an online softmax
// (softmax_state.cuh), and the groups' states and sums then merge across
// the warp by xor butterflies (butterfly.cuh merge_rows: no shared memory,
// no barrier), group 0's lanes writing. At Dv = 128: one chunk a lane, the
// whole merge one L2 round trip deep.
// (Its few arguments stay positional: as fields of AttentionParams, loaded
// where used, they cost ptxas 8 more registers on sm_90.)
#include "../common.cuh"
#include "../plan_words.cuh"
#include "../ptx.cuh"
#include "../softmax_state.cuh"
#include "../butterfly.cuh"
#include "span.cuh"
#include "variant.cuh"
#include "epilogue.cuh"
#include "geometry.cuh"

namespace merge {
constexpr u32 kThreads = geom::merge::kThreads;
constexpr u32 kMinBlocks = geom::merge::kMinBlocks;  // the __launch_bounds__ minimum
static_assert(geom::merge::kHeadsPerBlock == 1, "one (query, head) per block: head blockIdx.y");
constexpr u32 kGroups = 8;  // split groups of a warp
constexpr u32 kQuad = 32 / kGroups;  // chunks a warp takes at once: lane = group * kQuad + chunk
constexpr u32 kBatch = CP_MAX_SPLITS / kGroups;  // splits a lane loads: all of them in one round
constexpr u32 kPass = kThreads / 32 * kQuad;  // chunks the block takes at once
static_assert(kBatch * kGroups == CP_MAX_SPLITS && kThreads % 32 == 0, "every split in one batch of whole warps");

// Row rowi of the partials merged into out (and lse): chunk c of W floats a
// lane, the lanes of one chunk merging across the warp.
template <u32 W>
__device__ __forceinline__ void merge_row(const float* __restrict__ part_out, const float* __restrict__ part_lse,
                                          scalar_t* __restrict__ out, float* __restrict__ lse, u32 stride, u32 rowi,
                                          u32 value_dim, u32 nsplit, u32 write_lse, float sink) {
    const u32 lane = threadIdx.x & 31u, sgroup = lane / kQuad;
    const u32 C = (value_dim + W - 1) / W;  // chunks of the row
    const u32 zlast = nsplit > 0 ? nsplit - 1u : 0u;
    // Split b of this lane's: whether it is one of the nsplit, and its row (the last split's past them).
    auto in = [&](u32 b) { return sgroup + b * kGroups < nsplit; };
    auto row_of = [&](u32 b) { return att::min_u32(sgroup + b * kGroups, zlast) * stride + rowi; };
    for (u32 c0 = (threadIdx.x >> 5) * kQuad; c0 < C; c0 += kPass) {  // uniform over the warp
        const u32 c = c0 + lane % kQuad, cr = c < C ? c : C - 1u;  // a chunk past the row reads the last
        // This lane's splits' LSEs and chunks, loaded together. The
        // LSEs are the same in every pass, but (c0 >> 31), always 0, keeps their loads and uses in the loop,
        // beside the chunks' loads; hoisted ahead of them, the chunks would wait for the LSEs' round trip.
        float l2[kBatch], v[kBatch][W];
#pragma unroll
        for (u32 b = 0; b < kBatch; ++b) {
            const u32 row = row_of(b);
            if constexpr (W == 4) {
                const float4 f = ldv(reinterpret_cast<const float4*>(part_out + row * value_dim) + cr);
                v[b][0] = f.x;
                v[b][1] = f.y;
                v[b][2] = f.z;
                v[b][3] = f.w;
            } else {
                v[b][0] = part_out[row * value_dim + cr];
            }
        }
#pragma unroll
        for (u32 b = 0; b < kBatch; ++b) l2[b] = part_lse[row_of(b) + (c0 >> 31)];
        // The splits' weights exp2(lse - m), log2 domain: 0 past the last (its values 0 too: exactly
        // nothing) and for an empty split, NaN for a NaN one.
        float mb = neg_inf();
#pragma unroll
        for (u32 b = 0; b < kBatch; ++b) {
            l2[b] = in(b) ? l2[b] * softmax::kLog2e : neg_inf();
            mb = fmaxf(mb, l2[b]);
        }
        softmax::State st[1];
        st[0].clear();
        const float alpha = st[0].raise(mb);
        float acc[1][W], psum = 0.0f;
#pragma unroll
        for (u32 i = 0; i < W; ++i) acc[0][i] = 0.0f;
#pragma unroll
        for (u32 b = 0; b < kBatch; ++b) {
            const float w = softmax::rescale(l2[b], st[0].m);
            psum += w;
#pragma unroll
            for (u32 i = 0; i < W; ++i) acc[0][i] = fmaf(w, in(b) ? v[b][i] : 0.0f, acc[0][i]);
        }
        st[0].add(alpha, psum);
        bfly::merge_rows<kQuad>(st, acc);  // the groups' states and sums, in every lane
        if (sgroup == 0 && c < C) {
            const float inv = epi::normalize(st[0], sink);  // the head's sink, once (CP_SINKS)
#pragma unroll
            for (u32 i = 0; i < W; ++i)
                if (c * W + i < value_dim)
                    out[(u64)rowi * value_dim + c * W + i] = from_float<scalar_t>(acc[0][i] * inv);
            if (c == 0 && write_lse) lse[rowi] = st[0].lse();
        }
    }
}
}  // namespace merge

// kMinBlocks (4, merge.py MIN_BLOCKS) resident blocks of 256 threads by design: at most 64 registers (48 - 56
// on sm_80 / sm_86 / sm_89 / sm_90, no spill), and more of its loads in flight per SM.
extern "C" __global__ void __launch_bounds__(merge::kThreads, merge::kMinBlocks)
    attention_split_merge(const float* __restrict__ part_out, const float* __restrict__ part_lse,
                          scalar_t* __restrict__ out, float* __restrict__ lse, u32 queries, u32 q_heads, u32 value_dim,
                          u32 splits, u32 write_lse, const float* __restrict__ sinks) {
    // A dependent launch (launch.py): the split kernels before it may still run; wait for their
    // grid's completion before touching memory.
    ptx::grid_dependency_wait();
    const u32 qi = blockIdx.x, h = blockIdx.y;
    if (qi >= queries || h >= q_heads) return;  // the whole block: before any barrier
    const u32 nsplit = att::min_u32(splits, CP_MAX_SPLITS);
    // Offsets in 32 bits: the workspace holds fewer than 2^32 elements (SplitWorkspace checks its size).
    const u32 stride = queries * q_heads;  // between splits, in (query, head) rows
    const u32 rowi = qi * q_heads + h;
    // sinks [q_heads] (natural units), read with CP_SINKS only; the log2-domain sink of head h
    const float sink = variant::kSinks ? sinks[h] * softmax::kLog2e : neg_inf();
    if (value_dim % 4 == 0 && (reinterpret_cast<u64>(part_out) & 15u) == 0)
        merge::merge_row<4>(part_out, part_lse, out, lse, stride, rowi, value_dim, nsplit, write_lse, sink);
    else
        merge::merge_row<1>(part_out, part_lse, out, lse, stride, rowi, value_dim, nsplit, write_lse, sink);
}
