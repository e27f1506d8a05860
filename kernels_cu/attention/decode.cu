// decode.cu: paged_attention, the CUDA-core attention kernel: decode, and the
// fallback for every shape the tensor-core kernels (decode_tc.cu,
// prefill_tc.cu, mla_tc.cu, mla_wgmma.cu, mla_seesaw.cu) do not take. The split merge is its own module (merge.cu). Layout, positions,
// metadata words, LSE and the split workspace are defined in docs/layout.md;
// this file follows it. The argument is one AttentionParams (params.cuh).
//
// A launch covers the packed queries [q_begin, q_begin + q_count) of the
// plan (clamped to the plan's queries). A step whose sequences suit
// different kernels runs as up to four launches over contiguous ranges
// (segments, cupaged/ops/attention/schedule.py tc_segments); every launch
// indexes q, out, lse and the partials by global query, so the one merge
// after them serves all queries.
//
// paged_attention: one block per (query, KV head, head tile, split).
//   grid  (q_count, kv_heads * head_tiles, splits), block kThreads (kWarps
//   warps: geom::decode, from cupaged/ops/attention/kernels/decode.py);
//   block x serves query q_begin + x.
//   A block serves the query heads g = tile*GROUP_TILE .. +GROUP_TILE-1 of
//   the GQA group of its KV head, so each K/V row it reads is used by every
//   one of those heads (read once per group when the group fits one tile).
//   Each warp owns a slice of the tokens of every block step: its 32 lanes
//   form ROWS row groups of LANES lanes (as many as a row has chunks, at most
//   geom::decode::kRowLanes); a row group holds one K (and V) row,
//   each lane CHUNKS vector chunks of it (16-byte loads when VEC_LOADS). A
//   lane issues STEP_U rows of K and V loads before it uses any, so a block
//   has kThreads * STEP_U * CHUNKS * 2 loads in flight, and loads the next step's
//   page ids while they are in flight. A block's start is one round trip:
//   its q slice, the query's words and the page ids of its first rows (of
//   the share guessed from the plan's longest length, kv_len_hint; the words
//   decide, a wrong guess reloads them) load together. Scores are reduced over
//   the LANES lanes of a row by xor-shuffles (butterfly.cuh); every row group keeps its own
//   online-softmax state (softmax_state.cuh: max and sum in the log2 domain,
//   and an FP32 accumulator of its value slice for each head) and the states
//   are merged at the end: first inside a warp by shuffles, then across warps
//   through shared memory.
//   Tokens are never loaded past the split's end or from a page id
//   >= num_pages; such a token's score is -inf and its value registers hold
//   zeros, so no unused slot (NaN) can reach the output.
//   With splits > 1, split z covers positions [z*c, min(L, (z+1)*c)) with
//   c = ceil(L / splits) rounded up to CP_SPLIT_TILE (span.cuh), and writes
//   FP32 partials (an empty split writes out 0 and lse -inf);
//   attention_split_merge combines them. The rows are written by
//   epilogue.cuh's writer (the sink, the V scale, out and lse or a partial).
//
// K, V and k_rot rows are addressed through the cache strides of
// AttentionParams (page, slot, head; any view whose innermost dim is
// contiguous: HND, halves of a combined KV tensor, MLA column views).
//
// Memory traffic per block: the visible K and V rows of its split,
// L * (D + Dv) * sizeof(kv_t) bytes, read once for its GROUP_TILE heads; q and
// the outputs are small beside them.
//
// Defines (compile-time choices, cupaged/ops/attention/variants.py Variant):
//   CP_DTYPE    f32 | f16 | bf16: scalar_t, the type of q and out.
//   CP_KV_DTYPE the type of the caches, kv_t: CP_DTYPE, or an fp8 format
//               (e4m3 | e5m2, fp8.cuh) under f16 / bf16 q. fp8 codes decode
//               exactly; the scales fold in per block (every block serves
//               one KV head): k_scale into the score scale, v_scale into the
//               output and the split partials (with ROT_CAP: the latent's
//               k_scale into both, k_rot's v_scale into q_rot).
//   CP_SCORE    the score variant (variant.cuh), plain unless a test asks;
//   CP_SOFT_CAP, CP_WINDOW, CP_SINKS, CP_ALIBI: its features (variant.cuh).
//               A window starts the page walk at the window's first
//               position: the pages before it are never read.
//   HEAD_DIM    64 | 128 | 256: fast path with D == Dv == HEAD_DIM; 0 (or
//               absent) for runtime D and Dv up to DIM_CAP.
//   DIM_CAP     64 .. 1024 (power of two): capacity of the runtime-dim path.
//   VEC_LOADS   1: 16-byte loads (D and Dv multiples of 16 bytes, arrays
//               and their strides 16-byte aligned); 0: element loads (any
//               view, e.g. one misaligned by an element).
//   GROUP_TILE  1 .. 8 (the values decode.py GROUP_TILES builds): query heads per block.
//   ROT_CAP     0, or the capacity of the rotary part P (MLA): the score adds
//               q_rot.k_rot and V is the K row itself (the MLA latent cache
//               serves as both).
#ifdef CUPAGED_CPU
// The CPU backend: g++ does not read "#pragma unroll"; unrolling this file's fixed-count loops (the lane's dot
// products, the accumulator updates) ran SmolLM2's batch-8 decode attention 22% faster (same bits: no
// reassociation). Only here: the other kernels gained nothing and compile ~10% slower with it.
#pragma GCC optimize("unroll-loops")
#endif
#include "../common.cuh"
#include "../plan_words.cuh"
#include "../ptx.cuh"
#include "../softmax_state.cuh"
#include "../butterfly.cuh"
#include "params.cuh"
#include "variant.cuh"
#include "span.cuh"
#include "epilogue.cuh"
#include "geometry.cuh"

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

