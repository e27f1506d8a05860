// prefill_wgmma.cu: paged_prefill_wgmma, chunked-prefill attention on
// Hopper's warpgroup tensor-core instructions (wgmma.mma_async, sm_90a only;
// the split merge: merge.cu). Same arguments, rows, passes, masks and
// outputs as paged_prefill_tc (prefill_tc.cu): one AttentionParams
// (params.cuh), q [queries, Hq, D], caches [pages, page_size, Hkv, D] (any
// views with 16-byte aligned rows, addressed through their strides), out
// [queries, Hq, D]. Layout, positions, metadata words, LSE and the split
// workspace: docs/layout.md.
//
// Selected on sm_90 for 16-bit q at its head dims (paged_prefill_tc elsewhere). Modeled (python -m
// cupaged.tools.perf_model, pessimistic end, H200, D 128) at 269 TFLOP/s causal 1x4096 and 277 chunked 4x2048,
// beside paged_prefill_tc's 240 and 277 (docs/performance.md): with the two warpgroups taking turns and P V
// overlapping the softmax the tensor wait is gone, but each warp still issues ~735 instructions a tile, and the
// ring's block barrier starts both warpgroups together every tile (the second waits for the first's products).
// What is left of issue #21's FA3 schedule: a producer warp filling the ring through full / empty barriers (no
// block barrier a tile, no copies or page walk in the consumers), setmaxnreg for the register split
// (warpgroup.cuh).
//
// paged_prefill_wgmma: f16 / bf16 q, D == Dv == HEAD_DIM (64, 128, 256),
//   caches of q's type or fp8 codes (e4m3 / e5m2, k_scale / v_scale per
//   tensor or KV head).
//   grid (ceil(q_count / qt), kv_heads * head_tiles, splits), block kThreads =
//   two warpgroups, __launch_bounds__(kThreads, kMinBlocks); dynamic shared
//   memory prefill_wgmma.smem_bytes (cupaged/ops/attention/kernels/prefill_wgmma.py,
//   = kSmemBytes). The block geometry (threads, minimum, tile, alignment) is
//   defined once in prefill_wgmma.py (GEOMETRY), the stages per head dim are
//   its tile's (TC_STAGES), read here through geometry.cuh (geom::prefill_wgmma).
//   Rows (the M dimension, kRows = 128 per block, 64 per warpgroup: one
//   wgmma m64 tile each) are (query, head) pairs as in paged_prefill_tc:
//   ht = min(G, kRows) query heads of one KV head's GQA group for each of
//   qt = kRows / ht consecutive packed queries, so a K/V row read serves
//   qt * ht rows. Warpgroup w owns rows 64 w .. 64 w + 63 (warp w4 of it rows
//   64 w + 16 w4 .. + 15, the wgmma fragment rows).
//   Shared memory, all in the 128-byte-swizzled K-major layout of wgmma
//   (ptx.cuh; rows of 128 bytes = 64 elements, 16-byte chunk c of row r at
//   chunk c ^ (r % 8), column blocks of 64 elements one after the other):
//     sQ  [D / 64 column blocks][128 rows][128 B]             Q, staged once
//     sK  [kS][D / 64 column blocks][64 tokens][128 B]        K tiles
//     sV  [kS][D / 64 column blocks][64 tokens][128 B]        V tiles
//   fp8 caches: one K and one V 16-bit tile, and a ring of kS raw tiles of
//   codes (K [64][D] and V [64][D] bytes, half the bytes), decoded exactly
//   (fp8.cuh) into the 16-bit tiles as each tile is used (K as q's type, V
//   as f16: P V runs in f16, tc::v16_t); k_scale folds into the score scale,
//   v_scale into the output.
//   Per tile of kN = 64 tokens (kS buffers; 16-bit caches at D <= 128, kDefer: ring_keep, kS - 2 tiles of
//   cp.async copies in flight, one computing, the one before kept for its P V; fp8 and D 256: tc::run_ring,
//   kS - 1 in flight; one block barrier a tile):
//     turn: the warpgroups take turns issuing their products (named barriers kTurn + w, warpgroup.cuh;
//        warpgroup 0 first), so one's products run while the other's softmax issues;
//     S: each warpgroup computes S [64 x 64] of its rows: D / 16 wgmma
//        m64n64k16 with Q and K from shared memory;
//     kDefer: in the same turn O += P V of the previous tile, waited for after the softmax (wait_group 1 for
//        S, then 0), then O is rescaled for this tile; otherwise P V in a second turn after the softmax;
//     softmax: f32, log2 domain, on the S fragments (softmax_state.cuh;
//        a row's max and sum live in the 4 lanes of a quad); the score hook
//        (variant.cuh) and the visibility of each row (span.cuh);
//     O += P V: P as wgmma A fragments from registers (the S fragments
//        converted), V read N-major from the tile: kN / 16 wgmma m64nDk16,
//        O [64 x D] f32 in registers (D / 2 a thread).
//   Finished rows: epilogue.cuh's writer (the sink, the V scale, out and lse
//   or a split partial).
//   Per 64-token tile and block: 2 x 2 x 128 x 64 x D FLOP (4.2 MFLOP at
//   D = 128) in 2 (D / 16 + 4) wgmma (each warpgroup: D / 16 for S, 4 for P V).
//   Each row sees positions [lo, hi) of its query (span.cuh: causal by
//   absolute position, the window, the split share); a pass reads [min lo,
//   max hi) of its rows and masks per row. Positions past the pass's end and
//   page ids >= num_pages are zero-filled (never read) and masked. A valid
//   token a stored row cannot see contributes exactly nothing, also when its
//   value row holds Inf or NaN: on a tile where some stored row of the block
//   misses a valid token the block checks the V tile (before the turns); if it
//   holds a non-finite element, each lane adds p * v for those elements of its
//   columns and the tokens its rows see, then they become 0 in the tile and
//   the tensor cores add the finite rest (masked P is 0); kDefer: before the
//   tile's deferred P V.
//
// Memory traffic: K/V are read once per block, about ceil(q_len * G / 128) *
// L * 2 * D * sizeof(kv_t) bytes per sequence and KV head; q and the outputs
// once.
//
// Defines (cupaged/ops/attention/variants.py Variant; the tiles: prefill_wgmma.py WGMMA_TILES):
//   CP_DTYPE               f16 | bf16: q and out
//   CP_KV_DTYPE            CP_DTYPE, or e4m3 | e5m2
//   CP_SCORE               the score variant (variant.cuh)
//   CP_SOFT_CAP, CP_WINDOW, CP_SINKS, CP_ALIBI  its features (variant.cuh)
//   HEAD_DIM               64 | 128 | 256: D == Dv
//   TC_STAGES              tile buffers of the ring
//   CP_TARGET              sm_90a (compiled for that arch only)
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
#include "warpgroup.cuh"

