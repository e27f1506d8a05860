// attention.cu: paged attention for decode and chunked prefill, and the
// split-KV merge. Layout, positions, metadata words, LSE and the split
// workspace are defined in docs/layout.md; this file follows it.
//
// Three attention kernels share one argument list; a variant compiles one
// of them (TC_PREFILL, TC_MLA, or neither) plus attention_split_merge:
//   paged_attention   CUDA cores, any dtype and dims (decode, and the fallback)
//   paged_prefill_tc  tensor cores, f16 / bf16, D == Dv in {64, 128, 256}
//   paged_mla_tc      tensor cores, f16 / bf16 MLA at R = 512, P = 64
// All three write the same split partials, so the merge serves them all.
//
// A launch covers the packed queries [q_begin, q_begin + q_count) of the
// plan (host arguments, clamped to the plan's queries). A step whose
// sequences suit different kernels runs as up to four launches over
// contiguous ranges (segments, cupaged/ops/attention/schedule.py tc_segments); every
// launch indexes q, out, lse and the partials by global query, so the one
// merge after them serves all queries.
//
// paged_attention: one block per (query, KV head, head tile, split).
//   grid  (q_count, kv_heads * head_tiles, splits), block 128 (4 warps);
//   block x serves query q_begin + x.
//   A block serves the query heads g = tile*GROUP_TILE .. +GROUP_TILE-1 of
//   the GQA group of its KV head, so each K/V row it reads is used by every
//   one of those heads (read once per group when the group fits one tile).
//   Each warp owns a slice of the tokens of every block step: its 32 lanes
//   form ROWS row groups of LANES lanes; a row group holds one K (and V) row,
//   each lane CHUNKS vector chunks of it (16-byte loads when VEC_LOADS). A
//   lane issues STEP_U rows of K and V loads before it uses any, so a block
//   has 128 * STEP_U * CHUNKS * 2 loads in flight, and loads the next step's
//   page ids while they are in flight. Scores are reduced over
//   the LANES lanes of a row by xor-shuffles; every row group keeps its own
//   online-softmax state (max and sum in the log2 domain, FP32 accumulator of
//   its value slice for each head) and the states are merged at the end:
//   first inside a warp by shuffles, then across warps through shared memory.
//   Tokens are never loaded past the split's end or from a page id
//   >= num_pages; such a token's score is -inf and its value registers hold
//   zeros, so no unused slot (NaN) can reach the output.
//   With splits > 1, split z covers positions [z*c, min(L, (z+1)*c)) with
//   c = ceil(L / splits) rounded up to SPLIT_TILE, and writes FP32 partials
//   (an empty split writes out 0 and lse -inf); attention_split_merge
//   combines them.
//
// Defines (compile-time choices, see cupaged/ops/attention/variants.py):
//   CP_DTYPE    f32 | f16 | bf16, the type of q, caches and out.
//   HEAD_DIM    64 | 128 | 256: fast path with D == Dv == HEAD_DIM; 0 (or
//               absent) for runtime D and Dv up to DIM_CAP.
//   DIM_CAP     64 .. 1024 (power of two): capacity of the runtime-dim path.
//   VEC_LOADS   1: 16-byte loads (D and Dv multiples of 16 bytes, arrays
//               16-byte aligned); 0: element loads.
//   GROUP_TILE  1 | 2 | 4 | 8: query heads per block.
//   ROT_CAP     0, or the capacity of the rotary part P (MLA, HAS_ROT): the
//               score adds q_rot.k_rot and V is the K row itself (the MLA
//               latent cache serves as both).
//   TC_PREFILL  1: paged_prefill_tc with HEAD_DIM (CP_DTYPE f16 | bf16).
//   TC_MLA      1: paged_mla_tc with LATENT_DIM (R) and ROPE_DIM (P).
// The tensor-core kernels are described where they start (below); their
// inline PTX lives in ptx.cuh.
#include "common.cuh"
#include "plan_words.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 0
#endif
#ifndef DIM_CAP
#define DIM_CAP HEAD_DIM
#endif
#ifndef VEC_LOADS
#define VEC_LOADS 1
#endif
#ifndef GROUP_TILE
#define GROUP_TILE 1
#endif
#ifndef ROT_CAP
#define ROT_CAP 0
#endif
#ifndef TC_PREFILL
#define TC_PREFILL 0
#endif
#ifndef TC_MLA
#define TC_MLA 0
#endif

namespace att {
constexpr u32 kSplitTile = CP_SPLIT_TILE;
constexpr u32 kMaxLen = CP_MAX_VISIBLE_LEN;            // visible lengths are clamped to this

__device__ __forceinline__ u32 min_u32(u32 a, u32 b) { return a < b ? a : b; }

// End of a launch's query range [q_begin, q_end): q_begin + q_count clamped
// to the plan's queries; 0 (an empty range) when q_begin is past them. The
// range comes from the host, but is clamped like everything else.
__device__ __forceinline__ u32 range_end(u32 queries, u32 q_begin, u32 q_count) {
    return q_begin < queries ? q_begin + min_u32(q_count, queries - q_begin) : 0u;
}

// exp2(m - ref) as a rescale factor; 0 for an empty state (m == -inf).
__device__ __forceinline__ float rescale(float m, float ref) {
    return m == neg_inf() ? 0.0f : exp2f(m - ref);
}
}  // namespace att

#if TC_PREFILL || TC_MLA
// ===================================================================== tensor cores
#include "ptx.cuh"

