// variant.cuh: the one hook every attention kernel calls for what sets one
// attention variant apart from another (in the manner of FlashInfer's
// LogitsTransform / LogitsMask / OutputTransform). Each kernel calls each
// function at one site:
//   score(sc, row, s, k_pos)       the logit of a visible (query, key) pair
//                                  (Score::apply(p, s, q_pos, k_pos, head))
//   visible(len, causal, window, pos)  the positions [lo, hi) a query sees
//   (sinks)                        fold_sink(state, sc.sink2(head)) where a
//                                  row's softmax is finished (the kernel's
//                                  epilogue without splits, else the merge)
//
// score: s arrives in the kernels' log2 domain, s = scale * log2(e) * q.k
// (f32, the rotary part included for MLA); the variant returns the logit it
// wants in the same domain (a change in natural units is multiplied by
// softmax::kLog2e). p: the launch's AttentionParams (a score's runtime data,
// e.g. a per-head array, is a params field its option row fills); q_pos,
// k_pos: absolute positions of the query and the key in their sequence
// (docs/layout.md); head: the query head. The score is composed at compile
// time of
//   * CP_SCORE: a name from the SCORES table of cupaged/ops/attention/
//     options.py, which selects struct score_<name> below (plain: s itself);
//   * CP_SOFT_CAP=1: logit = cap * tanh(logit / cap) (Gemma 2), on the
//     score so far;
//   * CP_ALIBI=1: logit += slope[head] * (k_pos - q_pos) (BLOOM / MPT; <= 0
//     for a causal key), after the cap.
// Each feature's runtime values come from the AttentionParams fields of the
// score group (params.py): the cap where it is used (a kernel parameter),
// a head's slope once per row (ScoreRow), its sink once at the end. A variant
// with none of them and an identity CP_SCORE has kPlainScore: the kernels
// test it with `if constexpr`, so the plain variant compiles to exactly the
// code it had before this hook existed (no positions are even read).
//
// visible: causal (a launch argument) and, with CP_WINDOW=1, a left window
// of p.window positions: the query at position p sees p - window + 1 .. p
// (causal) or p - window + 1 .. len - 1 (not causal), clipped at 0. It
// returns a range, not a per-key predicate, so the kernels start their page
// walk at lo: the pages before it are never read. The kernels clamp hi to
// CP_MAX_VISIBLE_LEN and split [lo, hi) between the splits.
//
// sinks (CP_SINKS=1): a per-head logit sink[h] (natural units) in the
// softmax denominator: out = sum_j exp(s_j) v_j / (exp(sink) + sum_j
// exp(s_j)); the sink is a key whose value row is zero, so the LSE counts it:
// lse = log(exp(sink) + sum_j exp(s_j)). Split partials leave it out and the
// merge folds it in once.
#pragma once
#include "../common.cuh"
#include "../softmax_state.cuh"
#include "params.cuh"

#ifndef CP_SCORE
#define CP_SCORE plain
#endif
#ifndef CP_SOFT_CAP
#define CP_SOFT_CAP 0
#endif
#ifndef CP_ALIBI
#define CP_ALIBI 0
#endif
#ifndef CP_WINDOW
#define CP_WINDOW 0
#endif
#ifndef CP_SINKS
#define CP_SINKS 0
#endif

namespace variant {

// plain: softmax(scale * q.k), every built variant.
struct score_plain {
    static constexpr bool kIdentity = true;
    __device__ __forceinline__ static float apply(const AttentionParams&, float s, u32, u32, u32) { return s; }
};

// test_bias: scale * q.k + 0.5 + 0.125 * head - 0.03125 * (q_pos - k_pos), an
// ALiBi-like toy that exercises every argument of the hook. Tests only
// (tests/attention/test_variant.py; the worked example "Adding a score
// variant" of docs/layout.md); not registered for the NVRTC gate.
struct score_test_bias {
    static constexpr bool kIdentity = false;
    __device__ __forceinline__ static float apply(const AttentionParams&, float s, u32 q_pos, u32 k_pos, u32 head) {
        const float bias = 0.5f + 0.125f * (float)head - 0.03125f * ((float)q_pos - (float)k_pos);
        return s + bias * softmax::kLog2e;
    }
};

// head_bias: scale * q.k + bias[head], bias float32 [Hq] at p.head_bias (natural
// units): a score with runtime data, the worked example of docs/layout.md
// ("Adding a score variant"). Tests only (its option row is added by
// tests/attention/test_variant.py); not registered for the NVRTC gate. A head
// past q_heads (a padded row) reads nothing.
struct score_head_bias {
    static constexpr bool kIdentity = false;
    __device__ __forceinline__ static float apply(const AttentionParams& p, float s, u32, u32, u32 head) {
        return head < p.q_heads ? fmaf(p.head_bias[head], softmax::kLog2e, s) : s;
    }
};

typedef CP_CAT(score_, CP_SCORE) Score;
constexpr bool kSoftCap = CP_SOFT_CAP != 0;
constexpr bool kAlibi = CP_ALIBI != 0;
constexpr bool kWindow = CP_WINDOW != 0;
constexpr bool kSinks = CP_SINKS != 0;
// True for a variant whose score is s itself: the kernels skip the hook.
constexpr bool kPlainScore = Score::kIdentity && !kSoftCap && !kAlibi;

// What the score of one row (a query and one of its heads) needs, set once
// per row: its query position and head, and the ALiBi slope of that head
// (log2 domain; 0 without CP_ALIBI).
struct ScoreRow {
    u32 q_pos, head;
    float slope;
};

// The score's runtime arguments: the params themselves (kernel parameters,
// which instructions read from the constant bank where they are used,
// holding no register across the loop).
struct Scorer {
    const AttentionParams& p;

