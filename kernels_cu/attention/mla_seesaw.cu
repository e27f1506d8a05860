// mla_seesaw.cu: paged_mla_seesaw, DeepSeek-style latent attention (absorbed
// form) on Hopper's warpgroup tensor-core instructions (wgmma.mma_async,
// sm_90a only; the split merge: merge.cu) in FlashMLA's "seesaw" schedule.
// Same arguments, rows, passes, masks and outputs as paged_mla_tc (mla_tc.cu):
// one AttentionParams (params.cuh); q [queries, H, R], q_rot [queries, H, P],
// k_cache the latent cache [pages, page_size, 1, R] (also the values), k_rot
// [pages, page_size, 1, P], views with contiguous rows read through their
// strides (the 576-wide cache c as c[..., :512] and c[..., 512:]). Layout,
// positions, metadata words, LSE and the split workspace: docs/layout.md.
//
// paged_mla_seesaw: f16 / bf16 q over a cache of q's type (fp8 caches:
// paged_mla_wgmma), R = LATENT_DIM = 512, P = ROPE_DIM = 64 or 0.
//   grid (head_tiles * ceil(q_count / qt), 1, splits), the head tile fastest
//   (the blocks of one query's head tiles run side by side: its latent rows
//   come from HBM once, the second read hits L2); block kBlockThreads: a
//   producer warpgroup (warpgroup 0, kProducer threads) and two consumer
//   warpgroups (1, 2: kThreads), __launch_bounds__(kBlockThreads, kMinBlocks),
//   setmaxnreg kProducerRegs / kConsumerRegs; dynamic shared memory
//   mla_seesaw.smem_bytes (cupaged/ops/attention/kernels/mla_seesaw.py, =
//   kSmemBytes). The block geometry (threads, minimum, tile, stages,
//   alignment) is defined once in mla_seesaw.py (GEOMETRY), the rows in
//   spec.py, read here through geometry.cuh (geom::mla_seesaw, geom::kTcRows).
//   Rows: ht = min(H, 64) heads of qt = 64 / ht queries, as paged_mla_tc; both
//   consumer warpgroups hold all 64 rows (warp w4 of each rows 16 w4 .. + 15).
//   Shared memory, in the K-major layouts of wgmma (ptx.cuh; 128-byte
//   swizzle: rows of 128 bytes = 64 elements, 16-byte chunk c of row r at
//   chunk c ^ (r % 8), column blocks of 64 elements one after the other):
//     sQ  [9 column blocks][64 rows][128 B]        Q: latent | rotary (72 KiB)
//     sK  [kS][9 column blocks][32 tokens][128 B]  latent | rotary rows of a tile
//     sP  [2][64 rows][32 tokens]                  consumer w's P of its last tile
//                                                  (64-byte swizzle: rows of 64 B)
//     s_m [2][64]                                  consumer w's row maxima after it
//
// The seesaw (FlashMLA's deep dive, 2025-04-22, with 32-token tiles and a
// producer warpgroup instead of TMA). The output's value columns are split:
// consumer w owns O [64 x 256] of columns 256 w .. 256 w + 255 (128 f32
// registers a thread). The block's n-th tile (every pass's, in order, padded
// to an even count with one empty tile) is consumer n % 2's own: its S [64 x
// 32] = Q K^T (36 wgmma m64n32k16, Q and K from shared memory) and its
// softmax (the score hook, masks, the running max m_n = max(m_{n-1}, the
// tile's)). Each consumer adds P V of every tile to its half (2 wgmma
// m64n256k16, V N-major from the tile; its own tile's P from registers, the
// other's from sP). A step of consumer w: its own tile n and the other's
// tile n - 1:
//   softmax of n from m_{n-1} (the other's, published at its kMax), m_n into
//   s_m[w] (kMax + w); O *= exp2(m_{n-2} - m_n) (O's reference was w's last
//   max: both tiles' factor at once), O += P_n V_n, O += P_{n-1} V_{n-1}
//   (sP[other], which its owner scaled to m_n: kReady + other); once both
//   products are done and m_{n+1} is known (kMax + other), P_n exp2(m_n -
//   m_{n+1}) into sP[w] (kReady + w, for the other's next step: the block's
//   last tile unscaled); then S of tile n + 2 (past the block's last tile, of
//   this one again, discarded: no product on a branch) and wait_group 0: no
//   product is in flight across the loop's back edge (ptxas would serialize
//   every wgmma of the kernel), so the overlap is the seesaw's: one
//   consumer's softmax issues while the tensor cores run the other's
//   products. Each consumer rescales O once a step (two tiles); consumer 0
//   adds consumer 1's last tile after its loop. Each keeps its own share of
//   the row sums (its tiles'), rescaled with O; at the end the shares add.
//   sP[w] is free when w writes it (the other read it in its step before and
//   waited for those products before it arrived at kReady); s_m[w] when w
//   rewrites it (the other read it before its next kMax, which w waits for).
//
// The ring, kS tile buffers of kN = 32 tokens: the producer's threads 4 t ..
// 4 t + 3 take row t of every tile, walk the page table for its token (its
// page word fetched a tile ahead, no division in the loop), wait until both
// consumers have released the buffer (named barrier kEmpty + b: each after
// its P V of the tile; not for the first kS tiles), copy 18 16-byte chunks
// of the row each (latent chunks q, q + 4, ..., rotary q, q + 4: one warp
// instruction reads 8 rows x 64 bytes) and, kLag tiles later, once they have
// landed, fence them to the async proxy and arrive at kFull + b (with the
// tile's first position, pass, valid bits and whether its value rows need
// the fix). The owner of buffer b (consumer b % 2: kS is even) waits at kFull
// + b before its S; the other reads the tile after the owner's kMax (the
// barriers order the producer's copies before its reads). A consumer releases
// its step's two tiles before it waits for its next one: the producer signals
// a tile only after issuing the next. Barriers: kFull + b
// (the producer and the owner, 256 threads), kEmpty + b (384), kMax + w and
// kReady + w (256: consumer w's maxima in s_m[w] / its P in sP[w]), kProd
// (the producer's own), kFix + w (consumer w's own).
//
// Masks, as paged_mla_wgmma: a warp whose stored rows all see a tile's valid
// tokens (all 32 valid) takes the unmasked softmax; the other branch
// (ptx::edge_tile) masks each element by its row's visibility. A valid token
// a stored row cannot see contributes nothing, also when its latent row holds
// Inf or NaN: the producer checks the value rows of a tile some stored row
// misses a valid token of; when one holds a non-finite element, each
// consumer, before its P V of the tile, adds p * v itself for those elements
// of its columns and the tokens its rows see, then zeroes them in its half of
// the tile (masked P is 0, and 0 x a finite value is 0).
//
// Per 32-token tile and block: 4.5 MFLOP in 40 wgmma a warpgroup (36 for
// S, 2 + 2 for P V); shared-memory operand reads 64 x 32 B of Q and 32 x 32
// B of K per S k-step, 16 x 512 B of V and (the other's) 64 x 32 B of P per
// P V k-step.
//
// Memory traffic: L * (R + P) * 2 bytes per block (each latent row serving up
// to 64 heads), the two head tiles of H = 128 sharing them in L2.
//
// Defines (cupaged/ops/attention/variants.py Variant):
//   CP_DTYPE               f16 | bf16 (the caches too)
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
#include "warpgroup.cuh"
#include "producer.cuh"
#include "mla_rows.cuh"

