// attention.cu: paged attention for decode and chunked prefill, and the
// split-KV merge. Layout, positions, metadata words, LSE and the split
// workspace are defined in docs/layout.md; this file follows it.
//
// paged_attention: one block per (query, KV head, head tile, split).
//   grid  (queries, kv_heads * head_tiles, splits), block 128 (4 warps).
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
// Defines (compile-time choices, see cupaged/attention.py):
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
#include "common.cuh"

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

constexpr u32 kWarps = 4;
constexpr u32 kThreads = 32 * kWarps;
constexpr u32 kSplitTile = 16;                         // SPLIT_TILE in attention.py
constexpr u32 kMaxLen = 0x7fff0000u;                   // visible lengths are clamped to this
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

__device__ __forceinline__ u32 min_u32(u32 a, u32 b) { return a < b ? a : b; }

// exp2(m - ref) as a rescale factor; 0 for an empty state (m == -inf).
__device__ __forceinline__ float rescale(float m, float ref) {
    return m == neg_inf() ? 0.0f : exp2f(m - ref);
}

}  // namespace att

// q        [queries, Hq, D]            scalar_t
// k_cache  [pages, page_size, Hkv, D]  scalar_t
// v_cache  [pages, page_size, Hkv, Dv] scalar_t (the K cache itself when ROT_CAP)
// q_rot    [queries, Hq, P], k_rot [pages, page_size, 1, P] (read only when ROT_CAP)
// words    plan metadata (docs/layout.md); lengths, positions, page ids
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
                float* __restrict__ part_lse, u32 queries, u32 sequences, u32 table_width, u32 page_size,
                u32 num_pages, u32 q_heads, u32 kv_heads, u32 head_dim, u32 value_dim, u32 rot_dim,
                u32 splits, u32 causal, u32 write_lse, float scale) {
    using namespace att;
    __shared__ float s_m[kWarps][kHeads];
    __shared__ float s_l[kWarps][kHeads];
    __shared__ __align__(16) float s_acc[kWarps][kHeads][kCap];

    const u32 D = HEAD_DIM ? HEAD_DIM : head_dim;
    const u32 Dv = HEAD_DIM ? HEAD_DIM : value_dim;
    const u32 qi = blockIdx.x;
    const u32 group = q_heads / kv_heads;
    const u32 tiles = (group + kHeads - 1) / kHeads;
    const u32 kvh = blockIdx.y / tiles;
    const u32 head0 = kvh * group + (blockIdx.y - kvh * tiles) * kHeads;   // first query head of the tile
    const u32 heads = min_u32(kHeads, (kvh + 1) * group - head0);       // real heads in the tile
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const u32 row = lane / kLanes, x = lane % kLanes;

    // ---- visible positions of this query and this split's share ----
    // Word offsets follow docs/layout.md from the plan's static sizes (the
    // offsets stored in words 6..10 are not trusted): q_seq at 16, q_pos at
    // 16 + Q, kv_len at 16 + 2Q, page_table at 17 + 2Q + 2S.
    const u32 seq = words[16 + qi];
    u32 len = 0;
    const u32* table = words;   // this sequence's page-table row (valid when len > 0)
    if (seq < sequences) {
        u64 L = words[16 + 2 * queries + seq];
        const u64 cap = (u64)table_width * page_size;
        if (L > cap) L = cap;
        if (causal) {
            const u64 p1 = (u64)words[16 + queries + qi] + 1;
            if (L > p1) L = p1;
        }
        len = (u32)(L < kMaxLen ? L : kMaxLen);
        table = words + 17 + 2 * queries + 2 * sequences + seq * table_width;
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
    constexpr u32 kMaxSplits = 64;   // MAX_SPLITS in attention.py
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
