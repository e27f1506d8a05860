// prefill_tc.cu: paged_prefill_tc, chunked-prefill attention on tensor cores,
// (the split merge: merge.cu). Layout, positions, metadata words,
// LSE and the split workspace: docs/layout.md. The argument is one
// AttentionParams (params.cuh); the block's rows, the K/V tile ring and the
// passes are shared with paged_mla_tc (tc_common.cuh), the inline PTX lives
// in ptx.cuh.
//
// paged_prefill_tc: FlashAttention-2 style, f16 / bf16 q, caches of q's type
//   or fp8 (e4m3 / e5m2 with k_scale / v_scale), D == Dv == HEAD_DIM, any
//   cache views with 16-byte aligned rows (K and V rows at page * stride_page
//   + slot * stride_slot + head * stride_head, strides from AttentionParams).
//   grid (ceil(q_count / qt), kv_heads * head_tiles, splits), block 32 * TC_WARPS,
//   dynamic shared memory prefill_tc.smem_bytes (cupaged/ops/attention/kernels/prefill_tc.py, per variant).
//   Rows (the M dimension, kRows = 16 * TC_MTILES * TC_WARPS per block) are
//   (query, head) pairs: ht = min(G, kRows) query heads of one KV head's GQA
//   group for each of qt = kRows / ht consecutive packed queries (blocks tile
//   the launch's range from q_begin), so a K/V row read serves qt * ht rows.
//   Warp w owns rows 16 * TC_MTILES * w .. + 16 * TC_MTILES - 1: TC_MTILES
//   m-tiles of 16 rows, so each K (and V) fragment loaded by ldmatrix feeds
//   TC_MTILES mma (D <= 128: two m-tiles, 0.375 ldmatrix per mma). Q is
//   staged once (cp.async) and read by ldmatrix each k-step, or kept as mma
//   A fragments in registers when they fit (TC_MTILES * D <= kQRegsMaxElems,
//   geom::prefill_tc: prefill_tc.py Q_REGS_MAX_ELEMS).
//   K and V tiles of kN = TC_KV_TILE tokens are copied page by page with
//   cp.async through a ring of TC_STAGES buffers (kS - 1 tiles in flight
//   while one computes, one barrier a tile); S = Q K^T and O += P V run on
//   mma.sync m16n8k16 with f32 accumulation; the online softmax
//   (softmax_state.cuh) runs in f32 in the log2 domain on the S fragments
//   (a row's max and sum live in the 4 lanes of a quad); each finished row
//   goes through epilogue.cuh's writer (the sink, the V scale, out and lse or
//   a split partial).
//   fp8 caches: the ring holds the tiles' raw codes (K [kN][D], V [kN][D]
//   bytes: half the bytes, same stages); after a tile's barrier the block
//   decodes it, exactly (fp8.cuh), into one 16-bit K / V tile [kN][kPitch]
//   (K in q's type, V in f16: P V runs as an f16 mma), meets at a second
//   barrier and computes as above; k_scale multiplies the score scale,
//   v_scale the output (one KV head a block; a null scale is 1).
//   Each row sees positions [lo, hi) of its query (the visibility hook and the
//   split share, span.cuh); a warp whose rows see nothing of a tile skips its
//   products. Positions past the pass's end and page ids >= num_pages are
//   zero-filled (never read) and masked, so no unused slot reaches the output.
//   A valid token a row cannot see (past its causal position, outside its
//   split share, another sequence's row) contributes exactly nothing, also
//   when its value row holds Inf or NaN (tc::pv_step: only k-steps where
//   some row misses a valid token check V, and only a slice with a
//   non-finite value leaves the tensor cores).
//
// Memory traffic: K/V are read once per block instead of once per query, about
// ceil(q_len * G / kRows) * L * (D + Dv) * sizeof(kv_t) bytes per sequence and
// KV head; q and the outputs once.
//
// Defines (cupaged/ops/attention/variants.py Variant; the tile table: prefill_tc.py PREFILL_TILES):
//   CP_DTYPE               f16 | bf16: q and out
//   CP_KV_DTYPE            the caches: CP_DTYPE, or e4m3 | e5m2 (kKvScaled: decoded in shared memory)
//   CP_SCORE               the score variant (variant.cuh)
//   CP_SOFT_CAP, CP_WINDOW, CP_SINKS, CP_ALIBI  its features (variant.cuh). With a window the rows of
//                          a block see different ranges: a pass reads [min lo, max hi) of its rows
//                          (pages wholly before every row's window are never read) and masks per row
//   HEAD_DIM               64 | 128 | 256: D == Dv
//   TC_WARPS, TC_MTILES    warps per block, m-tiles (16 rows) per warp
//   TC_KV_TILE, TC_STAGES  tokens per K/V tile, tile buffers in the ring
//   TC_MIN_BLOCKS          resident blocks per SM designed for (__launch_bounds__)
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

