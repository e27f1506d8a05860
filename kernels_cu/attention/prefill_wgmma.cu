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
// cupaged.tools.perf_model, pessimistic end, H200, D 128): docs/performance.md. The 16-bit builds at D <= 128
// follow FlashAttention-3's schedule (warp specialization: a producer warpgroup, two consumer warpgroups
// taking turns, setmaxnreg for the register split), with cp.async copies instead of TMA (pages of any size
// and stride) and named barriers instead of mbarriers, its intra-warpgroup overlap one tile deeper (tile j's
// softmax runs while the tensor cores compute tile j + 1's S and tile j - 1's P V) and its masking of the edge
// tiles only; what is left of it: 128-token tiles.
//
// paged_prefill_wgmma: f16 / bf16 q, D == Dv == HEAD_DIM (64, 128, 256),
//   caches of q's type or fp8 codes (e4m3 / e5m2, k_scale / v_scale per
//   tensor or KV head).
//   grid (ceil(q_count / qt), kv_heads * head_tiles, splits), block kBlockThreads:
//   the two computing warpgroups (kThreads) and, kSplit (16-bit caches, 4 or
//   more stages: D <= 128), a producer warpgroup before them (kProducer = 128
//   threads, warpgroup 0; setmaxnreg: kProducerRegs for it, kConsumerRegs for
//   the others), __launch_bounds__(kBlockThreads, kMinBlocks); dynamic shared
//   memory prefill_wgmma.smem_bytes (cupaged/ops/attention/kernels/prefill_wgmma.py,
//   = kSmemBytes). The block geometry (threads, minimum, tile, alignment) is
//   defined once in prefill_wgmma.py (GEOMETRY), the stages per head dim are
//   its tile's (TC_STAGES), read here through geometry.cuh (geom::prefill_wgmma).
//   Rows (the M dimension, kRows = 128 per block, 64 per warpgroup: one
//   wgmma m64 tile each) are (query, head) pairs as in paged_prefill_tc:
//   ht = min(G, kRows) query heads of one KV head's GQA group for each of
//   qt = kRows / ht consecutive packed queries, so a K/V row read serves
//   qt * ht rows. Computing warpgroup w owns rows 64 w .. 64 w + 63 (warp w4 of
//   it rows 64 w + 16 w4 .. + 15, the wgmma fragment rows).
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
//   The ring, kS tile buffers of kN = 64 tokens:
//     kSplit: the block's n-th tile (every pass's, in order) goes into buffer n % kS. The producer's threads
//        2 t and 2 t + 1 take row t of every tile: they walk the page table for its token (its page word
//        fetched a tile ahead, no division in the loop), wait until the consumers have released the buffer
//        (named barrier kEmpty + b; not for the first kS tiles), copy the even and the odd 16-byte chunks of
//        the row's K and V (16 cp.async a thread at D 128; a pair is one 32-byte sector) and,
//        kLag = kS - 3 tiles later, once its copies have landed, fences them to the async proxy and arrives
//        at kFull + b (with the tile's valid bits and whether its value rows need fix_values: st_bad). The
//        consumers wait at kFull + b and release the buffer (arrive at kEmpty + b) once its P V is done:
//        they hold three buffers (tile j - 1's, whose P V runs; tile j's, whose V the next turn reads; tile
//        j + 1's, whose S runs), the producer up to two, and no barrier of the whole block is met in the
//        loop (the consumers never wait for each other except for their turns).
//     fp8 and D 256: the two warpgroups copy and compute through tc::run_ring, kS - 1 tiles in flight, one
//        block barrier a tile.
//   Per tile:
//     turn: the computing warpgroups take turns issuing their products (named barriers kTurn + w,
//        warpgroup.cuh; warpgroup 0 first), so one's products run while the other's softmax issues;
//     S: each warpgroup computes S [64 x 64] of its rows: D / 16 wgmma
//        m64n64k16 with Q and K from shared memory;
//     kSplit: the turn of tile j issues S of tile j + 1 (past a pass's last tile, of tile j again, and
//        discarded: no product on a branch) and O += P V of tile j - 1; tile j's softmax (on its S, waited
//        for at the end of the turn before) runs while they do; then wait_group 0, O is rescaled for tile
//        j, tile j's P kept for the next turn. Otherwise S is waited for in its turn and P V issued in a
//        second turn after the softmax;
//     softmax: f32, log2 domain, on the S fragments (softmax_state.cuh;
//        a row's max and sum live in the 4 lanes of a quad); the score hook
//        (variant.cuh) and, on a tile some row of the warp sees only in part (an edge tile: the causal
//        diagonal, a window's or a split's edge, a pass's end), the visibility of each row (span.cuh);
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
//   misses a valid token the block checks the V tile (before the turns; kSplit:
//   the producer, from the rows' positions, before it signals the tile); if it
//   holds a non-finite element, each lane adds p * v for those elements of its
//   columns and the tokens its rows see, then they become 0 in the tile and
//   the tensor cores add the finite rest (masked P is 0); kSplit: before the
//   tile's P V, in the next tile's turn (the consumers meet on kFix).
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
#include "producer.cuh"

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
// Warp-specialized (16-bit caches with 4 or more buffers: D <= 128): a producer warpgroup (warpgroup 0)
// fills the ring and signals each tile on named barriers, the two consumer warpgroups (1, 2) compute, tile
// j's softmax beside S of tile j + 1 and P V of tile j - 1. fp8 (decoded into one tile) and D 256 (2
// buffers): the two warpgroups copy and compute through tc::run_ring, one block barrier a tile.
constexpr bool kSplit = !kFp8 && kS >= 4;
constexpr u32 kProducer = kSplit ? geom::prefill_wgmma::kProducerThreads : 0u;  // producer threads
constexpr u32 kBlockThreads = kThreads + kProducer;  // the block (kThreads: the computing warpgroups)
// setmaxnreg, kSplit: registers per thread of the producer and of the computing warpgroups (launched at 168).
constexpr u32 kProducerRegs = 48, kConsumerRegs = 224;
static_assert(kProducer * kProducerRegs + kThreads * kConsumerRegs <= 65536, "the block's register file");
constexpr u32 kLag = kS >= 3 ? kS - 3 : 0;  // tiles the producer keeps in flight past the one it signals
constexpr u32 kRawStage = kFp8 ? 2 * kN * kD : 0;  // bytes of one raw stage (fp8): K then V codes
// Dynamic shared memory (prefill_wgmma.smem_bytes): the layout above after up to kAlign - 1 bytes of alignment.
constexpr u32 kSmemBytes = kAlign + kQBytes + 2 * kTileBufs * kTileBytes + kS * kRawStage;
constexpr u32 kKSteps = kD / 16;  // k-steps of S = Q K^T
constexpr u32 kPSteps = kN / 16;  // k-steps of O += P V
constexpr u32 kChunks = kD / 8;  // 16-byte chunks of a 16-bit row
constexpr u32 kCopyChunks = kD * sizeof(kv_t) / geom::kVectorBytes;  // 16-byte copies per cache row
constexpr u32 kCopyElems = geom::kVectorBytes / sizeof(kv_t);  // cache elements per copy
constexpr u32 kCopyStep = kThreads / kCopyChunks;  // rows one pass of the copying threads copies (not kSplit)
// Named barriers (warpgroup.cuh): kTurn + w, computing warpgroup w's turn to issue its products; kSplit:
// kFull + b / kEmpty + b, tile buffer b landed (producer arrives, consumers wait) / free again (consumers
// arrive, producer waits), kProd the producer's own, kFix the consumers' own (fix_values).
constexpr u32 kTurn = 1;
constexpr u32 kFull = 3, kEmpty = kFull + kS, kProd = kEmpty + kS, kFix = kProd + 1;
static_assert(!kSplit || kFix <= 15, "named barriers 1 .. 15");
static_assert(kD == 64 || kD == 128 || kD == 256, "HEAD_DIM: 64, 128 or 256");
static_assert(kThreads == 2 * 128 && kRows == 128, "two warpgroups of 64 rows");
static_assert(kN == 64, "S [64 x 64] per warpgroup: tiles of 64 tokens (tc::tile_vis masks)");
static_assert(kAlign == 8 * 128, "a 128-byte swizzle atom: 8 rows of 128 B");
static_assert(kN % kCopyStep == 0, "whole rows per copy pass");
static_assert(!kSplit || kLag >= 1, "the producer keeps a tile in flight past the one it signals");
static_assert((kN * kChunks) % kThreads == 0, "whole decode steps per thread");
static_assert(sizeof(scalar_t) == 2 && (kFp8 || sizeof(kv_t) == 2), "f16 / bf16 q; f16 / bf16 / fp8 caches");
static_assert(kRawStage % kAlign == 0, "the tiles stay on swizzle atom boundaries");