namespace tc {
using att::min_u32;
using att::rescale;

constexpr u32 kRows = 64;             // (query, head) rows per block: the M dimension
constexpr u32 kNone = 0xffffffffu;    // no sequence / no page
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The rows of a block: kRows / ht query slots of ht heads each; slot i is
// query q0 + i. Filled once per block from the device words.
struct Rows {
    u32 seq[kRows];   // sequence of the slot's query, kNone when none (past the queries, bad index)
    u32 lo[kRows];    // this split's share [lo, hi) of the query's visible positions
    u32 hi[kRows];
};

// Visible positions of query slot i (threads i < kRows): layout rules as in
// paged_attention, split share with SPLIT_TILE rounding.
// Slots at or past q_end (the launch's range, <= queries) hold no query.
__device__ __forceinline__ void setup_rows(Rows& R, const u32* __restrict__ words, u64 q0, u32 qt, u32 q_end,
                                           u32 queries, u32 sequences, u32 table_width, u32 page_size,
                                           u32 splits, u32 causal) {
    for (u32 i = threadIdx.x; i < kRows; i += blockDim.x) {
        u32 seq = kNone, lo = 0, hi = 0;
        if (i < qt && q0 + i < q_end) {
            const u32 qi = (u32)(q0 + i);
            const u32 s = words[pw::q_seq(queries) + qi];
            if (s < sequences) {
                seq = s;
                u64 L = words[pw::kv_len(queries) + s];
                const u64 cap = (u64)table_width * page_size;
                if (L > cap) L = cap;
                if (causal) {
                    const u64 p1 = (u64)words[pw::q_pos(queries) + qi] + 1;
                    if (L > p1) L = p1;
                }
                const u32 len = (u32)(L < att::kMaxLen ? L : att::kMaxLen);
                hi = len;
                if (splits > 1) {
                    u32 c = (len + splits - 1) / splits;
                    c = (c + att::kSplitTile - 1) / att::kSplitTile * att::kSplitTile;
                    const u64 s0 = (u64)blockIdx.z * c;
                    lo = s0 < len ? (u32)s0 : len;
                    hi = min_u32(len, lo + c);
                }
            }
        }
        R.seq[i] = seq;
        R.lo[i] = lo;
        R.hi[i] = hi;
    }
}

// Page staging of a K/V tile: the page id and slot of each of its kN tokens
// (kNone past `hi` or for a page id >= num_pages) and a bit per valid token.
template <u32 kN> struct Stage {
    u32 page[2][kN];
    u32 slot[2][kN];
    u32 valid[2][kN / 32];
};

// The tiles of one pass: positions [lo, hi) of one sequence in tiles of kN,
// two buffers, the next tile's cp.async in flight while this one computes.
//   issue(buf): start the copies of the staged tile into buffer buf (every thread)
//   compute(buf, t0): use the tile of positions t0 .. t0+kN-1 in buffer buf
// Every thread of the block calls this with the same lo, hi. Threads
// tid < kN look up the page of token tid of each tile: the page-table
// word of tile j+2 is loaded while tile j computes and staged in shared
// memory (page id, slot, valid bit) for the copies of tile j+1.
template <u32 kN, typename Issue, typename Compute>
__device__ __forceinline__ void run_tiles(Stage<kN>& st, const u32* __restrict__ table, u32 lo, u32 hi,
                                          u32 page_size, u32 num_pages, Issue&& issue, Compute&& compute) {
    const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    u32 raw = kNone, slot = 0;   // token tid of a later tile: page-table word (kNone past hi) and slot
    auto fetch = [&](u32 t) {
        raw = kNone;
        slot = 0;
        if (tid < kN && t < hi) {
            const u32 j = t / page_size;
            raw = table[j];
            slot = t - j * page_size;
        }
    };
    // Stage the fetched token into buffer b (threads tid < kN); returns its validity.
    auto stage = [&](u32 b) -> bool {
        const bool ok = raw < num_pages;
        if (tid < kN) {
            st.page[b][tid] = ok ? raw : kNone;
            st.slot[b][tid] = slot;
        }
        return ok;
    };
    // The valid bits of buffer b (warps < kN / 32; a barrier must follow before compute).
    auto publish = [&](u32 b, bool ok) {
        if (warp < kN / 32) {
            const u32 bits = __ballot_sync(CP_FULL_MASK, ok);
            if (lane == 0) st.valid[b][warp] = bits;
        }
    };
    const u32 ntiles = (hi - lo + kN - 1) / kN;
    __syncthreads();   // the previous pass is done with every buffer and the staging arrays
    fetch(lo + tid);
    publish(0u, stage(0u));
    fetch(lo + kN + tid);
    __syncthreads();
    issue(0u);
    ptx::cp_async_commit();
    for (u32 j = 0; j < ntiles; ++j) {
        const u32 t0 = lo + j * kN, b = j & 1u;
        const bool more = j + 1 < ntiles;
        // Page ids and slots of buffer b^1 are read only by issue(), last for
        // tile j-1 before the previous iteration's barriers: restage them now.
        bool ok = false;
        if (more) {
            ok = stage(b ^ 1u);
            fetch(t0 + 2 * kN + tid);
        }
        __syncthreads();   // staging of tile j+1 visible; every warp is done computing tile j-1
        if (more) {
            publish(b ^ 1u, ok);   // compute(j-1) read these bits; it is done
            issue(b ^ 1u);
        }
        ptx::cp_async_commit();     // possibly empty: keeps one group per tile
        ptx::cp_async_wait<1>();    // tile j has landed (tile j+1 may still be in flight)
        __syncthreads();
        compute(b, t0);
    }
}

// The rows of query slots [i, j) with a visible share form one pass; rows
// of other slots see nothing in it. Calls pass(seq, slot_lo, slot_hi, lo, hi)
// for each maximal run of slots of one sequence (queries are packed in
// sequence order, so a block has one pass per sequence it touches; words
// that break that order only give more passes, each row still in one).
template <typename Pass>
__device__ __forceinline__ void for_each_pass(const Rows& R, u32 qt, Pass&& pass) {
    for (u32 i = 0; i < qt;) {
        const u32 cur = R.seq[i];
        u32 j = i + 1;
        while (j < qt && R.seq[j] == cur) ++j;
        if (cur != kNone) {
            u32 lo = kNone, hi = 0;
            for (u32 k = i; k < j; ++k)
                if (R.lo[k] < R.hi[k]) {
                    lo = min_u32(lo, R.lo[k]);
                    hi = R.hi[k] > hi ? R.hi[k] : hi;
                }
            if (lo < hi) pass(cur, i, j, lo, hi);
        }
        i = j;
    }
}

// Bits a .. e-1 of a tile's token mask (0 <= a, e <= 64; none when e <= a).
__device__ __forceinline__ u64 span_bits(u32 a, u32 e) {
    const u64 upto_e = e >= 64 ? ~0ull : ((1ull << e) - 1);
    const u64 upto_a = a >= 64 ? ~0ull : ((1ull << a) - 1);
    return upto_e & ~upto_a;
}

// Tokens t0 .. t0 + n - 1 (n <= 64) a row with positions [rlo, rhi) sees, as bits.
__device__ __forceinline__ u64 row_bits(u32 rlo, u32 rhi, u32 t0, u32 n) {
    const u32 a = rlo > t0 ? min_u32(rlo - t0, n) : 0u;
    const u32 e = rhi > t0 ? min_u32(rhi - t0, n) : 0u;
    return span_bits(a, e);
}

// Store two adjacent outputs of one row: scalar_t pair, or f32 pair into the partials.
__device__ __forceinline__ void store_pair(scalar_t* __restrict__ out, float* __restrict__ part, u64 idx,
                                           bool split, float a, float b) {
    if (split) {
        float2 v;
        v.x = a;
        v.y = b;
        *reinterpret_cast<float2*>(part + idx) = v;
    } else {
        *reinterpret_cast<u32*>(out + idx) = ptx::pack2<scalar_t>(a, b);
    }
}

}  // namespace tc

