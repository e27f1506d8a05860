// mla_wgmma.cu: paged_mla_wgmma, DeepSeek-style latent attention (absorbed
// form) on Hopper's warpgroup tensor-core instructions (wgmma.mma_async,
// sm_90a only; the split merge: merge.cu). Same arguments,
// rows, passes, masks and outputs as paged_mla_tc (mla_tc.cu): one
// AttentionParams (params.cuh); q [queries, H, R], q_rot [queries, H, P],
// k_cache the latent cache [pages, page_size, 1, R] (also the values),
// k_rot [pages, page_size, 1, P], views with contiguous rows read through
// their strides (the 576-wide cache c as c[..., :512] and c[..., 512:]).
// Layout, positions, metadata words, LSE and the split workspace:
// docs/layout.md.
//
// paged_mla_wgmma: f16 / bf16 q, R = LATENT_DIM = 512, P = ROPE_DIM = 64 or
// 0 (no rotary part), over an fp8 cache (16-bit caches: paged_mla_seesaw,
// mla_seesaw.cu, FlashMLA's seesaw schedule; this kernel's S is split by
// tokens and its warpgroups run in lockstep, fine at half the bytes a tile).
// fp8 codes (e4m3 / e5m2) with k_scale (latent) and v_scale (k_rot), as
// paged_mla_tc: the ring holds two tiles' raw codes ([2][64 tokens][R + P]
// bytes, cp.async), converted exactly into the one swizzled 16-bit tile below
// as each tile is used; k_scale folds into the score scale and the output,
// v_scale / k_scale into Q's rotary fragments.
//   grid (head_tiles * ceil(q_count / qt), 1, splits): the head tile is the
//   fastest block index, so the blocks of one query's head tiles run side by
//   side and its latent rows come from HBM once (the second read hits L2).
//   block kThreads = two warpgroups; __launch_bounds__(kThreads, kMinBlocks); dynamic shared
//   memory mla_wgmma.smem_bytes (cupaged/ops/attention/kernels/mla_wgmma.py, = kSmemBytes): 217 KiB.
//   The block geometry (threads, minimum, tile, stages, alignment) is defined once in mla_wgmma.py
//   (GEOMETRY), the rows in spec.py, and read here through geometry.cuh (geom::mla_wgmma, geom::kTcRows).
//   Rows: ht = min(H, 64) heads of qt = 64 / ht queries, as paged_mla_tc.
//   Shared memory, all in the 128-byte-swizzled K-major layout of wgmma
//   (ptx.cuh; rows of 128 bytes = 64 elements, 16-byte chunk c of row r at
//   chunk c ^ (r % 8), column blocks of 64 elements one after the other):
//     sQ  [8 column blocks][64 rows][128 B]       the latent part of Q (64 KiB)
//     sK  [9 column blocks][64 tokens][128 B]     latent | rotary rows of the tile in use
//     sRaw [2][64 tokens][R + P]                  the ring's codes
//     sP  [64 rows][64 tokens]                    P of the tile (8 KiB)
//   The rotary part of Q lives in registers as wgmma A fragments (16 a thread).
//   Per tile of kN = 64 tokens, two raw buffers (tile j + 1's cp.async
//   copies in flight while tile j computes). The page walk: threads 0 .. 63
//   keep their token's page-table column and slot and advance them by 64
//   tokens a tile (no division in the loop); each stages its row's element
//   offsets (latent, rotary) and valid bit in shared memory a tile ahead of
//   the copies, its page-table word loaded a tile before that. Per tile:
//     top: wait for this warpgroup's P V of tile j - 1 (it reads the buffer
//        tile j + 1's copies overwrite, and sP) and for tile j's copies; a
//        barrier (tile j visible, every P V of tile j - 1 done).
//     S: warpgroup w computes S [64 x 32] for tokens 32 w .. 32 w + 31 of the
//        tile: 32 wgmma m64n32k16 with Q and K from shared memory, then 4 with
//        Q's rotary fragments from registers (36 k-steps over R + P), one
//        group; tile j + 1's copies issue while it runs, then its wait.
//     softmax: each warpgroup's row maxima meet in shared memory (the second
//        barrier); both compute the same new maxima; P = exp2(S - m) into sP
//        (bf16 / f16, both halves), O rescaled; the third barrier (sP complete).
//     O += P V: warpgroup w owns value columns 256 w .. 256 w + 255 of all 64
//        rows (128 f32 registers a thread): 4 wgmma m64n256k16 with P from sP;
//        V is the latent tile itself, read N-major (the same bytes serve S
//        K-major). The group stays in flight until the next tile's top.
//   S is split by tokens, not by heads: a wgmma's M = 64 rows are all of the
//   block's rows, and a split by heads (128 rows a block, a warpgroup's 64)
//   would give each warpgroup all 512 value columns of its rows, 256 f32
//   accumulators a thread, past the 255-register cap.
//   Finished rows: epilogue.cuh's writer (the sink, the latent's scale, out
//   and lse or a split partial).
//   Per 64-token tile and block: 8.9 MFLOP in 320 wgmma warp-parts (288 of
//   them S's, 32 P V's); the shared-memory operand reads are 64 rows x 32 B
//   of Q and 32 x 32 B of K per S k-step and warpgroup, and 256 x 32 B of V
//   (plus P) per P V k-step.
//   A valid token a stored row cannot see contributes nothing, also when its
//   latent row holds Inf or NaN: a tile where some stored row misses a valid
//   token checks its value rows; when one holds a non-finite element, each
//   lane adds p * v itself for those elements of the tokens its rows see, and
//   they become 0 in the tile before the tensor cores' P V.
//
// Memory traffic: L * (R + P) * sizeof(kv_t) bytes per block (each latent row
// serving up to 64 heads), the two head tiles of H = 128 sharing them in L2.
//
// Defines (cupaged/ops/attention/variants.py Variant):
//   CP_DTYPE               f16 | bf16
//   CP_KV_DTYPE            CP_DTYPE, or e4m3 | e5m2
//   CP_SCORE               the score variant (variant.cuh)
//   CP_SOFT_CAP, CP_WINDOW, CP_SINKS, CP_ALIBI  its features (variant.cuh)
//   LATENT_DIM, ROPE_DIM   512, 64 or 0
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
#include "mla_rows.cuh"