namespace mss {
constexpr u32 kR = LATENT_DIM, kP = ROPE_DIM, kK = kR + kP;
constexpr u32 kN = geom::mla_seesaw::kN;  // tokens per tile
constexpr u32 kS = geom::mla_seesaw::kS;  // tile buffers
constexpr u32 kThreads = geom::mla_seesaw::kConsumerThreads;  // the two consumer warpgroups
constexpr u32 kProducer = geom::mla_seesaw::kProducerThreads;  // the producer warpgroup
constexpr u32 kBlockThreads = kThreads + kProducer;
constexpr u32 kMinBlocks = geom::mla_seesaw::kMinBlocks;  // the __launch_bounds__ minimum
constexpr u32 kAlign = geom::mla_seesaw::kAlignBytes;  // the layout's start: a swizzle atom boundary
constexpr u32 kRows = tc::kRows;
constexpr u32 kRBlocks = kR / 64, kBlocks = kK / 64;  // 128-byte column blocks (8 latent, 9 in all)
constexpr u32 kQCol = kRows * 128;  // bytes of one column block of Q
constexpr u32 kTCol = kN * 128;  // bytes of one column block of a tile
constexpr u32 kQBytes = kBlocks * kQCol;  // Q, latent and rotary
constexpr u32 kTileBytes = kBlocks * kTCol;
constexpr u32 kPBytes = kRows * kN * 2;  // one consumer's P: [64][32] 16-bit, rows of 64 bytes
constexpr u32 kHalf = kR / 2;  // value columns of one consumer
// Dynamic shared memory (mla_seesaw.smem_bytes): the layout above after up to kAlign - 1 bytes of alignment.
constexpr u32 kSmemBytes = kAlign + kQBytes + kS * kTileBytes + 2 * kPBytes + 2 * kRows * 4;
// setmaxnreg: registers per thread of the producer and of the consumers (launched at 168).
constexpr u32 kProducerRegs = 40, kConsumerRegs = 232;
static_assert(kProducer * kProducerRegs + kThreads * kConsumerRegs <= 65536, "the block's register file");
constexpr u32 kLag = 1;  // tiles the producer keeps in flight past the one it signals
// Named barriers (warpgroup.cuh; 0 is __syncthreads').
constexpr u32 kFull = 1, kEmpty = kFull + kS, kMax = kEmpty + kS, kReady = kMax + 2, kProd = kReady + 2;
constexpr u32 kFix = kProd + 1;  // kFix + w: consumer w's own
constexpr u32 kOwnerFull = kProducer + 128;  // kFull + b: the producer and the tile's owner (consumer b % 2)
constexpr u32 kEnd = kReady;  // the consumers' end (every kReady instance has completed by then)
static_assert(kFix + 1 <= 15, "named barriers 1 .. 15");
static_assert(kR == 512 && (kP == 64 || kP == 0), "LATENT_DIM 512, ROPE_DIM 64 or 0");
static_assert(kThreads == 2 * 128 && kProducer == 128, "a producer and two consumer warpgroups");
static_assert(kRows == 64 && kN == 32, "m64 wgmma rows; S [64 x 32] per tile, P V in two k-steps");
static_assert(kS == 4 && kS % 2 == 0,
              "four tile buffers (an even count: buffer b's owner is consumer b % 2): a step's two tiles and the "
              "next S's, the producer's copies");
static_assert(kAlign == 8 * 128, "a 128-byte swizzle atom: 8 rows of 128 B");
static_assert(kProducer == 4 * kN && kR / 8 == 4 * 16 && kP / 8 <= 4 * 2, "the copy map: four threads a row");
static_assert(sizeof(scalar_t) == 2 && sizeof(kv_t) == sizeof(scalar_t), "f16 / bf16 q and caches");

template <u32 N>
struct Count {  // a compile-time count (cp.async wait depths)
    static constexpr u32 value = N;
};
// The tile buffer after buffer b (n % kS kept by wrapping, no division).
__device__ __forceinline__ u32 next_buf(u32 b) { return b + 1 == kS ? 0u : b + 1; }
using mrows::swz;
// Byte offset of element c (0 .. 31) of row r of a P array ([64][32] 16-bit, 64-byte swizzle: chunk
// c / 8 ^ (r / 2) % 4).
__device__ __forceinline__ u32 p_at(u32 r, u32 c) {
    return r * 64 + ((((c >> 3) ^ (r >> 1)) & 3u) << 4) + (c & 7u) * 2;
}
}  // namespace mss

