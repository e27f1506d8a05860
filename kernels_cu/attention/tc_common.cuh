// tc_common.cuh: what the row-packed tensor-core attention kernels share
// (paged_prefill_tc in prefill_tc.cu, paged_mla_tc in mla_tc.cu,
// paged_mla_wgmma in mla_wgmma.cu, paged_mla_seesaw in mla_seesaw.cu): the rows of a block, the page-by-page
// K/V tile ring (cp.async), the passes over the sequences a block touches,
// token masks and the P V step that keeps masked Inf / NaN values out (the
// output rows: epilogue.cuh). The inline PTX they use lives in ptx.cuh.
#pragma once
#include "../common.cuh"
#include "../plan_words.cuh"
#include "../ptx.cuh"
#include "params.cuh"
#include "span.cuh"
#include "variant.cuh"
#include "geometry.cuh"

namespace tc {
using att::min_u32;

// (query, head) rows per block of paged_mla_tc / paged_mla_wgmma / paged_mla_seesaw, the M dimension, and the row unit of
// the tensor-core segments: spec.TC_ROWS (cupaged/ops/attention/kernels/spec.py), through geometry.cuh.
constexpr u32 kRows = geom::kTcRows;
static_assert(geom::kVectorBytes == sizeof(uint4), "16-byte copies: ptx::cp_async_16, uint4 loads");
constexpr u32 kNone = CP_NO_PAGE;  // no sequence / no page

// Where a row-packed prefill block (paged_prefill_tc, paged_prefill_wgmma,
// paged_prefill_simt) sits in its launch (schedule.py's Launch.grid): ht =
// min(G, R) query heads head0 .. head0 + heads - 1 of KV head kvh's group of G
// (head tile blockIdx.y % tiles), for each of qt = R / ht consecutive packed
// queries q0 .. q0 + qt - 1 of the launch's range [q_begin, q_end); block x
// serves the last ones first (under a causal mask they see the most).
template <u32 R>
struct Place {
    u32 group, ht, qt, kvh, head0, heads, q_end;
    u64 q0;
    __device__ __forceinline__ explicit Place(const AttentionParams& p) {
        group = p.q_heads / p.kv_heads;
        ht = group < R ? group : R;
        const u32 tiles = (group + ht - 1) / ht;
        qt = R / ht;
        kvh = blockIdx.y / tiles;
        head0 = kvh * group + (blockIdx.y - kvh * tiles) * ht;
        heads = min_u32(ht, (kvh + 1) * group - head0);
        q_end = att::range_end(p.queries, p.q_begin, p.q_count);
        q0 = (u64)p.q_begin + (u64)(gridDim.x - 1 - blockIdx.x) * qt;
    }
};

// Bits a .. e-1 of a tile's token mask (0 <= a, e <= 64; none when e <= a).
__device__ __forceinline__ u64 span_bits(u32 a, u32 e) { return ptx::shl64(~0ull, a) & ~ptx::shl64(~0ull, e); }

// Tokens t0 .. t0 + n - 1 (n <= 64) a row with positions [rlo, rhi) sees, as bits.
__device__ __forceinline__ u64 row_bits(u32 rlo, u32 rhi, u32 t0, u32 n) {
    const u32 a = rlo > t0 ? min_u32(rlo - t0, n) : 0u;
    const u32 e = rhi > t0 ? min_u32(rhi - t0, n) : 0u;
    return span_bits(a, e);
}

// A compile-time flag as a type (a lambda's `auto` argument: `decltype(f)::value`).
template <bool V>
struct Flag {
    static constexpr bool value = V;
};

// A or B by a compile-time condition (no <type_traits> under NVRTC).
template <bool C, typename A, typename B>
struct Pick {
    typedef A type;
};
template <typename A, typename B>
struct Pick<false, A, B> {
    typedef B type;
};

// fp8 caches (kKvScaled): the 16-bit types a K/V tile decodes into. K meets
// Q in one mma, so its codes become scalar_t; V meets P, and its codes
// become f16 whatever q is (exact for every e4m3 / e5m2 code; P in f16 keeps
// more bits than in bf16). 16-bit caches: scalar_t for both.
typedef typename Pick<kKvScaled, __half, scalar_t>::type v16_t;

// Decode rows [r0, r1) of a raw tile of fp8 codes (rows of kD codes, one
// after the other) into 16-bit rows of `pitch` elements of T, exactly: 8
// codes a step (an 8-byte shared load, a 16-byte store), steps i, i + kBy, ...
// for the caller's index i of kBy (a warp's lanes, a block's threads).
template <typename T, u32 kD, u32 kR, u32 kBy>
__device__ __forceinline__ void decode_rows(const unsigned char* raw, T* dst, u32 pitch, u32 i) {
    constexpr u32 kSteps = kR * kD / 8;
    static_assert(kSteps % kBy == 0, "whole decode steps per thread");
    if constexpr (kKvScaled) {  // (16-bit caches never call it; nothing to instantiate for them)
#pragma unroll
        for (u32 j = 0; j < kSteps / kBy; ++j) {
            const u32 c = i + j * kBy;
            const u32 r = c / (kD / 8), e = (c - r * (kD / 8)) * 8;
            const uint2 x = *reinterpret_cast<const uint2*>(raw + r * kD + e);
            uint4 y;
            fp8::x4_to<T, kv_t>(x.x, y.x, y.y);
            fp8::x4_to<T, kv_t>(x.y, y.z, y.w);
            *reinterpret_cast<uint4*>(dst + r * pitch + e) = y;
        }
    }
}

// ---------------------------------------------------------------------------
// Generic pieces (paged_prefill_tc, paged_mla_tc): a block of kR rows, a ring
// of kS K/V tile buffers, and the per-row visibility that keeps a masked
// token's value row out of a row's output even when it is Inf or NaN.

// The rows of a block of kR rows (as Rows above, any row count).
template <u32 kR, bool kKeep>
struct RowPositionsN {
    u32 pos[kR];
    __device__ __forceinline__ u32 position(u32 i) const { return pos[i]; }
    __device__ __forceinline__ void set_position(u32 i, u32 v) { pos[i] = v; }
};
template <u32 kR>
struct RowPositionsN<kR, false> {
    __device__ __forceinline__ u32 position(u32) const { return 0u; }
    __device__ __forceinline__ void set_position(u32, u32) {}
};
// The ALiBi slopes (log2 domain) of a block's heads head0 + i, for a variant
// with CP_ALIBI only (the tensor-core prefill reads them per tile rather than
// hold them in registers).
template <u32 kR, bool kKeep>
struct RowSlopesN {
    float slope[kR];
    __device__ __forceinline__ float slope_of(u32 i) const { return slope[i]; }
    __device__ __forceinline__ void set_slope(u32 i, float v) { slope[i] = v; }
};
template <u32 kR>
struct RowSlopesN<kR, false> {
    __device__ __forceinline__ float slope_of(u32) const { return 0.0f; }
    __device__ __forceinline__ void set_slope(u32, float) {}
};
template <u32 kR>
struct RowSet : RowPositionsN<kR, !variant::kPlainScore>, RowSlopesN<kR, variant::kAlibi> {
    static constexpr u32 kSize = kR;
    u32 seq[kR];  // sequence of the slot's query, kNone when none
    u32 lo[kR];  // this split's share [lo, hi) of the query's visible positions
    u32 hi[kR];
};

// setup_rows for a RowSet: query slots i < qt (threads i < kR).
template <u32 kR>
__device__ __forceinline__ void setup_row_set(RowSet<kR>& R, const AttentionParams& p, u64 q0, u32 qt, u32 q_end) {
    const u32* __restrict__ const words = p.words;
    for (u32 i = threadIdx.x; i < kR; i += blockDim.x) {
        u32 seq = kNone, lo = 0, hi = 0;
        if (i < qt && q0 + i < q_end) {
            const u32 qi = (u32)(q0 + i);
            const u32 s = words[pw::q_seq(p.queries) + qi];
            if (s < p.sequences) {
                seq = s;
                const att::Span sp = att::query_span(p, qi, s, blockIdx.z);
                lo = sp.lo;
                hi = sp.hi;
                if constexpr (!variant::kPlainScore) R.set_position(i, words[pw::q_pos(p.queries) + qi]);
            }
        }
        R.seq[i] = seq;
        R.lo[i] = lo;
        R.hi[i] = hi;
    }
}

// The slopes of heads head0 .. head0 + kR - 1 into R (CP_ALIBI; threads i < kR).
template <u32 kR>
__device__ __forceinline__ void setup_slopes(RowSet<kR>& R, const variant::Scorer& sc, u32 head0) {
    if constexpr (variant::kAlibi)
        for (u32 i = threadIdx.x; i < kR; i += blockDim.x) R.set_slope(i, sc.row(0u, head0 + i).slope);
}

// The score row of block row r, whose query slot is `slot` (kNone, or a slot
// >= qt, for a row without a query: any row, its scores are masked), from
// shared memory: its query's position, head head0 + (r - slot * ht), slope.
template <u32 kR>
__device__ __forceinline__ variant::ScoreRow score_row(const RowSet<kR>& R, u32 slot, u32 r, u32 ht, u32 head0,
                                                       u32 qt) {
    const u32 s = slot < qt ? slot : 0u;
    const u32 hl = r - s * ht;
    variant::ScoreRow x;
    x.q_pos = R.position(s);
    x.head = head0 + hl;
    x.slope = R.slope_of(hl);
    return x;
}

// for_each_pass over a RowSet (same rule as for Rows).
template <u32 kR, typename Pass>
__device__ __forceinline__ void for_each_pass_of(const RowSet<kR>& R, u32 qt, Pass&& pass) {
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

// Page staging of a ring of kS tile buffers of kN tokens: the page id and
// slot of each token of the next tile to issue ({page, slot}: one 8-byte
// load; two staging buffers), and a bit per valid token of each tile buffer.
template <u32 kN, u32 kS>
struct Ring {
    static constexpr u32 kWords = (kN + 31) / 32;
    uint2 row[2][kN];  // .x page id (kNone: no page), .y slot
    u32 valid[kS][kWords];
};

// The tiles of one pass, positions [lo, hi) of one sequence in tiles of kN
// tokens, through kS shared-memory buffers: kS - 1 tiles in flight (cp.async)
// while one computes; one block barrier per tile.
//   issue(sb, buf): start the copies of the tile staged in staging buffer sb
//                   into tile buffer buf (every thread)
//   compute(buf, t0): use the tile of positions t0 .. t0 + kN - 1 in buffer buf
//                   (its valid bits: st.valid[buf])
// Every thread of the block calls this with the same lo, hi. Threads
// tid < kN look up the page of token tid of each tile: the page-table word
// of tile n + 1 is loaded while tile n is staged (two tiles ahead of its
// issue), its page id and slot staged in shared memory for the copies.
// Iteration j: stage tile n = j + kS - 1, wait for tile j, barrier (tile j
// visible; every warp is done with tile j - 1, whose buffer n reuses), issue
// tile n, compute tile j.
//   kToAsyncProxy: wgmma reads the tiles (paged_mla_wgmma): each thread
//                   fences its landed cp.async copies to the async proxy
//                   before the barrier (ptx::fence_proxy_async_shared)
//   on_stage(sb, t, page, slot): optional, called by thread t < kN as it
//                   stages token t of the next tile into staging buffer sb
//                   (page kNone: no row), for a kernel that keeps more per
//                   token (the barrier before issue makes it visible)
struct NoStage {
    __device__ __forceinline__ void operator()(u32, u32, u32, u32) const {}
};
template <u32 kN, u32 kS, bool kToAsyncProxy = false, typename Issue, typename Compute, typename OnStage = NoStage>
__device__ __forceinline__ void run_ring(Ring<kN, kS>& st, const u32* __restrict__ table, u32 lo, u32 hi, u32 page_size,
                                         u32 num_pages, Issue&& issue, Compute&& compute,
                                         OnStage&& on_stage = OnStage()) {
    static_assert(kS >= 2 && kS <= 4, "2 to 4 stages");
    constexpr u32 kWords = Ring<kN, kS>::kWords;
    const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    u32 raw = kNone, slot = 0;  // token tid of a later tile: page-table word (kNone past hi) and slot
    auto fetch = [&](u32 t) {
        raw = kNone;
        slot = 0;
        if (tid < kN && t < hi) {
            const u32 j = t / page_size;
            raw = table[j];
            slot = t - j * page_size;
        }
    };
    auto stage = [&](u32 sb) -> bool {
        const bool ok = raw < num_pages;
        if (tid < kN) {
            uint2 v;
            v.x = ok ? raw : kNone;
            v.y = slot;
            st.row[sb][tid] = v;
            on_stage(sb, tid, v.x, slot);
        }
        return ok;
    };
    // Valid bits of tile buffer b (warps < kWords; tokens tid >= kN never valid).
    auto publish = [&](u32 b, bool ok) {
        if (warp < kWords) {
            const u32 bits = __ballot_sync(CP_FULL_MASK, ok && tid < kN);
            if (lane == 0) st.valid[b][warp] = bits;
        }
    };
    const u32 ntiles = (hi - lo + kN - 1) / kN;
    __syncthreads();  // the previous pass is done with every buffer and the staging arrays
    fetch(lo + tid);
#pragma unroll
    for (u32 i = 0; i + 1 < kS; ++i) {
        const bool ok = stage(i & 1u);
        fetch(lo + (i + 1) * kN + tid);
        __syncthreads();
        if (i < ntiles) {
            publish(i, ok);
            issue(i & 1u, i);
        }
        ptx::cp_async_commit();  // possibly empty: one group per tile
    }
    for (u32 j = 0; j < ntiles; ++j) {
        const u32 n = j + kS - 1;
        const u32 b = j % kS, nb = n % kS;
        const bool ok = stage(n & 1u);
        fetch(lo + (n + 1) * kN + tid);
        ptx::cp_async_wait<kS - 2>();  // tile j has landed (the kS - 2 after it may still be in flight)
        if constexpr (kToAsyncProxy) ptx::fence_proxy_async_shared();
        __syncthreads();
        if (n < ntiles) {
            publish(nb, ok);  // compute(j - 1) read these bits; it is done
            issue(n & 1u, nb);
        }
        ptx::cp_async_commit();
        compute(b, lo + j * kN);
    }
}

// Bits of the tokens t0 .. t0 + kN - 1 of a tile (kN <= 64) that a row with
// positions [rlo, rhi) sees and that are valid (vbits), as a mask of kN bits.
template <u32 kN>
__device__ __forceinline__ u64 tile_vis(u64 vbits, u32 rlo, u32 rhi, u32 t0) {
    return vbits & row_bits(rlo, rhi, t0, kN);
}

// Whether a 16-bit element pair (one u32 of an mma fragment) holds an Inf or
// a NaN: exponent all ones in either half (f16: 5 bits, bf16: 8 bits).
template <typename T>
__device__ __forceinline__ bool nonfinite2(u32 x);
template <>
__device__ __forceinline__ bool nonfinite2<__half>(u32 x) {
    return ((x & 0x7c00u) == 0x7c00u) || ((x & 0x7c000000u) == 0x7c000000u);
}
template <>
__device__ __forceinline__ bool nonfinite2<__nv_bfloat16>(u32 x) {
    return ((x & 0x7f80u) == 0x7f80u) || ((x & 0x7f800000u) == 0x7f800000u);
}

// Element (lo half when hi == 0) of a 16-bit pair as float.
template <typename T>
__device__ __forceinline__ float half_of(u32 x, u32 hi);
template <>
__device__ __forceinline__ float half_of<__half>(u32 x, u32 hi) {
    return __half2float(__ushort_as_half((unsigned short)(hi ? x >> 16 : x & 0xffffu)));
}
template <>
__device__ __forceinline__ float half_of<__nv_bfloat16>(u32 x, u32 hi) {
    return __bfloat162float(__ushort_as_bfloat16((unsigned short)(hi ? x >> 16 : x & 0xffffu)));
}

// Masked tokens contribute exactly nothing to O += P V, also when a value row
// holds Inf or NaN (0 x Inf is NaN in an mma). The product of one k-step (16
// tokens, P as the A fragment a of a 16-row m-tile) with one 16-column slice
// of V (bq from ldmatrix.trans; o0, o1 its two n-tiles) goes through the
// tensor cores unless the k-step is `mixed` (some row of the m-tile that is
// stored misses a valid token of it) and the slice holds a non-finite value;
// then each lane adds p * v itself, for the tokens its rows see only. vis0 /
// vis1: this lane's rows' (g, g + 8) visibility of the 16 tokens (bit u:
// token u of the k-step); vrow: the k-step's first value row in shared memory
// (pitch elements a row), col0: the slice's first column. Every lane of the
// warp calls this with the same mixed.
template <typename T>
__device__ __forceinline__ void pv_step(float (&o0)[4], float (&o1)[4], const u32 (&a)[4], const u32 (&bq)[4],
                                        bool mixed, u32 vis0, u32 vis1, const T* vrow, u32 pitch, u32 col0) {
    const u32 b0[2] = {bq[0], bq[1]}, b1[2] = {bq[2], bq[3]};
    if (mixed) {
        const bool bad = nonfinite2<T>(bq[0]) | nonfinite2<T>(bq[1]) | nonfinite2<T>(bq[2]) | nonfinite2<T>(bq[3]);
        if (__any_sync(CP_FULL_MASK, bad)) {
            const u32 lane = threadIdx.x & 31u, g = lane >> 2, tq = lane & 3u;
#pragma unroll 1
            for (u32 u = 0; u < 16; ++u) {
                ptx::cold_path();
                // P of rows g and g + 8 for token u: a[0] / a[1] (tokens 2t, 2t+1) or a[2] / a[3] (8 + 2t, ...)
                // of lane 4g + (u & 7) / 2.
                const u32 src = 4 * g + ((u & 7u) >> 1);
                const u32 r0 = __shfl_sync(CP_FULL_MASK, u < 8 ? a[0] : a[2], src);
                const u32 r1 = __shfl_sync(CP_FULL_MASK, u < 8 ? a[1] : a[3], src);
                const float p0 = half_of<T>(r0, u & 1u), p1 = half_of<T>(r1, u & 1u);
                const u32 v0 = *reinterpret_cast<const u32*>(vrow + u * pitch + col0 + 2 * tq);
                const u32 v1 = *reinterpret_cast<const u32*>(vrow + u * pitch + col0 + 8 + 2 * tq);
                const bool s0 = (vis0 >> u) & 1u, s1 = (vis1 >> u) & 1u;
                if (s0) {
                    o0[0] += p0 * half_of<T>(v0, 0);
                    o0[1] += p0 * half_of<T>(v0, 1);
                    o1[0] += p0 * half_of<T>(v1, 0);
                    o1[1] += p0 * half_of<T>(v1, 1);
                }
                if (s1) {
                    o0[2] += p1 * half_of<T>(v0, 0);
                    o0[3] += p1 * half_of<T>(v0, 1);
                    o1[2] += p1 * half_of<T>(v1, 0);
                    o1[3] += p1 * half_of<T>(v1, 1);
                }
            }
            return;
        }
    }
    ptx::mma_16816<T>(o0, a, b0);
    ptx::mma_16816<T>(o1, a, b1);
}

// ---------------------------------------------------------------------------
// Row maxima across the lanes sharing a row (paged_prefill_simt): for each
// aligned group of kLanes lanes (a power of two) of the lanes in `mask`,
// every lane's v[i] becomes the group's fmaxf of v[i], for i < N. On the GPU
// an xor butterfly of shuffles (as bfly::sum, butterfly.cuh); on the CPU
// backend one warp collective (the last lane to arrive writes each group's
// maxima into every lane's values) instead of one per shuffle. fmaxf is
// exact, commutative and associative (a NaN loses to any number), so both
// give every lane the same bits. Every lane of `mask` calls it; mask is a
// union of whole groups.
#ifdef CUPAGED_CPU
namespace cpu {
template <u32 kLanes, u32 N>
void max_lanes_warp(void** lanes, unsigned mask, void*) {
    for (u32 g = 0; g < 32; g += kLanes) {
        if (!((mask >> g) & 1u)) continue;
        float m[N];
        for (u32 i = 0; i < N; ++i) m[i] = static_cast<float*>(lanes[g])[i];
        for (u32 l = g + 1; l < g + kLanes; ++l)
            for (u32 i = 0; i < N; ++i) m[i] = fmaxf(m[i], static_cast<float*>(lanes[l])[i]);
        for (u32 l = g; l < g + kLanes; ++l)
            for (u32 i = 0; i < N; ++i) static_cast<float*>(lanes[l])[i] = m[i];
    }
}
}  // namespace cpu
#endif

template <u32 kLanes, u32 N>
__device__ __forceinline__ void max_lanes(float (&v)[N], unsigned mask) {
    static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "lanes: a power of two up to 32");
#ifdef CUPAGED_CPU
    if constexpr (kLanes > 1) cupaged_warp_collective(mask, v, &cpu::max_lanes_warp<kLanes, N>, nullptr);
#else
#pragma unroll
    for (u32 o = kLanes / 2; o > 0; o >>= 1)
#pragma unroll
        for (u32 i = 0; i < N; ++i) v[i] = fmaxf(v[i], __shfl_xor_sync(mask, v[i], o));
#endif
}

// The block of kRows rows of paged_mla_tc.
using Rows = RowSet<kRows>;
template <typename Pass>
__device__ __forceinline__ void for_each_pass(const Rows& R, u32 qt, Pass&& pass) {
    for_each_pass_of(R, qt, static_cast<Pass&&>(pass));
}
__device__ __forceinline__ void setup_rows(Rows& R, const AttentionParams& p, u64 q0, u32 qt, u32 q_end) {
    setup_row_set(R, p, q0, qt, q_end);
}
}  // namespace tc