namespace mwg {
constexpr u32 kR = LATENT_DIM, kP = ROPE_DIM, kK = kR + kP;
constexpr u32 kN = geom::mla_wgmma::kN;  // tokens per tile
constexpr u32 kS = geom::mla_wgmma::kS;  // tile buffers
constexpr u32 kThreads = geom::mla_wgmma::kThreads;
constexpr u32 kMinBlocks = geom::mla_wgmma::kMinBlocks;  // the __launch_bounds__ minimum
constexpr u32 kAlign = geom::mla_wgmma::kAlignBytes;  // the layout's start: a swizzle atom boundary
constexpr u32 kRows = tc::kRows;
constexpr u32 kRBlocks = kR / 64, kBlocks = kK / 64;  // 128-byte column blocks (8 latent, 9 in all)
constexpr u32 kRotSteps = kP / 16;  // k-steps of the rotary part
constexpr u32 kWarps = kThreads / 32;
constexpr u32 kRowsPerWarp = kN / kWarps;  // the copy map: rows w + kWarps i of warp w
constexpr u32 kHalfBlocks = kRBlocks / 2;  // a lane's two latent chunks: kHalfBlocks column blocks apart
constexpr u32 kRotChunks = kP * 2 / 16;  // 16-byte chunks of a 16-bit rotary row
constexpr u32 kColBytes = 64 * 128;  // one column block of 64 rows (or tokens)
constexpr u32 kQBytes = kRBlocks * kColBytes;
constexpr u32 kKBytes = kBlocks * kColBytes;
constexpr u32 kPBytes = kColBytes;
// One 16-bit tile, the codes are converted into; the ring is kS raw tiles [kN][kK] bytes.
constexpr u32 kRawBytes = kN * kK;
// Dynamic shared memory: the layout above and the row maxima, after up to kAlign - 1 bytes of alignment
// (mla_wgmma.smem_bytes).
constexpr u32 kSmemBytes = kAlign + kQBytes + kKBytes + kS * kRawBytes + kPBytes + 2 * kRows * 4;
static_assert(kR == 512 && (kP == 64 || kP == 0), "LATENT_DIM 512, ROPE_DIM 64 or 0");
static_assert(kThreads == 2 * 128, "two warpgroups");
static_assert(kRows == 64 && kN == 64, "m64 wgmma rows; S [64 x 32] per warpgroup over a tile of 64 tokens");
static_assert(kAlign == 8 * 128, "a 128-byte swizzle atom: 8 rows of 128 B");
static_assert(kWarps == 8 && kR / 8 == 2 * 32 && kRotChunks <= 32 && kP / 16 <= 32,
              "the copy map: a warp's rows share r % 8; two latent chunks a lane");
static_assert(sizeof(scalar_t) == 2 && kKvScaled, "f16 / bf16 q over fp8 caches (16-bit caches: mla_seesaw.cu)");
static_assert(kRawBytes % kAlign == 0, "P stays on a swizzle atom boundary");

using mrows::swz;

}  // namespace mwg

