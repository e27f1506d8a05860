// mla_rows.cuh: what the two warpgroup MLA kernels (paged_mla_wgmma in
// mla_wgmma.cu, paged_mla_seesaw in mla_seesaw.cu) share about their rows: a
// block's place in its launch (its heads and queries), the staging of its Q
// rows in shared memory (128-byte-swizzled column blocks of 64 rows, as
// wgmma reads them), and the end, where each warpgroup writes its half of the
// value columns of every row (the row writer inline, not epilogue.cuh's:
// through epi::finish / row_of / store_lse ptxas spills the all-features
// builds at the register cap).
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

// Byte offset of 16-byte chunk c (0 .. 7) of row r in a 128-byte-swizzled column block.
__device__ __forceinline__ u32 swz(u32 r, u32 c) { return r * 128 + ((c ^ (r & 7u)) << 4); }

// Every thread of the block (tid of nthreads) copies its share of the block's 64 Q rows into sq: 16-byte chunk
// ch of row r (ch < kChunks; chunk 8 b + c at column block b, byte sq + b * 64 * 128 + swz(r, c)), the latent
// part (q's row, kR) first, then (kChunks > kR / 8) the rotary part (q_rot's row, kP), each row where its view's
// strides put it (att::q_at, att::q_rot_at); rows with no query or head zero-filled from q (never read). One
// cp.async group, committed.
template <typename T, u32 kChunks, u32 kR, u32 kP>
__device__ __forceinline__ void stage_q(unsigned char* sq, const T* __restrict__ q, const T* __restrict__ q_rot,
                                        const Place& pl, const AttentionParams& p, u32 tid, u32 nthreads) {
    static_assert(kChunks == kR / 8 || kChunks == (kR + kP) / 8, "the latent part, or the latent and rotary parts");
    for (u32 c = tid; c < tc::kRows * kChunks; c += nthreads) {
        const u32 r = c / kChunks, ch = c - r * kChunks;  // chunk ch of row r
        u32 slot, hl;
        const bool ok = pl.row_ok(r, slot, hl);
        const u64 qi = pl.q0 + slot;
        const u32 h = pl.head0 + hl;
        const T* src =
            ch < kR / 8 ? q + att::q_at(p, qi, h) + ch * 8 : q_rot + att::q_rot_at(p, qi, h) + (ch - kR / 8) * 8;
        ptx::cp_async_16(sq + (ch >> 3) * (tc::kRows * 128) + swz(r, ch & 7u), ok ? src : q, ok);
    }
    ptx::cp_async_commit();
}

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