namespace pwg {
constexpr u32 kD = HEAD_DIM;
constexpr u32 kThreads = geom::prefill_wgmma::kThreads;
constexpr u32 kMinBlocks = geom::prefill_wgmma::kMinBlocks;  // the __launch_bounds__ minimum
constexpr u32 kN = geom::prefill_wgmma::kN;  // tokens per tile
constexpr u32 kS = TC_STAGES;  // tile buffers
constexpr u32 kAlign = geom::prefill_wgmma::kAlignBytes;  // the layout's start: a swizzle atom boundary
constexpr u32 kWgRows = 64;  // rows per warpgroup: one m64 wgmma tile
constexpr u32 kRows = kThreads / 128 * kWgRows;  // (query, head) rows per block
constexpr u32 kBlocks = kD / 64;  // 128-byte column blocks of a row
constexpr u32 kQCol = kRows * 128;  // bytes of one column block of Q
constexpr u32 kTCol = kN * 128;  // bytes of one column block of a K / V tile
constexpr u32 kQBytes = kBlocks * kQCol;
constexpr u32 kTileBytes = kBlocks * kTCol;  // one 16-bit K (or V) tile
constexpr bool kFp8 = kKvScaled;
constexpr u32 kTileBufs = kFp8 ? 1 : kS;  // 16-bit tiles of each of K and V
// P V of tile j runs in iteration j + 1, beside S of tile j + 1 (ring_keep keeps tile j's buffer): 16-bit caches
// with 3 or more buffers (fp8 decodes into one tile; D 256 has 2 buffers).
constexpr bool kDefer = !kFp8 && kS >= 3;
constexpr u32 kRawStage = kFp8 ? 2 * kN * kD : 0;  // bytes of one raw stage (fp8): K then V codes
// Dynamic shared memory (prefill_wgmma.smem_bytes): the layout above after up to kAlign - 1 bytes of alignment.
constexpr u32 kSmemBytes = kAlign + kQBytes + 2 * kTileBufs * kTileBytes + kS * kRawStage;
constexpr u32 kKSteps = kD / 16;  // k-steps of S = Q K^T
constexpr u32 kPSteps = kN / 16;  // k-steps of O += P V
constexpr u32 kChunks = kD / 8;  // 16-byte chunks of a 16-bit row
constexpr u32 kCopyChunks = kD * sizeof(kv_t) / geom::kVectorBytes;  // 16-byte copies per cache row
constexpr u32 kCopyElems = geom::kVectorBytes / sizeof(kv_t);  // cache elements per copy
constexpr u32 kCopyStep = kThreads / kCopyChunks;  // rows one pass of the block's threads copies
constexpr u32 kTurn = 1;  // named barriers kTurn + w: warpgroup w's turn to issue its products (warpgroup.cuh)
static_assert(kD == 64 || kD == 128 || kD == 256, "HEAD_DIM: 64, 128 or 256");
static_assert(kThreads == 2 * 128 && kRows == 128, "two warpgroups of 64 rows");
static_assert(kN == 64, "S [64 x 64] per warpgroup: tiles of 64 tokens (tc::tile_vis masks)");
static_assert(kAlign == 8 * 128, "a 128-byte swizzle atom: 8 rows of 128 B");
static_assert(kN % kCopyStep == 0, "whole rows per copy pass");
static_assert((kN * kChunks) % kThreads == 0, "whole decode steps per thread");
static_assert(sizeof(scalar_t) == 2 && (kFp8 || sizeof(kv_t) == 2), "f16 / bf16 q; f16 / bf16 / fp8 caches");
static_assert(kRawStage % kAlign == 0, "the tiles stay on swizzle atom boundaries");

// tc::run_ring with the buffer of the tile before the one computing kept (its V tile read by the deferred P V):
// iteration j stages and issues tile j + kS - 2 into the buffer of tile j - 2, waits for tile j (kS - 3 tiles
// after it in flight), one barrier a tile, compute(buf, t0, First{} / Later{}) as run_ring's compute (issue(sb,
// buf) and on_stage(sb, t, page, slot) too), the copies fenced to the async proxy (wgmma reads the tiles),
// finish() after the last tile. Every thread of the block calls it with the same lo, hi.
struct First {  // compute's third argument: the pass's first tile (no deferred tile before it) ...
    static constexpr bool kFirst = true;
};
struct Later {  // ... or a later one
    static constexpr bool kFirst = false;
};
// The page walk has no division in the loop: thread tid < kN keeps the page-table column and slot of its token
// of the next tile to fetch and advances them by kN tokens a tile (the pass's one division is its first token's).
template <u32 kN, u32 kS, typename Issue, typename Compute, typename Finish, typename OnStage>
__device__ __forceinline__ void ring_keep(tc::Ring<kN, kS>& st, const u32* __restrict__ table, u32 lo, u32 hi,
                                          u32 page_size, u32 num_pages, Issue&& issue, Compute&& compute,
                                          Finish&& finish, OnStage&& on_stage) {
    static_assert(kS >= 3 && kS <= 4, "3 or 4 buffers: one kept, one computing, at least one in flight");
    constexpr u32 kWords = tc::Ring<kN, kS>::kWords, kAhead = kS - 2;  // tiles issued ahead of the computing one
    const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    u32 raw = tc::kNone, slot = 0;  // token tid of a later tile: page-table word (kNone past hi) and slot
    const u32 step_j = kN / page_size, step_s = kN - step_j * page_size;
    u32 tok = lo + tid, pj = tok / page_size, psl = tok - pj * page_size;  // the next token to fetch
    auto fetch = [&] {
        raw = (tid < kN && tok < hi) ? table[pj] : tc::kNone;
        slot = psl;
        tok += kN;
        pj += step_j;
        psl += step_s;
        if (psl >= page_size) {
            psl -= page_size;
            ++pj;
        }
    };
    auto stage = [&](u32 sb) -> bool {
        const bool ok = raw < num_pages;
        if (tid < kN) {
            st.row[sb][tid] = make_uint2(ok ? raw : tc::kNone, slot);
            on_stage(sb, tid, ok ? raw : tc::kNone, slot);
        }
        return ok;
    };
    auto publish = [&](u32 b, bool ok) {  // valid bits of tile buffer b
        if (warp < kWords) {
            const u32 bits = __ballot_sync(CP_FULL_MASK, ok && tid < kN);
            if (lane == 0) st.valid[b][warp] = bits;
        }
    };
    const u32 ntiles = (hi - lo + kN - 1) / kN;
    __syncthreads();  // the previous pass is done with every buffer and the staging arrays
    fetch();
#pragma unroll
    for (u32 i = 0; i < kAhead; ++i) {
        const bool ok = stage(i & 1u);
        fetch();
        __syncthreads();
        if (i < ntiles) {
            publish(i, ok);
            issue(i & 1u, i);
        }
        ptx::cp_async_commit();  // possibly empty: one group per tile
    }
    auto tile = [&](u32 j, auto first) {
        const u32 n = j + kAhead;
        const u32 b = j % kS, nb = n % kS;  // nb: the buffer of tile j - 2, done with
        const bool ok = stage(n & 1u);
        fetch();
        ptx::cp_async_wait<kAhead - 1>();  // tile j has landed
        ptx::fence_proxy_async_shared();
        __syncthreads();  // tile j visible; every warp is past tile j - 1's S and tile j - 2's P V
        if (n < ntiles) {
            publish(nb, ok);
            issue(n & 1u, nb);
        }
        ptx::cp_async_commit();
        compute(b, lo + j * kN, first);
    };
    if (ntiles == 0) return;
    tile(0, First{});  // peeled: compute's deferred work is unconditional (no wgmma on a divergent path)
    // Two tiles a trip: the page-table word loaded in one stays in its register for the next (one trip would
    // copy it at the back edge, waiting for the load in the iteration that issued it).
#pragma unroll 2
    for (u32 j = 1; j < ntiles; ++j) tile(j, Later{});
    finish();  // the last tile's deferred work
}

// Byte offset of 16-byte chunk c (0 .. 7) of row r in a 128-byte-swizzled column block.
__device__ __forceinline__ u32 swz(u32 r, u32 c) { return r * 128 + ((c ^ (r & 7u)) << 4); }
// Byte offset of 16-byte chunk ch (0 .. kChunks - 1) of row r in a swizzled array of column blocks of col bytes.
__device__ __forceinline__ u32 chunk_at(u32 r, u32 ch, u32 col) { return (ch >> 3) * col + swz(r, ch & 7u); }
}  // namespace pwg