extern "C" __global__ void __launch_bounds__(mss::kBlockThreads, mss::kMinBlocks)
    paged_mla_seesaw(const AttentionParams p) {
    CP_ATTENTION_ARRAYS(p);  // the arrays as __restrict__ locals (epilogue.cuh)
    ptx::launch_dependents();  // the split merge, a dependent launch, may start: it waits for this grid
    using namespace mss;
    using tc::kNone;
    CUPAGED_DYNAMIC_SHARED(unsigned char, smem_raw);
    // The swizzle patterns start on kAlign-byte boundaries (descriptor base offset 0). The offset is
    // added to the shared array itself, so the compiler keeps shared-memory accesses (LDS / STS).
    unsigned char* const sQ = smem_raw + ((0u - (u32) reinterpret_cast<u64>(smem_raw)) & (kAlign - 1u));
    unsigned char* const sK = sQ + kQBytes;  // [kS][kBlocks][kN][128 B]
    unsigned char* const sP = sK + kS * kTileBytes;  // [2][64][32] 16-bit
    float* const s_m = reinterpret_cast<float*>(sP + 2 * kPBytes);  // [2][kRows]
    __shared__ tc::RowSet<kRows> rows;
    __shared__ u32 st_valid[kS];  // tile buffer b's valid tokens (bit t: token t0 + t)
    __shared__ u32 st_bad[kS];  // tile buffer b's value rows need the fix (the producer's check)
    __shared__ u32 st_t0[kS];  // tile buffer b's first position
    __shared__ u32 st_slots[kS];  // ... and its pass's query slots [lo, hi) (lo | hi << 16)

    const u32 tid = threadIdx.x, wg = tid >> 7, warp4 = (tid >> 5) & 3u, lane = tid & 31u;
    const u32 g = lane >> 2, tq = lane & 3u;
    const u32 q_heads = p.q_heads;
    const mrows::Place pl(p, blockIdx.x);  // this block's heads and queries
    const u32 ht = pl.ht, qt = pl.qt, head0 = pl.head0, q_end = pl.q_end;
    const u64 q0 = pl.q0;
    auto row_ok = [&](u32 r, u32& slot, u32& hl) { return pl.row_ok(r, slot, hl); };

    // ---- Q into sQ, swizzled, the latent part then the rotary part (every thread of the block) ----
    static_assert(kQCol == kRows * 128, "mrows::stage_q's column blocks");
    mrows::stage_q<scalar_t, kBlocks * 8, kR, kP>(sQ, q, q_rot, pl, p, tid, kBlockThreads);
    tc::setup_row_set(rows, p, q0, qt, q_end);
    ptx::cp_async_wait<0>();
    ptx::fence_proxy_async_shared();  // Q is read by wgmma
    __syncthreads();

    const u32* const tables = words + pw::page_table(p.queries, p.sequences);
    if (wg == 0) {
        // ---- the producer: every tile of every pass, in the consumers' order (buffer n % kS of the
        // block's n-th tile), then the empty one if the count is odd; tile n's copies issued once buffer
        // n % kS is free (kEmpty), signalled (kFull) kLag tiles later, once they have landed ----
        wgb::regs_dec<kProducerRegs>();
        // Threads 4 t .. 4 t + 3 copy row t of each tile: thread quarter qq its latent chunks qq + 4 i (i < 16:
        // column block i / 2, chunk qq + 4 (i % 2)) and rotary chunks qq + 4 i (i < kP / 32).
        const u32 ptok = tid >> 2, qq = tid & 3u;
        const u32 d0 = swz(ptok, qq), d1 = swz(ptok, qq + 4);
        u32 gp = 0, missbits = 0, pb = 0, sig_b = 0;  // tiles issued; bit k: tile gp - 1 - k needs the check
        auto signal = [&](auto keep) {  // the oldest unsignalled tile, keep.value later tiles in flight
            ptx::cp_async_wait<decltype(keep)::value>();
            ptx::fence_proxy_async_shared();  // wgmma reads the tiles
            const u32 b = sig_b;
            sig_b = next_buf(sig_b);
            if ((missbits >> decltype(keep)::value) & 1u) {
                ptx::cold_path();
                wgb::sync(kProd, kProducer);  // every producer thread's copies of the tile have landed
                const unsigned char* const vt = sK + b * kTileBytes;
                bool any = false;
#pragma unroll 1
                for (u32 c = tid; c < kRBlocks * kTCol / 16; c += kProducer) {  // the latent (value) chunks
                    ptx::cold_path();
                    const uint4 x = *reinterpret_cast<const uint4*>(vt + c * 16);
                    any |= tc::nonfinite2<scalar_t>(x.x) | tc::nonfinite2<scalar_t>(x.y) |
                           tc::nonfinite2<scalar_t>(x.z) | tc::nonfinite2<scalar_t>(x.w);
                }
                if (__any_sync(CP_FULL_MASK, any) && lane == 0) atomicOr(&st_bad[b], 1u);
            }
            wgb::arrive(kFull + b, kOwnerFull);
        };
        // One tile into buffer pb: this thread's row at latent lat / rotary rot (ok: a valid token; else page
        // 0's row at its slot, inside the caches and never read: the copies zero-fill); miss: some stored row
        // may miss a valid token of it (the value check).
        auto produce = [&](const kv_t* lat, const kv_t* rot, bool ok, bool miss, u32 t0, u32 slots) {
            const u32 b = pb;
            if (gp >= kS) wgb::sync(kEmpty + b, kBlockThreads);  // both consumers are done with buffer b
            st_t0[b] = t0;  // (by every producer thread: no branch)
            st_slots[b] = slots;
            {  // the tile's valid bits: warp w's 8 rows, lane l's vote for row 8 w + l % 8 (lane 4 l's ok)
                const bool okl = __shfl_sync(CP_FULL_MASK, (u32)ok, 4 * (lane & 7u)) != 0;
                const u32 x = __ballot_sync(CP_FULL_MASK, okl) & 0xffu;
                // every lane stores the same byte (no branch: one shared-memory write)
                reinterpret_cast<unsigned char*>(&st_valid[b])[tid >> 5] = (unsigned char)x;
            }
            st_bad[b] = 0;  // (by every producer thread: no branch)
            // (one base address each, the chunks at immediate offsets from it)
            unsigned char* const dst0 = sK + b * kTileBytes + d0;
            unsigned char* const dst1 = sK + b * kTileBytes + d1;
            const kv_t* const lq = lat + qq * 8;
            const kv_t* const rq = rot + qq * 8;
#pragma unroll
            for (u32 i = 0; i < kR / 32; ++i)  // latent chunk qq + 4 i
                ptx::cp_async_16(((i & 1u) ? dst1 : dst0) + (i >> 1) * kTCol, lq + 32 * i, ok);
#pragma unroll
            for (u32 i = 0; i < kP / 32; ++i)  // rotary chunk qq + 4 i
                ptx::cp_async_16(((i & 1u) ? dst1 : dst0) + kRBlocks * kTCol, rq + 32 * i, ok);
            ptx::cp_async_commit();
            missbits = missbits << 1 | (u32)miss;
            ++gp;
            pb = next_buf(pb);
            if (gp > kLag) signal(Count<kLag>{});
        };
        tc::for_each_pass_of(rows, qt, [&](u32 seq, u32 slot_lo, u32 slot_hi, u32 lo, u32 hi) {
            const prod::PassSpan span = prod::pass_span(rows, qt, q0, q_end, slot_lo, slot_hi);
            // The page walk: threads 4 t .. 4 t + 3 follow token t of each tile.
            prod::TokenWalk<kN> walk(tables + (u64)seq * p.table_width, lo + ptok, hi, p.page_size);
            u32 raw = kNone, slot = 0;
            const u32 ntiles = (hi - lo + kN - 1) / kN;
            walk.next(raw, slot);
            for (u32 j = 0; j < ntiles; ++j) {
                const u32 t0 = lo + j * kN;
                const bool ok = raw < p.num_pages;
                const u32 page = ok ? raw : 0u;
                const kv_t* const lat = k_cache + ((u64)page * p.k_stride_page + (u64)slot * p.k_stride_slot);
                const kv_t* const rot =
                    kP ? k_rot + ((u64)page * p.rot_stride_page + (u64)slot * p.rot_stride_slot) : k_rot;
                walk.next(raw, slot);
                produce(lat, rot, ok, span.miss(t0, t0 + kN < hi ? t0 + kN : hi), t0, slot_lo | slot_hi << 16);
            }
        });
        if (gp & 1u) produce(k_cache, k_rot, false, false, 0u, 0u);  // the empty tile of an odd count: no rows
        if (gp >= kLag) signal(Count<0>{});  // the last tile (kLag == 1)
        // The consumers' last releases, so that every named barrier ends complete.
        for (u32 n = gp > kS ? gp - kS : 0u; n < gp; ++n) wgb::sync(kEmpty + n % kS, kBlockThreads);
        return;
    }
    wgb::regs_inc<kConsumerRegs>();
    // The block's tiles, every pass's, padded to an even count (the last pair's second tile empty).
    u32 total = 0;
    tc::for_each_pass_of(rows, qt, [&](u32, u32, u32, u32 lo, u32 hi) { total += (hi - lo + kN - 1) / kN; });
    // (broadcast from lane 0, so that the compiler knows it is uniform: the loop, its selects and the
    // descriptors stay in uniform registers)
    total = __shfl_sync(CP_FULL_MASK, total + (total & 1u), 0);

    // ---- the consumers: c = 0, 1; each holds all 64 rows and value columns kHalf c .. kHalf c + kHalf - 1 ----
    const u32 c = wg - 1u, wtid = tid & 127u;  // this consumer, its thread
    // The consumer, broadcast from lane 0, so that the compiler keeps the descriptors built from it in
    // uniform registers.
    const u32 cu = __shfl_sync(CP_FULL_MASK, c, 0);
    // Rows 16 warp4 + g (+ 8) of this thread in every wgmma fragment.
    u32 my_slot[2];
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        u32 slot, hl;
        my_slot[h] = row_ok(16 * warp4 + g + 8 * h, slot, hl) ? slot : kNone;
    }
    const float qscale = p.scale * softmax::kLog2e;
    softmax::State sm[2];  // rows g, g + 8: the max (both consumers the same) and this lane's part of its share
    float o[kHalf / 2];  // O [64 x 256]: value columns kHalf c + 8 j + 2 tq (+ 1), rows as above