#if TC_PREFILL
// ---------------------------------------------------------------- chunked prefill
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
//   accumulation; the online softmax runs in f32 in the log2 domain on the
//   S fragments (a row's max and sum live in the 4 lanes of a quad).
//   Each row sees positions [lo, hi) of its query (causal clamp, split
//   share); a warp whose 16 rows see nothing of a tile skips its products.
//   Positions past the pass's end and page ids >= num_pages are zero-filled
//   (never read) and masked, so no unused slot reaches the output.
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
}  // namespace tcp

extern "C" __global__ void __launch_bounds__(128, 1)
paged_prefill_tc(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k_cache,
                 const scalar_t* __restrict__ v_cache, const scalar_t* __restrict__ q_rot,
                 const scalar_t* __restrict__ k_rot, const u32* __restrict__ words,
                 scalar_t* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_out,
                 float* __restrict__ part_lse, u32 queries, u32 q_begin, u32 q_count,
                 u32 sequences, u32 table_width, u32 page_size, u32 num_pages, u32 q_heads, u32 kv_heads,
                 u32 head_dim, u32 value_dim, u32 rot_dim, u32 splits, u32 causal, u32 write_lse, float scale) {
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
    const u32 group = q_heads / kv_heads;
    const u32 ht = group < kRows ? group : kRows;        // heads per block
    const u32 tiles = (group + ht - 1) / ht;
    const u32 qt = kRows / ht;                           // query slots per block
    const u32 kvh = blockIdx.y / tiles;
    const u32 head0 = kvh * group + (blockIdx.y - kvh * tiles) * ht;
    const u32 heads = tc::min_u32(ht, (kvh + 1) * group - head0);
    // Queries q0 .. q0 + qt - 1 of the launch's range [q_begin, q_end); last
    // queries first: under a causal mask they see the most.
    const u32 q_end = att::range_end(queries, q_begin, q_count);
    const u64 q0 = (u64)q_begin + (u64)(gridDim.x - 1 - blockIdx.x) * qt;

    // ---- Q rows (zero rows for slots without a query or head) ----
    for (u32 c = tid; c < kRows * kChunks; c += kThreads) {
        const u32 r = c / kChunks, ch = c - r * kChunks;
        const u32 slot = r / ht, hl = r - slot * ht;
        const bool ok = slot < qt && q0 + slot < q_end && hl < heads;
        const scalar_t* src = q + ((q0 + slot) * q_heads + head0 + hl) * kD + ch * 8;
        ptx::cp_async_16(sQ + r * kPitch + ch * 8, ok ? src : q, ok);
    }
    ptx::cp_async_commit();
    tc::setup_rows(rows, words, q0, qt, q_end, queries, sequences, table_width, page_size, splits, causal);
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

    const float qscale = scale * tc::kLog2e;
    float m[2], l[2], o[kOTiles][4];
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        m[h] = neg_inf();
        l[h] = 0.0f;
    }
#pragma unroll
    for (u32 n = 0; n < kOTiles; ++n)
#pragma unroll
        for (u32 i = 0; i < 4; ++i) o[n][i] = 0.0f;

    const u64 k_page = (u64)page_size * kv_heads * kD;   // elements per page
    const u32* const tables = words + pw::page_table(queries, sequences);

    tc::for_each_pass(rows, qt, [&](u32 seq, u32 slot_lo, u32 slot_hi, u32 lo, u32 hi) {
        u32 rlo[2], rhi[2];   // this thread's rows' positions in this pass
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            const u32 s = my_slot[h];
            const bool in = s != kNone && s >= slot_lo && s < slot_hi;
            rlo[h] = in ? rows.lo[s] : 0u;
            rhi[h] = in ? rows.hi[s] : 0u;
        }
        auto issue = [&](u32 b) {
            // Thread tid copies chunk tid % kChunks of rows tid / kChunks + i * kRowStep.
#pragma unroll
            for (u32 i = 0; i < kN / kRowStep; ++i) {
                const u32 r = tid / kChunks + i * kRowStep, ch = tid % kChunks;
                const u32 page = st.page[b][r];
                const bool ok = page != kNone;
                const u64 off = (u64)page * k_page + ((u64)st.slot[b][r] * kv_heads + kvh) * kD + ch * 8;
                scalar_t* const dk = sK + (b * kN + r) * kPitch + ch * 8;
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

            // Mask and scale into the log2 domain; online softmax per row.
            float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
            for (u32 n = 0; n < kSTiles; ++n)
#pragma unroll
                for (u32 i = 0; i < 4; ++i) {
                    const u32 h = i >> 1;
                    s[n][i] = ((vis[h] >> (n * 8 + (i & 1u))) & 1u) ? s[n][i] * qscale : neg_inf();
                    mx[h] = fmaxf(mx[h], s[n][i]);
                }
            float alpha[2], mu[2];
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 1));
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 2));
                const float mn = fmaxf(m[h], mx[h]);
                alpha[h] = tc::rescale(m[h], mn);
                mu[h] = mn == neg_inf() ? 0.0f : mn;   // exp2(-inf - mu) = 0 for masked scores
                m[h] = mn;
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
            for (u32 h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + ps[h];   // this lane's part of the row sum
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
        tc::run_tiles<kN>(st, tables + (u64)seq * table_width, lo, hi, page_size, num_pages, issue, compute);
    });

    // ---- normalize and write ----
    const bool split = splits > 1;