extern "C" __global__ void __launch_bounds__(pwg::kThreads, pwg::kMinBlocks)
    paged_prefill_wgmma(const AttentionParams p) {
    CP_ATTENTION_ARRAYS(p);  // the arrays as __restrict__ locals (epilogue.cuh)
    using namespace pwg;
    using tc::kNone;
    using tc::v16_t;
    CUPAGED_DYNAMIC_SHARED(unsigned char, smem_raw);
    // The swizzle patterns start on kAlign-byte boundaries (descriptor base offset 0). The offset is
    // added to the shared array itself, so the compiler keeps shared-memory accesses (LDS / STS).
    unsigned char* const sQ = smem_raw + ((0u - (u32) reinterpret_cast<u64>(smem_raw)) & (kAlign - 1u));
    unsigned char* const sK = sQ + kQBytes;  // [kTileBufs][kBlocks][kN][128 B]
    unsigned char* const sV = sK + kTileBufs * kTileBytes;  // [kTileBufs][kBlocks][kN][128 B]
    unsigned char* const sRaw = sV + kTileBufs * kTileBytes;  // fp8: [kS][2][kN][kD] codes
    __shared__ tc::RowSet<kRows> rows;
    __shared__ tc::Ring<kN, kS> st;
    // The K and V rows of each staged token (staging buffer, token): their first element, or the cache's
    // first (never read: the copy zero-fills) where the ring staged no page. Thread t < kN computes token
    // t's as it stages it, once for the 256 / kCopyChunks threads that copy its chunks.
    struct alignas(16) RowSrc {  // one 16-byte load
        const kv_t* k;
        const kv_t* v;
    };
    __shared__ RowSrc src[2][kN];

    const u32 tid = threadIdx.x, wg = tid >> 7, warp4 = (tid >> 5) & 3u, lane = tid & 31u;
    const u32 g = lane >> 2, tq = lane & 3u;  // fragment coordinates
    const u32 q_heads = p.q_heads;
    const tc::Place<kRows> place(p);  // this block's heads and queries
    const u32 group = place.group, ht = place.ht, qt = place.qt, kvh = place.kvh;
    const u32 head0 = place.head0, heads = place.heads, q_end = place.q_end;
    const u64 q0 = place.q0;
    auto row_ok = [&](u32 r, u32& slot, u32& hl) {
        slot = r / ht;
        hl = r - slot * ht;
        return slot < qt && q0 + slot < q_end && hl < heads;
    };

    // ---- Q rows into sQ, swizzled (zero rows for slots without a query or head) ----
    for (u32 c = tid; c < kRows * kChunks; c += kThreads) {
        const u32 r = c / kChunks, ch = c - r * kChunks;
        u32 slot, hl;
        const bool ok = row_ok(r, slot, hl);
        const scalar_t* src = q + ((q0 + slot) * q_heads + head0 + hl) * kD + ch * 8;
        ptx::cp_async_16(sQ + chunk_at(r, ch, kQCol), ok ? src : q, ok);
    }
    ptx::cp_async_commit();
    tc::setup_row_set(rows, p, q0, qt, q_end);
    const variant::Scorer sc(p);  // a score variant's arguments
    tc::setup_slopes(rows, sc, head0);
    // This thread's rows (g and g + 8 of its warp's 16): query slot, or kNone.
    u32 my_slot[2];
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        u32 slot, hl;
        my_slot[h] = row_ok(wg * kWgRows + 16 * warp4 + g + 8 * h, slot, hl) ? slot : kNone;
    }
    ptx::cp_async_wait<0>();
    ptx::fence_proxy_async_shared();  // Q is read by wgmma
    __syncthreads();
    // The warpgroups take turns issuing their products (S, then P V, of each tile): warpgroup w waits on
    // barrier kTurn + w until the other has issued its own and arrived there; warpgroup 0 goes first.
    auto take_turn = [&] { wgb::sync(kTurn + wg, kThreads); };
    auto pass_turn = [&] { wgb::arrive(kTurn + (wg ^ 1u), kThreads); };
    if (wg == 1) pass_turn();

    // An fp8 cache's K scale folds into the score scale, its V scale into the
    // output (every row of the block reads KV head kvh).
    float qscale = p.scale * softmax::kLog2e;
    if constexpr (kFp8)
        if (p.k_scale) qscale *= p.k_scale[kvh * p.k_scale_stride];  // null: 1
    softmax::State sm[2];  // rows g, g + 8: the max and this lane's part of the sum
    float o[kD / 2];  // O [64 x D] of the warpgroup: cols 8 j + 2 tq (+ 1), rows g (o[4 j], o[4 j + 1]), g + 8