namespace tcp {
constexpr u32 kD = HEAD_DIM;
constexpr u32 kMT = TC_MTILES;  // m-tiles per warp
constexpr u32 kWarps = TC_WARPS, kThreads = 32 * kWarps;
constexpr u32 kRows = 16 * kMT * kWarps;  // (query, head) rows per block
constexpr u32 kN = TC_KV_TILE;  // tokens per K/V tile
constexpr u32 kS = TC_STAGES;  // tile buffers
constexpr u32 kPitch = kD + geom::kPitchPad;  // shared row pitch (elements): conflict-free ldmatrix
constexpr u32 kChunks = kD / 8;  // 16-byte chunks per q row
// fp8 caches (kKvScaled): the codes of a tile are copied raw (half the
// bytes) into a ring of their own and, after the tile's barrier, decoded by
// the block into one 16-bit K / V tile the fragments load from (K as
// scalar_t, V as f16: tc::v16_t), then a second barrier.
constexpr bool kFp8 = kKvScaled;
constexpr u32 kCopyChunks = kD * sizeof(kv_t) / geom::kVectorBytes;  // 16-byte copies per cache row
constexpr u32 kCopyElems = geom::kVectorBytes / sizeof(kv_t);  // cache elements per copy
constexpr u32 kKSteps = kD / 16;  // k-steps of S = Q K^T
constexpr u32 kSTiles = kN / 8;  // n-tiles of S
constexpr u32 kOTiles = kD / 8;  // n-tiles of O
constexpr bool kQInRegs = kMT * kD <= geom::prefill_tc::kQRegsMaxElems;  // Q's A fragments: kMT * kKSteps * 4 registers
constexpr u32 kRowStep = kThreads / kCopyChunks;  // rows one pass of the block's threads copies
static_assert(kD == 64 || kD == 128 || kD == 256, "HEAD_DIM: 64, 128 or 256");
static_assert(kMT == 1 || kMT == 2, "one or two m-tiles per warp");
static_assert(kN == 16 || kN == 32 || kN == 64, "K/V tiles of 16, 32 or 64 tokens");
static_assert(kN % kRowStep == 0 || kRowStep % kN == 0, "whole rows per copy pass");
// Q and K meet in one mma: 16-bit caches of q's type are copied raw into the
// 16-bit tiles, fp8 ones decoded into them.
static_assert(sizeof(scalar_t) == 2 && (kFp8 || sizeof(kv_t) == 2), "f16 / bf16 q; f16 / bf16 / fp8 caches");
// Shared memory (scalar_t elements): Q [kRows][kPitch]; the K / V tiles, kS
// of each (16-bit caches) or one of each (fp8: the decoded tile), whose area
// starts at 0 when Q moves to registers; fp8: then the raw ring, kS stages of
// K [kN][kD] and V [kN][kD] codes.
constexpr u32 kQElems = kRows * kPitch;
constexpr u32 kKvElems = 2 * (kFp8 ? 1 : kS) * kN * kPitch;
constexpr u32 kRawOff = kQInRegs ? (kQElems > kKvElems ? kQElems : kKvElems) : kQElems + kKvElems;
constexpr u32 kRawStage = 2 * kN * kD;  // bytes of one raw stage (fp8)
// How a copying thread forms its K / V row offsets (the views' strides). The kernel runs at its
// register cap (__launch_bounds__), where ptxas' allocation decides spills, not the instruction
// count: the NVRTC gate (no spills, sm_80 / sm_90, every registered variant) found the forms below.
//   kStagedRows: the staging threads compute each token's offsets once per tile (tc::run_ring's
//     on_stage) into shared memory, the copying threads add their chunk (Q in registers, f16 q);
//   else the copying thread computes them, the head's part from shared memory when Q stays in
//     shared memory (s_head) and as a product ptxas hoists when Q is in registers (bf16 q).
template <typename T>
struct IsHalf {
    static constexpr bool value = false;
};
template <>
struct IsHalf<__half> {
    static constexpr bool value = true;
};
constexpr bool kStagedRows = kQInRegs && IsHalf<scalar_t>::value;
static_assert((kN * kD / 8) % kThreads == 0, "whole decode steps per thread");
}  // namespace tcp

