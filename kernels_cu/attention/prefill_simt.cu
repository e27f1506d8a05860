// prefill_simt.cu: paged_prefill_simt, chunked-prefill attention on CUDA
// cores for f32 (the split merge: merge.cu). Layout, positions, metadata
// words, LSE and the split workspace: docs/layout.md. The argument is one
// AttentionParams (params.cuh); the block's rows, the K/V tile ring and the
// passes are the tensor-core prefill's (tc_common.cuh), the rows are written
// by epilogue.cuh's writer.
//
// paged_prefill_simt: f32 q, out and caches, D == Dv == HEAD_DIM, any cache
//   views with 16-byte aligned rows (K and V rows at page * stride_page +
//   slot * stride_slot + head * stride_head, strides from AttentionParams).
//   grid (ceil(q_count / qt), kv_heads * head_tiles, splits), block kThreads
//   (geom::prefill_simt, from cupaged/ops/attention/kernels/prefill_simt.py),
//   dynamic shared memory prefill_simt.smem_bytes.
//   Rows (kRows = geom::kTcRows per block) are (query, head) pairs as in
//   paged_prefill_tc: ht = min(G, kRows) query heads of one KV head's GQA
//   group for each of qt = kRows / ht consecutive packed queries (blocks tile
//   the launch's range from q_begin, the last first), so a K/V row read
//   serves qt * ht rows.
//   Row group rg (kRows / kRowTile of them) is rows kRowTile rg .. + kRowTile
//   - 1, held by kLanes consecutive lanes of one warp (lane c of the group:
//   thread kLanes rg + c). Each thread owns, for its group's rows, the
//   scores of tokens c + kLanes j (j < kTokTile) of a tile (a register
//   micro-tile, kRowTile x kTokTile) and the outputs of dims 4 c + 4 kLanes
//   e .. + 3 (e < kDimChunks; a kRowTile x 4 kDimChunks micro-tile): no
//   lane computes another lane's scores, exponentials or outputs.
//   Q is staged once, transposed (Q^T [D][kRows], scaled into the log2
//   domain as paged_attention does), so a thread's rows at one d are one
//   16-byte load; K and V tiles of kN tokens come page by page through the
//   cp.async ring of kStages buffers (tc::run_ring: one block barrier a
//   tile). Per tile and row group: S = Q K^T accumulates over d with fmaf in
//   order (d = 0 .. D - 1); the score hook and the mask; the row maxima over
//   the group's lanes in one collective (tc::max_lanes); each thread takes
//   exp2f of its own scores only and keeps its part of each row sum
//   (softmax_state.cuh, log2 domain); P [kN][kRows] and the rows' rescale
//   factors (computed by lane 0 of the group) go to shared memory, the
//   group meets (__syncwarp of its lanes), and O += P V runs from shared
//   memory on each thread's output micro-tile. A group whose rows see none
//   of a tile skips it whole. At the end the lanes' row sums are summed
//   (bfly::sum, one collective) and each thread writes its outputs (the
//   sink, out and lse, or a split partial).
//   Each row sees positions [lo, hi) of its query (the visibility hook and
//   the split share, span.cuh). Positions past the pass's end and page ids
//   >= num_pages are zero-filled (never read) and masked. A valid token a
//   row cannot see (past its causal position, outside its window or split
//   share, another sequence's row) has P = 0 and its value row never enters
//   a row's accumulator (a group whose stored rows miss a valid token of the
//   tile selects, row by row and token by token, between the accumulator and
//   its update), so Inf / NaN there never reach the output.
//
// Memory traffic: K/V are read once per block instead of once per query, about
// ceil(q_len * G / kRows) * L * (D + Dv) * 4 bytes per sequence and KV head;
// q and the outputs once.
//
// Defines (cupaged/ops/attention/variants.py Variant):
//   CP_DTYPE, CP_KV_DTYPE  f32: q, out and the caches
//   CP_SCORE               the score variant (variant.cuh)
//   CP_SOFT_CAP, CP_WINDOW, CP_SINKS, CP_ALIBI  its features (variant.cuh). With a window the rows of
//                          a block see different ranges: a pass reads [min lo, max hi) of its rows
//                          (pages wholly before every row's window are never read) and masks per row
//   HEAD_DIM               64 | 128: D == Dv
#include "../common.cuh"
#include "../plan_words.cuh"
#include "../ptx.cuh"
#include "../softmax_state.cuh"
#include "../butterfly.cuh"
#include "../vec4.cuh"
#include "params.cuh"
#include "variant.cuh"
#include "span.cuh"
#include "tc_common.cuh"
#include "epilogue.cuh"
#include "geometry.cuh"

