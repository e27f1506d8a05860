// prefill_tc.cu: paged_prefill_tc, chunked-prefill attention on tensor cores,
// plus attention_split_merge (merge.cuh). Layout, positions, metadata words,
// LSE and the split workspace: docs/layout.md. The argument is one
// AttentionParams (params.cuh); the block's rows, the K/V tile pipeline and
// the passes are shared with paged_mla_tc (tc_common.cuh), the inline PTX
// lives in ptx.cuh.
//
// paged_prefill_tc: FlashAttention-2 style, f16 / bf16, D == Dv == HEAD_DIM.
//   grid (ceil(q_count / qt), kv_heads * head_tiles, splits), block 128 (4 warps),
//   dynamic shared memory prefill_smem_bytes(D) (ops/attention/variants.py): 36 / 68 / 99 KiB
//   at D = 64 / 128 / 256.
//   Rows (the M dimension, 64 per block, 16 per warp) are (query, head)
//   pairs: ht = min(G, 64) query heads of one KV head's GQA group for each of
//   qt = 64 / ht consecutive packed queries (blocks tile the launch's range
//   from q_begin), so a K/V row read serves qt * ht rows. Q is staged once
//   (cp.async) and kept as mma A fragments in registers (D <= 128) or
//   re-read from shared memory by ldmatrix (D = 256).
//   K and V tiles of kN tokens (64, or 32 at D = 256) are copied page by page
//   with cp.async into two buffers (the next tile in flight while one
//   computes); S = Q K^T and O += P V run on mma.sync m16n8k16 with f32
//   accumulation; the online softmax (softmax_state.cuh) runs in f32 in the
//   log2 domain on the S fragments (a row's max and sum live in the 4 lanes
//   of a quad).
//   Each row sees positions [lo, hi) of its query (the visibility hook and the
//   split share, span.cuh); a warp whose 16 rows see nothing of a tile skips
//   its products. Positions past the pass's end and page ids >= num_pages are
//   zero-filled (never read) and masked, so no unused slot reaches the output.
//
// Memory traffic: K/V are read once per block instead of once per query, about
// ceil(q_len * G / 64) * L * (D + Dv) * sizeof(kv_t) bytes per sequence and KV
// head; q and the outputs once.
//
// Defines (cupaged/ops/attention/variants.py Variant):
//   CP_DTYPE, CP_KV_DTYPE  f16 | bf16 (one type: the mma takes Q and K alike)
//   CP_SCORE               the score variant (variant.cuh)
//   HEAD_DIM               64 | 128 | 256: D == Dv
#include "../common.cuh"
#include "../plan_words.cuh"
#include "../ptx.cuh"
#include "../softmax_state.cuh"
#include "params.cuh"
#include "variant.cuh"
#include "span.cuh"
#include "tc_common.cuh"

namespace tcp {
constexpr u32 kD = HEAD_DIM;
constexpr u32 kN = kD <= 128 ? 64 : 32;     // tokens per K/V tile
constexpr u32 kWarps = 4, kThreads = 32 * kWarps;
constexpr u32 kPitch = kD + 8;              // shared row pitch (elements): conflict-free ldmatrix
constexpr u32 kChunks = kD / 8;             // 16-byte chunks per row
constexpr u32 kKSteps = kD / 16;            // k-steps of S = Q K^T
constexpr u32 kSTiles = kN / 8;             // n-tiles of S
constexpr u32 kOTiles = kD / 8;             // n-tiles of O
constexpr bool kQInRegs = kD <= 128;
constexpr u32 kRowStep = kThreads / kChunks;   // rows one pass of the block's threads copies
static_assert(kD == 64 || kD == 128 || kD == 256, "HEAD_DIM: 64, 128 or 256");
static_assert(tc::kRows == 16 * kWarps, "16 rows per warp");
// Q and K meet in one mma, and the K/V tiles are copied raw into shared memory.
static_assert(sizeof(kv_t) == sizeof(scalar_t) && sizeof(kv_t) == 2, "f16 / bf16 q and caches");
}  // namespace tcp