#pragma unroll
    for (u32 h = 0; h < 2; ++h) sm[h].clear();
#pragma unroll
    for (u32 i = 0; i < kHalf / 2; ++i) o[i] = 0.0f;
    constexpr u32 kSw = ptx::kSwizzle128B;
    const variant::Scorer sc(p);  // a score variant's arguments

    // S of the tile in buffer b into s (one group): (R + P) / 16 k-steps, Q and K from shared memory.
    // Descriptors move along K by adding the byte offset >> 4 to the start address field.
    float s[16];  // S [64 x 32]: rows as above, token 8 (i / 4) + 2 tq (+ 1)
#pragma unroll
    for (u32 i = 0; i < 16; ++i) s[i] = 0.0f;
    const u64 dq0 = ptx::wgmma_desc(sQ, 16, 1024, kSw);
    auto issue_s = [&](u32 b) {
        const u64 dk = ptx::wgmma_desc(sK + b * kTileBytes, 16, 1024, kSw);
        // Q's descriptor made opaque here, so that the compiler forms each k-step's from it (an add) rather
        // than hoisting all of them out of the loop into registers.
        u64 dq = dq0;
        asm volatile("" : "+l"(dq));
        ptx::wgmma_fence();
#pragma unroll
        for (u32 ks = 0; ks < kK / 16; ++ks)
            ptx::wgmma_ss<scalar_t, kN, 0, 0>(s, ptx::wgmma_desc_at(dq, ((ks >> 2) * kQCol + (ks & 3u) * 32) >> 4),
                                              ptx::wgmma_desc_at(dk, ((ks >> 2) * kTCol + (ks & 3u) * 32) >> 4),
                                              ks > 0);
        ptx::wgmma_commit();
    };
    // This consumer's half of V in buffer b (N-major: column blocks kTCol apart, 8-token groups 1024 B).
    auto v_desc = [&](u32 b) { return ptx::wgmma_desc(sK + b * kTileBytes + 4 * cu * kTCol, kTCol, 1024, kSw); };
    // The fix of a tile whose value rows hold Inf / NaN (cold): this consumer adds p * v itself for every
    // non-finite element of its columns and a token its rows see (P of the tile from sp), then zeroes those
    // elements of its half of the tile; o is the tile's reference already.
    auto fix = [&](u32 b, const unsigned char* sp, const u64(&vis)[2]) {
        ptx::cold_path();
        wgb::sync(kFix + c, 128);  // the tile's P is in sp (the owner's own stores included)
        const unsigned char* const kt = sK + b * kTileBytes;
#pragma unroll 1
        for (u32 tok = 0; tok < kN; ++tok) {
            ptx::cold_path();
            const bool see0 = (vis[0] >> tok) & 1u, see1 = (vis[1] >> tok) & 1u;
            const u32 r0 = 16 * warp4 + g;
            const float p0 = tc::half_of<scalar_t>(*reinterpret_cast<const u32*>(sp + p_at(r0, tok & ~1u)), tok & 1u);
            const float p1 =
                tc::half_of<scalar_t>(*reinterpret_cast<const u32*>(sp + p_at(r0 + 8, tok & ~1u)), tok & 1u);
#pragma unroll
            for (u32 j = 0; j < 32; ++j) {  // unrolled: o stays in registers
                const u32 col = kHalf * c + 8 * j + 2 * tq;  // value columns col, col + 1
                // volatile: one value at a time (no register pressure from early loads)
                const u32 vb = *reinterpret_cast<const volatile u32*>(kt + (col >> 6) * kTCol +
                                                                      swz(tok, (col >> 3) & 7u) + (col & 7u) * 2);
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
        wgb::sync(kFix + c, 128);  // every lane of this consumer has read the tile's non-finite values
        unsigned char* const half = sK + b * kTileBytes + 4 * c * kTCol;
#pragma unroll 1
        for (u32 i = wtid; i < kHalf / 64 * kTCol / 4; i += 128) {  // every 32-bit pair of this half
            ptx::cold_path();
            u32* const w = reinterpret_cast<u32*>(half) + i;
            const u32 x = *w;
            const u32 lo = tc::nonfinite2<scalar_t>(x & 0xffffu) ? 0u : (x & 0xffffu);
            const u32 hi = tc::nonfinite2<scalar_t>(x >> 16) ? 0u : (x & 0xffff0000u);
            *w = lo | hi;
        }
        ptx::fence_proxy_async_shared();  // the zeroed half is read by the P V wgmma below
        wgb::sync(kFix + c, 128);
    };

    // ---- the consumers' pieces of a step (the loop: consume, below) ----
    // What the producer published with tile buffer b: this thread's rows' share of the tile's pass and the
    // score rows (t0: the tile's first position).
    auto tile_rows = [&](u32 b, u32& t0, u32(&rlo)[2], u32(&rhi)[2], variant::ScoreRow(&srow)[2]) {
        t0 = st_t0[b];
        const u32 slots = st_slots[b], slot_lo = slots & 0xffffu, slot_hi = slots >> 16;
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            const u32 s0 = my_slot[h];
            const bool in = s0 != kNone && s0 >= slot_lo && s0 < slot_hi;
            rlo[h] = in ? rows.lo[s0] : 0u;
            rhi[h] = in ? rows.hi[s0] : 0u;
            if constexpr (!variant::kPlainScore)
                srow[h] = sc.row(in ? rows.position(s0) : 0u, head0 + (16 * warp4 + g + 8 * h - (in ? s0 : 0u) * ht));
        }
    };
    // The softmax of an own tile in buffer b (its S in s): scores, the score hook and masks; m_n = max(m_{n-1},
    // the tile's) (m_{n-1}: sm's); s = P = exp2(S - m_n), this lane's part of the row sums added; returns the
    // factor O (and the sums) move by (alpha).
    auto softmax_tile = [&](u32 b, float (&alpha)[2]) {
        u32 t0, rlo[2], rhi[2];
        variant::ScoreRow srow[2] = {{0u, 0u, 0.0f}, {0u, 0u, 0.0f}};
        tile_rows(b, t0, rlo, rhi, srow);
        const u64 vbits = st_valid[b];
        // Whether every stored row of this warp sees every token of the tile (warp-uniform; a row of no query is
        // never written): then nothing is masked (FlashAttention-3 masks only the edge tiles).
        bool mine = vbits == 0xffffffffull;
#pragma unroll
        for (u32 h = 0; h < 2; ++h) mine &= my_slot[h] == kNone || (rlo[h] <= t0 && t0 + kN <= rhi[h]);
        const bool full = __all_sync(CP_FULL_MASK, mine);
        // Scale into the log2 domain, the score hook, mask; the tile's row maxima. The plain score keeps S
        // unscaled up to exp2(S qscale - m) (one FFMA; qscale > 0 keeps the max), as paged_mla_wgmma.
        constexpr bool kLate = variant::kPlainScore;
        const float late = kLate ? qscale : 1.0f;
        float mx[2] = {neg_inf(), neg_inf()};
        auto scores = [&](auto masked, const u32(&vlane)[2]) {
#pragma unroll
            for (u32 i = 0; i < 16; ++i) {
                const u32 h = (i >> 1) & 1u, dc = 8 * (i >> 2) + (i & 1u);
                float v = s[i];
                if constexpr (!kLate) v = variant::score(sc, srow[h], v * qscale, t0 + 2 * tq + dc);
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
            u32 vlane[2];  // this lane's visible tokens from its first column 2 tq
#pragma unroll
            for (u32 h = 0; h < 2; ++h) vlane[h] = (u32)tc::tile_vis<kN>(vbits, rlo[h], rhi[h], t0) >> (2 * tq);
            scores(tc::Flag<true>{}, vlane);
        }
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 2));
            alpha[h] = sm[h].raise(mx[h] * late);
            const float mu = sm[h].offset();
            float ps = 0.0f;
#pragma unroll
            for (u32 i = 0; i < 16; ++i)
                if (((i >> 1) & 1u) == h) {
                    s[i] = exp2f(fmaf(s[i], late, -mu));
                    ps += s[i];
                }
            sm[h].add(alpha[h], ps);  // this lane's part of this consumer's share of the row sum
        }
    };
    // P (as its A fragments pa) times the rows' factors f into sP array dst (the A operand of the other's
    // P V): pa[kk][i] holds row g (+ 8 for i & 1), tokens 16 kk + 8 (i / 2) + 2 tq (+ 1).
    auto store_p = [&](unsigned char* dst, const u32(&pa)[2][4], const float (&f)[2]) {
#pragma unroll
        for (u32 kk = 0; kk < 2; ++kk)
#pragma unroll
            for (u32 i = 0; i < 4; ++i) {
                const u32 h = i & 1u, r = 16 * warp4 + g + 8 * h, t = 16 * kk + 8 * (i >> 1) + 2 * tq;
                const u32 x = pa[kk][i];
                *reinterpret_cast<u32*>(dst + p_at(r, t)) =
                    ptx::pack2<scalar_t>(tc::half_of<scalar_t>(x, 0) * f[h], tc::half_of<scalar_t>(x, 1) * f[h]);
            }
        ptx::fence_proxy_async_shared();  // dst is read by wgmma
    };
    auto pack_p = [&](u32(&pa)[2][4]) {  // k-step kk, tokens 16 kk .. 16 kk + 15
#pragma unroll
        for (u32 kk = 0; kk < 2; ++kk)
#pragma unroll
            for (u32 i = 0; i < 4; ++i) pa[kk][i] = ptx::pack2<scalar_t>(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
    };
    // O += P V of this consumer's half of the tile in buffer b: P from registers (its own tile) or from an sP
    // array (the other's).
    auto pv_own = [&](u32 b, const u32(&pa)[2][4]) {
        const u64 dv = v_desc(b);
        ptx::wgmma_fence();
#pragma unroll
        for (u32 kk = 0; kk < 2; ++kk)
            ptx::wgmma_rs<scalar_t, kHalf, 1>(o, pa[kk], ptx::wgmma_desc_at(dv, (16 * kk * 128) >> 4), true);
        ptx::wgmma_commit();
    };
    auto pv_other = [&](u32 b, const unsigned char* src) {
        const u64 dv = v_desc(b);
        const u64 dp = ptx::wgmma_desc(src, 16, 512, ptx::kSwizzle64B);
        ptx::wgmma_fence();
#pragma unroll
        for (u32 kk = 0; kk < 2; ++kk)
            ptx::wgmma_ss<scalar_t, kHalf, 0, 1>(o, ptx::wgmma_desc_at(dp, (32 * kk) >> 4),
                                                 ptx::wgmma_desc_at(dv, (16 * kk * 128) >> 4), true);
        ptx::wgmma_commit();
    };
    auto rescale_o = [&](const float (&f)[2]) {
#pragma unroll
        for (u32 i = 0; i < kHalf / 2; ++i) o[i] *= f[(i >> 1) & 1u];
    };
    // The cold fix of the tile in buffer b for this consumer's half from the P in src (the reference of o).
    auto fix_tile = [&](u32 b, const unsigned char* src) {
        u32 t0, rlo[2], rhi[2];
        variant::ScoreRow srow[2] = {{0u, 0u, 0.0f}, {0u, 0u, 0.0f}};
        tile_rows(b, t0, rlo, rhi, srow);
        const u64 vbits = st_valid[b];
        u64 vis[2];
#pragma unroll
        for (u32 h = 0; h < 2; ++h) vis[h] = tc::tile_vis<kN>(vbits, rlo[h], rhi[h], t0);
        fix(b, src, vis);
    };
    auto release = [&](u32 b) { wgb::arrive(kEmpty + b, kBlockThreads); };
    // ---- the tiles: consumer kC's loop (one per consumer, so that every wgmma group is where ptxas sees
    // it), one own tile n = 2 k + kC a step, and the other's tile n - 1 after it:
    //   softmax of n from m_{n-1} (the other's, known since the step before), m_n into s_m[kC] (kMax + kC);
    //   O *= exp2(m_{n-2} - m_n) (O's reference was this consumer's last max); O += P_n V_n (P from
    //   registers); O += P_{n-1} V_{n-1} (sP[kO], already scaled to m_n by its owner: kReady + kO); once both
    //   products are done, the tiles released and m_{n+1} known (kMax + kO), P_n exp2(m_n - m_{n+1}) into
    //   sP[kC] (kReady + kC: for the other's next step); then S of tile n + 2 and wait_group 0 (no product in
    //   flight across the loop's back edge, where ptxas would serialize them all).
    // So each consumer rescales O once a step (a pair of tiles), and consumer 0 adds consumer 1's last tile
    // after its loop. sP[c] is free when its owner writes it: the other read it in its step before, whose
    // products it waited for before it arrived at kReady. The maxima: s_m[c] is rewritten after the other's
    // kMax of its next step, which follows its reads.
    auto consume = [&](auto kc) {
        constexpr u32 kC = decltype(kc)::value, kO = kC ^ 1u;
        unsigned char* const myp = sP + kC * kPBytes;
        const unsigned char* const op = sP + kO * kPBytes;
        if (total == 0) return;
        wgb::sync(kFull + kC, kOwnerFull);  // S of this consumer's first tile
        issue_s(kC);
        ptx::wgmma_wait<0>();
        ptx::wgmma_fence_operand(s);
        if constexpr (kC == 1) wgb::sync(kMax + 0, kThreads);  // consumer 0's first max
        // Own tile n in buffer b, the other's tile n - 1 in buffer pb (first: none, consumer 0's tile 0).
        auto step = [&](u32 n, u32 b, u32 pb, auto first) {
            constexpr bool kFirst = decltype(first)::value;
            float alpha[2], a_n[2];
            u32 pa[2][4];
            // m_{n-1}, the other's max before this tile (s_m[kO], seen at its kMax: consumer 0's first tile, none)
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                const float m_prev = kFirst ? neg_inf() : s_m[kO * kRows + 16 * warp4 + g + 8 * h];
                alpha[h] = sm[h].move_to(m_prev);  // to m_{n-1}, then the tile raises it to m_n
                sm[h].add(alpha[h], 0.0f);
            }
            softmax_tile(b, a_n);
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                alpha[h] *= a_n[h];
                if (tq == 0) s_m[kC * kRows + 16 * warp4 + g + 8 * h] = sm[h].m;
            }
            wgb::arrive(kMax + kC, kThreads);
            rescale_o(alpha);
            // The cold fixes before the products (none may run while o is being written): the other's tile
            // first (its P, scaled to m_n, in sP[kO]; and sP[kC] is free once the other's kReady is seen),
            // then this one's from its unscaled P in sP[kC].
            const bool bad = st_bad[b] != 0 || (!kFirst && st_bad[pb] != 0);  // (block-uniform)
            if (bad) {
                if constexpr (!kFirst) {
                    wgb::sync(kReady + kO, kThreads);
                    if (st_bad[pb]) fix_tile(pb, op);
                }
                if (st_bad[b]) {
                    const float one[2] = {1.0f, 1.0f};
                    u32 unscaled[2][4];
                    pack_p(unscaled);
                    store_p(myp, unscaled, one);
                    fix_tile(b, myp);
                }
            }
            pack_p(pa);  // (after the fixes: no fragments held across them)
            pv_own(b, pa);
            if constexpr (!kFirst) {
                if (!bad) wgb::sync(kReady + kO, kThreads);
                pv_other(pb, op);
            }
            ptx::wgmma_wait<0>();
            ptx::wgmma_fence_operand(o);
            release(b);
            if constexpr (!kFirst) release(pb);
            // P_n scaled to m_{n+1} for the other (the block's last tile: to m_n itself).
            float beta[2] = {1.0f, 1.0f};
            if (n + 1 < total) {
                wgb::sync(kMax + kO, kThreads);
#pragma unroll
                for (u32 h = 0; h < 2; ++h)
                    beta[h] = softmax::rescale(sm[h].m, s_m[kO * kRows + 16 * warp4 + g + 8 * h]);
            }
            store_p(myp, pa, beta);  // (after a fix: its last barrier saw every lane done with the unscaled P)
            wgb::arrive(kReady + kC, kThreads);
            const bool more = n + 2 < total;
            const u32 nb = next_buf(next_buf(b));  // tile n + 2's buffer
            if (more) wgb::sync(kFull + nb, kOwnerFull);
            issue_s(more ? nb : b);
            ptx::wgmma_wait<0>();
            ptx::wgmma_fence_operand(s);
        };
        u32 n = kC, b = kC;  // this consumer's next own tile and its buffer
        if constexpr (kC == 0) {
            step(0u, 0u, 0u, tc::Flag<true>{});
            n = 2;
            b = 2;
        }
        for (; n < total; n += 2) {
            step(n, b, b == 0 ? kS - 1 : b - 1, tc::Flag<false>{});
            b = next_buf(next_buf(b));
        }
        if constexpr (kC == 0) {  // consumer 1's last tile (total - 1, in the buffer before b), at its own max
            const u32 pb = b == 0 ? kS - 1 : b - 1;
            float alpha[2];
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                alpha[h] = sm[h].move_to(s_m[kRows + 16 * warp4 + g + 8 * h]);
                sm[h].add(alpha[h], 0.0f);
            }
            rescale_o(alpha);
            wgb::sync(kReady + 1, kThreads);
            if (st_bad[pb]) fix_tile(pb, op);
            pv_other(pb, op);
            ptx::wgmma_wait<0>();
            ptx::wgmma_fence_operand(o);
            release(pb);
        }
    };
    if (c == 0)
        consume(Count<0>{});
    else
        consume(Count<1>{});

    // ---- normalize and write: consumer c its value columns of every row ----
    // Row sums: this lane's part of this consumer's share, over the quad, then both shares (through s_m).
    wgb::sync(kEnd, kThreads);  // both consumers are done reading s_m
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        float l = sm[h].l;
        l += __shfl_xor_sync(CP_FULL_MASK, l, 1);
        l += __shfl_xor_sync(CP_FULL_MASK, l, 2);
        sm[h].l = l;
        if (tq == 0) s_m[c * kRows + 16 * warp4 + g + 8 * h] = l;
    }
    wgb::sync(kEnd, kThreads);
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        const u32 r = 16 * warp4 + g + 8 * h;
        sm[h].l = s_m[r] + s_m[kRows + r];
    }
    // The block's place again, from an opaque copy of its index: recomputed here rather than held in
    // registers through the tile loop.
    u32 bx = blockIdx.x;
    asm volatile("" : "+r"(bx));
    const mrows::Place pe(p, bx);
    mrows::write_rows<scalar_t, kR>(p, sc, pe, out, part_out, lse, part_lse, sm, my_slot, o, kHalf * c, 1.0f, c == 0);
}