// The consumers' step's last argument: the pass's first tile (no tile before it whose P V is to issue) or a
// later one.
struct First {
    static constexpr bool kFirst = true;
};
struct Later {
    static constexpr bool kFirst = false;
};
// What a consumer knows of a tile when it has landed: its valid tokens (bit dt of valid: token t0 + dt is
// below the pass's end in a page < num_pages), whether every stored row of this warp sees all of them (full:
// warp-uniform; the softmax then masks nothing), the visible tokens of this thread's rows (bit dt of vis[h]:
// row h sees token t0 + dt, its share and a valid page; kSplit: filled by softmax_tile, on edge tiles only) and
// whether the tile's value rows need fix_values (bad: block-uniform).
struct TileState {
    u64 valid;
    u64 vis[2];
    bool full;
    bool bad;
};
template <u32 N>
struct Count {  // a compile-time count (cp.async wait depths, thread counts)
    static constexpr u32 value = N;
};
// f(Count<I>{}) for I = 0 .. N - 1.
template <u32 I, u32 N, typename F>
__device__ __forceinline__ void static_for(F&& f) {
    if constexpr (I < N) {
        f(Count<I>{});
        static_for<I + 1, N>(f);
    }
}

// The tile buffer after buffer b (tile n + 1's after tile n's: n % kS kept by wrapping, no division).
__device__ __forceinline__ u32 next_buf(u32 b) { return b + 1 == kS ? 0u : b + 1; }
// Byte offset of 16-byte chunk c (0 .. 7) of row r in a 128-byte-swizzled column block.
__device__ __forceinline__ u32 swz(u32 r, u32 c) { return r * 128 + ((c ^ (r & 7u)) << 4); }
// Byte offset of 16-byte chunk ch (0 .. kChunks - 1) of row r in a swizzled array of column blocks of col bytes.
__device__ __forceinline__ u32 chunk_at(u32 r, u32 ch, u32 col) { return (ch >> 3) * col + swz(r, ch & 7u); }
}  // namespace pwg

