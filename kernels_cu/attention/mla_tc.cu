// mla_tc.cu: paged_mla_tc, DeepSeek-style latent attention (absorbed form)
// on tensor cores (the split merge: merge.cu). Layout, positions,
// metadata words, LSE and the split workspace: docs/layout.md. The argument is
// one AttentionParams (params.cuh): q [queries, H, R], q_rot [queries, H, P],
// k_cache the latent cache [pages, page_size, 1, R] (also the values),
// k_rot [pages, page_size, 1, P], both any view whose rows are contiguous
// (rows at page * stride_page + slot * stride_slot: the 576-wide DeepSeek
// cache c [pages, page_size, 1, R + P] as latent = c[..., :R] and
// k_rot = c[..., R:], no copy). The block's rows, the K/V tile pipeline and
// the passes are shared with paged_prefill_tc (tc_common.cuh).
//
// paged_mla_tc: f16 / bf16 q, R = LATENT_DIM latent dims (the values too) +
// P = ROPE_DIM rotary dims (0: none, no q_rot / k_rot), one shared KV head.
// Caches of q's type, or fp8 codes (e4m3 / e5m2, fp8.cuh) with float32
// scales k_scale (the latent) and v_scale (k_rot, as append writes them):
// cp.async copies a tile's raw codes (half the bytes) into a ring of two
// staging buffers, and each tile is converted exactly to q's type in shared
// memory after its wait, so the mma runs on 16-bit operands; k_scale is
// folded into the score scale and the output, v_scale / k_scale into the
// rotary part of Q (rounded to q's type).
//   grid (head_tiles * ceil(q_count / qt), 1, splits): the head tile is the
//   fastest block index, so one query's head tiles run side by side and its
//   latent rows come from HBM once (the second read hits L2); block kThreads (kWarps = 8 warps),
//   dynamic shared memory mla_tc.smem_bytes(R, P) (cupaged/ops/attention/kernels/mla_tc.py): 151 KiB at
//   512 / 64. The block geometry (warps, minimum, tile, stages) is defined once in mla_tc.py (GEOMETRY),
//   the rows and row pad in spec.py, and read here through geometry.cuh (geom::mla_tc, geom::kTcRows).
//   Rows are (query, head) pairs as in paged_prefill_tc: ht = min(H, 64)
//   heads of qt = 64 / ht queries, so each latent row read serves up to 64
//   heads. A shared-memory row holds [q | q_pos] (Q) or [latent | k_pos] (K,
//   and its first R elements are V).
//   S = Q K^T: warp w computes rows 16 (w % 4) .. +15 against tokens
//   16 (w / 4) .. +15 of a kN = 32 token tile (36 k-steps of 16 over R + P).
//   The two warps of a row exchange their row maxima through shared memory,
//   write P (16-bit) and their row sums there; then every warp computes
//   O += P V for all 64 rows and its own R / 8 = 64 value columns (FlashMLA
//   splits R across warps the same way), rescaling its O rows with the
//   maxima every warp derives identically (softmax_state.cuh). O: 64 x 64
//   f32 per warp, 128 registers a lane. Tiles are double-buffered with
//   cp.async (tc::run_ring, kS = 2 buffers). Finished rows: epilogue.cuh's
//   writer (the sink, the latent's scale, out and lse or a split partial).
//   A valid token a stored row cannot see contributes nothing, also when its
//   latent row holds Inf or NaN: a tile where some stored row misses a valid
//   token runs its P V k-step by k-step (tc::pv_step: a 16-column slice with
//   a non-finite value leaves the tensor cores for exact per-lane sums).
//   On sm_90 devices paged_mla_seesaw (mla_seesaw.cu; 16-bit caches) and
//   paged_mla_wgmma (mla_wgmma.cu; fp8 caches) serve the same shapes.
//
// Memory traffic: L * (R + P) * sizeof(kv_t) bytes per block, each latent row
// serving up to 64 heads (the CUDA-core kernel reads it once per GROUP_TILE
// heads).
//
// Defines (cupaged/ops/attention/variants.py Variant):
//   CP_DTYPE               f16 | bf16
//   CP_KV_DTYPE            CP_DTYPE, or e4m3 | e5m2 (converted in shared memory)
//   CP_SCORE               the score variant (variant.cuh)
//   CP_SOFT_CAP, CP_WINDOW, CP_SINKS, CP_ALIBI  its features (variant.cuh)
//   LATENT_DIM, ROPE_DIM   R (a multiple of 128) and P (of 16, or 0)
#include "../common.cuh"
#include "../plan_words.cuh"
#include "../ptx.cuh"
#include "../softmax_state.cuh"
#include "params.cuh"
#include "variant.cuh"
#include "span.cuh"
#include "tc_common.cuh"
#include "epilogue.cuh"
#include "geometry.cuh"

