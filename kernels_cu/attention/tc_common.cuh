// tc_common.cuh: what the two tensor-core attention kernels share
// (paged_prefill_tc in prefill_tc.cu, paged_mla_tc in mla_tc.cu): the rows
// of a block, the double-buffered page-by-page K/V tile pipeline, the passes
// over the sequences a block touches, token masks and the output store. The
// inline PTX they use lives in ptx.cuh.
#pragma once
#include "../common.cuh"
#include "../plan_words.cuh"
#include "../ptx.cuh"
#include "params.cuh"
#include "span.cuh"
#include "variant.cuh"

namespace tc {
using att::min_u32;

constexpr u32 kRows = 64;             // (query, head) rows per block: the M dimension
constexpr u32 kNone = CP_NO_PAGE;     // no sequence / no page

// The absolute position of each slot's query, kept only for a score variant
// that reads it (an empty base otherwise: no shared memory, no loads).
template <bool kKeep>
struct RowPositions {
    u32 pos[kRows];
    __device__ __forceinline__ u32 position(u32 i) const { return pos[i]; }
    __device__ __forceinline__ void set_position(u32 i, u32 v) { pos[i] = v; }
};
template <>
struct RowPositions<false> {
    __device__ __forceinline__ u32 position(u32) const { return 0u; }
    __device__ __forceinline__ void set_position(u32, u32) {}
};

// The rows of a block: kRows / ht query slots of ht heads each; slot i is
// query q0 + i. Filled once per block from the device words.
struct Rows : RowPositions<!variant::kPlainScore> {
    u32 seq[kRows];   // sequence of the slot's query, kNone when none (past the queries, bad index)
    u32 lo[kRows];    // this split's share [lo, hi) of the query's visible positions
    u32 hi[kRows];
};

// Visible positions of query slot i (threads i < kRows): att::query_span,
// the same rules as paged_attention. Slots at or past q_end (the launch's
// range, <= queries) hold no query.
__device__ __forceinline__ void setup_rows(Rows& R, const AttentionParams& p, u64 q0, u32 qt, u32 q_end) {
    const u32* __restrict__ const words = p.words;
    for (u32 i = threadIdx.x; i < kRows; i += blockDim.x) {
        u32 seq = kNone, lo = 0, hi = 0;
        if (i < qt && q0 + i < q_end) {
            const u32 qi = (u32)(q0 + i);
            const u32 s = words[pw::q_seq(p.queries) + qi];
            if (s < p.sequences) {
                seq = s;
                const att::Span sp = att::query_span(p, qi, s, blockIdx.z);
                lo = sp.lo;
                hi = sp.hi;
                if constexpr (!variant::kPlainScore) R.set_position(i, words[pw::q_pos(p.queries) + qi]);
            }
        }
        R.seq[i] = seq;
        R.lo[i] = lo;
        R.hi[i] = hi;
    }
}

// Page staging of a K/V tile: the page id and slot of each of its kN tokens
// (kNone past `hi` or for a page id >= num_pages) and a bit per valid token.
template <u32 kN>
struct Stage {
    u32 page[2][kN];
    u32 slot[2][kN];
    u32 valid[2][kN / 32];
};

// The tiles of one pass: positions [lo, hi) of one sequence in tiles of kN,
// two buffers, the next tile's cp.async in flight while this one computes.
//   issue(buf): start the copies of the staged tile into buffer buf (every thread)
//   compute(buf, t0): use the tile of positions t0 .. t0+kN-1 in buffer buf
// Every thread of the block calls this with the same lo, hi. Threads
// tid < kN look up the page of token tid of each tile: the page-table
// word of tile j+2 is loaded while tile j computes and staged in shared
// memory (page id, slot, valid bit) for the copies of tile j+1.
template <u32 kN, typename Issue, typename Compute>
__device__ __forceinline__ void run_tiles(Stage<kN>& st, const u32* __restrict__ table, u32 lo, u32 hi,
                                          u32 page_size, u32 num_pages, Issue&& issue, Compute&& compute) {
    const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    u32 raw = kNone, slot = 0;   // token tid of a later tile: page-table word (kNone past hi) and slot
    auto fetch = [&](u32 t) {
        raw = kNone;
        slot = 0;
        if (tid < kN && t < hi) {
            const u32 j = t / page_size;
            raw = table[j];
            slot = t - j * page_size;
        }
    };
    // Stage the fetched token into buffer b (threads tid < kN); returns its validity.
    auto stage = [&](u32 b) -> bool {
        const bool ok = raw < num_pages;
        if (tid < kN) {
            st.page[b][tid] = ok ? raw : kNone;
            st.slot[b][tid] = slot;
        }
        return ok;
    };
    // The valid bits of buffer b (warps < kN / 32; a barrier must follow before compute).
    auto publish = [&](u32 b, bool ok) {
        if (warp < kN / 32) {
            const u32 bits = __ballot_sync(CP_FULL_MASK, ok);
            if (lane == 0) st.valid[b][warp] = bits;
        }
    };
    const u32 ntiles = (hi - lo + kN - 1) / kN;
    __syncthreads();   // the previous pass is done with every buffer and the staging arrays
    fetch(lo + tid);
    publish(0u, stage(0u));
    fetch(lo + kN + tid);
    __syncthreads();
    issue(0u);
    ptx::cp_async_commit();
    for (u32 j = 0; j < ntiles; ++j) {
        const u32 t0 = lo + j * kN, b = j & 1u;
        const bool more = j + 1 < ntiles;
        // Page ids and slots of buffer b^1 are read only by issue(), last for
        // tile j-1 before the previous iteration's barriers: restage them now.
        bool ok = false;
        if (more) {
            ok = stage(b ^ 1u);
            fetch(t0 + 2 * kN + tid);
        }
        __syncthreads();   // staging of tile j+1 visible; every warp is done computing tile j-1
        if (more) {
            publish(b ^ 1u, ok);   // compute(j-1) read these bits; it is done
            issue(b ^ 1u);
        }
        ptx::cp_async_commit();     // possibly empty: keeps one group per tile
        ptx::cp_async_wait<1>();    // tile j has landed (tile j+1 may still be in flight)
        __syncthreads();
        compute(b, t0);
    }
}

// The rows of query slots [i, j) with a visible share form one pass; rows
// of other slots see nothing in it. Calls pass(seq, slot_lo, slot_hi, lo, hi)
// for each maximal run of slots of one sequence (queries are packed in
// sequence order, so a block has one pass per sequence it touches; words
// that break that order only give more passes, each row still in one).
template <typename Pass>
__device__ __forceinline__ void for_each_pass(const Rows& R, u32 qt, Pass&& pass) {
    for (u32 i = 0; i < qt;) {
        const u32 cur = R.seq[i];
        u32 j = i + 1;
        while (j < qt && R.seq[j] == cur) ++j;
        if (cur != kNone) {
            u32 lo = kNone, hi = 0;
            for (u32 k = i; k < j; ++k)
                if (R.lo[k] < R.hi[k]) {
                    lo = min_u32(lo, R.lo[k]);
                    hi = R.hi[k] > hi ? R.hi[k] : hi;
                }
            if (lo < hi) pass(cur, i, j, lo, hi);
        }
        i = j;
    }
}

// Bits a .. e-1 of a tile's token mask (0 <= a, e <= 64; none when e <= a).
__device__ __forceinline__ u64 span_bits(u32 a, u32 e) {
    const u64 upto_e = e >= 64 ? ~0ull : ((1ull << e) - 1);
    const u64 upto_a = a >= 64 ? ~0ull : ((1ull << a) - 1);
    return upto_e & ~upto_a;
}

// Tokens t0 .. t0 + n - 1 (n <= 64) a row with positions [rlo, rhi) sees, as bits.
__device__ __forceinline__ u64 row_bits(u32 rlo, u32 rhi, u32 t0, u32 n) {
    const u32 a = rlo > t0 ? min_u32(rlo - t0, n) : 0u;
    const u32 e = rhi > t0 ? min_u32(rhi - t0, n) : 0u;
    return span_bits(a, e);
}

// Store two adjacent outputs of one row: scalar_t pair, or f32 pair into the partials.
__device__ __forceinline__ void store_pair(scalar_t* __restrict__ out, float* __restrict__ part, u64 idx,
                                           bool split, float a, float b) {
    if (split) {
        float2 v;
        v.x = a;
        v.y = b;
        *reinterpret_cast<float2*>(part + idx) = v;
    } else {
        *reinterpret_cast<u32*>(out + idx) = ptx::pack2<scalar_t>(a, b);
    }
}

}  // namespace tc