extern "C" __global__ void __launch_bounds__(mwg::kThreads, mwg::kMinBlocks) paged_mla_wgmma(const AttentionParams p) {
    CP_ATTENTION_ARRAYS(p);  // the arrays as __restrict__ locals (epilogue.cuh)
    ptx::launch_dependents();  // the split merge, a dependent launch, may start: it waits for this grid
    using namespace mwg;
    using tc::kNone;
    CUPAGED_DYNAMIC_SHARED(unsigned char, smem_raw);
    // The swizzle patterns start on kAlign-byte boundaries (descriptor base offset 0). The offset is
    // added to the shared array itself, so the compiler keeps shared-memory accesses (LDS / STS).
    unsigned char* const sQ = smem_raw + ((0u - (u32) reinterpret_cast<u64>(smem_raw)) & (kAlign - 1u));
    unsigned char* const sK = sQ + kQBytes;  // [kBlocks][64][128 B]: the converted tile
    unsigned char* const sRaw = sK + kKBytes;  // [kS][64][kK] codes
    unsigned char* const sP = sRaw + kS * kRawBytes;  // [64][128 B]
    float* const s_max = reinterpret_cast<float*>(sP + kPBytes);  // [2][kRows]: each warpgroup's row maxima
    __shared__ tc::RowSet<kRows> rows;
    // The ring's staging: per token of the next tile its rows' element offsets (latent, rotary; 0 when
    // invalid), and each tile buffer's valid bits.
    __shared__ u64 s_koff[2][kN];
    __shared__ u64 s_roff[kRotSteps ? 2 : 1][kN];
    __shared__ u32 s_sval[2][2];  // the staged tile's valid bits (for its copies)
    __shared__ u32 s_valid[kS][2];  // tile buffer b's valid bits (for its compute)

    const u32 tid = threadIdx.x, wg = tid >> 7, warp4 = (tid >> 5) & 3u, lane = tid & 31u;
    const u32 g = lane >> 2, tq = lane & 3u;
    // The warpgroup, broadcast from lane 0 so that the compiler keeps the descriptors built from it in
    // uniform registers.
    const u32 wgu = __shfl_sync(CP_FULL_MASK, wg, 0);
    const u32 q_heads = p.q_heads;
    const mrows::Place pl(p, blockIdx.x);  // this block's heads and queries
    const u32 ht = pl.ht, qt = pl.qt, head0 = pl.head0, q_end = pl.q_end;
    const u64 q0 = pl.q0;
    auto row_ok = [&](u32 r, u32& slot, u32& hl) { return pl.row_ok(r, slot, hl); };

    // ---- Q: the latent part into sQ (swizzled), the rotary part as A fragments ----
    static_assert(kColBytes == kRows * 128, "mrows::stage_q's column blocks");
    mrows::stage_q<scalar_t, kRBlocks * 8, kR, kP>(sQ, q, q_rot, pl, p, tid, kThreads);
    // Rows 16 warp4 + g (+ 8) of this thread in every wgmma fragment (both warpgroups: the same rows).
    u32 my_slot[2];
    u32 qr[kRotSteps ? kRotSteps : 1][4];  // A fragments of Q's rotary part, k-steps of 16 dims
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        u32 slot, hl;
        const u32 r = 16 * warp4 + g + 8 * h;
        const bool ok = row_ok(r, slot, hl);
        my_slot[h] = ok ? slot : kNone;
        const scalar_t* src = q_rot + att::q_rot_at(p, q0 + slot, head0 + hl);
#pragma unroll
        for (u32 kr = 0; kr != kRotSteps; ++kr)
#pragma unroll
            for (u32 c = 0; c < 2; ++c)  // a[h + 2 c]: row g (+ 8), dims 16 kr + 8 c + 2 tq, + 1
                qr[kr][h + 2 * c] = ok ? *reinterpret_cast<const u32*>(src + 16 * kr + 8 * c + 2 * tq) : 0u;
    }
    // fp8: score = scale * k_scale * (q.latent + q_rot.k_pos * v_scale / k_scale) over the codes.
    const float ks = p.k_scale ? p.k_scale[0] : 1.0f;
    if constexpr (kRotSteps > 0) {
        const float ratio = (p.v_scale ? p.v_scale[0] : 1.0f) / ks;
#pragma unroll
        for (u32 kr = 0; kr != kRotSteps; ++kr)
#pragma unroll
            for (u32 i = 0; i < 4; ++i)
                qr[kr][i] = ptx::pack2<scalar_t>(tc::half_of<scalar_t>(qr[kr][i], 0) * ratio,
                                                 tc::half_of<scalar_t>(qr[kr][i], 1) * ratio);
    }
    tc::setup_row_set(rows, p, q0, qt, q_end);
    ptx::cp_async_wait<0>();
    ptx::fence_proxy_async_shared();  // Q is read by wgmma
    __syncthreads();

    const float qscale = p.scale * ks * softmax::kLog2e;
    softmax::State sm[2];  // rows g, g + 8: the max (shared by both warpgroups) and this lane's part of its half's sum
    float o[128];  // O [64 x 256]: value columns 256 wg + 8 j + 2 tq (+ 1), rows as above
