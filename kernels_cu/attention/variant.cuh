// variant.cuh: the one hook every attention kernel calls for what sets one
// attention variant apart from another (in the manner of FlashInfer's
// LogitsTransform / LogitsMask). Each kernel calls each function once, at one
// site:
//   score(s, q_pos, k_pos, head)   the logit of a visible (query, key) pair
//   visible(len, causal, pos)      the positions [lo, hi) a query sees
//
// score: s arrives in the kernels' log2 domain, s = scale * log2(e) * q.k
// (f32, the rotary part included for MLA); the variant returns the logit it
// wants in the same domain (a change in natural units is multiplied by
// softmax::kLog2e). q_pos, k_pos: absolute positions of the query and the key
// in their sequence (docs/layout.md); head: the query head. The variant is
// picked at compile time by CP_SCORE, a name from the SCORES table of
// cupaged/ops/attention/variants.py: CP_SCORE=name selects struct
// score_<name> below. A struct with kIdentity = true is never called: the
// kernels test variant::kPlainScore with `if constexpr`, so the plain
// variant compiles to exactly the code it had before this hook existed (no
// positions are even read).
//
// visible: one rule for every variant today (causal is a launch argument).
// It returns a range, not a per-key predicate, so that a rule with lo > 0 (a
// sliding window) lets the kernels skip whole pages before lo; the kernels
// clamp hi to CP_MAX_VISIBLE_LEN and split [lo, hi) between the splits.
#pragma once
#include "../common.cuh"
#include "../softmax_state.cuh"

#ifndef CP_SCORE
#define CP_SCORE plain
#endif

namespace variant {

// plain: softmax(scale * q.k), every built variant.
struct score_plain {
    static constexpr bool kIdentity = true;
    __device__ __forceinline__ static float apply(float s, u32, u32, u32) { return s; }
};

// test_bias: scale * q.k + 0.5 + 0.125 * head - 0.03125 * (q_pos - k_pos), an
// ALiBi-like toy that exercises every argument of the hook. Tests only
// (tests/attention/test_variant.py; the worked example "Adding a score
// variant" of docs/layout.md); not registered for the NVRTC gate.
struct score_test_bias {
    static constexpr bool kIdentity = false;
    __device__ __forceinline__ static float apply(float s, u32 q_pos, u32 k_pos, u32 head) {
        const float bias = 0.5f + 0.125f * (float)head - 0.03125f * ((float)q_pos - (float)k_pos);
        return s + bias * softmax::kLog2e;
    }
};

typedef CP_CAT(score_, CP_SCORE) Score;
// True for a variant whose score is s itself: the kernels skip the hook.
constexpr bool kPlainScore = Score::kIdentity;

__device__ __forceinline__ float score(float s, u32 q_pos, u32 k_pos, u32 head) {
    return Score::apply(s, q_pos, k_pos, head);
}

struct Range {
    u64 lo, hi;
};

// The positions [lo, hi) of its sequence a query sees. len: the sequence's
// visible length (its kv_len word clamped to the page table's capacity);
// pos(): the query's absolute position, read from the words only when the
// rule needs it. Causal: positions 0 .. pos; otherwise all len.
template <typename Pos>
__device__ __forceinline__ Range visible(u64 len, u32 causal, Pos&& pos) {
    if (causal) {
        const u64 p1 = (u64)pos() + 1;
        if (len > p1) len = p1;
    }
    Range r;
    r.lo = 0;
    r.hi = len;
    return r;
}

}  // namespace variant
