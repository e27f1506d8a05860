// merge.cuh: attention_split_merge, combining the split partials every
// attention kernel writes. Each attention .cu file includes it, so every
// compiled attention module has its merge (the launch takes it from the
// module of the step's last launch).
//
// One warp per (query, head), 4 heads per block: grid (queries, ceil(Hq / 4)),
// block 128.
// part_out [splits, queries, Hq, Dv] f32, part_lse [splits, queries, Hq] f32
//   -> out [queries, Hq, Dv] scalar_t, lse [queries, Hq] f32 (when write_lse).
// lse = log(sum_z exp(lse_z)), out = sum_z exp(lse_z - lse) * out_z; a split
// with lse -inf adds nothing; all empty gives out 0, lse -inf.
// (Its few arguments stay positional: as fields of AttentionParams, loaded
// where used, they cost ptxas 8 more registers on sm_90.)
#pragma once
#include "../common.cuh"
#include "../plan_words.cuh"
#include "../softmax_state.cuh"
#include "span.cuh"

extern "C" __global__ void __launch_bounds__(128)
attention_split_merge(const float* __restrict__ part_out, const float* __restrict__ part_lse,
                      scalar_t* __restrict__ out, float* __restrict__ lse, u32 queries, u32 q_heads,
                      u32 value_dim, u32 splits, u32 write_lse) {
    constexpr u32 kMaxSplits = CP_MAX_SPLITS;
    __shared__ float s_w[4][kMaxSplits];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const u32 qi = blockIdx.x, h = blockIdx.y * 4 + warp;
    if (h >= q_heads) return;   // no block-wide barrier below
    const u32 nsplit = att::min_u32(splits, kMaxSplits);
    const u64 stride = (u64)queries * q_heads;   // between splits, in (query, head) rows
    const u64 rowi = (u64)qi * q_heads + h;

    // The splits' LSEs (natural log) as one softmax state in the log2 domain:
    // m the largest, l the sum of the weights exp2(lse_z - m).
    float mx = neg_inf();
    for (u32 z = lane; z < nsplit; z += 32) mx = fmaxf(mx, part_lse[z * stride + rowi] * softmax::kLog2e);
    mx = warp_max(mx);
    float total = 0.0f;
    for (u32 z = lane; z < nsplit; z += 32) {
        const float w = softmax::rescale(part_lse[z * stride + rowi] * softmax::kLog2e, mx);
        s_w[warp][z] = w;
        total += w;
    }
    total = warp_sum(total);
    __syncwarp();
    const softmax::State st = softmax::make_state(mx, total);
    const float inv = st.inv_sum();
    for (u32 e = lane; e < value_dim; e += 32) {
        float a = 0.0f;
        for (u32 z = 0; z < nsplit; ++z) {
            const float w = s_w[warp][z];
            if (w != 0.0f) a = fmaf(w, part_out[(z * stride + rowi) * value_dim + e], a);
        }
        out[rowi * value_dim + e] = from_float<scalar_t>(a * inv);
    }
    if (lane == 0 && write_lse) lse[rowi] = st.lse();
}
