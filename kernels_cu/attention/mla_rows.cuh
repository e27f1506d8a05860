// mla_rows.cuh: what the two warpgroup MLA kernels (paged_mla_wgmma in
// mla_wgmma.cu, paged_mla_seesaw in mla_seesaw.cu) share about their rows: a
// block's place in its launch (its heads and queries) and the end, where each
// warpgroup writes its half of the value columns of every row (the row writer
// inline, not epilogue.cuh's: through epi::finish / row_of / store_lse ptxas
// spills the all-features builds at the register cap).
#pragma once
#include "../common.cuh"
#include "../softmax_state.cuh"
#include "params.cuh"
#include "variant.cuh"
#include "span.cuh"
#include "tc_common.cuh"
#include "epilogue.cuh"

namespace mrows {
// Block bx's rows: ht = min(H, 64) heads head0 .. head0 + heads - 1 of each of qt = 64 / ht queries q0 .. of
// the launch's range (below q_end); the head tile is the fastest block index (blocks x, x + 1 share a query
// block), the last queries first.
struct Place {
    u32 ht, qt, head0, heads, q_end;
    u64 q0;
    __device__ __forceinline__ Place(const AttentionParams& p, u32 bx) {
        const u32 q_heads = p.q_heads;
        ht = q_heads < tc::kRows ? q_heads : tc::kRows;
        qt = tc::kRows / ht;
        const u32 tiles = (q_heads + ht - 1) / ht, qblk = bx / tiles;
        head0 = (bx - qblk * tiles) * ht;
        heads = tc::min_u32(ht, q_heads - head0);
        q_end = att::range_end(p.queries, p.q_begin, p.q_count);
        q0 = (u64)p.q_begin + (u64)(gridDim.x / tiles - 1 - qblk) * qt;
    }
    // Block row r (0 .. 63): its query slot and head within the tile; whether it has a query and head.
    __device__ __forceinline__ bool row_ok(u32 r, u32& slot, u32& hl) const {
        slot = r / ht;
        hl = r - slot * ht;
        return slot < qt && q0 + slot < q_end && hl < heads;
    }
};

// This thread's two rows (16 warp4 + g + 8 h, query slots slot[h], kNone: none), whose states sm hold the
// whole row sums, and its warpgroup's value columns col0 + 8 j + 2 tq (+ 1) of o [64 x 256] (o[4 j + 2 h]):
// out and (lse_lane: the thread that writes it) lse, or the split partials; the sink folded once (not into
// split partials); o scaled by vscale / l (vscale: the latent's fp8 scale, 1 for 16-bit caches).
template <typename OutT, u32 kR>
__device__ __forceinline__ void write_rows(const AttentionParams& p, const variant::Scorer& sc, const Place& pl,
                                           OutT* __restrict__ out, float* __restrict__ part_out,
                                           float* __restrict__ lse, float* __restrict__ part_lse,
                                           softmax::State (&sm)[2], const u32 (&slot)[2], const float (&o)[128],
                                           u32 col0, float vscale, bool lse_lane) {
    const u32 lane = threadIdx.x & 31u, warp4 = (threadIdx.x >> 5) & 3u, g = lane >> 2, tq = lane & 3u;
    const bool split = p.splits > 1;
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        const u32 r = 16 * warp4 + g + 8 * h, s = slot[h];
        if (s == tc::kNone) continue;
        const u32 head = pl.head0 + (r - s * pl.ht);
        const u64 row = (pl.q0 + s) * p.q_heads + head;
        const u64 row_out = split ? (u64)blockIdx.z * p.queries * p.q_heads + row : row;
        float inv = sm[h].inv_sum();
        if constexpr (variant::kSinks) {
            if (!split) {  // the head's sink, once (split partials leave it to the merge)
                const float a = variant::fold_sink(sm[h], sc.sink2(head));
                inv = sm[h].inv_sum() * a;
            }
        }
        inv *= vscale;
#pragma unroll
        for (u32 j = 0; j < 32; ++j)
            epi::store_pair(out, part_out, row_out * kR + col0 + 8 * j + 2 * tq, split, o[4 * j + 2 * h] * inv,
                            o[4 * j + 2 * h + 1] * inv);
        if (lse_lane && tq == 0) {
            const float lse_v = sm[h].lse();
            if (split)
                part_lse[row_out] = lse_v;
            else if (p.write_lse)
                lse[row] = lse_v;
        }
    }
}
}  // namespace mrows
