// decode_tc.cu: paged_decode_tc, decode attention on tensor cores (the design
// of FlashInfer's tensor-core decode and FlashDecoding; the split merge:
// merge.cu). Layout, positions, metadata words, LSE
// and the split workspace: docs/layout.md. The argument is one
// AttentionParams (params.cuh); the inline PTX lives in ptx.cuh.
//
// paged_decode_tc: f16 / bf16 q, caches of q's type or fp8 (e4m3 / e5m2,
// with k_scale / v_scale), D == Dv == HEAD_DIM (64 or 128), 16-byte aligned
// arrays and cache strides (any view whose rows are: HND, halves of a
// combined KV tensor). It serves any query (decode, or a query of a short
// chunk) exactly as paged_attention does, with a block for a pack of KV heads:
//   grid (q_count, kv_heads / pack * head_tiles, splits), block pack * kThreads (kWarps = 2 warps
//   per KV head), pack (1, 2 or up to kHeadPack = 4 heads: the launch's, schedule.py) read from
//   blockDim; dynamic shared memory pack * decode_tc.smem_bytes(D, kv)
//   (cupaged/ops/attention/kernels/decode_tc.py): 18 / 14.5 KiB at D = 64, 34 / 26.5 KiB at D = 128
//   (16-bit / fp8) a KV head; __launch_bounds__(kThreads * kMinBlocks, 1): registers capped so that
//   six one-head blocks fit an SM (the resident slots choose_splits fills: six / pack blocks).
//   The block geometry (warps, minimum, pack, rows, tile, stages, row pads) is defined once in
//   decode_tc.py (GEOMETRY) and read here through geometry.cuh (geom::decode_tc).
//   Block x serves query q_begin + x; block y the KV heads (y / tiles) * pack .. + pack - 1 and,
//   of each, the query heads (y % tiles) * 16 .. + 15 (a tile of up to 16 heads of the GQA
//   group). Warp w = c * pack + j computes KV head j of the pack in column c.
//
// Tiling. The tile's heads are the M dimension of mma.sync m16n8k16: 16 rows
// (rows past the tile's heads are zero queries, never written). A block's
// start is two dependent round trips: Q's copies (cp.async, into the last
// stage of the last column's ring, which the prologue leaves empty), the
// query's words (att::query_words: its sequence, position and, in a decode
// step, its sequence's length) and the page word of its share's first tile
// (guessed: the share of a decode step of the plan's longest length,
// kv_len_hint; checked against the words, reloaded where wrong) issue
// together; then the first tiles' copies, after which Q is waited for and
// held as A fragments in registers. The query's visible
// positions [lo, hi) of its split are cut into tiles of 16 tokens; column c
// (the pack's warps c * pack .. + pack - 1, one a KV head) takes tiles c,
// c + 2, c + 4, ... and runs its own pipeline, with one named barrier of its
// warps a tile and no block barrier inside the loop:
//   * a cp.async ring of kStages stages per column in shared memory (STAGES
//     in decode_tc.py, 2), a stage holding each head's K and V tile (16 x D
//     rows, padded by 8 elements for conflict-free ldmatrix): while the
//     column computes tile k from one stage, tiles k + 1 .. k + kStages - 1
//     are in flight into the others. The column's lanes copy the tile
//     together, token by token: a copy instruction moves 512 contiguous
//     bytes of a token's rows of the pack's heads (an NHD cache: one run of
//     pack x D elements), the pack's warps a whole run; each warp waits for
//     its own copies, then the column's barrier says every copy of tile k
//     has landed and every warp is done with tile k - 1's stage, which the
//     copies of tile k + kStages - 1 then refill; no static shared memory;
//   * the page walk (no division in the loop: the one division is at the
//     start) advances a page column and slot by 32 tokens a tile, and the
//     page-table word of tile k + kStages loads while tile k computes (each
//     warp of a column walks its tiles). When
//     the page size is a multiple of 16 and the share starts on a tile
//     boundary (no window, or one starting there; splits are cut in
//     SPLIT_TILE multiples), a tile lies in one page: one page-table word a
//     tile, the same in every lane, and each lane addresses its rows from
//     that page and the tile's slot plus its row (one 64-bit add a row).
//     Other page sizes and windows walk a token per lane of the first 16 and
//     a copying lane takes its rows' pages and slots from those lanes
//     (shuffles, in a rolled loop that ptx::cold_path marks for the model);
//   * fp8 caches: the ring holds the raw codes (K [16][D + 32], V [16][D]
//     bytes: half the bytes in flight per token, the same tile and wait).
//     K's B fragments are decoded in registers from 8-byte loads of the
//     codes (lane (g, t) reads dims 32 kp + 8 t .. + 7 of tokens g, g + 8:
//     two k-steps; Q's A fragments were loaded in the same order of dims,
//     so the dot products are unchanged); V's codes are decoded by the warp
//     into one 16-bit V tile [16][D + 8] that ldmatrix.trans reads as above.
//     Decoding is exact (fp8.cuh): K in q's type, V in f16 (P V is an f16
//     mma). k_scale multiplies the score scale and v_scale the output (one
//     KV head a warp; a null scale is 1);
//   * S = Q K^T (8 / 16 mma a tile at D = 64 / 128), the online softmax
//     (softmax_state.cuh) on the S fragments in f32, log2 domain, a row's max
//     and sum in the 4 lanes of a quad (O rescaled only on the tiles where a
//     row of the warp raises its max); O += P V with P's fragments as the A
//     operand (8 / 16 mma). Every row of a block belongs to one query, so a
//     token is visible to all rows or to none: tokens past hi and page ids
//     >= num_pages are zero-filled, never read, and their scores are -inf,
//     so P is 0 exactly where V is 0 (no unused slot, Inf or NaN reaches an
//     output). A NaN query gives NaN rows, as the reference does.
//   At the end each KV head's two warps' states and O tiles meet in shared
//   memory (the rings, reused) and each (head, 8 values) is written once:
//   out / lse, or with splits > 1 the FP32 partials attention_split_merge
//   combines (epilogue.cuh's row writer: the sink, the V scale, the stores).
//
// Memory traffic per block: the visible K and V rows of its split once,
// pack * L * 2 * D * sizeof(kv_t) bytes, for all its heads, and one 4-byte
// page-table word per 16 tokens (a page size that is a multiple of 16) or per
// token (other page sizes) and warp from L1 / L2; q and the outputs are small
// beside them. In flight: kStages - 1 16-token tiles per warp (8 KiB each at
// D = 128, 4 KiB fp8) while one computes; at two stages twelve warps per SM
// (six one-head blocks, three of two heads; one of four: eight warps, its
// 136 KiB of shared memory) hold up to 96 KiB (48) in flight against the
// ~23 KiB Little's law asks of an H200 SM (4.3 TB/s x 700 ns / 132). The
// grid of a batch-64 decode with 8 KV heads (128 blocks of four heads) fits
// the 132 SMs of an H200 in one wave.
//
// Defines (cupaged/ops/attention/variants.py Variant):
//   CP_DTYPE               f16 | bf16: q and out
//   CP_KV_DTYPE            the caches: CP_DTYPE, or e4m3 | e5m2 (kKvScaled: decoded in shared memory)
//   CP_SCORE               the score variant (variant.cuh)
//   CP_SOFT_CAP, CP_WINDOW, CP_SINKS, CP_ALIBI  its features (variant.cuh); a window starts the
//                          share [lo, hi) past 0, so the pages before lo are never read
//   HEAD_DIM               64 | 128: D == Dv
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