extern "C" __global__ void __launch_bounds__(pwg::kBlockThreads, pwg::kMinBlocks)
    paged_prefill_wgmma(const AttentionParams p) {
    CP_ATTENTION_ARRAYS(p);  // the arrays as __restrict__ locals (epilogue.cuh)
    ptx::launch_dependents();  // the split merge, a dependent launch, may start: it waits for this grid
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
    // The K and V rows of each staged token (staging buffer, token) of tc::run_ring's tiles (not kSplit: the
    // producer's threads compute their own rows): their first element, or the cache's first (never read: the
    // copy zero-fills) where the ring staged no page. Thread t < kN computes token t's as it stages it, once
    // for the 256 / kCopyChunks threads that copy its chunks.
    struct alignas(16) RowSrc {  // one 16-byte load
        const kv_t* k;
        const kv_t* v;
    };
    __shared__ RowSrc src[kSplit ? 1 : 2][kN];
    __shared__ u32 st_bad[kS];  // kSplit: tile buffer b's value rows need fix_values (the producer's check)
    __shared__ volatile float s_issued[kBlockThreads / 32];  // kSplit: never read (the consumers' wait order)

    const u32 tid = threadIdx.x, wg = tid >> 7, warp4 = (tid >> 5) & 3u, lane = tid & 31u;
    // The computing warpgroup cw (0, 1) and its thread ctid (kSplit: warpgroups 1, 2; meaningless in the producer).
    const u32 cw = wg - (kSplit ? 1u : 0u), ctid = tid - kProducer;
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
    for (u32 c = tid; c < kRows * kChunks; c += kBlockThreads) {
        const u32 r = c / kChunks, ch = c - r * kChunks;
        u32 slot, hl;
        const bool ok = row_ok(r, slot, hl);
        const scalar_t* src = q + att::q_at(p, q0 + slot, head0 + hl) + ch * 8;
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
        my_slot[h] = row_ok(cw * kWgRows + 16 * warp4 + g + 8 * h, slot, hl) ? slot : kNone;
    }
    ptx::cp_async_wait<0>();
    ptx::fence_proxy_async_shared();  // Q is read by wgmma
    __syncthreads();
    // The warpgroups take turns issuing their products (S, then P V, of each tile): warpgroup w waits on
    // barrier kTurn + w until the other has issued its own and arrived there; warpgroup 0 goes first.
    auto take_turn = [&] { wgb::sync(kTurn + cw, kThreads); };
    auto pass_turn = [&] { wgb::arrive(kTurn + (cw ^ 1u), kThreads); };
    // One turn: this warpgroup's products (issue() issues and commits them) while the other one waits.
    auto in_turn = [&](auto&& issue) {
        take_turn();
        ptx::wgmma_fence();
        issue();
        pass_turn();  // the other warpgroup's products queue behind these
    };
    if (cw == 1) pass_turn();

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
    // Staging thread t < kN: the K and V rows of its token of the tile staged in staging buffer sb.
    auto on_stage = [&](u32 sb, u32 t, u32 page, u32 slot) {
        const bool ok = page != kNone;
        const u64 koff = (u64)page * p.k_stride_page + ((u64)slot * p.k_stride_slot + kh);
        const u64 voff = (u64)page * p.v_stride_page + ((u64)slot * p.v_stride_slot + vh);
        src[sb][t] = RowSrc{ok ? k_cache + koff : k_cache, ok ? v_cache + voff : v_cache};
    };
    // Copying thread t (of kThreads; not kSplit) copies chunk t % kCopyChunks of rows t / kCopyChunks + i * kCopyStep of K
    // and V of the tile staged in sb into tile buffer b (the same swizzle row r % 8 for every i: kCopyStep is a
    // multiple of 8, so row i's chunk is row 0's + i kCopyStep rows).
    static_assert(kFp8 || kCopyStep % 8 == 0, "one swizzle pattern for a thread's rows");
    auto copy_tile = [&](u32 t, u32 sb, u32 b) {
        const u32 cch = t % kCopyChunks, cr0 = t / kCopyChunks;
        const u32 cdst = kFp8 ? cr0 * kD + cch * 16 : chunk_at(cr0, cch, kTCol);
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
    // Whether thread t of n holds an Inf or a NaN in its share of the V tile in buffer b (cold: after a miss).
    auto check = [&](u32 b, u32 t, u32 n) {
        const unsigned char* const vt = sV + (kFp8 ? 0u : b) * kTileBytes;
        bool any = false;
#pragma unroll 1
        for (u32 c = t; c < kTileBytes / 16; c += n) {  // every 16-byte chunk of the values
            ptx::cold_path();
            const uint4 x = *reinterpret_cast<const uint4*>(vt + c * 16);
            any |= tc::nonfinite2<v16_t>(x.x) | tc::nonfinite2<v16_t>(x.y) | tc::nonfinite2<v16_t>(x.z) |
                   tc::nonfinite2<v16_t>(x.w);
        }
        return any;
    };
    // A barrier of the computing threads only (kSplit: the producer is elsewhere).
    auto csync = [&] {
        if constexpr (kSplit)
            wgb::sync(kFix, kThreads);
        else
            __syncthreads();
    };

    if constexpr (kSplit) {
        if (wg == 0) {
            // ---- the producer: every tile of every pass, in the consumers' order (buffer n % kS of the
            // block's n-th tile), through the page walk of threads tid < kN; tile n's copies issued once
            // buffer n % kS is free (kEmpty), signalled (kFull) kLag tiles later, once they have landed ----
            wgb::regs_dec<kProducerRegs>();
            // Threads 2 t and 2 t + 1 copy row t of each tile, the even and the odd 16-byte chunks (a pair is
            // one 32-byte sector; a warp instruction, 16 rows' sectors): chunk 2 c + half of the row goes to
            // column block c / 4, swizzled chunk (2 c % 8 + half) ^ (t % 8) = 2 (c % 4) ^ y of row t.
            static_assert(!kSplit || (kProducer == 2 * kN && kCopyChunks % 8 == 0), "two producer threads a row");
            const u32 ptok = tid >> 1, half = tid & 1u, y = half ^ (ptok & 7u);
            u32 coff[4];
#pragma unroll
            for (u32 c = 0; c < 4; ++c) coff[c] = ptok * 128 + (((2 * c) ^ y) << 4);
            // Tiles issued; bit k of missbits: tile gp - 1 - k needs the value check (a shift register: the tile
            // signalled with keep.value later tiles in flight is bit keep.value).
            u32 gp = 0, missbits = 0;
            u32 pb = 0, sig_b = 0;  // the buffers of tile gp (next to issue) and of the next tile to signal
            auto signal = [&](u32 n, auto keep) {  // tile n, with keep.value later tiles still in flight
                ptx::cp_async_wait<decltype(keep)::value>();
                ptx::fence_proxy_async_shared();  // wgmma reads the tiles
                const u32 b = sig_b;  // n % kS: tiles are signalled in order
                sig_b = next_buf(sig_b);
                if ((missbits >> decltype(keep)::value) & 1u) {
                    ptx::cold_path();
                    wgb::sync(kProd, kProducer);  // every producer thread's copies of tile n have landed
                    const bool any = __any_sync(CP_FULL_MASK, check(b, tid, kProducer));
                    if (any && lane == 0) atomicOr(&st_bad[b], 1u);
                }
                wgb::arrive(kFull + b, kBlockThreads);
            };
            tc::for_each_pass_of(rows, qt, [&](u32 seq, u32 slot_lo, u32 slot_hi, u32 lo, u32 hi) {
                const prod::PassSpan span = prod::pass_span(rows, qt, q0, q_end, slot_lo, slot_hi);
                // The page walk: threads 2 t and 2 t + 1 follow token t of each tile.
                prod::TokenWalk<kN> walk(tables + (u64)seq * p.table_width, lo + ptok, hi, p.page_size);
                u32 raw = kNone, slot = 0;
                const u32 ntiles = (hi - lo + kN - 1) / kN;
                walk.next(raw, slot);
                for (u32 j = 0; j < ntiles; ++j) {
                    const u32 b = pb, sb = gp & 1u, t0 = lo + j * kN;
                    const u32 word = raw, wslot = slot;  // this tile's; the next tile's word loads now, a tile ahead
                    walk.next(raw, slot);
                    if (gp >= kS) wgb::sync(kEmpty + b, kBlockThreads);  // the consumers are done with buffer b
                    const bool ok = word < p.num_pages;
                    // This thread's K / V row of token ptok (without a page: the row of page 0 at its slot,
                    // inside the caches and never read: the copies zero-fill), at its chunk of each pair.
                    const u32 page = ok ? word : 0u;
                    const u64 koff = (u64)page * p.k_stride_page + ((u64)wslot * p.k_stride_slot + kh);
                    const u64 voff = (u64)page * p.v_stride_page + ((u64)wslot * p.v_stride_slot + vh);
                    const kv_t* const ks = k_cache + koff + half * kCopyElems;
                    const kv_t* const vs = v_cache + voff + half * kCopyElems;
                    {  // the tile's valid bits: warp w's 16 tokens, lane l's vote for token l % 16 (lane 2 l's ok)
                        const bool okl = __shfl_sync(CP_FULL_MASK, (u32)ok, 2 * (lane & 15u)) != 0;
                        const u32 x = __ballot_sync(CP_FULL_MASK, okl) & 0xffffu;
                        // every lane stores the same half word (no branch: one shared-memory write)
                        reinterpret_cast<unsigned short*>(st.valid[b])[tid >> 5] = (unsigned short)x;
                    }
                    st_bad[b] = 0;  // (by every producer thread: no branch)
                    unsigned char* dk[4];  // this thread's chunk of each pair in the first column block of K
#pragma unroll
                    for (u32 i = 0; i < 4; ++i) dk[i] = sK + b * kTileBytes + coff[i];
                    constexpr u32 kToV = kTileBufs * kTileBytes;  // sV - sK
#pragma unroll
                    for (u32 c = 0; c < kCopyChunks / 2; ++c) {  // chunk 2 c + half of the row, K and V
                        unsigned char* const dst = dk[c & 3u] + (c >> 2) * kTCol;
                        ptx::cp_async_16(dst, ks + 2 * c * kCopyElems, ok);
                        ptx::cp_async_16(dst + kToV, vs + 2 * c * kCopyElems, ok);
                    }
                    ptx::cp_async_commit();
                    const u32 te = t0 + kN < hi ? t0 + kN : hi;
                    const bool miss = span.miss(t0, te);
                    missbits = missbits << 1 | (u32)miss;
                    ++gp;
                    pb = next_buf(pb);
                    if (gp > kLag) signal(gp - 1 - kLag, Count<kLag>{});
                }
            });
            static_for<0, kLag>([&](auto i) {  // the last tiles
                constexpr u32 kI = decltype(i)::value;
                if (gp + kI >= kLag) signal(gp + kI - kLag, Count<kLag - 1 - kI>{});
            });
            // The consumers' last releases, so that every named barrier ends complete.
            for (u32 n = gp > kS ? gp - kS : 0u; n < gp; ++n) wgb::sync(kEmpty + n % kS, kBlockThreads);
            return;
        }
        wgb::regs_inc<kConsumerRegs>();
    }
    // The operand descriptors of Q (this warpgroup's rows), the first K and V tiles (K-major / N-major); a
    // tile's own adds its byte offset >> 4 (the start address field), as the k-steps do.
    // The warpgroup broadcast from lane 0, so that the compiler keeps the descriptors built from it in uniform
    // registers (and they move by 32-bit adds: ptx::wgmma_desc_at).
    const u32 wgu = __shfl_sync(CP_FULL_MASK, cw, 0);
    const u64 dq = ptx::wgmma_desc(sQ + wgu * kWgRows * 128, 16, 1024, kSw);
    const u64 dk0 = ptx::wgmma_desc(sK, 16, 1024, kSw), dv0 = ptx::wgmma_desc(sV, kTCol, 1024, kSw);
    u64 dqs[kKSteps];  // Q's descriptor of each k-step of S (the same every tile)
#pragma unroll
    for (u32 ks = 0; ks < kKSteps; ++ks) dqs[ks] = ptx::wgmma_desc_at(dq, ((ks >> 2) * kQCol + (ks & 3u) * 32) >> 4);

    u32 cb = 0;  // kSplit: the buffer of the block's next tile to compute (tile n's is n % kS)
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
                srow[h] = tc::score_row(rows, s, cw * kWgRows + 16 * warp4 + g + 8 * h, ht, head0, qt);
        }
        // This thread's stored rows' common positions [flo, fhi): a tile inside them is whole for both (a row
        // of no query is never written: it sees what the others see).
        u32 flo = 0, fhi = ~0u;
#pragma unroll
        for (u32 h = 0; h < 2; ++h)
            if (my_slot[h] != kNone) {
                flo = rlo[h] > flo ? rlo[h] : flo;
                fhi = rhi[h] < fhi ? rhi[h] : fhi;
            }
        // The tile in buffer b at t0 ..: its valid tokens and whether it is full for this warp (ts.valid,
        // ts.full).
        auto tile_full = [&](u32 b, u32 t0, TileState& ts) {
            ts.valid = (u64)st.valid[b][0] | (u64)st.valid[b][1] << 32;
            ts.full = __all_sync(CP_FULL_MASK, ts.valid == ~0ull && flo <= t0 && t0 + kN <= fhi);
        };
        // This thread's rows' visible tokens of the tile at t0 (ts.vis), and whether a stored one misses a
        // valid token.
        auto tile_miss = [&](u32 t0, TileState& ts) {
            bool m = false;
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                ts.vis[h] = tc::tile_vis<kN>(ts.valid, rlo[h], rhi[h], t0);
                m |= my_slot[h] != kNone && ts.vis[h] != ts.valid;
            }
            return m;
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
            csync();  // every lane has read the tile's non-finite values
#pragma unroll 1
            for (u32 c = ctid; c < kTileBytes / 4; c += kThreads) {  // every 32-bit pair
                ptx::cold_path();
                u32* const w = reinterpret_cast<u32*>(vt_) + c;
                const u32 x = *w;
                const u32 xlo = tc::nonfinite2<v16_t>(x & 0xffffu) ? 0u : (x & 0xffffu);
                const u32 xhi = tc::nonfinite2<v16_t>(x >> 16) ? 0u : (x & 0xffff0000u);
                *w = xlo | xhi;
            }
            ptx::fence_proxy_async_shared();  // the tile is read by wgmma
            csync();
        };
        // O [64 x D] += P V of a tile: P from registers, V N-major from the V tile of buffer vb (issued, not
        // committed). Descriptors move by the byte offset >> 4 (from the buffer index: integer math).
        auto issue_pv = [&](const u32(&pa_)[kPSteps][4], u32 vb) {
            const u64 dv = ptx::wgmma_desc_at(dv0, vb * (kTileBytes >> 4));
#pragma unroll
            for (u32 kk = 0; kk < kPSteps; ++kk)
                ptx::wgmma_rs<v16_t, kD, 1>(o, pa_[kk], ptx::wgmma_desc_at(dv, (16 * kk * 128) >> 4), true);
        };
        // S [64 x 64] = Q K^T of this warpgroup's rows and the K tile of buffer kb (issued, not committed).
        // Descriptors move along K by adding the byte offset >> 4 to the start address field.
        auto issue_s = [&](float (&d)[kN / 2], u32 kb) {
            const u64 dk = ptx::wgmma_desc_at(dk0, kb * (kTileBytes >> 4));
#pragma unroll
            for (u32 ks = 0; ks < kKSteps; ++ks)
                ptx::wgmma_ss<scalar_t, kN, 0, 0>(
                    d, dqs[ks], ptx::wgmma_desc_at(dk, ((ks >> 2) * kTCol + (ks & 3u) * 32) >> 4), ks > 0);
        };
        // The softmax of a tile's S (in place: P in f32) at t0 ..: scale into the log2 domain, the score hook,
        // the mask (edge tiles only: vis filled here for kSplit), the online softmax per row; returns each
        // row's rescale factor of O. Element i of the fragment: row g (+ 8 for i & 2), token 8 (i / 4) + 2 tq
        // (+ 1 for i & 1). The plain score keeps S unscaled up to exp2(S qscale - m) (one FFMA; qscale > 0
        // keeps the max).
        auto softmax_tile = [&](float (&s)[kN / 2], TileState& ts, u32 t0, float (&alpha)[2]) {
            constexpr bool kLate = variant::kPlainScore;
            const float late = kLate ? qscale : 1.0f;
            u64(&vis)[2] = ts.vis;
            float mx[2] = {neg_inf(), neg_inf()};
            // The score hook and, masked (an edge tile), each element by its row's visibility from this lane's
            // first column 2 tq on (vq: element i tests a constant bit).
            auto scores = [&](auto masked, const u64(&vq)[2]) {
#pragma unroll
                for (u32 i = 0; i < kN / 2; ++i) {
                    const u32 h = (i >> 1) & 1u, dc = 8 * (i >> 2) + (i & 1u);  // column 2 tq + dc
                    float v = s[i];
                    if constexpr (!kLate) v = variant::score(sc, srow[h], v * qscale, t0 + dc + 2 * tq);
                    if constexpr (decltype(masked)::value) v = ((vq[h] >> dc) & 1u) ? v : neg_inf();
                    s[i] = v;
                    mx[h] = fmaxf(mx[h], v);
                }
            };
            if (ts.full) {  // every row of the warp sees every token (FlashAttention-3 masks only edge tiles)
                vis[0] = vis[1] = ~0ull;
                scores(tc::Flag<false>{}, vis);
            } else {
                ptx::edge_tile();
                if constexpr (kSplit) tile_miss(t0, ts);  // (the producer checked the values)
                const u64 vq[2] = {vis[0] >> (2 * tq), vis[1] >> (2 * tq)};
                scores(tc::Flag<true>{}, vq);
            }
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
        };
        auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
            for (u32 i = 0; i < kD / 2; ++i) o[i] *= alpha[(i >> 1) & 1u];
        };
        // P as A fragments of k-step kk (tokens 16 kk ..): S n-tiles 2 kk (a[0], a[1]) and 2 kk + 1.
        auto pack = [&](const float (&s)[kN / 2], u32(&dst)[kPSteps][4]) {
#pragma unroll
            for (u32 kk = 0; kk < kPSteps; ++kk)
#pragma unroll
                for (u32 i = 0; i < 4; ++i) dst[kk][i] = ptx::pack2<v16_t>(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
        };
        if constexpr (kSplit) {
            // The consumers (FlashAttention-3's intra-warpgroup overlap, one tile deeper): the block's tiles in
            // order, tile n in buffer n % kS once the producer signals it. In the turn of tile j a warpgroup
            // issues S of tile j + 1 (or, past the pass's last tile, of tile j again: discarded, so that no
            // product sits on a branch) and O += P V of tile j - 1, then runs tile j's softmax on the S it
            // waited for in the turn before, while the tensor cores run both; then it waits for them,
            // releases tile j - 1's buffer, rescales O for tile j and keeps tile j's P for the next turn.
            // Buffers held: tile j - 1's (P V in flight), j's (its V), j + 1's (its S).
            const u32 ntiles = (hi - lo + kN - 1) / kN;
            if (ntiles == 0) return;
            u32 pa_prev[kPSteps][4];  // tile j - 1: P, visible tokens, buffer, whether its V needs fixing
            u64 vis_prev[2] = {0, 0};
            u32 b_prev = 0;
            bool bad_prev = false;
            float sa[kN / 2], sb[kN / 2];  // S of tiles j (cur) and j + 1 (nxt), by the tile's parity
            auto step = [&](u32 j, float (&cur)[kN / 2], float (&nxt)[kN / 2], auto first) {
                constexpr bool kPrev = !decltype(first)::kFirst;  // a tile before this one (its P V to issue)
                const u32 b = cb, t0 = lo + j * kN;
                const bool more = j + 1 < ntiles;
                const u32 nb = more ? next_buf(cb) : b;
                if (more) wgb::sync(kFull + nb, kBlockThreads);  // tile j + 1 landed
                TileState ts;
                tile_full(b, t0, ts);
                ts.bad = st_bad[b] != 0;
                if constexpr (kPrev)
                    if (bad_prev) fix_values(pa_prev, vis_prev, sV + b_prev * kTileBytes);  // block-uniform
                in_turn([&] {  // (this warpgroup's softmax below issues while they run)
                    issue_s(nxt, nb);
                    ptx::wgmma_commit();
                    if constexpr (kPrev) issue_pv(pa_prev, b_prev);
                    ptx::wgmma_commit();  // possibly empty
                });
                float alpha[2];
                softmax_tile(cur, ts, t0, alpha);
                // The row sums (every exponential of the tile) stored before the wait: ptxas keeps a shared store
                // ahead of a later wgmma.wait_group, so the softmax issues while the products run (without it
                // ptxas hoists the wait above the exponentials and the warp first stalls for the products).
                s_issued[tid >> 5] = sm[0].l + sm[1].l;
                ptx::wgmma_wait<0>();
                ptx::wgmma_fence_operand(o);
                ptx::wgmma_fence_operand(nxt);
                if constexpr (kPrev) wgb::arrive(kEmpty + b_prev, kBlockThreads);  // tile j - 1's buffer is free
                rescale(alpha);
                pack(cur, pa_prev);
                vis_prev[0] = ts.vis[0];
                vis_prev[1] = ts.vis[1];
                b_prev = b;
                bad_prev = ts.bad;
                cb = next_buf(cb);
            };
            // Tile 0's S, waited for (once a pass); then the tiles, S of tile j in sa (j even) or sb (j odd).
            wgb::sync(kFull + cb, kBlockThreads);
            in_turn([&] {
                issue_s(sa, cb);
                ptx::wgmma_commit();
            });
            ptx::wgmma_wait<0>();
            ptx::wgmma_fence_operand(sa);
            step(0, sa, sb, First{});
            u32 j = 1;
#pragma unroll 1
            for (; j + 1 < ntiles; j += 2) {
                step(j, sb, sa, Later{});
                step(j + 1, sa, sb, Later{});
            }
            if (j < ntiles) step(j, sb, sa, Later{});
            // The last tile's P V, before the pass ends (the next pass's ring reuses its buffer).
            if (bad_prev) fix_values(pa_prev, vis_prev, sV + b_prev * kTileBytes);
            ptx::wgmma_fence_operand(o);
            in_turn([&] {
                issue_pv(pa_prev, b_prev);
                ptx::wgmma_commit();
            });
            ptx::wgmma_wait<0>();
            ptx::wgmma_fence_operand(o);
            wgb::arrive(kEmpty + b_prev, kBlockThreads);
        } else {
            // fp8 and D 256: the ring's tiles, S then (after the softmax) P V in two turns of each tile.
            auto compute = [&](u32 b, u32 t0) {
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
                unsigned char* const vt = sV + (kFp8 ? 0u : b) * kTileBytes;
                // A tile where some stored row of the block misses a valid token (the causal diagonal, split
                // edges, another sequence's rows): its value rows' Inf / NaN must reach only the rows that see
                // them (0 x Inf is NaN in the tensor cores). The block knows before either warpgroup's turn
                // whether its V tile holds one (bad: block-uniform); the rows that see such an element add it
                // in fix_values.
                TileState ts;
                ts.bad = false;
                tile_full(b, t0, ts);
                if (__syncthreads_or(tile_miss(t0, ts))) {
                    ptx::cold_path();
                    ts.bad = __syncthreads_or(check(b, tid, kThreads));
                }
                float s[kN / 2];
                in_turn([&] {
                    issue_s(s, kFp8 ? 0u : b);
                    ptx::wgmma_commit();
                });
                ptx::wgmma_wait<0>();
                ptx::wgmma_fence_operand(s);
                float alpha[2];
                softmax_tile(s, ts, t0, alpha);
                rescale(alpha);
                u32 pa[kPSteps][4];
                pack(s, pa);
                if (ts.bad) fix_values(pa, ts.vis, vt);
                // ---- O [64 x D] += P V in this warpgroup's turn ----
                ptx::wgmma_fence_operand(o);
                in_turn([&] {
                    issue_pv(pa, kFp8 ? 0u : b);
                    ptx::wgmma_commit();
                });
                ptx::wgmma_wait<0>();
                ptx::wgmma_fence_operand(o);
            };
            // 16-bit tiles are read by wgmma as cp.async left them: fenced to the async proxy (fp8: compute
            // fences its decoded tiles).
            tc::run_ring<kN, kS, !kFp8>(
                st, tables + (u64)seq * p.table_width, lo, hi, p.page_size, p.num_pages,
                [&](u32 sb, u32 b) { copy_tile(tid, sb, b); }, [&](u32 b, u32 t0) { compute(b, t0); }, on_stage);
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
        const u32 r = cw * kWgRows + 16 * warp4 + g + 8 * h;
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