#pragma unroll
    for (u32 h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(CP_FULL_MASK, l[h], 1);
        l[h] += __shfl_xor_sync(CP_FULL_MASK, l[h], 2);
        const u32 slot = my_slot[h];
        if (slot == kNone) continue;
        const u32 r = warp * 16 + g + 8 * h;
        const u64 row = (q0 + slot) * q_heads + head0 + (r - slot * ht);
        const u64 row_out = split ? (u64)blockIdx.z * queries * q_heads + row : row;
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        const float lse_v = l[h] > 0.0f ? m[h] * tc::kLn2 + logf(l[h]) : neg_inf();
#pragma unroll
        for (u32 n = 0; n < kOTiles; ++n)
            tc::store_pair(out, part_out, row_out * kD + n * 8 + 2 * tq, split, o[n][2 * h] * inv,
                           o[n][2 * h + 1] * inv);
        if (tq == 0) {
            if (split) part_lse[row_out] = lse_v;
            else if (write_lse) lse[row] = lse_v;
        }
    }
}
#endif  // TC_PREFILL

#if TC_MLA
// ---------------------------------------------------------------- MLA
// paged_mla_tc: DeepSeek-style latent attention (absorbed form), f16 / bf16,
// R = LATENT_DIM latent dims (the values too) + P = ROPE_DIM rotary dims,
// one shared KV head.
//   grid (ceil(q_count / qt), head_tiles, splits), block 256 (8 warps),
//   dynamic shared memory mla_smem_bytes(R, P) (ops/attention/variants.py): 151 KiB at 512 / 64.
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
//   maxima every warp derives identically. O: 64 x 64 f32 per warp, 128
//   registers a lane. Tiles are double-buffered with cp.async as in
//   paged_prefill_tc.
namespace tcm {
constexpr u32 kR = LATENT_DIM, kP = ROPE_DIM, kK = kR + kP;
constexpr u32 kN = 32;                      // tokens per tile
constexpr u32 kWarps = 8, kThreads = 32 * kWarps;
constexpr u32 kPitch = kK + 8;              // shared row pitch of Q and K (elements)
constexpr u32 kPPitch = kN + 8;             // shared row pitch of P
constexpr u32 kChunks = kK / 8, kRChunks = kR / 8;
constexpr u32 kKSteps = kK / 16;
constexpr u32 kCols = kR / kWarps;          // value columns per warp
constexpr u32 kOTiles = kCols / 8;
constexpr u32 kMTiles = tc::kRows / 16;
static_assert(kR % 128 == 0 && kP % 16 == 0, "LATENT_DIM a multiple of 128, ROPE_DIM of 16");
static_assert(kN == 32 && kWarps == 8, "two warps of 16 tokens per row block");
}  // namespace tcm

extern "C" __global__ void __launch_bounds__(256, 1)
paged_mla_tc(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k_cache,
             const scalar_t* __restrict__ v_cache, const scalar_t* __restrict__ q_rot,
             const scalar_t* __restrict__ k_rot, const u32* __restrict__ words,
             scalar_t* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_out,
             float* __restrict__ part_lse, u32 queries, u32 q_begin, u32 q_count,
             u32 sequences, u32 table_width, u32 page_size, u32 num_pages, u32 q_heads, u32 kv_heads,
             u32 head_dim, u32 value_dim, u32 rot_dim, u32 splits, u32 causal, u32 write_lse, float scale) {
    using namespace tcm;
    using tc::kNone;
    using tc::kRows;
    CUPAGED_DYNAMIC_SHARED(scalar_t, smem);
    scalar_t* const sQ = smem;                           // [kRows][kPitch]  q | q_pos
    scalar_t* const sKV = sQ + kRows * kPitch;           // [2][kN][kPitch]  latent | k_pos
    scalar_t* const sP = sKV + 2 * kN * kPitch;          // [kRows][kPPitch] softmax numerators
    __shared__ tc::Rows rows;
    __shared__ tc::Stage<kN> st;
    __shared__ float s_max[2][kRows], s_sum[2][kRows];   // per token half of the tile

    const u32 tid = threadIdx.x, warp = tid >> 5, lane = tid & 31u;
    const u32 g = lane >> 2, tq = lane & 3u;
    const u32 r8 = lane & 7u, tile = lane >> 3;
    const u32 ht = q_heads < kRows ? q_heads : kRows;
    const u32 qt = kRows / ht;
    const u32 head0 = blockIdx.y * ht;
    const u32 heads = tc::min_u32(ht, q_heads - head0);
    // Queries q0 .. q0 + qt - 1 of the launch's range [q_begin, q_end); last
    // queries first: under a causal mask they see the most.
    const u32 q_end = att::range_end(queries, q_begin, q_count);
    const u64 q0 = (u64)q_begin + (u64)(gridDim.x - 1 - blockIdx.x) * qt;

    // ---- Q rows: [q (R) | q_pos (P)] ----
    for (u32 c = tid; c < kRows * kChunks; c += kThreads) {
        const u32 r = c / kChunks, ch = c - r * kChunks;
        const u32 slot = r / ht, hl = r - slot * ht;
        const bool ok = slot < qt && q0 + slot < q_end && hl < heads;
        const u64 qrow = (q0 + slot) * q_heads + head0 + hl;
        const scalar_t* src = ch < kRChunks ? q + qrow * kR + ch * 8 : q_rot + qrow * kP + (ch - kRChunks) * 8;
        ptx::cp_async_16(sQ + r * kPitch + ch * 8, ok ? src : q, ok);
    }
    ptx::cp_async_commit();
    tc::setup_rows(rows, words, q0, qt, q_end, queries, sequences, table_width, page_size, splits, causal);
    ptx::cp_async_wait<0>();
    __syncthreads();

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
    const float qscale = scale * tc::kLog2e;
    float ms[2] = {neg_inf(), neg_inf()};               // running max of the S rows
    float mo[kMTiles][2], lsum[kMTiles][2], o[kMTiles][kOTiles][4];
#pragma unroll
    for (u32 mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            mo[mt][h] = neg_inf();
            lsum[mt][h] = 0.0f;
        }
#pragma unroll
        for (u32 n = 0; n < kOTiles; ++n)
#pragma unroll
            for (u32 i = 0; i < 4; ++i) o[mt][n][i] = 0.0f;
    }

    const u64 lat_page = (u64)page_size * kR, rot_page = (u64)page_size * kP;
    const u32* const tables = words + pw::page_table(queries, sequences);

    tc::for_each_pass(rows, qt, [&](u32 seq, u32 slot_lo, u32 slot_hi, u32 lo, u32 hi) {
        u32 rlo[2], rhi[2];
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            const u32 s = s_slot[h];
            const bool in = s != kNone && s >= slot_lo && s < slot_hi;
            rlo[h] = in ? rows.lo[s] : 0u;
            rhi[h] = in ? rows.hi[s] : 0u;
        }
        auto issue = [&](u32 b) {
            for (u32 c = tid; c < kN * kChunks; c += kThreads) {
                const u32 r = c / kChunks, ch = c - r * kChunks;
                const u32 page = st.page[b][r];
                const bool ok = page != kNone;
                const u64 slot = st.slot[b][r];
                const scalar_t* src = ch < kRChunks ? k_cache + (u64)page * lat_page + slot * kR + ch * 8
                                                    : k_rot + (u64)page * rot_page + slot * kP + (ch - kRChunks) * 8;
                ptx::cp_async_16(sKV + (b * kN + r) * kPitch + ch * 8, ok ? src : k_cache, ok);
            }
        };
        auto compute = [&](u32 b, u32 t0) {
            const scalar_t* const kt = sKV + b * kN * kPitch;
            // ---- S for rows srow0.., tokens t0 + 16 th .. +15 ----
            // Bit dt of vis[h]: row h sees token t0 + 16 th + dt.
            const u32 vbits = st.valid[b][0] >> (16 * th);
            u32 vis[2];
#pragma unroll
            for (u32 h = 0; h < 2; ++h) vis[h] = vbits & (u32)tc::row_bits(rlo[h], rhi[h], t0 + 16 * th, 16);
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
            float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
            for (u32 n = 0; n < 2; ++n)
#pragma unroll
                for (u32 i = 0; i < 4; ++i) {
                    const u32 h = i >> 1;
                    s[n][i] = ((vis[h] >> (n * 8 + (i & 1u))) & 1u) ? s[n][i] * qscale : neg_inf();
                    mx[h] = fmaxf(mx[h], s[n][i]);
                }
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 1));
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(CP_FULL_MASK, mx[h], 2));
                if (tq == 0) s_max[th][srow0 + g + 8 * h] = mx[h];
            }
            __syncthreads();
            // ---- P = exp2(S - m) into shared memory, row sums ----
            float ps[2] = {0.0f, 0.0f};
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                const u32 r = srow0 + g + 8 * h;
                const float mn = fmaxf(ms[h], fmaxf(s_max[0][r], s_max[1][r]));
                const float mu = mn == neg_inf() ? 0.0f : mn;
                ms[h] = mn;