namespace dtc {
constexpr u32 kD = HEAD_DIM;
constexpr u32 kRows = geom::decode_tc::kRows;  // M: query heads of one block (one mma row tile)
constexpr u32 kN = geom::decode_tc::kN;  // tokens per warp tile
// Per KV head: kWarps warps (columns), kThreads threads; a block serves pack <= kHeadPack heads.
constexpr u32 kWarps = geom::decode_tc::kWarps, kThreads = geom::decode_tc::kThreads;
constexpr u32 kHeadPack = geom::decode_tc::kHeadPack;
// One-head blocks resident per SM by design: the __launch_bounds__ block kThreads * kMinBlocks caps the registers.
constexpr u32 kMinBlocks = geom::decode_tc::kMinBlocks;
constexpr u32 kBoundThreads = kThreads * kMinBlocks;
constexpr u32 kStages = geom::decode_tc::kStages;  // stages of each column's ring
constexpr u32 kPitch = kD + geom::kPitchPad;  // shared row pitch (elements): conflict-free ldmatrix
constexpr u32 kQChunks = kD / 8;  // 16-byte chunks of a q row
constexpr u32 kKSteps = kD / 16;  // k-steps of S = Q K^T
constexpr u32 kOTiles = kD / 8;  // n-tiles of O
// fp8 caches (kKvScaled): the codes of a tile are copied raw (half the bytes)
// into a ring of their own and decoded, exactly, into one 16-bit tile that
// the fragments load from: K as scalar_t (Q's type: one mma), V as f16 (P
// and V meet in an f16 mma, exact for every e4m3 / e5m2 code, P rounded to
// f16 rather than bf16).
constexpr bool kFp8 = kKvScaled;
using tc::v16_t;  // P and V's type in O += P V
constexpr u32 kChunkElems = geom::kVectorBytes / sizeof(kv_t);  // cache elements per 16-byte copy
constexpr u32 kChunks = kD / kChunkElems;  // 16-byte copies per cache row
// fp8: K's B fragments are decoded in registers from the raw codes (8-byte
// loads, Q's fragments in the matching order of dims), so only V goes
// through a decoded 16-bit tile [kN][kPitch]. Raw K rows are kD + kRawKPad
// (32) bytes apart: the 8-byte loads of a quarter warp (4 tokens x 4 lanes)
// hit distinct banks.
constexpr u32 kRawKPitch = kD + geom::decode_tc::kRawKPad;
// A ring stage, in bytes: 16-bit caches, a 16-bit tile (K, then V); fp8, the
// raw codes K [kN][kRawKPitch], then V [kN][kD].
constexpr u32 kKPitchB = kFp8 ? kRawKPitch : 2 * kPitch;  // bytes between K rows of a stage
constexpr u32 kVPitchB = kFp8 ? kD : 2 * kPitch;  // bytes between V rows of a stage
constexpr u32 kVOffB = kN * kKPitchB;  // V rows' offset in a stage
constexpr u32 kStageBytes = kVOffB + kN * kVPitchB;
constexpr u32 kDecodedBytes = kFp8 ? kN * kPitch * 2 : 0;  // fp8: the decoded V tile, before the stages
// Per warp (a KV head of a column): kStages stages (16-bit), or its decoded V tile and kStages raw stages (fp8).
// A column of pack warps: their decoded tiles, then its ring, stage b holding head j's tile at (b * pack + j).
constexpr u32 kWarpBytes = kDecodedBytes + kStages * kStageBytes;
constexpr u32 kRowsPerCopy = 32 / kChunks;  // tokens one column-wide step of copies covers (2, 4 or 8)
constexpr u32 kRowsPerLane = kN / kRowsPerCopy;  // K (and V) rows of a tile each lane copies a chunk of
constexpr u32 kNone = CP_NO_PAGE;
static_assert(kD == 64 || kD == 128, "HEAD_DIM: 64 or 128");
static_assert(kThreads == 32 * kWarps, "whole warps");
static_assert(kHeadPack * kThreads <= kBoundThreads, "the largest pack's block within the launch bounds");
static_assert(kWarps + 1 <= 16, "a named barrier (1 .. kWarps) per column");
static_assert(kRows == 16 && kN == 16, "one m16n8k16 row tile of heads; one k-step of 16 tokens in P V");
static_assert(kStages >= 2, "a ring of at least two stages per column");
static_assert((kN * kChunks) % 32 == 0, "a tile's K rows are whole copy instructions");
static_assert((kN * kD / 8) % 32 == 0, "a tile's K rows are whole 8-code decode steps");
static_assert(kWarpBytes % 16 == 0 && kDecodedBytes % 16 == 0 && kVOffB % 16 == 0, "16-byte aligned rings");
static_assert(kKSteps % 2 == 0, "fp8: K's codes are read two k-steps at a time");
// The end-of-kernel merge reuses the ring: each warp's O [kRows][kD] f32 and its m, l.
static_assert((kRows * kD + 2 * kRows) * 4 <= kWarpBytes, "merge area fits a warp's ring");
// Q is staged in the last stage of the last column's ring, which the prologue leaves empty: a KV head's
// 16-bit tile [kRows][kPitch] within a head's part of a stage.
static_assert(kRows * kPitch * 2 <= kStageBytes && kStageBytes % 16 == 0, "a head's Q tile fits a stage");
static_assert(sizeof(scalar_t) == 2 && (kFp8 || sizeof(kv_t) == 2), "f16 / bf16 q; f16 / bf16 / fp8 caches");
}  // namespace dtc