#pragma unroll
    for (u32 h = 0; h < 2; ++h) sm[h].clear();
#pragma unroll
    for (u32 i = 0; i < kD / 2; ++i) o[i] = 0.0f;

    const u32* const tables = words + pw::page_table(p.queries, p.sequences);
    constexpr u32 kSw = ptx::kSwizzle128B;
    const u64 kh = (u64)kvh * p.k_stride_head, vh = (u64)kvh * p.v_stride_head;
    // The operand descriptors of Q (this warpgroup's rows), the first K and V tiles (K-major / N-major); a
    // tile's own adds its byte offset >> 4 (the start address field), as the k-steps do.
    // The warpgroup broadcast from lane 0, so that the compiler keeps the descriptors built from it in uniform
    // registers (and they move by 32-bit adds: ptx::wgmma_desc_at).
    const u32 wgu = __shfl_sync(CP_FULL_MASK, wg, 0);
    const u64 dq = ptx::wgmma_desc(sQ + wgu * kWgRows * 128, 16, 1024, kSw);
    const u64 dk0 = ptx::wgmma_desc(sK, 16, 1024, kSw), dv0 = ptx::wgmma_desc(sV, kTCol, 1024, kSw);
    u64 dqs[kKSteps];  // Q's descriptor of each k-step of S (the same every tile)
