// softmax_state.cuh: the online softmax every attention kernel keeps, in one
// place: paged_attention, paged_prefill_tc, paged_mla_tc and
// attention_split_merge all use these functions rather than their own copy.
//
// A state summarizes scores s_i (log2 domain: scale * log2(e) * q.k) seen so
// far by their running max m and the sum l = sum_i exp2(s_i - m); m is -inf
// (and l 0) while nothing is seen. The matching output accumulator holds
// sum_i exp2(s_i - m) v_i; whenever m moves, l and the accumulator are scaled
// by the factor a step returns. At the end out = acc / l and the natural-log
// LSE is m ln 2 + log(l) (-inf, with out 0, when nothing was seen).
//
// The operations are written exactly as each kernel computed them before they
// shared this header (order of operations, fmaxf, exp2f, the -inf guards), so
// every output is bit for bit what it was.
#pragma once
#include "common.cuh"

namespace softmax {
constexpr float kLog2e = 1.4426950408889634f;  // scores enter the log2 domain
constexpr float kLn2 = 0.6931471805599453f;  // and the LSE leaves it

// exp2(m - ref) as a rescale factor; 0 for an empty state (m == -inf).
__device__ __forceinline__ float rescale(float m, float ref) { return m == neg_inf() ? 0.0f : exp2f(m - ref); }

struct State {
    float m;  // running max (log2 domain), -inf while empty
    float l;  // running sum of exp2(s - m)

    __device__ __forceinline__ void clear() {
        m = neg_inf();
        l = 0.0f;
    }
    // Move the max to mn (>= m); returns the factor l and the accumulator
    // must be scaled by (before adding terms relative to mn).
    __device__ __forceinline__ float move_to(float mn) {
        const float alpha = rescale(m, mn);
        m = mn;
        return alpha;
    }
    // Raise the max to cover a tile whose largest score is mx.
    __device__ __forceinline__ float raise(float mx) { return move_to(fmaxf(m, mx)); }
    // What exp2(s - offset()) subtracts: the max, or 0 while it is -inf (then
    // every score is -inf too and exp2 gives 0, never NaN).
    __device__ __forceinline__ float offset() const { return m == neg_inf() ? 0.0f : m; }
    // l = l * alpha + psum: the rescaled sum plus a tile's sum of exp2(s - m).
    __device__ __forceinline__ void add(float alpha, float psum) { l = l * alpha + psum; }
    // Merge another state into this one; a and b scale this state's and the
    // other's accumulators (acc = acc * a + other * b).
    __device__ __forceinline__ void merge(const State& o, float& a, float& b) {
        const float mn = fmaxf(m, o.m);
        a = rescale(m, mn);
        b = rescale(o.m, mn);
        l = l * a + o.l * b;
        m = mn;
    }
    // 1 / l, the output scale; 0 when nothing was seen (out = 0). A NaN sum
    // (a NaN score reached it) stays NaN: out and lse are NaN, as in the
    // reference.
    __device__ __forceinline__ float inv_sum() const { return l == 0.0f ? 0.0f : 1.0f / l; }
    // Natural-log LSE; -inf when nothing was seen, NaN after a NaN score.
    __device__ __forceinline__ float lse() const { return l == 0.0f ? neg_inf() : m * kLn2 + logf(l); }
    // Fold in one more key of log2 score `sink` whose value row is zero (an
    // attention sink, variant.cuh): returns the factor the accumulator must
    // be scaled by. A sink of -inf changes nothing (factor 1); a state that
    // saw nothing gets m = sink, l = 1 (out 0, lse = the sink). A NaN sink or
    // sum stays NaN.
    __device__ __forceinline__ float add_sink(float sink) {
        const float mn = fmaxf(m, sink);
        if (mn == neg_inf()) return 1.0f;
        const float a = rescale(m, mn);
        l = l * a + exp2f(sink - mn);
        m = mn;
        return a;
    }
};

__device__ __forceinline__ State make_state(float m, float l) {
    State s;
    s.m = m;
    s.l = l;
    return s;
}
}  // namespace softmax