// Reads p.q, p.k_cache, p.v_cache and the words; writes p.out and p.lse
// (splits == 1) or the partials (splits > 1).
extern "C" __global__ void __launch_bounds__(dtc::kBoundThreads, 1) paged_decode_tc(const AttentionParams p) {
    using namespace dtc;
    CP_ATTENTION_ARRAYS(p);  // the arrays as __restrict__ locals (epilogue.cuh)
    ptx::launch_dependents();  // the split merge, a dependent launch, may start: it waits for this grid
    CUPAGED_DYNAMIC_SHARED(scalar_t, smem);  // kWarps columns' rings (and fp8's decoded tiles)

    const u32 qi = p.q_begin + blockIdx.x;  // see paged_attention: the whole block leaves before any barrier
    if (blockIdx.x >= p.q_count || qi >= p.queries || qi < p.q_begin) return;
    const u32 nthreads = blockDim.x, pack = nthreads / kThreads;  // KV heads of the block
    const u32 tid = threadIdx.x, warp = tid >> 5, lane = tid & 31u;
    const u32 col = warp / pack, hj = warp - col * pack;  // this warp's column and KV head of the pack
    const u32 g = lane >> 2, tq = lane & 3u;  // mma fragment coordinates
    const u32 r8 = lane & 7u, tile = lane >> 3;  // ldmatrix: row within a tile, tile of the x4
    const u32 q_heads = p.q_heads, kv_heads = p.kv_heads;
    const u32 group = q_heads / kv_heads;
    const u32 ht = group < kRows ? group : kRows;  // heads per tile
    const u32 tiles = (group + ht - 1) / ht;
    const u32 kvh0 = blockIdx.y / tiles * pack;  // the pack's first KV head
    const u32 t_off = (blockIdx.y - blockIdx.y / tiles * tiles) * ht;  // the tile's first head in a group
    const u32 kvh = kvh0 + hj;  // this warp's
    const u32 head0 = kvh * group + t_off;
    const u32 heads = att::min_u32(ht, group - t_off);  // real rows of each head's tile

    // ---- Q: each KV head's tile copied first, into the last stage of the last column's ring ----
    // (the prologue's copies fill stages 0 .. kStages - 2; Q goes to registers before the loop refills it)
    scalar_t* const q_area = reinterpret_cast<scalar_t*>(
        reinterpret_cast<char*>(smem) +
        ((kWarps - 1) * pack * kWarpBytes + pack * kDecodedBytes + (kStages - 1) * pack * kStageBytes));
    for (u32 c = tid; c < pack * kRows * kQChunks; c += nthreads) {
        const u32 rr = c / kQChunks, ch = c - rr * kQChunks;  // row rr of the pack's tiles
        const u32 j = rr / kRows, r = rr - j * kRows;
        const bool ok = r < heads;
        const scalar_t* src = q + att::q_at(p, qi, (kvh0 + j) * group + t_off + r) + ch * 8;
        ptx::cp_async_16(q_area + rr * kPitch + ch * 8, ok ? src : q, ok);
    }
    ptx::cp_async_commit();
    // An fp8 cache's K scale folds into the score scale (below, after Q's wait: a use here would hold
    // the first tiles' copies until it arrives), its V scale into the output (every row of the warp reads
    // KV head kvh). A null scale is 1.
    float k_sc = 1.0f;
    if constexpr (kFp8)
        if (p.k_scale) k_sc = p.k_scale[kvh * p.k_scale_stride];

    // ---- this split's share [lo, hi) of the query's visible positions, and its first page word ----
    // The share is guessed first: that of a decode step of the plan's longest length (p.kv_len_hint, from
    // the host) in sequence qi, so the first tile's page word loads beside the query's words (one round
    // trip for both). The words then say whether the guess was right (always, in a decode step of a
    // batch of equal lengths planned on the host); where it was not (other lengths, a chunk's queries, a
    // captured graph whose lengths moved on) the walk restarts from the real share and reloads that word
    // on a path ptx::cold_path marks. Nothing read on a guess is used unless the guess was right.
    const u32 hint = p.kv_len_hint;
    const att::Span guess = att::share(p, hint, [&] { return hint > 0 ? hint - 1u : 0u; }, blockIdx.z);
    const u32* const table_qi = words + pw::page_table(p.queries, p.sequences) + (u64)qi * p.table_width;
    const u32 ps = p.page_size, num_pages = p.num_pages;
    // Page walk. When the page size is a multiple of kN and the share starts on
    // a tile boundary (no window, or one that starts there), every tile lies in
    // one page: the walk holds the tile's first token tok = lo + (k * kWarps +
    // col) * kN in every lane, one page-table word a tile, and each lane
    // addresses its rows from that page and slot (whole). Otherwise lane l < kN
    // walks token tok + l, and a copying lane takes its rows' pages and slots
    // from their lanes (shuffles). The page position (att::PagePos) advances by
    // kStep tokens a tile (no division in the loop: the one division is here).
    constexpr u32 kStep = kN * kWarps;
    const att::PageStep step(kStep, ps);
    u32 lo, tok;
    att::PagePos pos;
    bool whole;
    auto start = [&](u32 share_lo) {  // the walk's first token of this column, from the share's start
        lo = share_lo;
        whole = ps % kN == 0 && lo % kN == 0;
        tok = lo + col * kN + (whole ? 0u : lane);
        pos.at(tok, ps);
    };
    start(guess.lo);
    u32 raw = kNone;  // page-table word of tok (kNone past hi), loaded one tile ahead
    // The guessed share's first word (its row and column inside the table: never past the arrays).
    if ((whole || lane < kN) && qi < p.sequences && pos.pj < p.table_width) raw = table_qi[pos.pj];
    const att::QueryWords qw = att::query_words(p, qi);  // one round trip for all in a decode step
    const u32 seq = qw.seq;
    u32 hi = 0;
    const u32* table = words;
    {
        att::Span sp{0u, 0u};
        if (seq < p.sequences) {
            sp = att::share(p, qw, blockIdx.z);
            table = words + pw::page_table(p.queries, p.sequences) + (u64)seq * p.table_width;
        }
        hi = sp.hi;
        if (seq != qi || sp.lo != lo) {
            ptx::cold_path();  // a wrong guess: the walk from the real share
            start(sp.lo);
            raw = (whole || lane < kN) && tok < hi ? table[pos.pj] : kNone;
        }
    }
    if (!(tok < hi)) raw = kNone;  // past the share (or an empty one)
    auto fetch = [&] { raw = ((whole || lane < kN) && tok < hi) ? table[pos.pj] : kNone; };
    auto advance = [&] {
        tok += kStep;
        pos.advance(step);
    };
    // For a score variant: its arguments, and the rows (query position, head, slope) of this lane's heads g, g + 8.
    const variant::Scorer sc(p);
    variant::ScoreRow srow[2];
    if constexpr (!variant::kPlainScore) {
        srow[0] = sc.row(qw.pos, head0 + g);
        srow[1] = sc.row(qw.pos, head0 + g + 8);
    }

    float qscale = p.scale * softmax::kLog2e;  // (times k_sc after Q's wait)
    u32 qf[kKSteps][4];  // Q's A fragments (loaded after the prologue's copies are issued)
    softmax::State sm[2];  // rows g and g + 8
    float o[kOTiles][4];
#pragma unroll
    for (u32 h = 0; h < 2; ++h) sm[h].clear();
#pragma unroll
    for (u32 n = 0; n < kOTiles; ++n)
#pragma unroll
        for (u32 i = 0; i < 4; ++i) o[n][i] = 0.0f;

    // ---- this column's tiles: c, c + kWarps, ... of the share ----
    // The column's area: its warps' decoded V tiles (fp8), then its ring; stage b holds head j's tile at b * pack + j.
    char* const area = reinterpret_cast<char*>(smem) + (u64)col * pack * kWarpBytes;
    v16_t* const decoded = reinterpret_cast<v16_t*>(area + hj * kDecodedBytes);  // (fp8)
    char* const stages = area + pack * kDecodedBytes;
    const u32 ntiles = (hi - lo + kN - 1) / kN;
    const u32 nk = ntiles > col ? (ntiles - col + kWarps - 1) / kWarps : 0u;  // the same in every warp of the column
    // This lane's part of every copy: lane cl of the column copies chunk ch of head cj's rows r0, r0 +
    // kRowsPerCopy, ... of a tile (K and V); a step of the column's copies covers kRowsPerCopy tokens' rows
    // of all the pack's heads, 16 bytes a lane, so a warp-wide instruction reads 512 contiguous bytes of a
    // token's rows where its heads are adjacent (NHD). A row of token (page, slot) is page * stride_page +
    // slot * stride_slot (the views' element strides).
    const u32 cl = hj * 32 + lane, run = pack * kChunks;
    const u32 r0 = cl / run, cj = (cl - r0 * run) / kChunks, ch = cl % kChunks;
    const kv_t* const k_lane = k_cache + (u64)(kvh0 + cj) * p.k_stride_head + ch * kChunkElems;
    const kv_t* const v_lane = v_cache + (u64)(kvh0 + cj) * p.v_stride_head + ch * kChunkElems;
    char* const kdst_lane = stages + cj * kStageBytes + r0 * kKPitchB + ch * 16;
    char* const vdst_lane = stages + cj * kStageBytes + kVOffB + r0 * kVPitchB + ch * 16;
    const u32 stage_b = pack * kStageBytes;  // bytes between stages
    // Byte steps between the rows one lane copies (kRowsPerCopy slots apart in
    // a page: a page's own offsets fit 32 bits).
    const u32 krow_b = kRowsPerCopy * p.k_stride_slot * (u32)sizeof(kv_t);
    const u32 vrow_b = kRowsPerCopy * p.v_stride_slot * (u32)sizeof(kv_t);
    // This lane's copies of the fetched tile into stage b; returns the tile's
    // valid bits (bit r: token r is below hi in a page < num_pages; the same in
    // every warp of the column). An invalid row is zero-filled from an address
    // inside the cache (never read).
    auto issue = [&](u32 b) -> u32 {
        char* const kd = kdst_lane + b * stage_b;
        char* const vd = vdst_lane + b * stage_b;
        if (whole) {
            // One page for the whole tile (raw and pos.psl are the same in every lane).
            const bool ok = raw < num_pages;
            const u32 nv = ok ? att::min_u32(hi - tok, kN) : 0u;  // valid tokens: rows 0 .. nv - 1
            const u64 page = ok ? raw : 0u;
            const u32 slot = pos.psl + r0;
            const char* const kb =
                reinterpret_cast<const char*>(k_lane + page * p.k_stride_page + slot * p.k_stride_slot);
            const char* const vb =
                reinterpret_cast<const char*>(v_lane + page * p.v_stride_page + slot * p.v_stride_slot);
#pragma unroll
            for (u32 u = 0; u < kRowsPerLane; ++u) {
                const bool row_ok = u * kRowsPerCopy + r0 < nv;
                ptx::cp_async_16(kd + u * kRowsPerCopy * kKPitchB, kb + (u64)krow_b * u, row_ok);
                ptx::cp_async_16(vd + u * kRowsPerCopy * kVPitchB, vb + (u64)vrow_b * u, row_ok);
            }
            return (1u << nv) - 1u;
        }
        const u32 valid = __ballot_sync(CP_FULL_MASK, lane < kN && raw < num_pages);
        // The general walk (a rolled loop; its marker tells the performance model
        // how often it runs): row u * kRowsPerCopy + r0's page and slot from its lane.
#pragma unroll 1
        for (u32 u = 0; u < kRowsPerLane; ++u) {
            ptx::cold_path();
            const u32 row = u * kRowsPerCopy + r0;
            const u32 pg = __shfl_sync(CP_FULL_MASK, raw, row), sl = __shfl_sync(CP_FULL_MASK, pos.psl, row);
            const bool row_ok = (valid >> row) & 1u;
            const u64 page = row_ok ? pg : 0u;
            const u32 slot = row_ok ? sl : 0u;
            ptx::cp_async_16(kd + u * kRowsPerCopy * kKPitchB, k_lane + page * p.k_stride_page + slot * p.k_stride_slot,
                             row_ok);
            ptx::cp_async_16(vd + u * kRowsPerCopy * kVPitchB, v_lane + page * p.v_stride_page + slot * p.v_stride_slot,
                             row_ok);
        }
        return valid;
    };
    // This warp's head's tile in stage b.
    auto stage = [&](u32 b) { return stages + (b * pack + hj) * kStageBytes; };
    // fp8: decode raw stage b's V rows of this warp's head into its 16-bit V
    // tile, as f16 (8 codes a step: one 8-byte shared load, one 16-byte store).
    // Zero-filled rows (invalid tokens) decode to 0.
    auto decode = [&](u32 b) {
        const unsigned char* const src = reinterpret_cast<const unsigned char*>(stage(b));
        tc::decode_rows<v16_t, kD, kN, 32>(src + kVOffB, decoded, kPitch, lane);
    };
    auto compute = [&](u32 b, u32 valid, u32 t0) {
        const scalar_t* const kt = reinterpret_cast<const scalar_t*>(stage(b));  // (16-bit caches)
        const v16_t* const vt = kFp8 ? decoded : reinterpret_cast<const v16_t*>(kt + kN * kPitch);
        // S = Q K^T: [16 heads x 16 tokens].
        float s[2][4];
#pragma unroll
        for (u32 n = 0; n < 2; ++n)
#pragma unroll
            for (u32 i = 0; i < 4; ++i) s[n][i] = 0.0f;
        if constexpr (kFp8) {
            // B fragments straight from the codes: lane (g, tq) reads dims 32 kp + 8 tq .. + 7 of
            // tokens g and 8 + g; their pairs are k-steps 2 kp and 2 kp + 1 in the order Q's
            // fragments were loaded in (qf below).
            const unsigned char* const kraw =
                reinterpret_cast<const unsigned char*>(stage(b)) + g * kRawKPitch + 8 * tq;
#pragma unroll
            for (u32 kp = 0; kp < kKSteps / 2; ++kp) {
                const uint2 x0 = *reinterpret_cast<const uint2*>(kraw + kp * 32);
                const uint2 x1 = *reinterpret_cast<const uint2*>(kraw + 8 * kRawKPitch + kp * 32);
                u32 b0[2], b1[2];
                fp8::x4_to<scalar_t, kv_t>(x0.x, b0[0], b0[1]);
                fp8::x4_to<scalar_t, kv_t>(x1.x, b1[0], b1[1]);
                ptx::mma_16816<scalar_t>(s[0], qf[2 * kp], b0);
                ptx::mma_16816<scalar_t>(s[1], qf[2 * kp], b1);
                fp8::x4_to<scalar_t, kv_t>(x0.y, b0[0], b0[1]);
                fp8::x4_to<scalar_t, kv_t>(x1.y, b1[0], b1[1]);
                ptx::mma_16816<scalar_t>(s[0], qf[2 * kp + 1], b0);
                ptx::mma_16816<scalar_t>(s[1], qf[2 * kp + 1], b1);
            }
        } else {
#pragma unroll
            for (u32 ks = 0; ks < kKSteps; ++ks) {
                u32 bq[4];
                ptx::ldmatrix_x4(bq, kt + (r8 + 8 * (tile >> 1)) * kPitch + ks * 16 + 8 * (tile & 1u));
                const u32 b0[2] = {bq[0], bq[1]}, b1[2] = {bq[2], bq[3]};
                ptx::mma_16816<scalar_t>(s[0], qf[ks], b0);
                ptx::mma_16816<scalar_t>(s[1], qf[ks], b1);
            }
        }
        // Scale into the log2 domain, the score hook, mask; online softmax per row.
        const u32 vis = valid >> (2 * tq);  // bit n * 8 + e: this lane's column e of n-tile n
        float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (u32 n = 0; n < 2; ++n)
#pragma unroll
            for (u32 i = 0; i < 4; ++i) {
                const u32 h = i >> 1;
                float v = s[n][i] * qscale;
                if constexpr (!variant::kPlainScore) v = variant::score(sc, srow[h], v, t0 + n * 8 + 2 * tq + (i & 1u));
                s[n][i] = ((vis >> (n * 8 + (i & 1u))) & 1u) ? v : neg_inf();
                mx[h] = fmaxf(mx[h], s[n][i]);
            }
        float alpha[2], mu[2];
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 2));
            alpha[h] = sm[h].raise(mx[h]);
            mu[h] = sm[h].offset();  // exp2(-inf - mu) = 0 for masked scores
        }
        float psum[2] = {0.0f, 0.0f};