#pragma unroll
                for (u32 n = 0; n < 2; ++n) {
                    const float p0 = exp2f(s[n][2 * h] - mu), p1 = exp2f(s[n][2 * h + 1] - mu);
                    ps[h] += p0 + p1;
                    *reinterpret_cast<u32*>(sP + r * kPPitch + 16 * th + n * 8 + 2 * tq) =
                        ptx::pack2<scalar_t>(p0, p1);
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
                    const float mn = fmaxf(mo[mt][h], fmaxf(s_max[0][r], s_max[1][r]));
                    const float alpha = tc::rescale(mo[mt][h], mn);
                    mo[mt][h] = mn;
                    lsum[mt][h] = lsum[mt][h] * alpha + (s_sum[0][r] + s_sum[1][r]);
#pragma unroll
                    for (u32 n = 0; n < kOTiles; ++n) {
                        o[mt][n][2 * h] *= alpha;
                        o[mt][n][2 * h + 1] *= alpha;
                    }
                }
#pragma unroll
            for (u32 kk = 0; kk < kN / 16; ++kk) {
                u32 a[kMTiles][4];
#pragma unroll
                for (u32 mt = 0; mt < kMTiles; ++mt)
                    ptx::ldmatrix_x4(a[mt], sP + (mt * 16 + r8 + 8 * (tile & 1u)) * kPPitch + kk * 16 + 8 * (tile >> 1));
#pragma unroll
                for (u32 dp = 0; dp < kOTiles / 2; ++dp) {
                    u32 bq[4];
                    ptx::ldmatrix_x4_trans(bq, kt + (kk * 16 + r8 + 8 * (tile & 1u)) * kPitch + c0 + dp * 16 + 8 * (tile >> 1));
                    const u32 b0[2] = {bq[0], bq[1]}, b1[2] = {bq[2], bq[3]};
#pragma unroll
                    for (u32 mt = 0; mt < kMTiles; ++mt) {
                        ptx::mma_16816<scalar_t>(o[mt][2 * dp], a[mt], b0);
                        ptx::mma_16816<scalar_t>(o[mt][2 * dp + 1], a[mt], b1);
                    }
                }
            }
        };
        tc::run_tiles<kN>(st, tables + (u64)seq * table_width, lo, hi, page_size, num_pages, issue, compute);
    });

    // ---- normalize and write: every warp its value columns of all rows ----
    const bool split = splits > 1;
#pragma unroll
    for (u32 mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            const u32 r = mt * 16 + g + 8 * h, slot = r / ht, hl = r - slot * ht;
            if (!(slot < qt && q0 + slot < q_end && hl < heads)) continue;
            const u64 row = (q0 + slot) * q_heads + head0 + hl;
            const u64 row_out = split ? (u64)blockIdx.z * queries * q_heads + row : row;
            const float l = lsum[mt][h];
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
            for (u32 n = 0; n < kOTiles; ++n)
                tc::store_pair(out, part_out, row_out * kR + c0 + n * 8 + 2 * tq, split, o[mt][n][2 * h] * inv,
                               o[mt][n][2 * h + 1] * inv);
            if (warp == 0 && tq == 0) {
                const float lse_v = l > 0.0f ? mo[mt][h] * tc::kLn2 + logf(l) : neg_inf();
                if (split) part_lse[row_out] = lse_v;
                else if (write_lse) lse[row] = lse_v;
            }
        }
}
#endif  // TC_MLA