namespace att {

constexpr u32 kWarps = geom::decode::kWarps;
constexpr u32 kThreads = geom::decode::kThreads;
constexpr u32 kMinBlocks = geom::decode::kMinBlocks;  // the __launch_bounds__ minimum
constexpr u32 kVec = VEC_LOADS ? geom::kVectorBytes / (u32)sizeof(kv_t) : 1u;  // elements per chunk (16 bytes of kv_t)
static_assert(kThreads == 32 * kWarps, "whole warps");
static_assert(geom::kVectorBytes == sizeof(uint4), "a 16-byte chunk is one uint4 load");
constexpr u32 kCap = HEAD_DIM ? HEAD_DIM : DIM_CAP;  // largest D / Dv of the variant
constexpr u32 kRowChunks = kCap / kVec;  // chunks in a row of kCap elements
constexpr u32 kLanes =
    kRowChunks < geom::decode::kRowLanes ? kRowChunks : geom::decode::kRowLanes;  // lanes per row (LANES)
constexpr u32 kChunks = kRowChunks / kLanes;  // chunks per lane (CHUNKS)
constexpr u32 kElems = kChunks * kVec;  // elements of a row per lane
constexpr u32 kRows = 32 / kLanes;  // rows a warp holds at once (ROWS)
constexpr u32 kHeads = GROUP_TILE;
constexpr u32 kRegsPerChunk = VEC_LOADS ? 4u : 1u;
constexpr u32 kRotCap = ROT_CAP;
constexpr u32 kRotElems = kRotCap ? (kRotCap + kLanes - 1) / kLanes : 1u;  // rotary elems per lane
// Rows per lane per step (STEP_U): about 32 load registers per lane (K, and V
// or the rotary part), at most 16 scores (rows x heads), at most 4 rows.
constexpr u32 kLoadRegsPerRow = kChunks * kRegsPerChunk * (kRotCap ? 1u : 2u) + (kRotCap ? kRotElems : 0u);
constexpr u32 kStepLoads = 32u / kLoadRegsPerRow;
constexpr u32 kStepScores = 16u / kHeads;
// fp8: a row's decoded values (kElems floats per lane, twice a 16-bit row's
// for one 16-byte chunk) count too: at most 32 per lane for the step.
constexpr u32 kStepDecoded = kKvScaled ? 32u / kElems : 4u;
constexpr u32 kStepMin = kStepLoads < kStepScores ? kStepLoads : kStepScores;
constexpr u32 kStepRaw = kStepMin < kStepDecoded ? kStepMin : kStepDecoded;
constexpr u32 kU = kStepRaw < 1u ? 1u : (kStepRaw > 4u ? 4u : kStepRaw);
constexpr u32 kStep = kWarps * kRows * kU;  // tokens per block step
constexpr u32 kNoPage = CP_NO_PAGE;  // a token not loaded (past the split, bad page id)
static_assert(kCap >= 64 && kCap <= 1024 && (kCap & (kCap - 1)) == 0, "dim capacity: power of two in 64..1024");
static_assert(kRowChunks * kVec == kCap && kLanes * kChunks == kRowChunks, "row chunking");
static_assert(32 % kLanes == 0, "lanes per row divide a warp");
static_assert(kHeads >= 1 && kHeads <= 8, "GROUP_TILE in 1..8");
static_assert(kStep <= kSplitTile * 8, "block step");
// A lane's slice of q lines up with its slice of the K row: one chunk of
// kVec elements for both, so a q (and out) chunk is kQParts 16-byte parts
// (two for 16-bit q over an fp8 cache; epi::store_values writes out's).
static_assert(sizeof(kv_t) == sizeof(scalar_t) || (kKvScaled && sizeof(scalar_t) == 2),
              "q and K/V elements of one size, or 16-bit q over an fp8 cache");
constexpr u32 kQParts = VEC_LOADS ? kVec * (u32)sizeof(scalar_t) / 16u : 1u;

// A chunk of kVec elements: 16 bytes of kv_t (kQParts x 16 bytes of
// scalar_t), or one element with element loads.
#if VEC_LOADS
struct q_chunk_t {
    uint4 part[kQParts];
};
typedef uint4 kv_chunk_t;
#else
typedef scalar_t q_chunk_t;
typedef kv_t kv_chunk_t;
#endif

// A q chunk at p (16-byte aligned with VEC_LOADS).
__device__ __forceinline__ q_chunk_t load_q(const scalar_t* p) {
#if VEC_LOADS
    q_chunk_t c;
#pragma unroll
    for (u32 i = 0; i < kQParts; ++i) c.part[i] = ldv(reinterpret_cast<const uint4*>(p) + i);
    return c;
#else
    return ldv(p);
#endif
}

template <typename C>
__device__ __forceinline__ C zero_chunk() {
#if VEC_LOADS
    C z;
    uint4* w = reinterpret_cast<uint4*>(&z);
#pragma unroll
    for (u32 i = 0; i < (u32)(sizeof(C) / 16); ++i) w[i].x = w[i].y = w[i].z = w[i].w = 0u;
    return z;
#else
    return from_float<C>(0.0f);
#endif
}

// The kVec elements of a q or K/V chunk as floats.
__device__ __forceinline__ void unpack_q(const q_chunk_t& c, float* f) {
    const scalar_t* e = reinterpret_cast<const scalar_t*>(&c);
#pragma unroll
    for (u32 i = 0; i < kVec; ++i) f[i] = to_float(e[i]);
}
__device__ __forceinline__ void unpack_kv(const kv_chunk_t& c, float* f) {
#if VEC_LOADS
    if constexpr (kKvScaled) {  // fp8 codes, two at a time (exact; fp8.cuh)
        const u32* w = reinterpret_cast<const u32*>(&c);
#pragma unroll
        for (u32 i = 0; i < kVec / 2; ++i) {
            const float2 t = fp8::x2_to_float2<kv_t>(w[i / 2] >> (16u * (i & 1u)));
            f[2 * i] = t.x;
            f[2 * i + 1] = t.y;
        }
        return;
    }
#endif
    const kv_t* e = reinterpret_cast<const kv_t*>(&c);
#pragma unroll
    for (u32 i = 0; i < kVec; ++i) f[i] = kv_to_float(e[i]);
}

}  // namespace att