namespace tcm {
constexpr u32 kR = LATENT_DIM, kP = ROPE_DIM, kK = kR + kP;
constexpr u32 kN = geom::mla_tc::kN;  // tokens per tile
constexpr u32 kS = geom::mla_tc::kS;  // tile buffers of the ring
constexpr u32 kWarps = geom::mla_tc::kWarps, kThreads = geom::mla_tc::kThreads;
constexpr u32 kMinBlocks = geom::mla_tc::kMinBlocks;  // the __launch_bounds__ minimum
constexpr u32 kPitch = kK + geom::kPitchPad;  // shared row pitch of Q and K (elements)
constexpr u32 kPPitch = kN + geom::kPitchPad;  // shared row pitch of P
constexpr u32 kChunks = kK / 8, kRChunks = kR / 8;  // 16-byte chunks of a 16-bit row
// The tile copies: 16 bytes each, kCopies a token (kRCopies of them latent).
constexpr u32 kCopyElems = geom::kVectorBytes / sizeof(kv_t);
constexpr u32 kCopies = kK / kCopyElems, kRCopies = kR / kCopyElems;
// 16-bit tile buffers: kS (the ring itself), or one for an fp8 cache,
// whose ring holds the raw codes [kS][kN][kK] and whose tiles are converted
// into the one 16-bit buffer as they are used.
constexpr u32 kTileBufs = kKvScaled ? 1 : kS;
constexpr u32 kKSteps = kK / 16;
constexpr u32 kCols = kR / kWarps;  // value columns per warp
constexpr u32 kOTiles = kCols / 8;
constexpr u32 kMTiles = tc::kRows / 16;
static_assert(kR % 128 == 0 && kP % 16 == 0, "LATENT_DIM a multiple of 128, ROPE_DIM of 16");
static_assert(kThreads == 32 * kWarps, "whole warps");
// Warp w computes S for the rows of m-tile w % kMTiles against token half w / kMTiles of the tile.
static_assert(kN == 2 * 16 && kWarps == 2 * kMTiles, "two warps of 16 tokens per m-tile (s_max, s_sum: two halves)");
// Q and K meet in one mma: 16-bit caches of q's type are copied raw into
// the tile, fp8 codes converted to q's type (exactly).
static_assert(sizeof(scalar_t) == 2 && (sizeof(kv_t) == sizeof(scalar_t) || kKvScaled),
              "f16 / bf16 q; caches of q's type or fp8");
}  // namespace tcm