#else
// ===================================================================== CUDA cores
namespace att {

constexpr u32 kWarps = 4;
constexpr u32 kThreads = 32 * kWarps;
constexpr u32 kVec = VEC_LOADS ? 16u / (u32)sizeof(scalar_t) : 1u;   // elements per chunk
constexpr u32 kCap = HEAD_DIM ? HEAD_DIM : DIM_CAP;   // largest D / Dv of the variant
constexpr u32 kRowChunks = kCap / kVec;               // chunks in a row of kCap elements
constexpr u32 kLanes = kRowChunks < 32 ? kRowChunks : 32;   // lanes per row (LANES)
constexpr u32 kChunks = kRowChunks / kLanes;          // chunks per lane (CHUNKS)
constexpr u32 kElems = kChunks * kVec;                // elements of a row per lane
constexpr u32 kRows = 32 / kLanes;                    // rows a warp holds at once (ROWS)
constexpr u32 kHeads = GROUP_TILE;
constexpr u32 kRegsPerChunk = VEC_LOADS ? 4u : 1u;
constexpr u32 kRotCap = ROT_CAP;
constexpr u32 kRotElems = kRotCap ? (kRotCap + kLanes - 1) / kLanes : 1u;   // rotary elems per lane
// Rows per lane per step (STEP_U): about 32 load registers per lane (K, and V
// or the rotary part), at most 16 scores (rows x heads), at most 4 rows.
constexpr u32 kLoadRegsPerRow = kChunks * kRegsPerChunk * (kRotCap ? 1u : 2u) + (kRotCap ? kRotElems : 0u);
constexpr u32 kStepLoads = 32u / kLoadRegsPerRow;
constexpr u32 kStepScores = 16u / kHeads;
constexpr u32 kStepRaw = kStepLoads < kStepScores ? kStepLoads : kStepScores;
constexpr u32 kU = kStepRaw < 1u ? 1u : (kStepRaw > 4u ? 4u : kStepRaw);
constexpr u32 kStep = kWarps * kRows * kU;            // tokens per block step
static_assert(kCap >= 64 && kCap <= 1024 && (kCap & (kCap - 1)) == 0, "dim capacity: power of two in 64..1024");
static_assert(kRowChunks * kVec == kCap && kLanes * kChunks == kRowChunks, "row chunking");
static_assert(32 % kLanes == 0, "lanes per row divide a warp");
static_assert(kHeads >= 1 && kHeads <= 8, "GROUP_TILE in 1..8");
static_assert(kStep <= kSplitTile * 8, "block step");

#if VEC_LOADS
typedef uint4 chunk_t;
#else
typedef scalar_t chunk_t;
#endif

__device__ __forceinline__ chunk_t zero_chunk() {
#if VEC_LOADS
    uint4 z;
    z.x = z.y = z.z = z.w = 0u;
    return z;
#else
    return from_float<scalar_t>(0.0f);
#endif
}

// The kVec elements of a chunk as floats.
__device__ __forceinline__ void unpack(const chunk_t& c, float* f) {
    const scalar_t* e = reinterpret_cast<const scalar_t*>(&c);
#pragma unroll
    for (u32 i = 0; i < kVec; ++i) f[i] = to_float(e[i]);
}

__device__ __forceinline__ chunk_t pack(const float* f) {
    chunk_t c;
    scalar_t* e = reinterpret_cast<scalar_t*>(&c);
#pragma unroll
    for (u32 i = 0; i < kVec; ++i) e[i] = from_float<scalar_t>(f[i]);
    return c;
}


}  // namespace att

