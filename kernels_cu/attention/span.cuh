// span.cuh: which queries an attention launch serves, and which positions of
// a query one block reads (the visibility hook, then the split's share).
// Shared by the five attention kernels; docs/layout.md defines the rules.
#pragma once
#include "../common.cuh"
#include "../plan_words.cuh"
#include "../ptx.cuh"
#include "params.cuh"
#include "variant.cuh"

namespace att {
constexpr u32 kSplitTile = CP_SPLIT_TILE;
constexpr u32 kMaxLen = CP_MAX_VISIBLE_LEN;  // visible lengths are clamped to this

__device__ __forceinline__ u32 min_u32(u32 a, u32 b) { return a < b ? a : b; }

// End of a launch's query range [q_begin, q_end): q_begin + q_count clamped
// to the plan's queries; 0 (an empty range) when q_begin is past them. The
// range comes from the host, but is clamped like everything else.
__device__ __forceinline__ u32 range_end(u32 queries, u32 q_begin, u32 q_count) {
    return q_begin < queries ? q_begin + min_u32(q_count, queries - q_begin) : 0u;
}

// Where (query qi, head h)'s row of q and of q_rot starts, in elements: the
// views' strides (AttentionParams: any view whose last dim is contiguous,
// e.g. a column slice of a fused QKV projection; C-contiguous q has strides
// Hq * D, D). The only formula of a query row's address. A view spans
// fewer than 2^32 elements (checked on the host, as a packed q's count), so
// the offsets are u32 (queries < 2^31).
__device__ __forceinline__ u32 q_at(const AttentionParams& p, u32 qi, u32 h) {
    return qi * p.q_stride_token + h * p.q_stride_head;
}
__device__ __forceinline__ u32 q_rot_at(const AttentionParams& p, u32 qi, u32 h) {
    return qi * p.q_rot_stride_token + h * p.q_rot_stride_head;
}

struct Span {
    u32 lo, hi;
};

// The words a block of packed query qi starts from: its sequence, that
// sequence's kv_len word and the query's position, loaded together. Where
// queries map one to one onto sequences (a decode step: q_seq[qi] == qi) the
// length word of sequence qi loads beside the others, one round trip for
// all; where the guess is wrong (a chunk's queries, rows past the step's) the
// length loads after the sequence word, on a path ptx::cold_path marks for
// the performance model. seq >= sequences (a padding row): len 0.
struct QueryWords {
    u32 seq, len, pos;
};
__device__ __forceinline__ QueryWords query_words(const AttentionParams& p, u32 qi) {
    const u32* __restrict__ const words = p.words;
    QueryWords r;
    r.seq = words[pw::q_seq(p.queries) + qi];
    r.pos = words[pw::q_pos(p.queries) + qi];
    r.len = qi < p.sequences ? words[pw::kv_len(p.queries) + qi] : 0u;
    if (r.seq != qi) {
        ptx::cold_path();
        r.len = r.seq < p.sequences ? words[pw::kv_len(p.queries) + r.seq] : 0u;
    }
    return r;
}

// The positions [lo, hi) split z covers of a packed query whose sequence's
// kv_len word is len and whose position word pos() returns: the positions the
// query sees (variant::visible, the length clamped to the page table's
// capacity, hi to kMaxLen; lo past 0 with a window, whose pages are then never
// read); with splits > 1, split z takes [lo + z c, lo + (z + 1) c) of them, c
// the visible count / splits rounded up to kSplitTile (an empty share past hi).
template <class Pos>
__device__ __forceinline__ Span share(const AttentionParams& p, u64 len, Pos pos, u32 z) {
    const u64 cap = (u64)p.table_width * p.page_size;
    const u64 L = len > cap ? cap : len;
    const variant::Range v = variant::visible(L, p.causal, p.window, pos);
    const u32 hi = (u32)(v.hi < kMaxLen ? v.hi : kMaxLen);
    Span r;
    r.lo = (u32)(v.lo < hi ? v.lo : hi);
    r.hi = hi;
    if (p.splits > 1) {
        u32 c = (hi - r.lo + p.splits - 1) / p.splits;
        c = (c + kSplitTile - 1) / kSplitTile * kSplitTile;
        const u64 s0 = r.lo + (u64)z * c;
        r.lo = s0 < hi ? (u32)s0 : hi;
        r.hi = min_u32(hi, r.lo + c);
    }
    return r;
}

// share() of the words query_words read (seq < sequences).
__device__ __forceinline__ Span share(const AttentionParams& p, const QueryWords& w, u32 z) {
    return share(p, w.len, [&] { return w.pos; }, z);
}

// A walk's step through pages of ps tokens, split once (the walk's one
// division): `step` positions are `j` page-table columns and `s` slots.
struct PageStep {
    u32 ps, j, s;
    __device__ __forceinline__ PageStep(u32 step, u32 page_size) : ps(page_size) {
        j = step / page_size;
        s = step - j * page_size;
    }
};

// A position's page-table column pj and slot psl, set once by division (at)
// and then advanced a PageStep at a time with none: the page walk of every
// kernel that walks (paged_attention's rows, paged_decode_tc's tiles, the
// wgmma kernels' staged tokens).
struct PagePos {
    u32 pj, psl;
    __device__ __forceinline__ void at(u32 tok, u32 ps) {
        pj = tok / ps;
        psl = tok - pj * ps;
    }
    __device__ __forceinline__ void advance(const PageStep& st) {
        pj += st.j;
        psl += st.s;
        if (psl >= st.ps) {
            psl -= st.ps;
            ++pj;
        }
    }
};

// share() of query qi of sequence seq (seq < sequences), its length read
// here and its position when the rule needs it.
__device__ __forceinline__ Span query_span(const AttentionParams& p, u32 qi, u32 seq, u32 z) {
    const u32* __restrict__ const words = p.words;
    return share(p, words[pw::kv_len(p.queries) + seq], [&] { return words[pw::q_pos(p.queries) + qi]; }, z);
}
}  // namespace att