extern "C" __global__ void __launch_bounds__(128, 1) paged_prefill_tc(const AttentionParams p) {
    // The arrays as __restrict__ locals (NVVM keeps restrict on these, not on
    // struct members: read-only loads stay ld.global.nc).
    const scalar_t* __restrict__ const q = p.q;
    const kv_t* __restrict__ const k_cache = p.k_cache;
    const kv_t* __restrict__ const v_cache = p.v_cache;
    const u32* __restrict__ const words = p.words;
    scalar_t* __restrict__ const out = p.out;
    float* __restrict__ const lse = p.lse;
    float* __restrict__ const part_out = p.part_out;
    float* __restrict__ const part_lse = p.part_lse;
    using namespace tcp;
    using tc::kNone;
    using tc::kRows;
    CUPAGED_DYNAMIC_SHARED(scalar_t, smem);
    // Q [kRows][kPitch], then K [2][kN][kPitch] and V [2][kN][kPitch]. With Q
    // held in registers its staging area is reused by the K/V buffers (the
    // first copy into them follows a barrier after the fragments are loaded).
    scalar_t* const sQ = smem;
    scalar_t* const sK = kQInRegs ? smem : sQ + kRows * kPitch;
    __shared__ tc::Rows rows;
    __shared__ tc::Stage<kN> st;

    const u32 tid = threadIdx.x, warp = tid >> 5, lane = tid & 31u;
    const u32 g = lane >> 2, tq = lane & 3u;             // mma fragment coordinates
    const u32 r8 = lane & 7u, tile = lane >> 3;          // ldmatrix: row within a tile, tile of the x4
    const u32 q_heads = p.q_heads, kv_heads = p.kv_heads;
    const u32 group = q_heads / kv_heads;
    const u32 ht = group < kRows ? group : kRows;        // heads per block
    const u32 tiles = (group + ht - 1) / ht;
    const u32 qt = kRows / ht;                           // query slots per block
    const u32 kvh = blockIdx.y / tiles;
    const u32 head0 = kvh * group + (blockIdx.y - kvh * tiles) * ht;
    const u32 heads = tc::min_u32(ht, (kvh + 1) * group - head0);
    // Queries q0 .. q0 + qt - 1 of the launch's range [q_begin, q_end); last
    // queries first: under a causal mask they see the most.
    const u32 q_end = att::range_end(p.queries, p.q_begin, p.q_count);
    const u64 q0 = (u64)p.q_begin + (u64)(gridDim.x - 1 - blockIdx.x) * qt;

    // ---- Q rows (zero rows for slots without a query or head) ----
    for (u32 c = tid; c < kRows * kChunks; c += kThreads) {
        const u32 r = c / kChunks, ch = c - r * kChunks;
        const u32 slot = r / ht, hl = r - slot * ht;
        const bool ok = slot < qt && q0 + slot < q_end && hl < heads;
        const scalar_t* src = q + ((q0 + slot) * q_heads + head0 + hl) * kD + ch * 8;
        ptx::cp_async_16(sQ + r * kPitch + ch * 8, ok ? src : q, ok);
    }
    ptx::cp_async_commit();
    tc::setup_rows(rows, p, q0, qt, q_end);
    ptx::cp_async_wait<0>();
    __syncthreads();

    u32 qf[kQInRegs ? kKSteps : 1][4];
    if (kQInRegs) {
#pragma unroll
        for (u32 ks = 0; ks < kKSteps; ++ks)
            ptx::ldmatrix_x4(qf[ks], sQ + (warp * 16 + r8 + 8 * (tile & 1u)) * kPitch + ks * 16 + 8 * (tile >> 1));
    }

    // This thread's two rows (g and g + 8 of its warp's 16): query slot, or kNone.
    u32 my_slot[2];
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        const u32 r = warp * 16 + g + 8 * h, slot = r / ht, hl = r - slot * ht;
        my_slot[h] = (slot < qt && q0 + slot < q_end && hl < heads) ? slot : kNone;
    }

    const float qscale = p.scale * softmax::kLog2e;
    softmax::State sm[2];
    float o[kOTiles][4];
#pragma unroll
    for (u32 h = 0; h < 2; ++h) sm[h].clear();