// q        [queries, Hq, D]            scalar_t
// k_cache  [pages, page_size, Hkv, D]  scalar_t
// v_cache  [pages, page_size, Hkv, Dv] scalar_t (the K cache itself when ROT_CAP)
// q_rot    [queries, Hq, P], k_rot [pages, page_size, 1, P] (read only when ROT_CAP)
// words    plan metadata (docs/layout.md); lengths, positions, page ids
// queries  the plan's; q_begin, q_count: this launch's range of them
// out      [queries, Hq, Dv] scalar_t, lse [queries, Hq] f32 (when write_lse)   (splits == 1)
// part_out [splits, queries, Hq, Dv] f32, part_lse [splits, queries, Hq] f32     (splits > 1)
// Sizes are the plan's static ones; nothing in `words` is trusted for memory
// safety (see the layout document).
// __launch_bounds__(128, 1): with (128) alone ptxas spills a few bytes in
// some runtime-dim variants at 64-72 registers; (128, 1) lets it use what it
// needs (every variant stays under 255 registers without a spill).
extern "C" __global__ void __launch_bounds__(128, 1)
paged_attention(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k_cache,
                const scalar_t* __restrict__ v_cache, const scalar_t* __restrict__ q_rot,
                const scalar_t* __restrict__ k_rot, const u32* __restrict__ words,
                scalar_t* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_out,
                float* __restrict__ part_lse, u32 queries, u32 q_begin, u32 q_count,
                u32 sequences, u32 table_width, u32 page_size, u32 num_pages, u32 q_heads, u32 kv_heads,
                u32 head_dim, u32 value_dim, u32 rot_dim, u32 splits, u32 causal, u32 write_lse, float scale) {
    using namespace att;
    __shared__ float s_m[kWarps][kHeads];
    __shared__ float s_l[kWarps][kHeads];
    __shared__ __align__(16) float s_acc[kWarps][kHeads][kCap];

    const u32 D = HEAD_DIM ? HEAD_DIM : head_dim;
    const u32 Dv = HEAD_DIM ? HEAD_DIM : value_dim;
    // Query q_begin + blockIdx.x of the launch's range [q_begin, q_begin +
    // q_count), clamped to the plan's queries (a sum that wraps 32 bits is
    // below q_begin). The whole block leaves before any barrier. (Checked
    // in 32 bits: a 64-bit index costs up to 10 registers in some variants.)
    const u32 qi = q_begin + blockIdx.x;
    if (blockIdx.x >= q_count || qi >= queries || qi < q_begin) return;
    const u32 group = q_heads / kv_heads;
    const u32 tiles = (group + kHeads - 1) / kHeads;
    const u32 kvh = blockIdx.y / tiles;
    const u32 head0 = kvh * group + (blockIdx.y - kvh * tiles) * kHeads;   // first query head of the tile
    const u32 heads = min_u32(kHeads, (kvh + 1) * group - head0);       // real heads in the tile
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const u32 row = lane / kLanes, x = lane % kLanes;

    // ---- visible positions of this query and this split's share ----
    // Word offsets from the plan's static sizes (plan_words.cuh; the offsets
    // stored in words 6..10 are not trusted).
    const u32 seq = words[pw::q_seq(queries) + qi];
    u32 len = 0;
    const u32* table = words;   // this sequence's page-table row (valid when len > 0)
    if (seq < sequences) {
        u64 L = words[pw::kv_len(queries) + seq];
        const u64 cap = (u64)table_width * page_size;
        if (L > cap) L = cap;
        if (causal) {
            const u64 p1 = (u64)words[pw::q_pos(queries) + qi] + 1;
            if (L > p1) L = p1;
        }
        len = (u32)(L < kMaxLen ? L : kMaxLen);
        table = words + pw::page_table(queries, sequences) + (u64)seq * table_width;
    }
    u32 start = 0, end = len;
    if (splits > 1) {
        u32 c = (len + splits - 1) / splits;
        c = (c + kSplitTile - 1) / kSplitTile * kSplitTile;
        const u64 s0 = (u64)blockIdx.z * c;
        start = s0 < len ? (u32)s0 : len;
        end = min_u32(len, start + c);
    }

    // ---- this lane's slice of q for each head, pre-scaled into the log2 domain ----
    const float qscale = scale * 1.4426950408889634f;
    float qf[kHeads][kElems];
#pragma unroll
    for (u32 g = 0; g < kHeads; ++g) {
        const scalar_t* qrow = q + ((u64)qi * q_heads + head0 + g) * D;
#pragma unroll
        for (u32 c = 0; c < kChunks; ++c) {
            const u32 e = (x + c * kLanes) * kVec;
            chunk_t ch = zero_chunk();
            if (g < heads && (HEAD_DIM || e < D)) ch = *reinterpret_cast<const chunk_t*>(qrow + e);
            unpack(ch, &qf[g][c * kVec]);
#pragma unroll
            for (u32 i = 0; i < kVec; ++i) qf[g][c * kVec + i] *= qscale;
        }
    }
#if ROT_CAP
    float qr[kHeads][kRotElems];
#pragma unroll
    for (u32 g = 0; g < kHeads; ++g)
#pragma unroll
        for (u32 i = 0; i < kRotElems; ++i) {
            const u32 e = x + i * kLanes;
            qr[g][i] = (g < heads && e < rot_dim)
                           ? to_float(q_rot[((u64)qi * q_heads + head0 + g) * rot_dim + e]) * qscale
                           : 0.0f;
        }
#endif

    // ---- online softmax over this split's tokens ----
    float m[kHeads], l[kHeads], acc[kHeads][kElems];
#pragma unroll
    for (u32 g = 0; g < kHeads; ++g) {
        m[g] = neg_inf();
        l[g] = 0.0f;
#pragma unroll
        for (u32 i = 0; i < kElems; ++i) acc[g][i] = 0.0f;
    }

    const u32 k_page = page_size * kv_heads * D;        // elements per page (fits u32: checked on the host)
    const u32 v_page = page_size * kv_heads * Dv;
    const u32 my_row = warp * (kRows * kU) + row;
    // Page id and slot of this lane's rows of the step at `base`; a token past
    // the split's end or on a page id >= num_pages gets page 0xffffffff.
    u32 pg[kU], sl[kU];
    auto locate = [&](u32 base) {
#pragma unroll
        for (u32 u = 0; u < kU; ++u) {
            const u32 t = base + my_row + u * kRows;
            pg[u] = 0xffffffffu;
            sl[u] = 0;
            if (t < end) {
                const u32 j = t / page_size;
                const u32 page = table[j];
                pg[u] = page < num_pages ? page : 0xffffffffu;
                sl[u] = t - j * page_size;
            }
        }
    };
    locate(start);
    for (u32 base = start; base < end; base += kStep) {
        chunk_t kc[kU][kChunks];
#if !ROT_CAP
        chunk_t vc[kU][kChunks];
#else
        float kr[kU][kRotElems];
#endif
        bool ok[kU];
#pragma unroll
        for (u32 u = 0; u < kU; ++u) {
            const u32 page = pg[u], slot = sl[u];
            ok[u] = page != 0xffffffffu;
            const scalar_t* krow = k_cache + (u64)page * k_page + (slot * kv_heads + kvh) * D;
#pragma unroll
            for (u32 c = 0; c < kChunks; ++c) {
                const u32 e = (x + c * kLanes) * kVec;
                kc[u][c] = (ok[u] && (HEAD_DIM || e < D)) ? *reinterpret_cast<const chunk_t*>(krow + e)
                                                           : zero_chunk();
            }
#if !ROT_CAP
            const scalar_t* vrow = v_cache + (u64)page * v_page + (slot * kv_heads + kvh) * Dv;
#pragma unroll
            for (u32 c = 0; c < kChunks; ++c) {
                const u32 e = (x + c * kLanes) * kVec;
                vc[u][c] = (ok[u] && (HEAD_DIM || e < Dv)) ? *reinterpret_cast<const chunk_t*>(vrow + e)
                                                            : zero_chunk();
            }
#else
            const scalar_t* rrow = k_rot + (u64)page * (page_size * rot_dim) + slot * rot_dim;
#pragma unroll
            for (u32 i = 0; i < kRotElems; ++i) {
                const u32 e = x + i * kLanes;
                kr[u][i] = (ok[u] && e < rot_dim) ? to_float(rrow[e]) : 0.0f;
            }
#endif
        }
        locate(base + kStep);   // next step's page ids load while this step's rows are in flight

        // Scores: this lane's partial dot products, then the sum over the row's lanes.
        float s[kU][kHeads];
#pragma unroll
        for (u32 u = 0; u < kU; ++u) {
            float kf[kElems];
#pragma unroll
            for (u32 c = 0; c < kChunks; ++c) unpack(kc[u][c], &kf[c * kVec]);
#pragma unroll
            for (u32 g = 0; g < kHeads; ++g) {
                float d = 0.0f;
#pragma unroll
                for (u32 i = 0; i < kElems; ++i) d = fmaf(qf[g][i], kf[i], d);
#if ROT_CAP
#pragma unroll
                for (u32 i = 0; i < kRotElems; ++i) d = fmaf(qr[g][i], kr[u][i], d);
#endif
                s[u][g] = d;
            }
        }
#pragma unroll
        for (u32 o = kLanes / 2; o > 0; o >>= 1)
#pragma unroll
            for (u32 u = 0; u < kU; ++u)
#pragma unroll
                for (u32 g = 0; g < kHeads; ++g) s[u][g] += __shfl_xor_sync(CP_FULL_MASK, s[u][g], o);

        // Values of the step's rows (zeros for skipped tokens).
        float vf[kU][kElems];
#pragma unroll
        for (u32 u = 0; u < kU; ++u)
#pragma unroll
            for (u32 c = 0; c < kChunks; ++c) {
#if ROT_CAP
                unpack(kc[u][c], &vf[u][c * kVec]);
#else
                unpack(vc[u][c], &vf[u][c * kVec]);
#endif
            }

#pragma unroll
        for (u32 g = 0; g < kHeads; ++g) {
            float mx = m[g];
#pragma unroll
            for (u32 u = 0; u < kU; ++u) {
                if (!ok[u]) s[u][g] = neg_inf();
                mx = fmaxf(mx, s[u][g]);
            }
            if (mx == neg_inf()) continue;   // nothing visible yet in this row group
            const float alpha = rescale(m[g], mx);
            float p[kU], psum = 0.0f;
#pragma unroll
            for (u32 u = 0; u < kU; ++u) {
                p[u] = ok[u] ? exp2f(s[u][g] - mx) : 0.0f;
                psum += p[u];
            }
            m[g] = mx;
            l[g] = l[g] * alpha + psum;
#pragma unroll
            for (u32 i = 0; i < kElems; ++i) {
                float a = acc[g][i] * alpha;
#pragma unroll
                for (u32 u = 0; u < kU; ++u) a = fmaf(p[u], vf[u][i], a);
                acc[g][i] = a;
            }
        }
    }

    // ---- merge the row groups of each warp (shuffles), then the warps (shared memory) ----
#pragma unroll
    for (u32 o = kLanes; o < 32; o <<= 1) {
#pragma unroll
        for (u32 g = 0; g < kHeads; ++g) {
            const float mo = __shfl_xor_sync(CP_FULL_MASK, m[g], o);
            const float lo = __shfl_xor_sync(CP_FULL_MASK, l[g], o);
            const float mn = fmaxf(m[g], mo);
            const float a = rescale(m[g], mn), b = rescale(mo, mn);
            l[g] = l[g] * a + lo * b;
            m[g] = mn;
#pragma unroll
            for (u32 i = 0; i < kElems; ++i) {
                const float other = __shfl_xor_sync(CP_FULL_MASK, acc[g][i], o);
                acc[g][i] = acc[g][i] * a + other * b;
            }
        }
    }
    if (row == 0) {
#pragma unroll
        for (u32 g = 0; g < kHeads; ++g) {
            if (x == 0) {
                s_m[warp][g] = m[g];
                s_l[warp][g] = l[g];
            }
#pragma unroll
            for (u32 c = 0; c < kChunks; ++c)
#pragma unroll
                for (u32 i = 0; i < kVec; ++i)
                    s_acc[warp][g][(x + c * kLanes) * kVec + i] = acc[g][c * kVec + i];
        }
    }
    __syncthreads();

    const bool split = splits > 1;
    for (u32 idx = threadIdx.x; idx < kHeads * kRowChunks; idx += kThreads) {
        const u32 g = idx / kRowChunks, chunk = idx - g * kRowChunks;
        const u32 e0 = chunk * kVec;
        if (g >= heads || (!HEAD_DIM && e0 >= Dv)) continue;
        float mx = neg_inf();
#pragma unroll
        for (u32 w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w][g]);
        float wt[kWarps], total = 0.0f;
#pragma unroll
        for (u32 w = 0; w < kWarps; ++w) {
            wt[w] = rescale(s_m[w][g], mx);
            total += s_l[w][g] * wt[w];
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        float o[kVec];
#pragma unroll
        for (u32 i = 0; i < kVec; ++i) {
            float a = 0.0f;
#pragma unroll
            for (u32 w = 0; w < kWarps; ++w) a = fmaf(s_acc[w][g][e0 + i], wt[w], a);
            o[i] = a * inv;
        }
        // Natural-log LSE; -inf when the query (or split) sees nothing.
        const float lse_v = total > 0.0f ? mx * 0.6931471805599453f + logf(total) : neg_inf();
        const u32 h = head0 + g;
        if (split) {
            const u64 row_out = ((u64)blockIdx.z * queries + qi) * q_heads + h;
            float* po = part_out + row_out * Dv + e0;
#pragma unroll
            for (u32 i = 0; i < kVec; ++i) po[i] = o[i];
            if (chunk == 0) part_lse[row_out] = lse_v;
        } else {
            const u64 row_out = (u64)qi * q_heads + h;
            *reinterpret_cast<chunk_t*>(out + row_out * Dv + e0) = pack(o);
            if (chunk == 0 && write_lse) lse[row_out] = lse_v;
        }
    }
}