#pragma unroll
    for (u32 h = 0; h < 2; ++h) sm[h].clear();
#pragma unroll
    for (u32 i = 0; i < 128; ++i) o[i] = 0.0f;

    const u32* const tables = words + pw::page_table(p.queries, p.sequences);
    constexpr u32 kSw = ptx::kSwizzle128B;
    const variant::Scorer sc(p);  // a score variant's arguments

    tc::for_each_pass_of(rows, qt, [&](u32 seq, u32 slot_lo, u32 slot_hi, u32 lo, u32 hi) {
        u32 rlo[2], rhi[2];
        variant::ScoreRow srow[2];  // for a score variant: the rows' query position, head, slope
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            const u32 s = my_slot[h];
            const bool in = s != kNone && s >= slot_lo && s < slot_hi;
            rlo[h] = in ? rows.lo[s] : 0u;
            rhi[h] = in ? rows.hi[s] : 0u;
            if constexpr (!variant::kPlainScore)
                srow[h] = sc.row(in ? rows.position(s) : 0u, head0 + (16 * warp4 + g + 8 * h - (in ? s : 0u) * ht));
        }
        // The copy map (also fp8's conversion map): warp w copies rows w + 8 i (i < 8) of a tile, lane l the
        // 16-byte chunks l and l + 32 of a row's latent part and, l < kRotChunks, chunk l of its rotary part.
        // Every row w + 8 i has r % 8 = w, so a lane's swizzled chunk position is the same in each of its
        // rows: its destinations are one address plus constants (immediate offsets), its sources a row's
        // offset, read once a row by the whole warp (a broadcast), plus the lane's column.
        const u32 cw = tid >> 5;
        unsigned char* const cdst = sK + (lane >> 3) * kColBytes + cw * 128 + (((lane & 7u) ^ cw) << 4);
        // The copies of the tile staged in sb into buffer b (its valid bits published): an invalid row's
        // offset is 0 (a row of page 0, never read: zero fill).
        auto issue = [&](u32 sb, u32 b) {
            const u64 vw = ((u64)s_sval[sb][0] | (u64)s_sval[sb][1] << 32) >> cw;  // row cw + 8 i: bit 8 i
            // Raw codes, [kN][kK] bytes a tile: lane l copies codes 16 l .. 16 l + 15 of the latent part and,
            // l < kP / 16, of the rotary part.
            unsigned char* const raw = sRaw + b * kRawBytes + cw * kK + lane * 16;
#pragma unroll
            for (u32 i = 0; i < kRowsPerWarp; ++i) {
                const u32 r = cw + kWarps * i;
                const bool ok = (vw >> (kWarps * i)) & 1u;
                ptx::cp_async_16(raw + kWarps * i * kK, k_cache + s_koff[sb][r] + lane * 16, ok);
                if constexpr (kRotSteps > 0)
                    if (lane < kP / 16)
                        ptx::cp_async_16(raw + kWarps * i * kK + kR, k_rot + s_roff[sb][r] + lane * 16, ok);
            }
        };
        auto compute = [&](u32 b, u32 t0, auto&& next_copies) {
            // The tile's codes into the swizzled 16-bit tile (exactly), on the copy map: 8 codes make a
            // 16-byte chunk; lane l converts latent chunks l and l + 32 and rotary chunk l (l < kRotChunks)
            // of rows cw + 8 i.
            const unsigned char* const raw = sRaw + b * kRawBytes + cw * kK + lane * 8;
            auto convert = [&](const unsigned char* from, unsigned char* to) {
                const uint2 x = *reinterpret_cast<const uint2*>(from);
                uint4 y;
                fp8::x4_to<scalar_t, kv_t>(x.x, y.x, y.y);
                fp8::x4_to<scalar_t, kv_t>(x.y, y.z, y.w);
                *reinterpret_cast<uint4*>(to) = y;
            };
#pragma unroll 4
            for (u32 i = 0; i < kRowsPerWarp; ++i) {
                const unsigned char* const from = raw + kWarps * i * kK;
                unsigned char* const to = cdst + kWarps * i * 128;
                convert(from, to);
                convert(from + kHalfBlocks * 64, to + kHalfBlocks * kColBytes);
                if constexpr (kRotSteps > 0)
                    if (lane < kRotChunks) convert(from + kR, to + kRBlocks * kColBytes);
            }
            ptx::fence_proxy_async_shared();
            __syncthreads();
            unsigned char* const kt = sK;
            // Whether every stored row of this warp sees every token of the tile (warp-uniform; a row of no query
            // is never written): then nothing is masked (FlashAttention-3 masks only the edge tiles).
            const u64 vbits = (u64)s_valid[b][0] | (u64)s_valid[b][1] << 32;
            bool mine = vbits == ~0ull;
#pragma unroll
            for (u32 h = 0; h < 2; ++h) mine &= my_slot[h] == kNone || (rlo[h] <= t0 && t0 + kN <= rhi[h]);
            const bool full = __all_sync(CP_FULL_MASK, mine);
            u64 vis[2] = {~0ull, ~0ull};  // this thread's rows' visible tokens (an edge tile's: below)
            bool miss = false;  // a stored row of this thread misses a valid token

            // ---- S [64 x 32] of this warpgroup's tokens 32 wg .. + 31 ----
            float s[16];
            // Descriptors move along K by adding the byte offset >> 4 to the start address field.
            const u64 dq = ptx::wgmma_desc(sQ, 16, 1024, kSw);
            const u64 dk = ptx::wgmma_desc(kt + wgu * 32 * 128, 16, 1024, kSw);
            ptx::wgmma_fence();
#pragma unroll
            for (u32 ks = 0; ks < kR / 16; ++ks) {
                const u32 k_off = ((ks >> 2) * kColBytes + (ks & 3u) * 32) >> 4;
                ptx::wgmma_ss<scalar_t, 32, 0, 0>(s, ptx::wgmma_desc_at(dq, k_off), ptx::wgmma_desc_at(dk, k_off),
                                                  ks > 0);
            }
#pragma unroll
            for (u32 kr = 0; kr != kRotSteps; ++kr)
                ptx::wgmma_rs<scalar_t, 32, 0>(s, qr[kr], ptx::wgmma_desc_at(dk, (kRBlocks * kColBytes + kr * 32) >> 4),
                                               true);
            ptx::wgmma_commit();
            next_copies();  // the next tile's copies issue while the tensor cores compute S
            ptx::wgmma_wait<0>();
            ptx::wgmma_fence_operand(s);

            // Scale into the log2 domain, the score hook, mask; this half's row maxima. The plain score keeps S
            // unscaled up to exp2(S qscale - m) (one FFMA; qscale > 0 keeps the max), as paged_prefill_wgmma.
            constexpr bool kLate = variant::kPlainScore;
            const float late = kLate ? qscale : 1.0f;
            float mx[2] = {neg_inf(), neg_inf()};
            // The score hook and, masked (an edge tile), each element by its row's visibility (vlane: this lane's
            // visible bits from its first column 32 wg + 2 tq, column c of the tile at bit c - that).
            auto scores = [&](auto masked, const u32(&vlane)[2]) {
#pragma unroll
                for (u32 i = 0; i < 16; ++i) {
                    const u32 h = (i >> 1) & 1u, dc = 8 * (i >> 2) + (i & 1u);
                    float v = s[i];
                    if constexpr (!kLate) v = variant::score(sc, srow[h], v * qscale, t0 + 32 * wg + 2 * tq + dc);
                    if constexpr (decltype(masked)::value) v = ((vlane[h] >> dc) & 1u) ? v : neg_inf();
                    s[i] = v;
                    mx[h] = fmaxf(mx[h], v);
                }
            };
            if (full) {
                const u32 all[2] = {~0u, ~0u};
                scores(tc::Flag<false>{}, all);
            } else {
                ptx::edge_tile();
#pragma unroll
                for (u32 h = 0; h < 2; ++h) {
                    vis[h] = tc::tile_vis<kN>(vbits, rlo[h], rhi[h], t0);
                    miss |= my_slot[h] != kNone && vis[h] != vbits;
                }
                const u32 vlane[2] = {(u32)(vis[0] >> (32 * wg + 2 * tq)), (u32)(vis[1] >> (32 * wg + 2 * tq))};
                scores(tc::Flag<true>{}, vlane);
            }
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 1));
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 2));
                if (tq == 0) s_max[wg * kRows + 16 * warp4 + g + 8 * h] = mx[h];
            }
            // The maxima meet; and whether any stored row of the block misses a valid token.
            const bool mixed = __syncthreads_or(miss) != 0;

            // ---- P = exp2(S - m): A fragments (own half) and sP (for the other warpgroup) ----
            float alpha[2];
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                const u32 r = 16 * warp4 + g + 8 * h;
                alpha[h] = sm[h].raise(fmaxf(s_max[r], s_max[kRows + r]) * late);
                const float mu = sm[h].offset();
                float ps = 0.0f;