// Reads p.q, p.k_cache, p.v_cache (p.q_rot, p.k_rot when ROT_CAP) and the
// words; writes p.out and p.lse (splits == 1) or the partials (splits > 1).
// __launch_bounds__(kThreads, kMinBlocks), both defined once in
// cupaged/ops/attention/kernels/decode.py (THREADS, MIN_BLOCKS = 2; read here
// through geometry.cuh): with the block size alone ptxas spills a few bytes in
// some runtime-dim variants at 64-72 registers; a minimum of 2 blocks per SM
// caps nothing below the 255 registers a thread may have anyway, so ptxas
// uses what it needs (every variant stays under 255 registers without a
// spill), and two blocks always fit (shared memory: at most 33 KiB a block).
// choose_splits counts on the minimum (variants.RESIDENT_BLOCKS, the spec's
// min_blocks); most variants fit more.
extern "C" __global__ void __launch_bounds__(att::kThreads, att::kMinBlocks) paged_attention(const AttentionParams p) {
    using namespace att;
    CP_ATTENTION_ARRAYS(p);  // the arrays as __restrict__ locals (epilogue.cuh)
    ptx::launch_dependents();  // the split merge, a dependent launch, may start: it waits for this grid
    __shared__ float s_m[kWarps][kHeads];
    __shared__ float s_l[kWarps][kHeads];
    __shared__ __align__(16) float s_acc[kWarps][kHeads][kCap];

    const u32 D = HEAD_DIM ? HEAD_DIM : p.head_dim;
    const u32 Dv = HEAD_DIM ? HEAD_DIM : p.value_dim;
    // Query q_begin + blockIdx.x of the launch's range [q_begin, q_begin +
    // q_count), clamped to the plan's queries (a sum that wraps 32 bits is
    // below q_begin). The whole block leaves before any barrier. (Checked
    // in 32 bits: a 64-bit index costs up to 10 registers in some variants.)
    const u32 qi = p.q_begin + blockIdx.x;
    if (blockIdx.x >= p.q_count || qi >= p.queries || qi < p.q_begin) return;
    const u32 group = p.q_heads / p.kv_heads;
    const u32 tiles = (group + kHeads - 1) / kHeads;
    const u32 kvh = blockIdx.y / tiles;
    const u32 head0 = kvh * group + (blockIdx.y - kvh * tiles) * kHeads;  // first query head of the tile
    const u32 heads = min_u32(kHeads, (kvh + 1) * group - head0);  // real heads in the tile
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const u32 row = lane / kLanes, x = lane % kLanes;

    // ---- this lane's slice of q for each head, pre-scaled into the log2 domain ----
    // (first: its loads and their scaling wait for nothing the words bring)
    const float qscale = p.scale * softmax::kLog2e;
    // fp8: this KV head's dequantization scales (null pointers: 1). K's
    // folds into q, V's into the output; with ROT_CAP the latent (k_scale)
    // is K and V, and k_rot's scale (v_scale) folds into q_rot.
    float k_sc = 1.0f, v_sc = 1.0f;
    if constexpr (kKvScaled) {
        if (p.k_scale) k_sc = p.k_scale[kvh * p.k_scale_stride];
        if (p.v_scale) v_sc = p.v_scale[kvh * p.v_scale_stride];
    }
    float qs = qscale;
    if constexpr (kKvScaled) qs *= k_sc;
    float qf[kHeads][kElems];
#pragma unroll
    for (u32 g = 0; g < kHeads; ++g) {
        const scalar_t* qrow = q + att::q_at(p, qi, head0 + g);
#pragma unroll
        for (u32 c = 0; c < kChunks; ++c) {
            const u32 e = (x + c * kLanes) * kVec;
            q_chunk_t ch = zero_chunk<q_chunk_t>();
            if (g < heads && (HEAD_DIM || e < D)) ch = load_q(qrow + e);
            unpack_q(ch, &qf[g][c * kVec]);
#pragma unroll
            for (u32 i = 0; i < kVec; ++i) qf[g][c * kVec + i] *= qs;
        }
    }
#if ROT_CAP
    const u32 rot_dim = p.rot_dim;
    float qrs = qscale;
    if constexpr (kKvScaled) qrs *= v_sc;
    float qr[kHeads][kRotElems];
#pragma unroll
    for (u32 g = 0; g < kHeads; ++g)
#pragma unroll
        for (u32 i = 0; i < kRotElems; ++i) {
            const u32 e = x + i * kLanes;
            qr[g][i] = (g < heads && e < rot_dim) ? to_float(q_rot[att::q_rot_at(p, qi, head0 + g) + e]) * qrs : 0.0f;
        }
#endif
    // ---- this split's share [start, end) of the positions this query sees, and its first rows' pages ----
    // Word offsets from the plan's static sizes (plan_words.cuh; the offsets
    // stored in words 6..10 are not trusted). As in paged_decode_tc, the share
    // is guessed first (a decode step of the plan's longest length,
    // kv_len_hint, in sequence qi), so its first rows' page words load beside
    // the query's words; the words decide, and a wrong guess reloads them on
    // a path ptx::cold_path marks.
    const u32 num_pages = p.num_pages, page_size = p.page_size;
    const u32 my_row = warp * (kRows * kU) + row;
    // Page id and slot of this lane's rows of the step at `base`: the page
    // words of row `tab` of a table `width` columns wide (0: none) load
    // together (load), and are checked after (check: a token past the split's
    // end or on a page id >= num_pages gets page kNoPage), one round trip for
    // all, where a check beside each load would make it one a row. Each row's
    // page position is found afresh (att::PagePos::at, a division a row):
    // kept and advanced instead, as the tile walks do, the 2 kU words it holds
    // cost more registers than the divisions cost instructions (the gate's
    // variants: +1.5 registers mean, 25 of them past 128).
    u32 pg[kU], sl[kU];
    auto load = [&](u32 base, const u32* tab, u32 width) {
#pragma unroll
        for (u32 u = 0; u < kU; ++u) {
            att::PagePos pos;
            pos.at(base + my_row + u * kRows, page_size);
            pg[u] = pos.pj < width ? tab[pos.pj] : kNoPage;
            sl[u] = pos.psl;
        }
    };
    u32 start = 0, end = 0;
    auto check = [&](u32 base) {
#pragma unroll
        for (u32 u = 0; u < kU; ++u) {
            const bool in = base + my_row + u * kRows < end && pg[u] < num_pages;
            pg[u] = in ? pg[u] : kNoPage;
            sl[u] = in ? sl[u] : 0u;
        }
    };
    const u32 hint = p.kv_len_hint;
    const u32 guess = share(p, hint, [&] { return hint > 0 ? hint - 1u : 0u; }, blockIdx.z).lo;
    load(guess, words + pw::page_table(p.queries, p.sequences) + (u64)qi * p.table_width,
         qi < p.sequences ? p.table_width : 0u);
    const QueryWords qw = query_words(p, qi);  // one round trip for all in a decode step
    const u32 seq = qw.seq;
    const u32* table = words;  // this sequence's page-table row (valid when end > start)
    u32 width = 0;
    if (seq < p.sequences) {
        const Span sp = share(p, qw, blockIdx.z);
        start = sp.lo;
        end = sp.hi;
        table = words + pw::page_table(p.queries, p.sequences) + (u64)seq * p.table_width;
        width = p.table_width;
    }
    if (seq != qi || start != guess) {
        ptx::cold_path();  // a wrong guess: the real share's pages
        load(start, table, width);
    }
    check(start);
    auto locate = [&](u32 base) {
        load(base, table, width);
        check(base);
    };

    // The score's arguments and each head's row (query position, head,
    // ALiBi slope), for a score variant that uses them.
    const variant::Scorer sc(p);
    variant::ScoreRow srow[kHeads];
    if constexpr (!variant::kPlainScore) {
#pragma unroll
        for (u32 g = 0; g < kHeads; ++g) srow[g] = sc.row(qw.pos, head0 + g);
    }

    // ---- online softmax over this split's tokens ----
    softmax::State st[kHeads];
    float acc[kHeads][kElems];
#pragma unroll
    for (u32 g = 0; g < kHeads; ++g) {
        st[g].clear();
#pragma unroll
        for (u32 i = 0; i < kElems; ++i) acc[g][i] = 0.0f;
    }

    // Row addressing: base + page * stride_page + slot * stride_slot (a
    // page's offsets fit u32: checked on the host).
    const kv_t* __restrict__ const k_base = k_cache + (u64)kvh * p.k_stride_head;
    const kv_t* __restrict__ const v_base = v_cache + (u64)kvh * p.v_stride_head;
    const u64 k_page = p.k_stride_page, v_page = p.v_stride_page;
    const u32 k_slot = p.k_stride_slot, v_slot = p.v_stride_slot;
    for (u32 base = start; base < end; base += kStep) {
        kv_chunk_t kc[kU][kChunks];
#if !ROT_CAP
        kv_chunk_t vc[kU][kChunks];
#else
        float kr[kU][kRotElems];
#endif
        bool ok[kU];
#pragma unroll
        for (u32 u = 0; u < kU; ++u) {
            const u32 page = pg[u], slot = sl[u];
            ok[u] = page != kNoPage;
            const kv_t* krow = k_base + (u64)page * k_page + slot * k_slot;
#pragma unroll
            for (u32 c = 0; c < kChunks; ++c) {
                const u32 e = (x + c * kLanes) * kVec;
                kc[u][c] = (ok[u] && (HEAD_DIM || e < D)) ? ldv(reinterpret_cast<const kv_chunk_t*>(krow + e))
                                                          : zero_chunk<kv_chunk_t>();
            }
#if !ROT_CAP
            const kv_t* vrow = v_base + (u64)page * v_page + slot * v_slot;
#pragma unroll
            for (u32 c = 0; c < kChunks; ++c) {
                const u32 e = (x + c * kLanes) * kVec;
                vc[u][c] = (ok[u] && (HEAD_DIM || e < Dv)) ? ldv(reinterpret_cast<const kv_chunk_t*>(vrow + e))
                                                           : zero_chunk<kv_chunk_t>();
            }
#else
            const kv_t* rrow = k_rot + (u64)page * p.rot_stride_page + slot * p.rot_stride_slot;
#pragma unroll
            for (u32 i = 0; i < kRotElems; ++i) {
                const u32 e = x + i * kLanes;
                kr[u][i] = (ok[u] && e < rot_dim) ? kv_to_float(rrow[e]) : 0.0f;
            }
#endif
        }
        locate(base + kStep);  // next step's page ids load while this step's rows are in flight

        // Scores: this lane's partial dot products, then the sum over the row's lanes.
        float s[kU][kHeads];
#pragma unroll
        for (u32 u = 0; u < kU; ++u) {
            float kf[kElems];
#pragma unroll
            for (u32 c = 0; c < kChunks; ++c) unpack_kv(kc[u][c], &kf[c * kVec]);
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
        bfly::sum<kLanes, kU * kHeads>(&s[0][0]);
        if constexpr (!variant::kPlainScore) {
#pragma unroll
            for (u32 u = 0; u < kU; ++u)
#pragma unroll
                for (u32 g = 0; g < kHeads; ++g)
                    s[u][g] = variant::score(sc, srow[g], s[u][g], base + my_row + u * kRows);
        }

        // Values of the step's rows (zeros for skipped tokens).
        float vf[kU][kElems];
#pragma unroll
        for (u32 u = 0; u < kU; ++u)
#pragma unroll
            for (u32 c = 0; c < kChunks; ++c) {
#if ROT_CAP
                unpack_kv(kc[u][c], &vf[u][c * kVec]);
#else
                unpack_kv(vc[u][c], &vf[u][c * kVec]);
#endif
            }

#pragma unroll
        for (u32 g = 0; g < kHeads; ++g) {
            float mx = st[g].m;
#pragma unroll
            for (u32 u = 0; u < kU; ++u) {
                if (!ok[u]) s[u][g] = neg_inf();
                mx = fmaxf(mx, s[u][g]);
            }
            // No skip when mx is -inf: a NaN score (a NaN query, a NaN in a
            // visible K row) is ignored by fmaxf and must still reach the
            // sum, as it does in the reference (issue #12, item 9).
            const float alpha = st[g].move_to(mx);  // 0 while the row group has seen nothing
            const float mu = st[g].offset();  // mx, or 0 while it is -inf
            float p_[kU], psum = 0.0f;
#pragma unroll
            for (u32 u = 0; u < kU; ++u) {
                p_[u] = ok[u] ? exp2f(s[u][g] - mu) : 0.0f;
                psum += p_[u];
            }
            st[g].add(alpha, psum);
#pragma unroll
            for (u32 i = 0; i < kElems; ++i) {
                float a = acc[g][i] * alpha;
#pragma unroll
                for (u32 u = 0; u < kU; ++u) a = fmaf(p_[u], vf[u][i], a);
                acc[g][i] = a;
            }
        }
    }

    // ---- merge the row groups of each warp (shuffles), then the warps (shared memory) ----
    bfly::merge_rows<kLanes>(st, acc);
    if (row == 0) {
#pragma unroll
        for (u32 g = 0; g < kHeads; ++g) {
            if (x == 0) {
                s_m[warp][g] = st[g].m;
                s_l[warp][g] = st[g].l;
            }
#pragma unroll
            for (u32 c = 0; c < kChunks; ++c)
#pragma unroll
                for (u32 i = 0; i < kVec; ++i) s_acc[warp][g][(x + c * kLanes) * kVec + i] = acc[g][c * kVec + i];
        }
    }
    __syncthreads();

    const bool split = p.splits > 1;
    for (u32 idx = threadIdx.x; idx < kHeads * kRowChunks; idx += kThreads) {
        const u32 g = idx / kRowChunks, chunk = idx - g * kRowChunks;
        const u32 e0 = chunk * kVec;
        if (g >= heads || (!HEAD_DIM && e0 >= Dv)) continue;
        // The warps' states as one: weights exp2(m_w - m), sum of l_w times them.
        float mx = neg_inf();
#pragma unroll
        for (u32 w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w][g]);
        float wt[kWarps], total = 0.0f;
#pragma unroll
        for (u32 w = 0; w < kWarps; ++w) {
            wt[w] = softmax::rescale(s_m[w][g], mx);
            total += s_l[w][g] * wt[w];
        }
        softmax::State all = softmax::make_state(mx, total);
        const u32 h = head0 + g;
        // The head's sink (not in a split partial) and V's scale (the latent's with ROT_CAP).
        const float inv = epi::finish(all, sc, h, split, ROT_CAP ? k_sc : v_sc);
        float o[kVec];
#pragma unroll
        for (u32 i = 0; i < kVec; ++i) {
            float a = 0.0f;
#pragma unroll
            for (u32 w = 0; w < kWarps; ++w) a = fmaf(s_acc[w][g][e0 + i], wt[w], a);
            o[i] = a;
        }
        const epi::Row r = epi::row_of(p, (u64)qi * p.q_heads + h, split);
        epi::store_values(out, part_out, r.dst * Dv + e0, split, o, inv);
        // natural log; -inf when the query (or split) sees nothing
        if (chunk == 0) epi::store_lse(lse, part_lse, p.write_lse, r, split, all.lse());
    }
}