extern "C" __global__ void __launch_bounds__(tcp::kThreads, TC_MIN_BLOCKS) paged_prefill_tc(const AttentionParams p) {
    CP_ATTENTION_ARRAYS(p);  // the arrays as __restrict__ locals (epilogue.cuh)
    ptx::launch_dependents();  // the split merge, a dependent launch, may start: it waits for this grid
    using namespace tcp;
    using tc::kNone;
    CUPAGED_DYNAMIC_SHARED(scalar_t, smem);
    // Q [kRows][kPitch], then K [kS][kN][kPitch] and V [kS][kN][kPitch]. With Q
    // held in registers its staging area is reused by the K/V buffers (the
    // first copy into them follows a barrier after the fragments are loaded).
    scalar_t* const sQ = smem;
    scalar_t* const sK = kQInRegs ? smem : sQ + kRows * kPitch;
    scalar_t* const sV = sK + (kFp8 ? 1 : kS) * kN * kPitch;
    unsigned char* const sRaw = reinterpret_cast<unsigned char*>(smem + kRawOff);  // fp8: the raw ring
    __shared__ tc::RowSet<kRows> rows;
    __shared__ tc::Ring<kN, kS> st;
    // The block's KV head's row offsets in K and V (element strides; kStagedRows below).
    __shared__ u64 s_head[2];
    // kStagedRows: each staged token's K / V row offsets (head kvh; 0 for no row), per staging buffer.
    __shared__ u64 s_koff[kStagedRows ? 2 : 1][kStagedRows ? kN : 1], s_voff[kStagedRows ? 2 : 1][kStagedRows ? kN : 1];

    const u32 tid = threadIdx.x, warp = tid >> 5, lane = tid & 31u;
    const u32 g = lane >> 2, tq = lane & 3u;  // mma fragment coordinates
    const u32 r8 = lane & 7u, tile = lane >> 3;  // ldmatrix: row within a tile, tile of the x4
    const u32 row0 = warp * 16 * kMT;  // the warp's first row
    const u32 q_heads = p.q_heads;
    const tc::Place<kRows> place(p);  // this block's heads and queries
    const u32 group = place.group, ht = place.ht, qt = place.qt, kvh = place.kvh;
    const u32 head0 = place.head0, heads = place.heads, q_end = place.q_end;
    const u64 q0 = place.q0;

    // ---- Q rows (zero rows for slots without a query or head) ----
    for (u32 c = tid; c < kRows * kChunks; c += kThreads) {
        const u32 r = c / kChunks, ch = c - r * kChunks;
        const u32 slot = r / ht, hl = r - slot * ht;
        const bool ok = slot < qt && q0 + slot < q_end && hl < heads;
        const scalar_t* src = q + att::q_at(p, q0 + slot, head0 + hl) + ch * 8;
        ptx::cp_async_16(sQ + r * kPitch + ch * 8, ok ? src : q, ok);
    }
    ptx::cp_async_commit();
    tc::setup_row_set(rows, p, q0, qt, q_end);
    if (tid == 0) {
        s_head[0] = (u64)kvh * p.k_stride_head;
        s_head[1] = (u64)kvh * p.v_stride_head;
    }
    const variant::Scorer sc(p);  // a score variant's arguments
    tc::setup_slopes(rows, sc, head0);
    ptx::cp_async_wait<0>();
    __syncthreads();

    u32 qf[kQInRegs ? kMT : 1][kQInRegs ? kKSteps : 1][4];
    if constexpr (kQInRegs) {
#pragma unroll
        for (u32 mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (u32 ks = 0; ks < kKSteps; ++ks)
                ptx::ldmatrix_x4(qf[mt][ks],
                                 sQ + (row0 + 16 * mt + r8 + 8 * (tile & 1u)) * kPitch + ks * 16 + 8 * (tile >> 1));
    }

    // This thread's rows (g and g + 8 of each m-tile): query slot, or kNone.
    u32 my_slot[kMT][2];
#pragma unroll
    for (u32 mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            const u32 r = row0 + 16 * mt + g + 8 * h, slot = r / ht, hl = r - slot * ht;
            my_slot[mt][h] = (slot < qt && q0 + slot < q_end && hl < heads) ? slot : kNone;
        }

    // An fp8 cache's K scale folds into the score scale, its V scale into the
    // output (every row of the block reads KV head kvh).
    float qscale = p.scale * softmax::kLog2e;
    if constexpr (kFp8)
        if (p.k_scale) qscale *= p.k_scale[kvh * p.k_scale_stride];  // null: 1
    softmax::State sm[kMT][2];
    float o[kMT][kOTiles][4];
#pragma unroll
    for (u32 mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (u32 h = 0; h < 2; ++h) sm[mt][h].clear();
#pragma unroll
        for (u32 n = 0; n < kOTiles; ++n)
#pragma unroll
            for (u32 i = 0; i < 4; ++i) o[mt][n][i] = 0.0f;
    }

    const u32* const tables = words + pw::page_table(p.queries, p.sequences);

    tc::for_each_pass_of(rows, qt, [&](u32 seq, u32 slot_lo, u32 slot_hi, u32 lo, u32 hi) {
        u32 rlo[kMT][2], rhi[kMT][2];  // this thread's rows' positions in this pass
#pragma unroll
        for (u32 mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                const u32 s = my_slot[mt][h];
                const bool in = s != kNone && s >= slot_lo && s < slot_hi;
                rlo[mt][h] = in ? rows.lo[s] : 0u;
                rhi[mt][h] = in ? rows.hi[s] : 0u;
            }
        auto issue = [&](u32 sb, u32 b) {
            // This thread's chunk of its KV head's rows (the views' element strides: the row of token
            // (page, slot) of head kvh is page * stride_page + slot * stride_slot + kvh * stride_head).
            const u64 kh = kQInRegs ? 0ull : s_head[0], vh = kQInRegs ? 0ull : s_head[1];
            // Thread tid copies chunk tid % kCopyChunks of rows tid / kCopyChunks + i * kRowStep.
#pragma unroll
            for (u32 i = 0; i < (kN + kRowStep - 1) / kRowStep; ++i) {
                const u32 r = tid / kCopyChunks + i * kRowStep, ch = tid % kCopyChunks;
                if (kN % kRowStep != 0 && r >= kN) break;
                const uint2 ps = st.row[sb][r];  // page, slot
                const bool ok = ps.x != kNone;
                u64 koff, voff;
                if constexpr (kStagedRows) {  // (0 for an invalid row: a row inside the caches, never read)
                    const u32 dst = (b * kN + r) * kPitch + ch * 8;
                    if constexpr (!kFp8) {
                        ptx::cp_async_16(sK + dst, k_cache + (s_koff[sb][r] + ch * kCopyElems), ok);
                        ptx::cp_async_16(sV + dst, v_cache + (s_voff[sb][r] + ch * kCopyElems), ok);
                        continue;
                    }
                    koff = s_koff[sb][r] + ch * kCopyElems;
                    voff = s_voff[sb][r] + ch * kCopyElems;
                } else {
                    koff = (u64)ps.x * p.k_stride_page +
                           ((u64)ps.y * p.k_stride_slot + (kQInRegs ? (u64)kvh * p.k_stride_head : kh)) +
                           ch * kCopyElems;
                    voff = (u64)ps.x * p.v_stride_page +
                           ((u64)ps.y * p.v_stride_slot + (kQInRegs ? (u64)kvh * p.v_stride_head : vh)) +
                           ch * kCopyElems;
                }
                if constexpr (kFp8) {
                    unsigned char* const dst = sRaw + b * kRawStage + r * kD + ch * 16;
                    ptx::cp_async_16(dst, ok ? k_cache + koff : k_cache, ok);
                    ptx::cp_async_16(dst + kN * kD, ok ? v_cache + voff : v_cache, ok);
                } else {
                    const u32 dst = (b * kN + r) * kPitch + ch * 8;
                    ptx::cp_async_16(sK + dst, ok ? k_cache + koff : k_cache, ok);
                    ptx::cp_async_16(sV + dst, ok ? v_cache + voff : v_cache, ok);
                }
            }
        };
        auto compute = [&](u32 b, u32 t0) {
            if constexpr (kFp8) {
                // Every warp is past tile j - 1's compute (the ring's barrier): the
                // block decodes tile j into the 16-bit tiles, then meets again.
                const unsigned char* const raw = sRaw + b * kRawStage;
                tc::decode_rows<scalar_t, kD, kN, kThreads>(raw, sK, kPitch, tid);
                tc::decode_rows<tc::v16_t, kD, kN, kThreads>(raw + kN * kD, reinterpret_cast<tc::v16_t*>(sV), kPitch,
                                                             tid);
                __syncthreads();
            }
            const u32 tb = kFp8 ? 0u : b;  // the 16-bit tile to read
            // Bit dt of vis[mt][h]: row (mt, h) sees token t0 + dt (its share, and a valid page).
            u64 vbits = st.valid[b][0];
            if constexpr (kN > 32) vbits |= (u64)st.valid[b][kN > 32 ? 1 : 0] << 32;
            u64 vis[kMT][2];
            bool any = false;
#pragma unroll
            for (u32 mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (u32 h = 0; h < 2; ++h) {
                    vis[mt][h] = tc::tile_vis<kN>(vbits, rlo[mt][h], rhi[mt][h], t0);
                    any |= vis[mt][h] != 0;
                }
            if (!__any_sync(CP_FULL_MASK, any)) return;  // none of the warp's rows sees this tile

            // S = Q K^T: [16 kMT x kN] per warp; each K fragment feeds kMT mma.
            const scalar_t* const kt = sK + tb * kN * kPitch;
            float s[kMT][kSTiles][4];
#pragma unroll
            for (u32 mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (u32 n = 0; n < kSTiles; ++n)
#pragma unroll
                    for (u32 i = 0; i < 4; ++i) s[mt][n][i] = 0.0f;
#pragma unroll
            for (u32 ks = 0; ks < kKSteps; ++ks) {
                u32 a[kMT][4];
#pragma unroll
                for (u32 mt = 0; mt < kMT; ++mt) {
                    if constexpr (kQInRegs) {
#pragma unroll
                        for (u32 i = 0; i < 4; ++i) a[mt][i] = qf[kQInRegs ? mt : 0][kQInRegs ? ks : 0][i];
                    } else {
                        ptx::ldmatrix_x4(
                            a[mt], sQ + (row0 + 16 * mt + r8 + 8 * (tile & 1u)) * kPitch + ks * 16 + 8 * (tile >> 1));
                    }
                }
#pragma unroll
                for (u32 np = 0; np < kSTiles / 2; ++np) {
                    u32 bq[4];
                    ptx::ldmatrix_x4(bq, kt + (np * 16 + r8 + 8 * (tile >> 1)) * kPitch + ks * 16 + 8 * (tile & 1u));
                    const u32 b0[2] = {bq[0], bq[1]}, b1[2] = {bq[2], bq[3]};
#pragma unroll
                    for (u32 mt = 0; mt < kMT; ++mt) {
                        ptx::mma_16816<scalar_t>(s[mt][2 * np], a[mt], b0);
                        ptx::mma_16816<scalar_t>(s[mt][2 * np + 1], a[mt], b1);
                    }
                }
            }

            // Scale into the log2 domain, the score hook, mask; online softmax per row. A score
            // variant's rows (query position, head, ALiBi slope) come from shared memory each tile:
            // held across the tile loop they would take registers the kernel does not have.
            variant::ScoreRow srow[kMT][2];
            if constexpr (!variant::kPlainScore) {
#pragma unroll
                for (u32 mt = 0; mt < kMT; ++mt)
#pragma unroll
                    for (u32 h = 0; h < 2; ++h)
                        srow[mt][h] = tc::score_row(rows, my_slot[mt][h], row0 + 16 * mt + g + 8 * h, ht, head0, qt);
            }
#pragma unroll
            for (u32 mt = 0; mt < kMT; ++mt) {
                float mx[2] = {neg_inf(), neg_inf()};
                // This lane's columns 2 tq, 2 tq + 1 of each n-tile: bits n * 8 + e after the shift.
                const u64 lv[2] = {vis[mt][0] >> (2 * tq), vis[mt][1] >> (2 * tq)};
#pragma unroll
                for (u32 n = 0; n < kSTiles; ++n)
#pragma unroll
                    for (u32 i = 0; i < 4; ++i) {
                        const u32 h = i >> 1, col = n * 8 + 2 * tq + (i & 1u);
                        float v = s[mt][n][i] * qscale;
                        if constexpr (!variant::kPlainScore) v = variant::score(sc, srow[mt][h], v, t0 + col);
                        s[mt][n][i] = ((lv[h] >> (n * 8 + (i & 1u))) & 1u) ? v : neg_inf();
                        mx[h] = fmaxf(mx[h], s[mt][n][i]);
                    }
                float alpha[2], mu[2];
#pragma unroll
                for (u32 h = 0; h < 2; ++h) {
                    mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 1));
                    mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 2));
                    alpha[h] = sm[mt][h].raise(mx[h]);
                    mu[h] = sm[mt][h].offset();  // exp2(-inf - mu) = 0 for masked scores
                }
                float ps[2] = {0.0f, 0.0f};
#pragma unroll
                for (u32 n = 0; n < kSTiles; ++n)
#pragma unroll
                    for (u32 i = 0; i < 4; ++i) {
                        s[mt][n][i] = exp2f(s[mt][n][i] - mu[i >> 1]);
                        ps[i >> 1] += s[mt][n][i];
                    }
#pragma unroll
                for (u32 h = 0; h < 2; ++h) sm[mt][h].add(alpha[h], ps[h]);  // this lane's part of the row sum
#pragma unroll
                for (u32 n = 0; n < kOTiles; ++n)
#pragma unroll
                    for (u32 i = 0; i < 4; ++i) o[mt][n][i] *= alpha[i >> 1];
            }

            // O += P V: P's S fragments are its A fragments (two n-tiles per k-step).
            const tc::v16_t* const vt = reinterpret_cast<const tc::v16_t*>(sV + tb * kN * kPitch);
            // A tile where a stored row misses a valid token (the causal
            // diagonal, split edges, another sequence's rows) takes the careful
            // loop, which keeps masked value rows out even when they hold Inf
            // or NaN (tc::pv_step); every other tile the plain products.
            bool miss = false;
#pragma unroll
            for (u32 mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (u32 h = 0; h < 2; ++h) miss |= my_slot[mt][h] != kNone && vis[mt][h] != vbits;
            if (!__any_sync(CP_FULL_MASK, miss)) {
#pragma unroll
                for (u32 kk = 0; kk < kN / 16; ++kk) {
                    u32 a[kMT][4];
#pragma unroll
                    for (u32 mt = 0; mt < kMT; ++mt) {
                        a[mt][0] = ptx::pack2<tc::v16_t>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                        a[mt][1] = ptx::pack2<tc::v16_t>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                        a[mt][2] = ptx::pack2<tc::v16_t>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                        a[mt][3] = ptx::pack2<tc::v16_t>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
                    }
#pragma unroll
                    for (u32 dp = 0; dp < kOTiles / 2; ++dp) {
                        u32 bq[4];
                        ptx::ldmatrix_x4_trans(
                            bq, vt + (kk * 16 + r8 + 8 * (tile & 1u)) * kPitch + dp * 16 + 8 * (tile >> 1));
                        const u32 b0[2] = {bq[0], bq[1]}, b1[2] = {bq[2], bq[3]};
#pragma unroll
                        for (u32 mt = 0; mt < kMT; ++mt) {
                            ptx::mma_16816<tc::v16_t>(o[mt][2 * dp], a[mt], b0);
                            ptx::mma_16816<tc::v16_t>(o[mt][2 * dp + 1], a[mt], b1);
                        }
                    }
                }
            } else {
#pragma unroll 1
                for (u32 kk = 0; kk < kN / 16; ++kk) {
                    u32 a[kMT][4];
                    u32 kv[kMT][2];  // this lane's rows' visibility of the k-step's 16 tokens
                    bool mixed[kMT];
                    const u32 valid16 = (u32)(vbits >> (16 * kk)) & 0xffffu;
#pragma unroll
                    for (u32 mt = 0; mt < kMT; ++mt) {
                        float p[2][4];  // S n-tiles 2 kk, 2 kk + 1, picked without indexing by kk
#pragma unroll
                        for (u32 i = 0; i < 4; ++i) {
                            p[0][i] = s[mt][0][i];
                            p[1][i] = s[mt][1][i];
                        }
#pragma unroll
                        for (u32 k2 = 1; k2 < kN / 16; ++k2)
                            if (kk == k2) {
#pragma unroll
                                for (u32 i = 0; i < 4; ++i) {
                                    p[0][i] = s[mt][2 * k2][i];
                                    p[1][i] = s[mt][2 * k2 + 1][i];
                                }
                            }
                        a[mt][0] = ptx::pack2<tc::v16_t>(p[0][0], p[0][1]);
                        a[mt][1] = ptx::pack2<tc::v16_t>(p[0][2], p[0][3]);
                        a[mt][2] = ptx::pack2<tc::v16_t>(p[1][0], p[1][1]);
                        a[mt][3] = ptx::pack2<tc::v16_t>(p[1][2], p[1][3]);
                        bool m = false;
#pragma unroll
                        for (u32 h = 0; h < 2; ++h) {
                            kv[mt][h] = (u32)(vis[mt][h] >> (16 * kk)) & 0xffffu;
                            m |= my_slot[mt][h] != kNone && kv[mt][h] != valid16;
                        }
                        mixed[mt] = __any_sync(CP_FULL_MASK, m);
                    }
#pragma unroll
                    for (u32 dp = 0; dp < kOTiles / 2; ++dp) {
                        u32 bq[4];
                        ptx::ldmatrix_x4_trans(
                            bq, vt + (kk * 16 + r8 + 8 * (tile & 1u)) * kPitch + dp * 16 + 8 * (tile >> 1));
#pragma unroll
                        for (u32 mt = 0; mt < kMT; ++mt)
                            tc::pv_step<tc::v16_t>(o[mt][2 * dp], o[mt][2 * dp + 1], a[mt], bq, mixed[mt], kv[mt][0],
                                                   kv[mt][1], vt + kk * 16 * kPitch, kPitch, dp * 16);
                    }
                }
            }
        };
        auto on_stage = [&](u32 sb, u32 t, u32 page, u32 slot) {
            if constexpr (kStagedRows) {
                const bool ok = page != kNone;
                s_koff[sb][t] = ok ? (u64)page * p.k_stride_page + (u64)slot * p.k_stride_slot + s_head[0] : 0ull;
                s_voff[sb][t] = ok ? (u64)page * p.v_stride_page + (u64)slot * p.v_stride_slot + s_head[1] : 0ull;
            }
        };
        tc::run_ring<kN, kS>(st, tables + (u64)seq * p.table_width, lo, hi, p.page_size, p.num_pages, issue, compute,
                             on_stage);
    });

    // ---- normalize and write ----
    // A row index fits 32 bits (out's size check). Its width is ptxas's allocation at the register cap of
    // the all-feature builds: 32 bits spill with an fp8 cache, 64 with a 16-bit one (the gate's rows).
    using row_t = typename tc::Pick<kFp8, u64, u32>::type;
    const bool split = p.splits > 1;
#pragma unroll
    for (u32 mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            float l = sm[mt][h].l;
            l += __shfl_xor_sync(CP_FULL_MASK, l, 1);
            l += __shfl_xor_sync(CP_FULL_MASK, l, 2);
            sm[mt][h].l = l;
            const u32 slot = my_slot[mt][h];
            if (slot == kNone) continue;
            // The row writer inline, not epilogue.cuh's (a documented hook: through epi::finish / row_of /
            // store_lse ptxas needs up to 8 more registers here and spills in the ALiBi builds at the cap).
            const u32 r = row0 + 16 * mt + g + 8 * h;
            const row_t row = (row_t)(q0 + slot) * q_heads + head0 + (r - slot * ht);
            const u64 row_out = split ? (u64)blockIdx.z * p.queries * q_heads + row : row;
            float inv = sm[mt][h].inv_sum();
            if constexpr (variant::kSinks) {
                if (!split) {  // the head's sink, once (split partials leave it to the merge)
                    const float a = variant::fold_sink(sm[mt][h], sc.sink2(head0 + (r - slot * ht)));
                    inv = sm[mt][h].inv_sum() * a;
                }
            }
            if constexpr (kFp8)
                if (p.v_scale) inv *= p.v_scale[kvh * p.v_scale_stride];  // the cache's V scale (null: 1)
            const float lse_v = sm[mt][h].lse();
#pragma unroll
            for (u32 n = 0; n < kOTiles; ++n)
                epi::store_pair(out, part_out, row_out * kD + n * 8 + 2 * tq, split, o[mt][n][2 * h] * inv,
                                o[mt][n][2 * h + 1] * inv);
            if (tq == 0) {
                if (split)
                    part_lse[row_out] = lse_v;
                else if (p.write_lse)
                    lse[row] = lse_v;
            }
        }
}