// The micro-tiles' loops unrolled by either compiler: g++ (the CPU backend) ignores #pragma unroll,
// and its rolled loops would keep the tiles in memory rather than registers and vector lanes.
#define SIMT_PRAGMA(x) _Pragma(#x)
#ifdef CUPAGED_CPU
#define SIMT_UNROLL SIMT_PRAGMA(GCC unroll 16)
#define SIMT_UNROLL_4 SIMT_PRAGMA(GCC unroll 4)
#define SIMT_UNROLL_NONE SIMT_PRAGMA(GCC unroll 1)
#else
#define SIMT_UNROLL SIMT_PRAGMA(unroll)
#define SIMT_UNROLL_4 SIMT_PRAGMA(unroll 4)
#define SIMT_UNROLL_NONE SIMT_PRAGMA(unroll 1)
#endif

namespace simt {
constexpr u32 kD = HEAD_DIM;
constexpr u32 kThreads = geom::prefill_simt::kThreads;
constexpr u32 kRows = geom::kTcRows;  // (query, head) rows per block
constexpr u32 kRowTile = geom::prefill_simt::kRowTile;  // rows of a thread's micro-tiles
constexpr u32 kN = geom::prefill_simt::kN;  // tokens per K/V tile
constexpr u32 kS = geom::prefill_simt::kStages;  // tile buffers
constexpr u32 kPad = geom::prefill_simt::kPad;
constexpr u32 kGroups = kRows / kRowTile;  // row groups
constexpr u32 kLanes = kThreads / kGroups;  // lanes of a row group
constexpr u32 kTokTile = kN / kLanes;  // tokens a lane scores per tile
constexpr u32 kDimChunks = kD / (4 * kLanes);  // 4-float output chunks a lane owns per row
constexpr u32 kPitch = kD + kPad;  // K / V row pitch (floats)
constexpr u32 kRowPitch = kRows + kPad;  // Q^T / P row pitch (floats)
constexpr u32 kCopyChunks = kD * 4 / geom::kVectorBytes;  // 16-byte copies per cache row
constexpr u32 kRowStep = kThreads / kCopyChunks;  // rows one pass of the block's threads copies
static_assert(kD == 64 || kD == 128, "HEAD_DIM: 64 or 128");
static_assert(kRowTile == 4 && kPad % 4 == 0, "a thread's rows at one d are one 16-byte load");
static_assert(kRows % kRowTile == 0 && kThreads % kGroups == 0 && 32 % kLanes == 0, "row groups of whole lanes");
static_assert(kN % kLanes == 0 && kN <= 32, "whole tokens per lane; one valid word per tile");
static_assert(kDimChunks >= 1 && kDimChunks * 4 * kLanes == kD, "whole output chunks per lane");
static_assert(kN % kRowStep == 0, "whole rows per copy pass");
static_assert(sizeof(scalar_t) == 4 && sizeof(kv_t) == 4, "f32 q and caches");
// Shared memory (floats): Q^T [kD][kRowPitch], K [kS][kN][kPitch], V [kS][kN][kPitch], P [kN][kRowPitch].
constexpr u32 kQElems = kD * kRowPitch;
constexpr u32 kKvElems = kS * kN * kPitch;
constexpr u32 kSmemBytes = 4 * (kQElems + 2 * kKvElems + kN * kRowPitch);  // prefill_simt.smem_bytes
}  // namespace simt