#pragma unroll
        for (u32 n = 0; n < 2; ++n)
#pragma unroll
            for (u32 i = 0; i < 4; ++i) {
                s[n][i] = exp2f(s[n][i] - mu[i >> 1]);
                psum[i >> 1] += s[n][i];
            }
#pragma unroll
        for (u32 h = 0; h < 2; ++h) sm[h].add(alpha[h], psum[h]);  // this lane's part of the row sum
        // O *= alpha only where a row of the warp raised its max: elsewhere alpha is 1 in every lane and
        // o * 1 is o, bit for bit (a warp-uniform branch). The running max settles within a few tiles of
        // a long context, so for the model the rescale is marked as edge tiles are: a few a block,
        // whatever its length (the probe's counts say how many).
        if (__any_sync(CP_FULL_MASK, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
            ptx::edge_tile();
#pragma unroll
            for (u32 n = 0; n < kOTiles; ++n)
#pragma unroll
                for (u32 i = 0; i < 4; ++i) o[n][i] *= alpha[i >> 1];
        }
        // O += P V: P's S fragments are its A fragments (one k-step of 16 tokens).
        const u32 a[4] = {ptx::pack2<v16_t>(s[0][0], s[0][1]), ptx::pack2<v16_t>(s[0][2], s[0][3]),
                          ptx::pack2<v16_t>(s[1][0], s[1][1]), ptx::pack2<v16_t>(s[1][2], s[1][3])};
#pragma unroll
        for (u32 dp = 0; dp < kOTiles / 2; ++dp) {
            u32 bq[4];
            ptx::ldmatrix_x4_trans(bq, vt + (r8 + 8 * (tile & 1u)) * kPitch + dp * 16 + 8 * (tile >> 1));
            const u32 b0[2] = {bq[0], bq[1]}, b1[2] = {bq[2], bq[3]};
            ptx::mma_16816<v16_t>(o[2 * dp], a, b0);
            ptx::mma_16816<v16_t>(o[2 * dp + 1], a, b1);
        }
    };

    // The ring: tile k in stage k % kStages; tiles k + 1 .. k + kStages - 1 in
    // flight while tile k computes; valid[j] holds tile k + j's valid bits.
    u32 valid[kStages];  // (the first tile's page word is in raw: loaded with the query's words)