#pragma unroll
    for (u32 n = 0; n < kOTiles; ++n)
#pragma unroll
        for (u32 i = 0; i < 4; ++i) o[n][i] = 0.0f;

    const u64 k_page = (u64)p.page_size * kv_heads * kD;   // elements per page
    const u32* const tables = words + pw::page_table(p.queries, p.sequences);

    tc::for_each_pass(rows, qt, [&](u32 seq, u32 slot_lo, u32 slot_hi, u32 lo, u32 hi) {
        u32 rlo[2], rhi[2];   // this thread's rows' positions in this pass
        u32 rpos[2], rhead[2];   // and, for a score variant, their query's position and head
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            const u32 s = my_slot[h];
            const bool in = s != kNone && s >= slot_lo && s < slot_hi;
            rlo[h] = in ? rows.lo[s] : 0u;
            rhi[h] = in ? rows.hi[s] : 0u;
            rpos[h] = in ? rows.position(s) : 0u;
            rhead[h] = head0 + (warp * 16 + g + 8 * h - (in ? s : 0u) * ht);
        }
        auto issue = [&](u32 b) {
            // Thread tid copies chunk tid % kChunks of rows tid / kChunks + i * kRowStep.
#pragma unroll
            for (u32 i = 0; i < kN / kRowStep; ++i) {
                const u32 r = tid / kChunks + i * kRowStep, ch = tid % kChunks;
                const u32 page = st.page[b][r];
                const bool ok = page != kNone;
                const u64 off = (u64)page * k_page + ((u64)st.slot[b][r] * kv_heads + kvh) * kD + ch * 8;
                kv_t* const dk = reinterpret_cast<kv_t*>(sK) + (b * kN + r) * kPitch + ch * 8;
                ptx::cp_async_16(dk, ok ? k_cache + off : k_cache, ok);
                ptx::cp_async_16(dk + 2 * kN * kPitch, ok ? v_cache + off : v_cache, ok);   // V buffer b
            }
        };
        auto compute = [&](u32 b, u32 t0) {
            // Bit dt of vis[h]: row h sees token t0 + dt (its share, and a valid page).
            u64 vbits = st.valid[b][0];
            if (kN > 32) vbits |= (u64)st.valid[b][kN > 32 ? 1 : 0] << 32;
            u64 vis[2];
#pragma unroll
            for (u32 h = 0; h < 2; ++h) vis[h] = vbits & tc::row_bits(rlo[h], rhi[h], t0, kN);
            if (!__any_sync(CP_FULL_MASK, (vis[0] | vis[1]) != 0)) return;   // none of the warp's rows sees this tile
#pragma unroll
            for (u32 h = 0; h < 2; ++h) vis[h] >>= 2 * tq;   // now bit n * 8 + e: this lane's column e of n-tile n

            // S = Q K^T: [16 x kN] per warp.
            const scalar_t* const kt = sK + b * kN * kPitch;
            float s[kSTiles][4];
#pragma unroll
            for (u32 n = 0; n < kSTiles; ++n)
#pragma unroll
                for (u32 i = 0; i < 4; ++i) s[n][i] = 0.0f;
#pragma unroll
            for (u32 ks = 0; ks < kKSteps; ++ks) {
                u32 a[4];
                if (kQInRegs) {
#pragma unroll
                    for (u32 i = 0; i < 4; ++i) a[i] = qf[kQInRegs ? ks : 0][i];
                } else {
                    ptx::ldmatrix_x4(a, sQ + (warp * 16 + r8 + 8 * (tile & 1u)) * kPitch + ks * 16 + 8 * (tile >> 1));
                }
#pragma unroll
                for (u32 np = 0; np < kSTiles / 2; ++np) {
                    u32 bq[4];
                    ptx::ldmatrix_x4(bq, kt + (np * 16 + r8 + 8 * (tile >> 1)) * kPitch + ks * 16 + 8 * (tile & 1u));
                    const u32 b0[2] = {bq[0], bq[1]}, b1[2] = {bq[2], bq[3]};
                    ptx::mma_16816<scalar_t>(s[2 * np], a, b0);
                    ptx::mma_16816<scalar_t>(s[2 * np + 1], a, b1);
                }
            }

            // Scale into the log2 domain, the score hook, mask; online softmax per row.
            float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
            for (u32 n = 0; n < kSTiles; ++n)
#pragma unroll
                for (u32 i = 0; i < 4; ++i) {
                    const u32 h = i >> 1;
                    float v = s[n][i] * qscale;
                    if constexpr (!variant::kPlainScore)
                        v = variant::score(v, rpos[h], t0 + n * 8 + 2 * tq + (i & 1u), rhead[h]);
                    s[n][i] = ((vis[h] >> (n * 8 + (i & 1u))) & 1u) ? v : neg_inf();
                    mx[h] = fmaxf(mx[h], s[n][i]);
                }
            float alpha[2], mu[2];
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 1));
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 2));
                alpha[h] = sm[h].raise(mx[h]);
                mu[h] = sm[h].offset();   // exp2(-inf - mu) = 0 for masked scores
            }
            float ps[2] = {0.0f, 0.0f};