extern "C" __global__ void __launch_bounds__(tcm::kThreads, tcm::kMinBlocks) paged_mla_tc(const AttentionParams p) {
    CP_ATTENTION_ARRAYS(p);  // the arrays as __restrict__ locals (epilogue.cuh)
    ptx::launch_dependents();  // the split merge, a dependent launch, may start: it waits for this grid
    using namespace tcm;
    using tc::kNone;
    using tc::kRows;
    CUPAGED_DYNAMIC_SHARED(scalar_t, smem);
    scalar_t* const sQ = smem;  // [kRows][kPitch]  q | q_pos
    scalar_t* const sKV = sQ + kRows * kPitch;  // [kTileBufs][kN][kPitch]  latent | k_pos
    scalar_t* const sP = sKV + kTileBufs * kN * kPitch;  // [kRows][kPPitch] softmax numerators
    // fp8 caches: [kS][kN][kK] raw codes (the ring), after P
    unsigned char* const sRaw = reinterpret_cast<unsigned char*>(sP + kRows * kPPitch);
    __shared__ tc::Rows rows;
    __shared__ tc::Ring<kN, kS> st;
    __shared__ float s_max[2][kRows], s_sum[2][kRows];  // per token half of the tile

    const u32 tid = threadIdx.x, warp = tid >> 5, lane = tid & 31u;
    const u32 g = lane >> 2, tq = lane & 3u;
    const u32 r8 = lane & 7u, tile = lane >> 3;
    const u32 q_heads = p.q_heads;
    const u32 ht = q_heads < kRows ? q_heads : kRows;
    const u32 qt = kRows / ht;
    const u32 tiles = (q_heads + ht - 1) / ht;
    const u32 qblk = blockIdx.x / tiles;  // the head tile is the fastest block index
    const u32 head0 = (blockIdx.x - qblk * tiles) * ht;
    const u32 heads = tc::min_u32(ht, q_heads - head0);
    // Queries q0 .. q0 + qt - 1 of the launch's range [q_begin, q_end); last
    // queries first: under a causal mask they see the most.
    const u32 q_end = att::range_end(p.queries, p.q_begin, p.q_count);
    const u64 q0 = (u64)p.q_begin + (u64)(gridDim.x / tiles - 1 - qblk) * qt;

    // ---- Q rows: [q (R) | q_pos (P)] ----
    for (u32 c = tid; c < kRows * kChunks; c += kThreads) {
        const u32 r = c / kChunks, ch = c - r * kChunks;
        const u32 slot = r / ht, hl = r - slot * ht;
        const bool ok = slot < qt && q0 + slot < q_end && hl < heads;
        const u64 qi = q0 + slot;
        const u32 h = head0 + hl;
        const scalar_t* src =
            ch < kRChunks ? q + att::q_at(p, qi, h) + ch * 8 : q_rot + att::q_rot_at(p, qi, h) + (ch - kRChunks) * 8;
        ptx::cp_async_16(sQ + r * kPitch + ch * 8, ok ? src : q, ok);
    }
    ptx::cp_async_commit();
    tc::setup_rows(rows, p, q0, qt, q_end);
    ptx::cp_async_wait<0>();
    __syncthreads();
    // fp8: score = scale * k_scale * (q.latent + q_rot.k_pos * v_scale / k_scale) over the codes.
    float ks = 1.0f;
    if constexpr (kKvScaled) {
        ks = p.k_scale ? p.k_scale[0] : 1.0f;
        if constexpr (kP > 0) {
            const float vs = p.v_scale ? p.v_scale[0] : 1.0f;
            if (vs != ks) {  // block-uniform
                const float ratio = vs / ks;
                for (u32 c = tid; c < kRows * (kP / 2); c += kThreads) {
                    const u32 r = c / (kP / 2), e = c - r * (kP / 2);
                    u32* const x = reinterpret_cast<u32*>(sQ + r * kPitch + kR) + e;
                    *x = ptx::pack2<scalar_t>(tc::half_of<scalar_t>(*x, 0) * ratio,
                                              tc::half_of<scalar_t>(*x, 1) * ratio);
                }
                __syncthreads();
            }
        }
    }

    // S roles: rows srow0 .. +15, token half th of each tile.
    const u32 srow0 = 16 * (warp & 3u), th = warp >> 2;
    u32 s_slot[2];
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        const u32 r = srow0 + g + 8 * h, slot = r / ht, hl = r - slot * ht;
        s_slot[h] = (slot < qt && q0 + slot < q_end && hl < heads) ? slot : kNone;
    }
    // O roles: every row (kMTiles x 2 per lane), value columns c0 .. c0 + kCols - 1.
    const u32 c0 = warp * kCols;
    const float qscale = kKvScaled ? p.scale * ks * softmax::kLog2e : p.scale * softmax::kLog2e;
    // The S rows keep only a running max (for exp2's offset); the O rows keep
    // the states whose sums and accumulators make the output.
    softmax::State ms[2];
    softmax::State so[kMTiles][2];
    float o[kMTiles][kOTiles][4];