#pragma unroll
                for (u32 i = 0; i < 16; ++i)
                    if (((i >> 1) & 1u) == h) {
                        s[i] = exp2f(fmaf(s[i], late, -mu));
                        ps += s[i];
                    }
                sm[h].add(alpha[h], ps);  // this lane's part of its half of the row sum
            }
            // P of this half into sP: S fragment element i is row g (+ 8 for i & 2), token 8 (i / 4) + 2 tq (+ 1).
#pragma unroll
            for (u32 i = 0; i < 16; i += 2) {
                const u32 r = 16 * warp4 + g + 4 * (i & 2u), c = 32 * wg + 8 * (i >> 2) + 2 * tq;
                *reinterpret_cast<u32*>(sP + swz(r, c >> 3) + (c & 7u) * 2) = ptx::pack2<scalar_t>(s[i], s[i + 1]);
            }
            ptx::fence_proxy_async_shared();  // sP is read by wgmma after the barrier below
#pragma unroll
            for (u32 i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1u];
            // A tile where some stored row misses a valid token: its value rows' Inf / NaN must reach
            // only the rows that see them. Each lane adds p * v itself for every non-finite element of
            // its columns and a token its row sees; then those elements become 0 in the tile, so the
            // products below add the finite rest (masked P is 0, and 0 x a finite value is 0).
            bool bad = false;
            if (mixed) {
                ptx::cold_path();
#pragma unroll 1
                for (u32 c = tid; c < kN * kRBlocks * 8; c += kThreads) {  // every 16-byte chunk of the values
                    ptx::cold_path();
                    const uint4 x = *reinterpret_cast<const uint4*>(kt + c * 16);
                    bad |= tc::nonfinite2<scalar_t>(x.x) | tc::nonfinite2<scalar_t>(x.y) |
                           tc::nonfinite2<scalar_t>(x.z) | tc::nonfinite2<scalar_t>(x.w);
                }
                bad = __syncthreads_or(bad) != 0;  // also: sP complete
            } else {
                __syncthreads();  // sP complete
            }
            if (bad) {
                ptx::cold_path();
#pragma unroll 1
                for (u32 tok = 0; tok < kN; ++tok) {
                    ptx::cold_path();
                    const bool see0 = (vis[0] >> tok) & 1u, see1 = (vis[1] >> tok) & 1u;
                    const u32 r0 = 16 * warp4 + g;
                    const float p0 = tc::half_of<scalar_t>(
                        *reinterpret_cast<const u32*>(sP + swz(r0, tok >> 3) + (tok & 6u) * 2), tok & 1u);
                    const float p1 = tc::half_of<scalar_t>(
                        *reinterpret_cast<const u32*>(sP + swz(r0 + 8, tok >> 3) + (tok & 6u) * 2), tok & 1u);
#pragma unroll
                    for (u32 j = 0; j < 32; ++j) {  // unrolled: o stays in registers
                        const u32 col = 256 * wg + 8 * j + 2 * tq;  // value columns col, col + 1
                        // volatile: one value at a time (no register pressure from early loads)
                        const u32 vb = *reinterpret_cast<const volatile u32*>(
                            kt + (col >> 6) * kColBytes + swz(tok, (col >> 3) & 7u) + (col & 7u) * 2);
                        if (!tc::nonfinite2<scalar_t>(vb)) continue;
#pragma unroll
                        for (u32 e = 0; e < 2; ++e)
                            if (tc::nonfinite2<scalar_t>(e ? vb >> 16 : vb & 0xffffu)) {
                                const float v = tc::half_of<scalar_t>(vb, e);
                                if (see0) o[4 * j + e] += p0 * v;
                                if (see1) o[4 * j + 2 + e] += p1 * v;
                            }
                    }
                }
                __syncthreads();  // every lane has read the tile's non-finite values
#pragma unroll 1
                for (u32 c = tid; c < kN * kRBlocks * 8 * 4; c += kThreads) {  // every 32-bit pair
                    ptx::cold_path();
                    u32* const w = reinterpret_cast<u32*>(kt) + c;
                    const u32 x = *w;
                    const u32 lo = tc::nonfinite2<scalar_t>(x & 0xffffu) ? 0u : (x & 0xffffu);
                    const u32 hi = tc::nonfinite2<scalar_t>(x >> 16) ? 0u : (x & 0xffff0000u);
                    *w = lo | hi;
                }
                ptx::fence_proxy_async_shared();  // the zeroed tile is read by the P V wgmma below
                __syncthreads();
            }

            // ---- O [64 x 256] += P V: P (both halves) from sP, V N-major from the tile ----
            const u64 dv = ptx::wgmma_desc(kt + 4 * wgu * kColBytes, kColBytes, 1024, kSw);
            const u64 dp = ptx::wgmma_desc(sP, 16, 1024, kSw);
            ptx::wgmma_fence_operand(o);
            ptx::wgmma_fence();