    __device__ __forceinline__ explicit Scorer(const AttentionParams& params) : p(params) {}
    // A row of query position q_pos and query head `head` (a head past
    // q_heads, a padded row, reads no slope).
    __device__ __forceinline__ ScoreRow row(u32 q_pos, u32 head) const {
        ScoreRow r;
        r.q_pos = q_pos;
        r.head = head;
        r.slope = 0.0f;
        if constexpr (kAlibi) r.slope = head < p.q_heads ? p.alibi_slopes[head] * softmax::kLog2e : 0.0f;
        return r;
    }
    // Head h's sink in the log2 domain; -inf (no sink) without CP_SINKS or
    // for a head past q_heads.
    __device__ __forceinline__ float sink2(u32 head) const {
        if constexpr (kSinks) return head < p.q_heads ? p.sinks[head] * softmax::kLog2e : neg_inf();
        return neg_inf();
    }
};

// tanh(x) within a few ulp relative over the whole range: the soft cap
// computes cap * tanh(logit / cap), so a cap far above the logits makes x
// tiny, where (1 - e) / (1 + e) alone cancels (at cap 1e8 every logit became
// 0). Below |x| = 0.625 the odd polynomial x + x^3 P(x^2) (Cephes' tanhf,
// relative error ~1.5e-7); above it (1 - e) / (1 + e), e = exp2(-2 |x|
// log2(e)), with x's sign: one exp2 and one fast division (no cancellation
// there: 1 - e > 0.7). Both are computed and one selected (no divergence), a
// few registers where libdevice's tanhf takes more (the tensor-core prefill
// kernel is at its register cap). NaN stays NaN, +-Inf gives +-1.
__device__ __forceinline__ float tanh_accurate(float x) {
    const float ax = fabsf(x);
    const float z = x * x;
    float p = fmaf(-5.70498872745e-3f, z, 2.06390887954e-2f);
    p = fmaf(p, z, -5.37397155531e-2f);
    p = fmaf(p, z, 1.33314422036e-1f);
    p = fmaf(p, z, -3.33332819422e-1f);
    const float small = fmaf(p * z, x, x);
    const float e = exp2f(-2.0f * softmax::kLog2e * ax);
    const float large = copysignf(__fdividef(1.0f - e, 1.0f + e), x);
    return ax < 0.625f ? small : large;
}

__device__ __forceinline__ float score(const Scorer& sc, const ScoreRow& r, float s, u32 k_pos) {
    if constexpr (!Score::kIdentity) s = Score::apply(sc.p, s, r.q_pos, k_pos, r.head);
    if constexpr (kSoftCap) s = sc.p.soft_cap * tanh_accurate(s * sc.p.inv_soft_cap);
    // k_pos - q_pos as a signed count (positions are below 2^31, a query's
    // may be negative: docs/layout.md), exact in f32 below 2^24.
    if constexpr (kAlibi) s = fmaf(r.slope, (float)(int)(k_pos - r.q_pos), s);
    return s;
}

// Fold head h's sink into a finished softmax state (every key of the row, or
// of the merged splits, seen): a key of log2 score sink2 whose value row is
// zero. Returns the factor the row's accumulator must be scaled by; without
// CP_SINKS nothing changes (1).
__device__ __forceinline__ float fold_sink(softmax::State& st, float sink2) {
    if constexpr (kSinks) return st.add_sink(sink2);
    return 1.0f;
}

struct Range {
    u64 lo, hi;
};

// The positions [lo, hi) of its sequence a query sees. len: the sequence's
// visible length (its kv_len word clamped to the page table's capacity);
// pos(): the query's absolute position (a signed 32-bit value in its word),
// read from the words only when the rule needs it. Causal: positions 0 ..
// pos; otherwise all len. With CP_WINDOW, positions below pos - window + 1
// are not seen either.
template <typename Pos>
__device__ __forceinline__ Range visible(u64 len, u32 causal, u32 window, Pos&& pos) {
    Range r;
    r.lo = 0;
    if constexpr (kWindow) {
        const long long p = (int)pos();
        if (causal) len = p < 0 ? 0 : (len > (u64)p + 1 ? (u64)p + 1 : len);
        const long long lo = p - (long long)window + 1;
        r.lo = lo > 0 ? (u64)lo : 0;
    } else if (causal) {
        const u64 p1 = (u64)pos() + 1;
        if (len > p1) len = p1;
    }
    r.hi = len;
    return r;
}

}  // namespace variant