#pragma unroll
    for (u32 ks = 0; ks < kKSteps; ++ks) dqs[ks] = ptx::wgmma_desc_at(dq, ((ks >> 2) * kQCol + (ks & 3u) * 32) >> 4);

    tc::for_each_pass_of(rows, qt, [&](u32 seq, u32 slot_lo, u32 slot_hi, u32 lo, u32 hi) {
        u32 rlo[2], rhi[2];  // this thread's rows' positions in this pass
        variant::ScoreRow srow[2];  // for a score variant: the rows' query position, head, slope
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            const u32 s = my_slot[h];
            const bool in = s != kNone && s >= slot_lo && s < slot_hi;
            rlo[h] = in ? rows.lo[s] : 0u;
            rhi[h] = in ? rows.hi[s] : 0u;
            if constexpr (!variant::kPlainScore)
                srow[h] = tc::score_row(rows, s, wg * kWgRows + 16 * warp4 + g + 8 * h, ht, head0, qt);
        }
        auto on_stage = [&](u32 sb, u32 t, u32 page, u32 slot) {
            const bool ok = page != kNone;
            const u64 koff = (u64)page * p.k_stride_page + ((u64)slot * p.k_stride_slot + kh);
            const u64 voff = (u64)page * p.v_stride_page + ((u64)slot * p.v_stride_slot + vh);
            src[sb][t] = RowSrc{ok ? k_cache + koff : k_cache, ok ? v_cache + voff : v_cache};
        };
        // Thread tid copies chunk tid % kCopyChunks of rows tid / kCopyChunks + i * kCopyStep of K and V (the
        // same swizzle row r % 8 for every i: kCopyStep is a multiple of 8, so row i's chunk is row 0's + i
        // kCopyStep rows).
        const u32 cch = tid % kCopyChunks, cr0 = tid / kCopyChunks;
        const u32 cdst = kFp8 ? cr0 * kD + cch * 16 : chunk_at(cr0, cch, kTCol);
        static_assert(kFp8 || kCopyStep % 8 == 0, "one swizzle pattern for a thread's rows");
        auto issue = [&](u32 sb, u32 b) {
#pragma unroll
            for (u32 i = 0; i < kN / kCopyStep; ++i) {
                const u32 r = cr0 + i * kCopyStep;
                const RowSrc rs = src[sb][r];
                const bool ok = st.row[sb][r].x != kNone;
                const kv_t* const ks = rs.k + cch * kCopyElems;
                const kv_t* const vs = rs.v + cch * kCopyElems;
                if constexpr (kFp8) {
                    unsigned char* const dst = sRaw + b * kRawStage + cdst + i * kCopyStep * kD;
                    ptx::cp_async_16(dst, ks, ok);
                    ptx::cp_async_16(dst + kN * kD, vs, ok);
                } else {
                    const u32 dst = b * kTileBytes + cdst + i * kCopyStep * 128;
                    ptx::cp_async_16(sK + dst, ks, ok);
                    ptx::cp_async_16(sV + dst, vs, ok);
                }
            }
        };
        // A V tile holding a non-finite element some row of the block must not see (bad: block-uniform,
        // every thread calls this): each lane adds p * v itself for every non-finite element of its columns
        // and a token its row sees (P of the tile: pa_, the rows' visible tokens: vis_); then those elements
        // become 0 in the tile vt_, and the products add the finite rest. O is not in flight here.
        auto fix_values = [&](const u32(&pa_)[kPSteps][4], const u64(&vis_)[2], unsigned char* vt_) {
            ptx::cold_path();
#pragma unroll
            for (u32 kk = 0; kk < kPSteps; ++kk) {
#pragma unroll 1
                for (u32 u = 0; u < 16; ++u) {
                    ptx::cold_path();
                    const u32 tok = 16 * kk + u;
                    // P of rows g, g + 8 for token tok: lane 4 g + (u & 7) / 2's a[0] / a[1] (u < 8)
                    // or a[2] / a[3].
                    const u32 src = 4 * g + ((u & 7u) >> 1);
                    const u32 r0 = __shfl_sync(CP_FULL_MASK, u < 8 ? pa_[kk][0] : pa_[kk][2], src);
                    const u32 r1 = __shfl_sync(CP_FULL_MASK, u < 8 ? pa_[kk][1] : pa_[kk][3], src);
                    const float p0 = tc::half_of<v16_t>(r0, u & 1u), p1 = tc::half_of<v16_t>(r1, u & 1u);
                    const bool see0 = (vis_[0] >> tok) & 1u, see1 = (vis_[1] >> tok) & 1u;
#pragma unroll
                    for (u32 j = 0; j < kD / 8; ++j) {  // unrolled: o stays in registers
                        const u32 col = 8 * j + 2 * tq;  // value columns col, col + 1
                        // volatile: one value at a time (no register pressure from early loads)
                        const u32 vb = *reinterpret_cast<const volatile u32*>(
                            vt_ + (col >> 6) * kTCol + swz(tok, (col >> 3) & 7u) + (col & 7u) * 2);
                        if (!tc::nonfinite2<v16_t>(vb)) continue;
#pragma unroll
                        for (u32 e = 0; e < 2; ++e)
                            if (tc::nonfinite2<v16_t>(e ? vb >> 16 : vb & 0xffffu)) {
                                const float v = tc::half_of<v16_t>(vb, e);
                                if (see0) o[4 * j + e] += p0 * v;
                                if (see1) o[4 * j + 2 + e] += p1 * v;
                            }
                    }
                }
            }
            __syncthreads();  // every lane has read the tile's non-finite values
#pragma unroll 1
            for (u32 c = tid; c < kTileBytes / 4; c += kThreads) {  // every 32-bit pair
                ptx::cold_path();
                u32* const w = reinterpret_cast<u32*>(vt_) + c;
                const u32 x = *w;
                const u32 xlo = tc::nonfinite2<v16_t>(x & 0xffffu) ? 0u : (x & 0xffffu);
                const u32 xhi = tc::nonfinite2<v16_t>(x >> 16) ? 0u : (x & 0xffff0000u);
                *w = xlo | xhi;
            }
            ptx::fence_proxy_async_shared();  // the tile is read by wgmma
            __syncthreads();
        };
        // O [64 x D] += P V of a tile: P from registers, V N-major from the tile vt_ (issued, not committed).
        auto issue_pv = [&](const u32(&pa_)[kPSteps][4], const unsigned char* vt_) {
            const u64 dv = ptx::wgmma_desc_at(dv0, (u32)(vt_ - sV) >> 4);
#pragma unroll
            for (u32 kk = 0; kk < kPSteps; ++kk)
                ptx::wgmma_rs<v16_t, kD, 1>(o, pa_[kk], ptx::wgmma_desc_at(dv, (16 * kk * 128) >> 4), true);
        };
        // The deferred tile (kDefer): its P, visible tokens, V tile, whether its V tile needs fix_values.
        u32 pa_prev[kPSteps][4];
        u64 vis_prev[2] = {0, 0};
        unsigned char* vt_prev = sV;
        bool bad_prev = false;
        auto compute = [&](u32 b, u32 t0, auto first) {
            constexpr bool kPrev = kDefer && !decltype(first)::kFirst;  // a deferred tile before this one
            if constexpr (kFp8) {
                // Every warp is past tile j - 1's products (the ring's barrier): the block decodes tile j's
                // codes into the swizzled 16-bit tiles, exactly (8 codes make a 16-byte chunk), then meets.
                const unsigned char* const raw = sRaw + b * kRawStage;
#pragma unroll
                for (u32 i = 0; i < kN * kChunks / kThreads; ++i) {
                    const u32 c = tid + i * kThreads, r = c / kChunks, ch = c - r * kChunks;
                    const uint2 xk = *reinterpret_cast<const uint2*>(raw + r * kD + ch * 8);
                    const uint2 xv = *reinterpret_cast<const uint2*>(raw + kN * kD + r * kD + ch * 8);
                    uint4 yk, yv;
                    fp8::x4_to<scalar_t, kv_t>(xk.x, yk.x, yk.y);
                    fp8::x4_to<scalar_t, kv_t>(xk.y, yk.z, yk.w);
                    fp8::x4_to<v16_t, kv_t>(xv.x, yv.x, yv.y);
                    fp8::x4_to<v16_t, kv_t>(xv.y, yv.z, yv.w);
                    *reinterpret_cast<uint4*>(sK + chunk_at(r, ch, kTCol)) = yk;
                    *reinterpret_cast<uint4*>(sV + chunk_at(r, ch, kTCol)) = yv;
                }
                ptx::fence_proxy_async_shared();  // the tiles are read by wgmma
                __syncthreads();
            }
            unsigned char* const kt = sK + (kFp8 ? 0u : b) * kTileBytes;
            unsigned char* const vt = sV + (kFp8 ? 0u : b) * kTileBytes;
            // Bit dt of vis[h]: row h sees token t0 + dt (its share, and a valid page).
            const u64 vbits = (u64)st.valid[b][0] | (u64)st.valid[b][1] << 32;
            u64 vis[2];
            bool miss = false;
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                vis[h] = tc::tile_vis<kN>(vbits, rlo[h], rhi[h], t0);
                miss |= my_slot[h] != kNone && vis[h] != vbits;
            }

            // A tile where some stored row of the block misses a valid token (the causal diagonal, split
            // edges, another sequence's rows): its value rows' Inf / NaN must reach only the rows that see
            // them (0 x Inf is NaN in the tensor cores). The block checks the V tile here, before either
            // warpgroup's turn (bad: block-uniform); the rows that see such an element add it below.
            bool bad = false;
            if (__syncthreads_or(miss)) {
                ptx::cold_path();
                bool any = false;
#pragma unroll 1
                for (u32 c = tid; c < kTileBytes / 16; c += kThreads) {  // every 16-byte chunk of the values
                    ptx::cold_path();
                    const uint4 x = *reinterpret_cast<const uint4*>(vt + c * 16);
                    any |= tc::nonfinite2<v16_t>(x.x) | tc::nonfinite2<v16_t>(x.y) | tc::nonfinite2<v16_t>(x.z) |
                           tc::nonfinite2<v16_t>(x.w);
                }
                bad = __syncthreads_or(any);
            }

            // ---- S [64 x 64] = Q K^T of this warpgroup's rows, in its turn ----
            float s[kN / 2];
            // Descriptors move along K by adding the byte offset >> 4 to the start address field.
            const u64 dk = ptx::wgmma_desc_at(dk0, (u32)(kt - sK) >> 4);
            if constexpr (kPrev)
                if (bad_prev) fix_values(pa_prev, vis_prev, vt_prev);  // block-uniform
            take_turn();
            ptx::wgmma_fence();
#pragma unroll
            for (u32 ks = 0; ks < kKSteps; ++ks)
                ptx::wgmma_ss<scalar_t, kN, 0, 0>(
                    s, dqs[ks], ptx::wgmma_desc_at(dk, ((ks >> 2) * kTCol + (ks & 3u) * 32) >> 4), ks > 0);
            ptx::wgmma_commit();
            if constexpr (kDefer) {
                // In the same turn, the previous tile's P V (its V tile kept by the ring): it runs on the tensor
                // cores while this warpgroup's softmax below issues (wait_group 1 waits for S only).
                if constexpr (kPrev) issue_pv(pa_prev, vt_prev);
                ptx::wgmma_commit();  // possibly empty
            }
            pass_turn();  // the other warpgroup's products queue behind these while this one waits
            if constexpr (kDefer)
                ptx::wgmma_wait<1>();
            else
                ptx::wgmma_wait<0>();
            ptx::wgmma_fence_operand(s);

            // Scale into the log2 domain, the score hook, mask; online softmax per row. Element i of
            // the fragment: row g (+ 8 for i & 2), token 8 (i / 4) + 2 tq (+ 1 for i & 1). The plain
            // score keeps S unscaled up to exp2(S qscale - m) (one FFMA; qscale > 0 keeps the max).
            constexpr bool kLate = variant::kPlainScore;
            const float late = kLate ? qscale : 1.0f;
            // The rows' visible tokens from this lane's first column 2 tq on: element i tests a constant bit.
            const u64 vq[2] = {vis[0] >> (2 * tq), vis[1] >> (2 * tq)};
            float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
            for (u32 i = 0; i < kN / 2; ++i) {
                const u32 h = (i >> 1) & 1u, dc = 8 * (i >> 2) + (i & 1u), col = dc + 2 * tq;
                float v = s[i];
                if constexpr (!kLate) v = variant::score(sc, srow[h], v * qscale, t0 + col);
                s[i] = ((vq[h] >> dc) & 1u) ? v : neg_inf();
                mx[h] = fmaxf(mx[h], s[i]);
            }
            float alpha[2];
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 1));
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 2));
                alpha[h] = sm[h].raise(mx[h] * late);
                const float mu = sm[h].offset();  // exp2(-inf - mu) = 0 for masked scores
                float ps = 0.0f;
