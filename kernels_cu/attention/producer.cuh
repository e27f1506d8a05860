// producer.cuh: what the producer warpgroups of the warp-specialized kernels
// (paged_prefill_wgmma in prefill_wgmma.cu, paged_mla_seesaw in mla_seesaw.cu)
// share: the walk of a tile's token through the page table, a thread's token
// kN at a time, and the span of a pass's stored rows that says which tiles the
// value check must read (tc_common.cuh's passes and rows).
#pragma once
#include "../common.cuh"
#include "tc_common.cuh"

namespace prod {
// Token tok of the next tile of a pass over positions [.., hi) of one sequence (its page-table row
// table): its page position (att::PagePos), advanced by kN tokens a tile with no division (the one
// division is the pass's, at the start).
template <u32 kN>
struct TokenWalk {
    const u32* __restrict__ table;
    u32 hi, tok;
    att::PageStep step;
    att::PagePos pos;
    __device__ __forceinline__ TokenWalk(const u32* __restrict__ t, u32 first, u32 end, u32 ps)
        : table(t), hi(end), tok(first), step(kN, ps) {
        pos.at(first, ps);
    }
    // The current token's page-table word (tc::kNone past the pass's end) and slot; then the next tile's token.
    __device__ __forceinline__ void next(u32& raw, u32& slot) {
        raw = tok < hi ? table[pos.pj] : tc::kNone;
        slot = pos.psl;
        tok += kN;
        pos.advance(step);
    }
};

// The stored rows' positions in a pass (slots [slot_lo, slot_hi) of the block's qt, queries q0 .. below
// q_end): a tile where one of them may miss a valid token (the latest first position elo, the earliest end
// ehi; rows of other passes or none: others) is the one whose value rows the producer checks.
struct PassSpan {
    u32 elo, ehi;
    bool others;
    // Whether a stored row may miss a valid token of the tile of positions [t0, te).
    __device__ __forceinline__ bool miss(u32 t0, u32 te) const { return others || elo > t0 || ehi < te; }
};
template <u32 kR>
__device__ __forceinline__ PassSpan pass_span(const tc::RowSet<kR>& rows, u32 qt, u64 q0, u32 q_end, u32 slot_lo,
                                              u32 slot_hi) {
    PassSpan sp{0u, tc::kNone, false};
    for (u32 s = 0; s < qt && q0 + s < q_end; ++s) {
        if (s >= slot_lo && s < slot_hi && rows.lo[s] < rows.hi[s]) {
            sp.elo = rows.lo[s] > sp.elo ? rows.lo[s] : sp.elo;
            sp.ehi = rows.hi[s] < sp.ehi ? rows.hi[s] : sp.ehi;
        } else {
            sp.others = true;
        }
    }
    return sp;
}
}  // namespace prod
