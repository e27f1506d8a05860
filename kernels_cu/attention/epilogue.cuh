// epilogue.cuh: what every attention kernel (paged_attention, paged_decode_tc,
// paged_prefill_tc, paged_mla_tc, paged_mla_wgmma) does first and last, in one
// place: the arrays of its AttentionParams as __restrict__ locals (the
// prologue), and the writer of a finished (query, head) row (the epilogue):
// fold the head's sink, apply V's dequantization scale, and write either the
// output row and its LSE or, with splits > 1, split z's FP32 partial row and
// its LSE (docs/layout.md: "Outputs and LSE", "Split-KV workspace").
//
// A row's accumulator holds sum_j exp2(s_j - m) v_j and its softmax state
// (softmax_state.cuh) m and l. Its output is acc * finish(...):
//   * without splits the head's sink (CP_SINKS, variant.cuh) is folded into
//     the state once (a key of logit sink[h] whose value row is zero); split
//     partials leave it out and attention_split_merge (merge.cu) folds it in
//     once, so the merged LSE counts it once;
//   * fp8 caches: times V's scale (the kernel says which: a KV head's
//     v_scale, or the MLA latent's k_scale, whose codes are also V);
//   * then the state's lse() is the row's natural-log LSE (-inf when it saw
//     nothing; the sink itself when only the sink is counted).
// The writes: output rows [queries, Hq, Dv] in q's type at row qi * Hq + h,
// partials [splits, queries, Hq, Dv] in f32 at row (z * queries + qi) * Hq + h,
// LSE [queries, Hq] (when p.write_lse) or the partials' [splits, queries, Hq].
// Every function is written exactly as each kernel computed it before they
// shared this header (order of operations, the -inf guards), so every output
// is bit for bit what it was.
#pragma once
#include "../common.cuh"
#include "../ptx.cuh"
#include "../softmax_state.cuh"
#include "params.cuh"
#include "variant.cuh"

// The prologue: the arrays of AttentionParams `p` as __restrict__ locals (NVVM
// keeps restrict on these, not on struct members: read-only loads stay
// ld.global.nc). A kernel reads the ones it needs; the others compile to
// nothing. (A macro, not a struct: a struct's members would lose restrict.)
#define CP_ATTENTION_ARRAYS(p)                                             \
    [[maybe_unused]] const scalar_t* __restrict__ const q = (p).q;         \
    [[maybe_unused]] const scalar_t* __restrict__ const q_rot = (p).q_rot; \
    [[maybe_unused]] const kv_t* __restrict__ const k_cache = (p).k_cache; \
    [[maybe_unused]] const kv_t* __restrict__ const v_cache = (p).v_cache; \
    [[maybe_unused]] const kv_t* __restrict__ const k_rot = (p).k_rot;     \
    [[maybe_unused]] const u32* __restrict__ const words = (p).words;      \
    [[maybe_unused]] scalar_t* __restrict__ const out = (p).out;           \
    [[maybe_unused]] float* __restrict__ const lse = (p).lse;              \
    [[maybe_unused]] float* __restrict__ const part_out = (p).part_out;    \
    [[maybe_unused]] float* __restrict__ const part_lse = (p).part_lse