#pragma unroll
    for (u32 h = 0; h < 2; ++h) ms[h].clear();
#pragma unroll
    for (u32 mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (u32 h = 0; h < 2; ++h) so[mt][h].clear();
#pragma unroll
        for (u32 n = 0; n < kOTiles; ++n)
#pragma unroll
            for (u32 i = 0; i < 4; ++i) o[mt][n][i] = 0.0f;
    }

    const u32* const tables = words + pw::page_table(p.queries, p.sequences);
    const variant::Scorer sc(p);  // a score variant's arguments

    tc::for_each_pass(rows, qt, [&](u32 seq, u32 slot_lo, u32 slot_hi, u32 lo, u32 hi) {
        u32 rlo[2], rhi[2];
        variant::ScoreRow srow[2];  // for a score variant: the rows' query position, head, slope
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            const u32 s = s_slot[h];
            const bool in = s != kNone && s >= slot_lo && s < slot_hi;
            rlo[h] = in ? rows.lo[s] : 0u;
            rhi[h] = in ? rows.hi[s] : 0u;
            if constexpr (!variant::kPlainScore)
                srow[h] = sc.row(in ? rows.position(s) : 0u, head0 + (srow0 + g + 8 * h - (in ? s : 0u) * ht));
        }
        auto issue = [&](u32 sb, u32 b) {
            for (u32 c = tid; c < kN * kCopies; c += kThreads) {
                const u32 r = c / kCopies, ch = c - r * kCopies;
                const uint2 ps = st.row[sb][r];  // page, slot
                const u64 page = ps.x;
                const bool ok = ps.x != kNone;
                const u64 slot = ps.y;
                const kv_t* src =
                    ch < kRCopies
                        ? k_cache + page * p.k_stride_page + slot * p.k_stride_slot + ch * kCopyElems
                        : k_rot + page * p.rot_stride_page + slot * p.rot_stride_slot + (ch - kRCopies) * kCopyElems;
                void* const dst = kKvScaled ? static_cast<void*>(sRaw + (b * kN + r) * kK + ch * 16)
                                            : static_cast<void*>(sKV + (b * kN + r) * kPitch + ch * 8);
                ptx::cp_async_16(dst, ok ? src : k_cache, ok);
            }
        };
        auto compute = [&](u32 b, u32 t0) {
            if constexpr (kKvScaled) {
                // The tile's codes (contiguous, kK a token) into the 16-bit tile, 8 a thread at a time.
                const unsigned char* const raw = sRaw + b * kN * kK;
                for (u32 c = tid; c < kN * kChunks; c += kThreads) {
                    const u32 r = c / kChunks, ch = c - r * kChunks;
                    const uint2 x = *reinterpret_cast<const uint2*>(raw + c * 8);
                    uint4 y;
                    fp8::x4_to<scalar_t, kv_t>(x.x, y.x, y.y);
                    fp8::x4_to<scalar_t, kv_t>(x.y, y.z, y.w);
                    *reinterpret_cast<uint4*>(sKV + r * kPitch + ch * 8) = y;
                }
                __syncthreads();
            }
            const scalar_t* const kt = sKV + (kKvScaled ? 0u : b) * kN * kPitch;
            // ---- S for rows srow0.., tokens t0 + 16 th .. +15 ----
            // Bit dt of vis[h]: row h sees token t0 + 16 th + dt.
            const u32 vbits = (st.valid[b][0] >> (16 * th)) & 0xffffu;
            u32 vis[2];
            bool miss = false;  // a stored row of this warp misses a valid token of its half
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                vis[h] = vbits & (u32)tc::row_bits(rlo[h], rhi[h], t0 + 16 * th, 16);
                miss |= s_slot[h] != kNone && vis[h] != vbits;
            }
            const bool mine = (vis[0] | vis[1]) != 0;
#pragma unroll
            for (u32 h = 0; h < 2; ++h) vis[h] >>= 2 * tq;
            float s[2][4];
#pragma unroll
            for (u32 n = 0; n < 2; ++n)
#pragma unroll
                for (u32 i = 0; i < 4; ++i) s[n][i] = 0.0f;
            if (__any_sync(CP_FULL_MASK, mine)) {
#pragma unroll 4
                for (u32 ks = 0; ks < kKSteps; ++ks) {
                    u32 a[4], bq[4];
                    ptx::ldmatrix_x4(a, sQ + (srow0 + r8 + 8 * (tile & 1u)) * kPitch + ks * 16 + 8 * (tile >> 1));
                    ptx::ldmatrix_x4(bq, kt + (16 * th + r8 + 8 * (tile >> 1)) * kPitch + ks * 16 + 8 * (tile & 1u));
                    const u32 b0[2] = {bq[0], bq[1]}, b1[2] = {bq[2], bq[3]};
                    ptx::mma_16816<scalar_t>(s[0], a, b0);
                    ptx::mma_16816<scalar_t>(s[1], a, b1);
                }
            }
            // Scale into the log2 domain, the score hook, mask.
            float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
            for (u32 n = 0; n < 2; ++n)
#pragma unroll
                for (u32 i = 0; i < 4; ++i) {
                    const u32 h = i >> 1;
                    float v = s[n][i] * qscale;
                    if constexpr (!variant::kPlainScore)
                        v = variant::score(sc, srow[h], v, t0 + 16 * th + n * 8 + 2 * tq + (i & 1u));
                    s[n][i] = ((vis[h] >> (n * 8 + (i & 1u))) & 1u) ? v : neg_inf();
                    mx[h] = fmaxf(mx[h], s[n][i]);
                }
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 1));
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 2));
                if (tq == 0) s_max[th][srow0 + g + 8 * h] = mx[h];
            }
            // The maxima meet; and whether any stored row of the block misses a valid token.
            const bool mixed = __syncthreads_or(miss) != 0;
            // ---- P = exp2(S - m) into shared memory, row sums ----
            float ps[2] = {0.0f, 0.0f};
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                const u32 r = srow0 + g + 8 * h;
                ms[h].raise(fmaxf(s_max[0][r], s_max[1][r]));
                const float mu = ms[h].offset();