#pragma unroll
    for (u32 j = 0; j + 1 < kStages; ++j) {
        valid[j] = 0u;
        if (j < nk) {
            valid[j] = issue(j);
            advance();
            fetch();  // the next tile's page word loads while this one is in flight
        }
        ptx::cp_async_commit();  // possibly empty: one group per tile
    }
    // ---- Q's group has landed (the tiles' copies may be in flight): A fragments in registers ----
    ptx::cp_async_wait<kStages - 1>();
    __syncthreads();
    const scalar_t* const qs = q_area + hj * kRows * kPitch;  // this warp's head's tile
    if constexpr (kFp8) {
        // The k-dims of k-steps 2 kp, 2 kp + 1 in the order the codes are read (compute): lane
        // (g, tq) holds dims 32 kp + 8 tq .. + 7 of rows g and g + 8; the products' sum is the same.
#pragma unroll
        for (u32 kp = 0; kp < kKSteps / 2; ++kp)
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                const uint4 x = *reinterpret_cast<const uint4*>(qs + (g + 8 * h) * kPitch + kp * 32 + 8 * tq);
                qf[2 * kp][h] = x.x;
                qf[2 * kp][2 + h] = x.y;
                qf[2 * kp + 1][h] = x.z;
                qf[2 * kp + 1][2 + h] = x.w;
            }
    } else {
#pragma unroll
        for (u32 ks = 0; ks < kKSteps; ++ks)
            ptx::ldmatrix_x4(qf[ks], qs + (r8 + 8 * (tile & 1u)) * kPitch + ks * 16 + 8 * (tile >> 1));
    }
    __syncthreads();  // every warp holds Q before the loop refills the last stage
    if constexpr (kFp8) qscale *= k_sc;
    u32 b = 0, nb = kStages - 1;  // the stage of tile k, and of tile k + kStages - 1
    for (u32 k = 0; k < nk; ++k) {
        ptx::cp_async_wait<kStages - 2>();  // this warp's copies of tile k have landed
        // The column's: tile k has landed, and every warp is done with tile k - 1's stage nb (and,
        // fp8, every lane with its decoded tile).
        wgb::sync(1 + col, pack * 32);
        valid[kStages - 1] = 0u;
        if (k + kStages - 1 < nk) {
            valid[kStages - 1] = issue(nb);
            advance();
            fetch();  // the page word of the tile after loads while tile k computes
        }
        ptx::cp_async_commit();  // possibly empty: one group per tile
        if (valid[0]) {
            if constexpr (kFp8) {
                decode(b);  // this warp's decoded tile was last read by its tile k - 1's compute
                __syncwarp();
            }
            compute(b, valid[0], lo + (k * kWarps + col) * kN);
        }
#pragma unroll
        for (u32 j = 0; j + 1 < kStages; ++j) valid[j] = valid[j + 1];
        nb = b;  // tile k's stage takes tile k + kStages
        b = b + 1 == kStages ? 0u : b + 1;
    }
    ptx::cp_async_wait<0>();
    __syncthreads();  // every ring is free: the merge area reuses them

    // ---- each head's warps' states and O tiles meet in shared memory ----
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        sm[h].l += __shfl_xor_sync(CP_FULL_MASK, sm[h].l, 1);
        sm[h].l += __shfl_xor_sync(CP_FULL_MASK, sm[h].l, 2);
    }
    // Warp w's area (w = c * pack + j): O [kRows][kD], m [kRows], l [kRows] in f32.
    constexpr u32 kAreaFloats = kWarpBytes / 4;
    float* const mine = reinterpret_cast<float*>(smem) + warp * kAreaFloats;