namespace epi {

// fp8 caches: KV head kvh's V scale from p.v_scale (a null pointer: 1); 1 for
// 16-bit caches (finish ignores it there).
__device__ __forceinline__ float v_scale(const AttentionParams& p, u32 kvh) {
    if constexpr (kKvScaled) return p.v_scale ? p.v_scale[kvh * p.v_scale_stride] : 1.0f;
    return 1.0f;
}

// 1 / l of a finished state with a sink of log2 logit sink2 folded in first
// (CP_SINKS; variant::fold_sink's factor for the accumulator included): the
// factor that makes a row's output from its accumulator. The kernels call it
// through finish (rows that are not split partials), attention_split_merge
// once a row, after every split: the sink counts once either way.
__device__ __forceinline__ float normalize(softmax::State& st, float sink2) {
    if constexpr (variant::kSinks) {
        const float a = variant::fold_sink(st, sink2);
        return st.inv_sum() * a;
    }
    return st.inv_sum();
}

// The factor a finished row's accumulator is multiplied by: 1 / l, with query
// head `head`'s sink folded into st first when the row is not a split
// partial, times V's scale v_scale for an fp8 cache. Leaves st the row's
// final state (st.lse() its LSE).
__device__ __forceinline__ float finish(softmax::State& st, const variant::Scorer& sc, u32 head, bool split,
                                        float v_scale) {
    float inv = st.inv_sum();
    if constexpr (variant::kSinks)
        if (!split) inv = normalize(st, sc.sink2(head));  // the head's sink, once (partials: the merge's)
    if constexpr (kKvScaled) inv *= v_scale;
    return inv;
}

// Row `row` (qi * Hq + h) of the outputs and the LSE, and the row its values
// and LSE go to: the same without splits, split blockIdx.z's partial row with.
struct Row {
    u64 row, dst;
};
__device__ __forceinline__ Row row_of(const AttentionParams& p, u64 row, bool split) {
    Row r;
    r.row = row;
    r.dst = split ? (u64)blockIdx.z * p.queries * p.q_heads + row : row;
    return r;
}

// Two adjacent values of a row (element idx of the destination's array, even):
// a pair of 16-bit T (scalar_t of the tensor-core kernels) into the output,
// or an f32 pair into the partials. (A template: nothing of it is compiled
// for an f32 build, which has no ptx::pack2.)
template <typename T>
__device__ __forceinline__ void store_pair(T* __restrict__ out, float* __restrict__ part, u64 idx, bool split, float a,
                                           float b) {
    if (split) {
        float2 v;
        v.x = a;
        v.y = b;
        *reinterpret_cast<float2*>(part + idx) = v;
    } else {
        *reinterpret_cast<u32*>(out + idx) = ptx::pack2<T>(a, b);
    }
}

// kN adjacent values v[i] * inv of a row from element idx: f32 stores into
// the partials, or scalar_t into the output, 16 bytes at a time when kN
// elements are whole 16-byte parts (the caller's rows are then 16-byte
// aligned), else one at a time.
template <u32 kN>
__device__ __forceinline__ void store_values(scalar_t* __restrict__ out, float* __restrict__ part, u64 idx, bool split,
                                             const float (&v)[kN], float inv) {
    if (split) {
        float* po = part + idx;
#pragma unroll
        for (u32 i = 0; i < kN; ++i) po[i] = v[i] * inv;
        return;
    }
    constexpr u32 kParts = kN * (u32)sizeof(scalar_t) / 16u;
    if constexpr (kParts * 16u == kN * (u32)sizeof(scalar_t) && kParts > 0) {
        struct Packed {
            uint4 part[kParts];
        } c;
        scalar_t* e = reinterpret_cast<scalar_t*>(&c);
#pragma unroll
        for (u32 i = 0; i < kN; ++i) e[i] = from_float<scalar_t>(v[i] * inv);
#pragma unroll
        for (u32 i = 0; i < kParts; ++i) stv(reinterpret_cast<uint4*>(out + idx) + i, c.part[i]);
    } else {
#pragma unroll
        for (u32 i = 0; i < kN; ++i) stv(out + idx + i, from_float<scalar_t>(v[i] * inv));
    }
}

// A row's LSE: into the partials' LSE with splits, else into lse when the
// launch asks for it (write_lse).
__device__ __forceinline__ void store_lse(float* __restrict__ lse, float* __restrict__ part_lse, u32 write_lse,
                                          const Row& r, bool split, float value) {
    if (split)
        part_lse[r.dst] = value;
    else if (write_lse)
        lse[r.row] = value;
}

}  // namespace epi