#pragma unroll
                for (u32 i = 0; i < kN / 2; ++i)
                    if (((i >> 1) & 1u) == h) {
                        s[i] = exp2f(fmaf(s[i], late, -mu));
                        ps += s[i];
                    }
                sm[h].add(alpha[h], ps);  // this lane's part of the row sum
            }
            if constexpr (!kDefer) {  // deferred: O is in flight (the previous tile's P V) until the wait below
#pragma unroll
                for (u32 i = 0; i < kD / 2; ++i) o[i] *= alpha[(i >> 1) & 1u];
            }
            // P as A fragments of k-step kk (tokens 16 kk ..): S n-tiles 2 kk (a[0], a[1]) and 2 kk + 1.
            // Deferred: packed after the wait below, into pa_prev (registers the P V in flight reads stay as
            // they are until it is done).
            u32 pa[kPSteps][4];
            auto pack = [&](u32(&dst)[kPSteps][4]) {
#pragma unroll
                for (u32 kk = 0; kk < kPSteps; ++kk)
#pragma unroll
                    for (u32 i = 0; i < 4; ++i)
                        dst[kk][i] = ptx::pack2<v16_t>(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
            };
            if constexpr (!kDefer) pack(pa);

            if constexpr (!kDefer) {
                if (bad) fix_values(pa, vis, vt);
            }
            if constexpr (kDefer) {
                // P V of the previous tile is done: rescale O for this tile, keep this tile's P for the next.
                ptx::wgmma_wait<0>();
                ptx::wgmma_fence_operand(o);
#pragma unroll
                for (u32 i = 0; i < kD / 2; ++i) o[i] *= alpha[(i >> 1) & 1u];
                pack(pa_prev);
                vis_prev[0] = vis[0];
                vis_prev[1] = vis[1];
                vt_prev = vt;
                bad_prev = bad;
            } else {
                // ---- O [64 x D] += P V in this warpgroup's turn ----
                ptx::wgmma_fence_operand(o);
                take_turn();
                ptx::wgmma_fence();
                issue_pv(pa, vt);
                ptx::wgmma_commit();
                pass_turn();
                ptx::wgmma_wait<0>();
                ptx::wgmma_fence_operand(o);
            }
        };
        // The last tile's deferred P V (kDefer), before the pass ends (the next pass's ring reuses its buffer).
        auto finish = [&] {
            if constexpr (kDefer) {
                if (bad_prev) fix_values(pa_prev, vis_prev, vt_prev);
                ptx::wgmma_fence_operand(o);
                take_turn();
                ptx::wgmma_fence();
                issue_pv(pa_prev, vt_prev);
                ptx::wgmma_commit();
                pass_turn();
                ptx::wgmma_wait<0>();
                ptx::wgmma_fence_operand(o);
            }
        };
        // 16-bit tiles are read by wgmma as cp.async left them: fenced to the async proxy (fp8: compute
        // fences its decoded tiles).
        if constexpr (kDefer) {
            ring_keep<kN, kS>(st, tables + (u64)seq * p.table_width, lo, hi, p.page_size, p.num_pages, issue, compute,
                              finish, on_stage);
        } else {
            tc::run_ring<kN, kS, !kFp8>(
                st, tables + (u64)seq * p.table_width, lo, hi, p.page_size, p.num_pages, issue,
                [&](u32 b, u32 t0) { compute(b, t0, Later{}); }, on_stage);
        }
    });

    // ---- normalize and write ----
    const bool split = p.splits > 1;
    const float vscale = epi::v_scale(p, kvh);
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        float l = sm[h].l;
        l += __shfl_xor_sync(CP_FULL_MASK, l, 1);
        l += __shfl_xor_sync(CP_FULL_MASK, l, 2);
        sm[h].l = l;
        const u32 slot = my_slot[h];
        if (slot == kNone) continue;
        const u32 r = wg * kWgRows + 16 * warp4 + g + 8 * h;
        const u32 head = head0 + (r - slot * ht);
        const epi::Row er = epi::row_of(p, (q0 + slot) * q_heads + head, split);
        const float inv = epi::finish(sm[h], sc, head, split, vscale);
#pragma unroll
        for (u32 j = 0; j < kD / 8; ++j)
            epi::store_pair(out, part_out, er.dst * kD + 8 * j + 2 * tq, split, o[4 * j + 2 * h] * inv,
                            o[4 * j + 2 * h + 1] * inv);
        if (tq == 0) epi::store_lse(lse, part_lse, p.write_lse, er, split, sm[h].lse());
    }
}