#pragma unroll
                for (u32 n = 0; n < 2; ++n) {
                    const float p0 = exp2f(s[n][2 * h] - mu), p1 = exp2f(s[n][2 * h + 1] - mu);
                    ps[h] += p0 + p1;
                    *reinterpret_cast<u32*>(sP + r * kPPitch + 16 * th + n * 8 + 2 * tq) = ptx::pack2<scalar_t>(p0, p1);
                }
                ps[h] += __shfl_xor_sync(CP_FULL_MASK, ps[h], 1);
                ps[h] += __shfl_xor_sync(CP_FULL_MASK, ps[h], 2);
            }
#pragma unroll
            for (u32 h = 0; h < 2; ++h)
                if (tq == 0) s_sum[th][srow0 + g + 8 * h] = ps[h];
            __syncthreads();
            // ---- O (all rows, columns c0..) = O * alpha + P V ----
#pragma unroll
            for (u32 mt = 0; mt < kMTiles; ++mt)
#pragma unroll
                for (u32 h = 0; h < 2; ++h) {
                    const u32 r = mt * 16 + g + 8 * h;
                    const float alpha = so[mt][h].raise(fmaxf(s_max[0][r], s_max[1][r]));
                    so[mt][h].add(alpha, s_sum[0][r] + s_sum[1][r]);
#pragma unroll
                    for (u32 n = 0; n < kOTiles; ++n) {
                        o[mt][n][2 * h] *= alpha;
                        o[mt][n][2 * h + 1] *= alpha;
                    }
                }
            if (!mixed) {
#pragma unroll
                for (u32 kk = 0; kk < kN / 16; ++kk) {
                    u32 a[kMTiles][4];
#pragma unroll
                    for (u32 mt = 0; mt < kMTiles; ++mt)
                        ptx::ldmatrix_x4(a[mt],
                                         sP + (mt * 16 + r8 + 8 * (tile & 1u)) * kPPitch + kk * 16 + 8 * (tile >> 1));
#pragma unroll
                    for (u32 dp = 0; dp < kOTiles / 2; ++dp) {
                        u32 bq[4];
                        ptx::ldmatrix_x4_trans(
                            bq, kt + (kk * 16 + r8 + 8 * (tile & 1u)) * kPitch + c0 + dp * 16 + 8 * (tile >> 1));
                        const u32 b0[2] = {bq[0], bq[1]}, b1[2] = {bq[2], bq[3]};
#pragma unroll
                        for (u32 mt = 0; mt < kMTiles; ++mt) {
                            ptx::mma_16816<scalar_t>(o[mt][2 * dp], a[mt], b0);
                            ptx::mma_16816<scalar_t>(o[mt][2 * dp + 1], a[mt], b1);
                        }
                    }
                }
            } else {
                // Careful k-steps: every row's visibility of the k-step's 16 tokens, from the block's spans.
                const u32 valid_all = st.valid[b][0];
#pragma unroll 1
                for (u32 kk = 0; kk < kN / 16; ++kk) {
                    const u32 valid16 = (valid_all >> (16 * kk)) & 0xffffu;
                    u32 a[kMTiles][4];
                    u32 kv[kMTiles][2];
                    bool mx16[kMTiles];
#pragma unroll
                    for (u32 mt = 0; mt < kMTiles; ++mt) {
                        ptx::ldmatrix_x4(a[mt],
                                         sP + (mt * 16 + r8 + 8 * (tile & 1u)) * kPPitch + kk * 16 + 8 * (tile >> 1));
                        bool m = false;
#pragma unroll
                        for (u32 h = 0; h < 2; ++h) {
                            const u32 r = mt * 16 + g + 8 * h, slot = r / ht, hl = r - slot * ht;
                            const bool stored = slot < qt && q0 + slot < q_end && hl < heads;
                            const bool in = stored && slot >= slot_lo && slot < slot_hi;
                            kv[mt][h] =
                                in ? valid16 & (u32)tc::row_bits(rows.lo[slot], rows.hi[slot], t0 + 16 * kk, 16) : 0u;
                            m |= stored && kv[mt][h] != valid16;
                        }
                        mx16[mt] = __any_sync(CP_FULL_MASK, m);
                    }
#pragma unroll
                    for (u32 dp = 0; dp < kOTiles / 2; ++dp) {
                        u32 bq[4];
                        ptx::ldmatrix_x4_trans(
                            bq, kt + (kk * 16 + r8 + 8 * (tile & 1u)) * kPitch + c0 + dp * 16 + 8 * (tile >> 1));
#pragma unroll
                        for (u32 mt = 0; mt < kMTiles; ++mt)
                            tc::pv_step<scalar_t>(o[mt][2 * dp], o[mt][2 * dp + 1], a[mt], bq, mx16[mt], kv[mt][0],
                                                  kv[mt][1], kt + kk * 16 * kPitch, kPitch, c0 + dp * 16);
                    }
                }
            }
        };
        tc::run_ring<kN, 2>(st, tables + (u64)seq * p.table_width, lo, hi, p.page_size, p.num_pages, issue, compute);
    });

    // ---- normalize and write: every warp its value columns of all rows ----
    const bool split = p.splits > 1;
#pragma unroll
    for (u32 mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            const u32 r = mt * 16 + g + 8 * h, slot = r / ht, hl = r - slot * ht;
            if (!(slot < qt && q0 + slot < q_end && hl < heads)) continue;
            const epi::Row row = epi::row_of(p, (q0 + slot) * q_heads + head0 + hl, split);
            // The head's sink (not in a split partial); V is the latent: its codes times k_scale (fp8).
            const float inv = epi::finish(so[mt][h], sc, head0 + hl, split, ks);
#pragma unroll
            for (u32 n = 0; n < kOTiles; ++n)
                epi::store_pair(out, part_out, row.dst * kR + c0 + n * 8 + 2 * tq, split, o[mt][n][2 * h] * inv,
                                o[mt][n][2 * h + 1] * inv);
            if (warp == 0 && tq == 0) epi::store_lse(lse, part_lse, p.write_lse, row, split, so[mt][h].lse());
        }
}