#endif  // TC_PREFILL || TC_MLA

// Split-KV merge: one warp per (query, head), 4 heads per block.
//   grid (queries, ceil(Hq / 4)), block 128.
// part_out [splits, queries, Hq, Dv] f32, part_lse [splits, queries, Hq] f32
//   -> out [queries, Hq, Dv] scalar_t, lse [queries, Hq] f32 (when write_lse).
// lse = log(sum_z exp(lse_z)), out = sum_z exp(lse_z - lse) * out_z; a split
// with lse -inf adds nothing; all empty gives out 0, lse -inf.
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
    const float log2e = 1.4426950408889634f;

    float mx = neg_inf();
    for (u32 z = lane; z < nsplit; z += 32) mx = fmaxf(mx, part_lse[z * stride + rowi] * log2e);
    mx = warp_max(mx);
    float total = 0.0f;
    for (u32 z = lane; z < nsplit; z += 32) {
        const float w = att::rescale(part_lse[z * stride + rowi] * log2e, mx);
        s_w[warp][z] = w;
        total += w;
    }
    total = warp_sum(total);
    __syncwarp();
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (u32 e = lane; e < value_dim; e += 32) {
        float a = 0.0f;
        for (u32 z = 0; z < nsplit; ++z) {
            const float w = s_w[warp][z];
            if (w != 0.0f) a = fmaf(w, part_out[(z * stride + rowi) * value_dim + e], a);
        }
        out[rowi * value_dim + e] = from_float<scalar_t>(a * inv);
    }
    if (lane == 0 && write_lse) lse[rowi] = total > 0.0f ? mx * 0.6931471805599453f + logf(total) : neg_inf();
}