extern "C" __global__ void __launch_bounds__(simt::kThreads, geom::prefill_simt::kMinBlocks)
    paged_prefill_simt(const AttentionParams p) {
    CP_ATTENTION_ARRAYS(p);  // the arrays as __restrict__ locals (epilogue.cuh)
    ptx::launch_dependents();  // the split merge, a dependent launch, may start: it waits for this grid
    using namespace simt;
    using tc::kNone;
    CUPAGED_DYNAMIC_SHARED(float, smem);
    float* const sQ = smem;  // Q^T
    float* const sK = sQ + kQElems;
    float* const sV = sK + kKvElems;
    float* const sP = sV + kKvElems;
    __shared__ tc::RowSet<kRows> rows;
    __shared__ tc::Ring<kN, kS> st;
    __shared__ __align__(16) float s_alpha[kRows];  // the rows' rescale factors of the current tile (16-byte loads)

    const u32 tid = threadIdx.x, lane = tid & 31u;
    const u32 rg = tid / kLanes, c = tid - rg * kLanes;  // row group, lane in it
    const u32 row0 = rg * kRowTile;  // the group's first row
    const unsigned gmask = ((kLanes == 32 ? 0u : (1u << kLanes)) - 1u) << (lane - c);  // the group's lanes
    const u32 q_heads = p.q_heads;
    const tc::Place<kRows> place(p);  // this block's heads and queries
    const u32 group = place.group, ht = place.ht, qt = place.qt, kvh = place.kvh;
    const u32 head0 = place.head0, heads = place.heads, q_end = place.q_end;
    const u64 q0 = place.q0;

    // ---- Q^T, scaled into the log2 domain (zero rows for slots without a query or head) ----
    const float qscale = p.scale * softmax::kLog2e;
    for (u32 i = tid, r_at = 0, slot = 0, hl = 0; i < kRows * kD; i += kThreads) {  // r_at = slot * ht + hl
        const u32 r = i / kD, d = i - r * kD;
        for (hl += r - r_at, r_at = r; hl >= ht; hl -= ht) ++slot;  // (slot, hl) follow r without a division
        const bool ok = slot < qt && q0 + slot < q_end && hl < heads;
        sQ[d * kRowPitch + r] = ok ? q[att::q_at(p, q0 + slot, head0 + hl) + d] * qscale : 0.0f;
    }
    tc::setup_row_set(rows, p, q0, qt, q_end);
    const variant::Scorer sc(p);  // a score variant's arguments
    tc::setup_slopes(rows, sc, head0);
    __syncthreads();

    // This thread's rows: query slot, or kNone; their score rows.
    u32 my_slot[kRowTile];
    variant::ScoreRow srow[kRowTile];
    SIMT_UNROLL
    for (u32 i = 0; i < kRowTile; ++i) {
        const u32 r = row0 + i, slot = r / ht, hl = r - slot * ht;
        my_slot[i] = (slot < qt && q0 + slot < q_end && hl < heads) ? slot : kNone;
        if constexpr (!variant::kPlainScore) srow[i] = tc::score_row(rows, my_slot[i], r, ht, head0, qt);
    }

    softmax::State sm[kRowTile];  // m: the row's max (every lane of the group); l: this lane's part of the sum
    v4::V4 o[kRowTile][kDimChunks];  // row i, dims 4 c + 4 kLanes e .. + 3
    SIMT_UNROLL
    for (u32 i = 0; i < kRowTile; ++i) {
        sm[i].clear();
        SIMT_UNROLL
        for (u32 e = 0; e < kDimChunks; ++e) o[i][e] = v4::zero();
    }

    const u32* const tables = words + pw::page_table(p.queries, p.sequences);

    tc::for_each_pass_of(rows, qt, [&](u32 seq, u32 slot_lo, u32 slot_hi, u32 lo, u32 hi) {
        u32 rlo[kRowTile], rhi[kRowTile];  // this thread's rows' positions in this pass
        SIMT_UNROLL
        for (u32 i = 0; i < kRowTile; ++i) {
            const u32 s = my_slot[i];
            const bool in = s != kNone && s >= slot_lo && s < slot_hi;
            rlo[i] = in ? rows.lo[s] : 0u;
            rhi[i] = in ? rows.hi[s] : 0u;
        }
        auto issue = [&](u32 sb, u32 b) {
            // Thread tid copies chunk tid % kCopyChunks of rows tid / kCopyChunks + i * kRowStep.
            SIMT_UNROLL
            for (u32 i = 0; i < kN / kRowStep; ++i) {
                const u32 r = tid / kCopyChunks + i * kRowStep, ch = tid % kCopyChunks;
                const uint2 ps = st.row[sb][r];  // page, slot
                const bool ok = ps.x != kNone;
                const u64 koff =
                    (u64)ps.x * p.k_stride_page + ((u64)ps.y * p.k_stride_slot + (u64)kvh * p.k_stride_head) + ch * 4;
                const u64 voff =
                    (u64)ps.x * p.v_stride_page + ((u64)ps.y * p.v_stride_slot + (u64)kvh * p.v_stride_head) + ch * 4;
                const u32 dst = (b * kN + r) * kPitch + ch * 4;
                ptx::cp_async_16(sK + dst, ok ? k_cache + koff : k_cache, ok);
                ptx::cp_async_16(sV + dst, ok ? v_cache + voff : v_cache, ok);
            }
        };
        auto compute = [&](u32 b, u32 t0) {
            // Bit t of vis[i]: row i sees token t0 + t (its share, and a valid page).
            const u32 vbits = st.valid[b][0];
            u32 vis[kRowTile], seen = 0;
            bool miss = false;  // a stored row misses a valid token of the tile
            SIMT_UNROLL
            for (u32 i = 0; i < kRowTile; ++i) {
                vis[i] = (u32)tc::tile_vis<kN>(vbits, rlo[i], rhi[i], t0);
                seen |= vis[i];
                miss |= my_slot[i] != kNone && vis[i] != vbits;
            }
            if (!seen) return;  // none of the group's rows sees this tile (the group's lanes agree)

            // S = Q K^T: this lane's tokens c + kLanes j x the group's rows (a V4 of 4 rows per token), over d
            // in order: s[j][i] = fmaf(k[j][d], q[d][i], s[j][i]) for d = 0 .. D - 1.
            const float* const kt = sK + b * kN * kPitch;
            float s[kTokTile][kRowTile];
            {
                v4::V4 acc[kTokTile];
                SIMT_UNROLL
                for (u32 j = 0; j < kTokTile; ++j) acc[j] = v4::zero();
                SIMT_UNROLL_4
                for (u32 d4 = 0; d4 < kD / 4; ++d4) {
                    float4 kv[kTokTile];
                    SIMT_UNROLL
                    for (u32 j = 0; j < kTokTile; ++j)
                        kv[j] = *reinterpret_cast<const float4*>(kt + (c + kLanes * j) * kPitch + 4 * d4);
                    SIMT_UNROLL
                    for (u32 dd = 0; dd < 4; ++dd) {
                        const v4::V4 qv = v4::load(sQ + (4 * d4 + dd) * kRowPitch + row0);
                        SIMT_UNROLL
                        for (u32 j = 0; j < kTokTile; ++j) {
                            const float k = dd == 0 ? kv[j].x : dd == 1 ? kv[j].y : dd == 2 ? kv[j].z : kv[j].w;
                            acc[j] = v4::fma(v4::splat(k), qv, acc[j]);
                        }
                    }
                }
                SIMT_UNROLL
                for (u32 j = 0; j < kTokTile; ++j) v4::to(s[j], acc[j]);
            }

            // The score hook and the mask; the rows' maxima over the group's lanes (one collective).
            float mx[kRowTile];
            SIMT_UNROLL
            for (u32 i = 0; i < kRowTile; ++i) {
                mx[i] = neg_inf();
                SIMT_UNROLL
                for (u32 j = 0; j < kTokTile; ++j) {
                    const u32 t = c + kLanes * j;
                    float v = s[j][i];
                    if constexpr (!variant::kPlainScore) v = variant::score(sc, srow[i], v, t0 + t);
                    s[j][i] = ((vis[i] >> t) & 1u) ? v : neg_inf();
                    // fmaxf(mx, s) (mx is never NaN; a NaN score loses): a compare g++ inlines, not a call.
                    mx[i] = s[j][i] > mx[i] ? s[j][i] : mx[i];
                }
            }
            tc::max_lanes<kLanes, kRowTile>(mx, gmask);

            // P = exp2(s - m) of this lane's scores, its part of the row sums; lane 0 of the group
            // computes the rows' rescale factors.
            float ps[kRowTile], mu[kRowTile];
            SIMT_UNROLL
            for (u32 i = 0; i < kRowTile; ++i) {
                const float mn = fmaxf(sm[i].m, mx[i]);
                if (c == 0) s_alpha[row0 + i] = softmax::rescale(sm[i].m, mn);
                sm[i].m = mn;
                mu[i] = sm[i].offset();  // exp2(-inf - mu) = 0 for masked scores
                ps[i] = 0.0f;
            }
            const v4::V4 muv = v4::from(mu);
            SIMT_UNROLL
            for (u32 j = 0; j < kTokTile; ++j) {
                v4::to(s[j], v4::exp2(v4::sub(v4::from(s[j]), muv)));  // a token's four rows at once
                SIMT_UNROLL
                for (u32 i = 0; i < kRowTile; ++i) ps[i] += s[j][i];  // each row's sum in token order
            }
            SIMT_UNROLL
            for (u32 j = 0; j < kTokTile; ++j) {
                float4 pv;
                pv.x = s[j][0];
                pv.y = s[j][1];
                pv.z = s[j][2];
                pv.w = s[j][3];
                *reinterpret_cast<float4*>(sP + (c + kLanes * j) * kRowPitch + row0) = pv;
            }
            __syncwarp(gmask);  // the group's P and rescale factors are in shared memory

            const float4 al = *reinterpret_cast<const float4*>(s_alpha + row0);
            const float alpha[kRowTile] = {al.x, al.y, al.z, al.w};
            SIMT_UNROLL
            for (u32 i = 0; i < kRowTile; ++i) {
                sm[i].add(alpha[i], ps[i]);
                const v4::V4 a = v4::splat(alpha[i]);
                SIMT_UNROLL
                for (u32 e = 0; e < kDimChunks; ++e) o[i][e] = v4::mul(o[i][e], a);
            }

            // O += P V: this lane's dims of the group's rows, tokens in order.
            const float* const vt = sV + b * kN * kPitch + 4 * c;
            if (!miss) {
                SIMT_UNROLL_4
                for (u32 t = 0; t < kN; ++t) {
                    const float4 pr = *reinterpret_cast<const float4*>(sP + t * kRowPitch + row0);
                    SIMT_UNROLL
                    for (u32 e = 0; e < kDimChunks; ++e) {
                        const v4::V4 v = v4::load(vt + t * kPitch + 4 * kLanes * e);
                        SIMT_UNROLL
                        for (u32 i = 0; i < kRowTile; ++i) {
                            const float pi = i == 0 ? pr.x : i == 1 ? pr.y : i == 2 ? pr.z : pr.w;
                            o[i][e] = v4::fma(v4::splat(pi), v, o[i][e]);
                        }
                    }
                }
            } else {
                // A row keeps only the tokens it sees: for a masked token the row's accumulator is kept as
                // it was (a select), so its value row (Inf, NaN) never enters, not even times P = 0.
                SIMT_UNROLL_NONE
                for (u32 t = 0; t < kN; ++t) {
                    const float4 pr = *reinterpret_cast<const float4*>(sP + t * kRowPitch + row0);
                    bool sees[kRowTile];
                    SIMT_UNROLL
                    for (u32 i = 0; i < kRowTile; ++i) sees[i] = (vis[i] >> t) & 1u;
                    SIMT_UNROLL
                    for (u32 e = 0; e < kDimChunks; ++e) {
                        const v4::V4 v = v4::load(vt + t * kPitch + 4 * kLanes * e);
                        SIMT_UNROLL
                        for (u32 i = 0; i < kRowTile; ++i) {
                            const float pi = i == 0 ? pr.x : i == 1 ? pr.y : i == 2 ? pr.z : pr.w;
                            o[i][e] = v4::select(sees[i], v4::fma(v4::splat(pi), v, o[i][e]), o[i][e]);
                        }
                    }
                }
            }
        };
        tc::run_ring<kN, kS>(st, tables + (u64)seq * p.table_width, lo, hi, p.page_size, p.num_pages, issue, compute);
    });

    // ---- the row sums over the group's lanes, then normalize and write ----
    // Row groups of a warp part ways in a tile one of them skips: the warp meets again before the
    // full-warp sum (a barrier, not a collective: lanes still in a group's collective are not named).
    __syncthreads();
    float l[kRowTile];
    SIMT_UNROLL
    for (u32 i = 0; i < kRowTile; ++i) l[i] = sm[i].l;
    bfly::sum<kLanes, kRowTile>(l);
    const bool split = p.splits > 1;
    SIMT_UNROLL
    for (u32 i = 0; i < kRowTile; ++i) {
        const u32 slot = my_slot[i];
        if (slot == kNone) continue;
        sm[i].l = l[i];
        const u32 head = head0 + (row0 + i - slot * ht);
        const epi::Row r = epi::row_of(p, (q0 + slot) * q_heads + head, split);
        const float inv = epi::finish(sm[i], sc, head, split, 1.0f);
        SIMT_UNROLL
        for (u32 e = 0; e < kDimChunks; ++e) {
            float oe[4];
            v4::to(oe, o[i][e]);
            epi::store_values<4>(out, part_out, r.dst * kD + 4 * c + 4 * kLanes * e, split, oe, inv);
        }
        if (c == 0) epi::store_lse(lse, part_lse, p.write_lse, r, split, sm[i].lse());
    }
}