#pragma unroll
            for (u32 n = 0; n < kSTiles; ++n)
#pragma unroll
                for (u32 i = 0; i < 4; ++i) {
                    s[n][i] = exp2f(s[n][i] - mu[i >> 1]);
                    ps[i >> 1] += s[n][i];
                }
#pragma unroll
            for (u32 h = 0; h < 2; ++h) sm[h].add(alpha[h], ps[h]);   // this lane's part of the row sum
#pragma unroll
            for (u32 n = 0; n < kOTiles; ++n)
#pragma unroll
                for (u32 i = 0; i < 4; ++i) o[n][i] *= alpha[i >> 1];

            // O += P V: P's S fragments are its A fragments (two n-tiles per k-step).
            const scalar_t* const vt = sK + (2 + b) * kN * kPitch;
#pragma unroll
            for (u32 kk = 0; kk < kN / 16; ++kk) {
                const u32 a[4] = {ptx::pack2<scalar_t>(s[2 * kk][0], s[2 * kk][1]),
                                  ptx::pack2<scalar_t>(s[2 * kk][2], s[2 * kk][3]),
                                  ptx::pack2<scalar_t>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                  ptx::pack2<scalar_t>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                for (u32 dp = 0; dp < kOTiles / 2; ++dp) {
                    u32 bq[4];
                    ptx::ldmatrix_x4_trans(bq, vt + (kk * 16 + r8 + 8 * (tile & 1u)) * kPitch + dp * 16 + 8 * (tile >> 1));
                    const u32 b0[2] = {bq[0], bq[1]}, b1[2] = {bq[2], bq[3]};
                    ptx::mma_16816<scalar_t>(o[2 * dp], a, b0);
                    ptx::mma_16816<scalar_t>(o[2 * dp + 1], a, b1);
                }
            }
        };
        tc::run_tiles<kN>(st, tables + (u64)seq * p.table_width, lo, hi, p.page_size, p.num_pages, issue, compute);
    });

    // ---- normalize and write ----
    const bool split = p.splits > 1;
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        sm[h].l += __shfl_xor_sync(CP_FULL_MASK, sm[h].l, 1);
        sm[h].l += __shfl_xor_sync(CP_FULL_MASK, sm[h].l, 2);
        const u32 slot = my_slot[h];
        if (slot == kNone) continue;
        const u32 r = warp * 16 + g + 8 * h;
        const u64 row = (q0 + slot) * q_heads + head0 + (r - slot * ht);
        const u64 row_out = split ? (u64)blockIdx.z * p.queries * q_heads + row : row;
        const float inv = sm[h].inv_sum();
        const float lse_v = sm[h].lse();
#pragma unroll
        for (u32 n = 0; n < kOTiles; ++n)
            tc::store_pair(out, part_out, row_out * kD + n * 8 + 2 * tq, split, o[n][2 * h] * inv,
                           o[n][2 * h + 1] * inv);
        if (tq == 0) {
            if (split) part_lse[row_out] = lse_v;
            else if (p.write_lse) lse[row] = lse_v;
        }
    }
}

#include "merge.cuh"