#pragma unroll
            for (u32 kk = 0; kk < kN / 16; ++kk)
                ptx::wgmma_ss<scalar_t, 256, 0, 1>(o, ptx::wgmma_desc_at(dp, (32 * kk) >> 4),
                                                   ptx::wgmma_desc_at(dv, (16 * kk * 128) >> 4), true);
            ptx::wgmma_commit();  // waited for at the next tile's top (or after the pass): o is not touched before
        };
        // ---- the ring: tile j computes in buffer j % 2 while tile j + 1's copies are in flight ----
        // Page walk: thread tid < kN keeps token tok = lo + kN n + tid of the tile n it stages next and its
        // page position (att::PagePos), advanced by kN tokens a tile (the one division is the pass's).
        // Its page-table word is loaded one tile ahead of its staging (two ahead of its use).
        const u32* const table = tables + (u64)seq * p.table_width;
        const u32 ntiles = (hi - lo + kN - 1) / kN;
        const att::PageStep step(kN, p.page_size);
        u32 tok = lo + tid, word = kNone;
        att::PagePos pos;
        pos.at(tok, p.page_size);
        auto fetch = [&] { word = (tid < kN && tok < hi) ? table[pos.pj] : kNone; };
        auto advance = [&] {
            tok += kN;
            pos.advance(step);
        };
        // The fetched token's row offsets and valid bits into staging buffer sb (threads tid < kN: warps 0
        // and 1); returns this warp's valid bits.
        auto stage = [&](u32 sb) -> u32 {
            u32 bits = 0;
            if (tid < kN) {
                const bool ok = word < p.num_pages;
                s_koff[sb][tid] = ok ? (u64)word * p.k_stride_page + (u64)pos.psl * p.k_stride_slot : 0ull;
                if constexpr (kRotSteps > 0)
                    s_roff[sb][tid] = ok ? (u64)word * p.rot_stride_page + (u64)pos.psl * p.rot_stride_slot : 0ull;
                bits = __ballot_sync(CP_FULL_MASK, ok);
                if (lane == 0) s_sval[sb][warp4] = bits;
            }
            return bits;
        };
        auto publish = [&](u32 b, u32 bits) {  // buffer b's valid bits, for its compute
            if (tid < kN && lane == 0) s_valid[b][warp4] = bits;
        };
        static_assert(kS == 2 && kN == 64, "two tile buffers of 64 tokens");
        __syncthreads();  // the previous pass is done with every buffer and the staging arrays
        fetch();
        {
            const u32 bits = stage(0u);
            advance();
            fetch();
            __syncthreads();
            if (ntiles > 0) {
                publish(0u, bits);
                issue(0u, 0u);
            }
            ptx::cp_async_commit();
        }
        // Iteration j: stage tile j + 1; wait for this warpgroup's P V of tile j - 1 (it reads buffer nb,
        // which tile j + 1's copies overwrite, and sP) and for tile j's copies; one barrier (tile j visible,
        // every P V of tile j - 1 done); S of tile j issues, then tile j + 1's copies (while S computes);
        // then softmax and P V of tile j, left in flight.
        for (u32 j = 0; j < ntiles; ++j) {
            const u32 b = j & 1u, nb = b ^ 1u;
            const u32 bits = stage(nb);
            advance();
            fetch();
            ptx::wgmma_wait<0>();  // P V of tile j - 1
            ptx::wgmma_fence_operand(o);
            ptx::cp_async_wait<0>();  // tile j has landed (compute fences its converted tile to the async proxy)
            __syncthreads();
            compute(b, lo + j * kN, [&] {
                if (j + 1 < ntiles) {
                    publish(nb, bits);  // compute(j - 1) read these bits; it is done
                    issue(nb, nb);
                }
                ptx::cp_async_commit();
            });
        }
        ptx::wgmma_wait<0>();  // P V of the pass's last tile
        ptx::wgmma_fence_operand(o);
    });

    // ---- normalize and write: warpgroup w its value columns of every row ----
    // Row sums: this lane's part of its half, over the quad, then both halves (through s_max).
    __syncthreads();  // every warpgroup is done reading s_max
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        float l = sm[h].l;
        l += __shfl_xor_sync(CP_FULL_MASK, l, 1);
        l += __shfl_xor_sync(CP_FULL_MASK, l, 2);
        sm[h].l = l;
        if (tq == 0) s_max[wg * kRows + 16 * warp4 + g + 8 * h] = l;
    }
    __syncthreads();
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        const u32 r = 16 * warp4 + g + 8 * h;
        sm[h].l = s_max[r] + s_max[kRows + r];
    }
    // V is the latent: its codes times k_scale
    mrows::write_rows<scalar_t, kR>(p, sc, pl, out, part_out, lse, part_lse, sm, my_slot, o, 256 * wg, ks, wg == 0);
}