#pragma unroll
    for (u32 n = 0; n < kOTiles; ++n)
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            float2 v;
            v.x = o[n][2 * h];
            v.y = o[n][2 * h + 1];
            *reinterpret_cast<float2*>(mine + (g + 8 * h) * kD + n * 8 + 2 * tq) = v;
        }
    if (tq == 0) {
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            mine[kRows * kD + g + 8 * h] = sm[h].m;
            mine[kRows * kD + kRows + g + 8 * h] = sm[h].l;
        }
    }
    __syncthreads();

    const bool split = p.splits > 1;
    for (u32 idx = tid; idx < pack * heads * kQChunks; idx += nthreads) {
        const u32 rr = idx / kQChunks, e0 = (idx - rr * kQChunks) * 8;  // row rr of the pack's heads
        const u32 j = rr / heads, r = rr - j * heads;
        const float* const w0 = reinterpret_cast<const float*>(smem) + j * kAreaFloats;  // column 0's warp of head j
        float mx = neg_inf(), wt[kWarps], total = 0.0f;
#pragma unroll
        for (u32 w = 0; w < kWarps; ++w) mx = fmaxf(mx, w0[w * pack * kAreaFloats + kRows * kD + r]);
#pragma unroll
        for (u32 w = 0; w < kWarps; ++w) {
            const float* ws = w0 + w * pack * kAreaFloats + kRows * kD;
            wt[w] = softmax::rescale(ws[r], mx);
            total += ws[kRows + r] * wt[w];
        }
        softmax::State all = softmax::make_state(mx, total);
        const u32 h = (kvh0 + j) * group + t_off + r;
        // The head's sink (not in a split partial) and the cache's V scale (fp8).
        const float inv = epi::finish(all, sc, h, split, epi::v_scale(p, kvh0 + j));
        float v[8];
#pragma unroll
        for (u32 i = 0; i < 8; ++i) v[i] = 0.0f;
#pragma unroll
        for (u32 w = 0; w < kWarps; ++w)
#pragma unroll
            for (u32 i = 0; i < 8; ++i) v[i] = fmaf(w0[w * pack * kAreaFloats + r * kD + e0 + i], wt[w], v[i]);
        const epi::Row row = epi::row_of(p, (u64)qi * q_heads + h, split);
        epi::store_values(out, part_out, row.dst * kD + e0, split, v, inv);
        // natural log; -inf when the query (or split) sees nothing
        if (e0 == 0) epi::store_lse(lse, part_lse, p.write_lse, row, split, all.lse());
    }
}
