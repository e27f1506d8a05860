// append.cu: writing new K/V rows into the paged caches, and copying pages
// for copy-on-write. Layout of caches, positions and metadata words:
// docs/layout.md.
//
// paged_append and write_slots take one AppendParams (append_params.cuh,
// generated from cupaged/ops/append.py). A row is one (token, KV head): D
// contiguous elements (the innermost dim of every array is contiguous); rows
// are found through strides, so the caches may be any such view (HND, one
// half of a combined [pages, 2, page_size, Hkv, D] tensor, the latent or
// rotary columns of a 576-wide MLA cache) and the new rows too (slices of a
// fused qkv projection).
//
// Builds (write_slots: the first two; paged_append: all three):
//   * a copy (CP_VEC_BYTES = 16, 8, 4, 2 or 1, the copy unit): the cache has
//     the new rows' dtype and rows are copied bit for bit whatever it is (NaN
//     payloads and -0.0 included), so one variant serves every dtype. The
//     host picks the widest unit that divides every row size, stride and
//     base address.
//   * a quantizing build (CP_QUANT = 1, CP_DTYPE the new rows' dtype,
//     CP_KV_DTYPE the fp8 cache's, CP_QVEC = 8, 4, 2 or 1 elements a step):
//     each element x of KV head h becomes the fp8 code of x / scale[h]
//     (fp8::encode: nearest, ties to even, saturating; NaN stays NaN), with
//     scale = k_scale / v_scale (one, or one per KV head; 1 when absent).
//   * a rotary build of paged_append (CP_ROPE = 1, CP_DTYPE, CP_QVEC; with
//     CP_QUANT and CP_KV_DTYPE into an fp8 cache): RoPE (rotate-half, as
//     layers.cu's rope) fused into the append: each query's K rows (or V
//     rows: rope_v, MLA's rotary part) are rotated by its position on the
//     way into the cache, rounded to CP_DTYPE (then quantized, as an append
//     of rotated rows would), the other side's rows copied, and its q rows
//     (rope_q, when given) rotated in place; first, where given, each row's
//     bias added and its RMSNorm applied (Prep), so one launch replaces
//     bias_add + rms_norm + rope + append.
// copy_pages moves raw bytes (CP_VEC_BYTES) of whole pages.
// Every unit is read and written through ldv / stv (common.cuh): the CPU
// backend checks each address is aligned to the unit, as a GPU requires.
#include "common.cuh"
#include "plan_words.cuh"
#include "append_params.cuh"

#ifndef CP_QUANT
#define CP_QUANT 0
#endif

template <u32 N>
struct Bytes;
template <>
struct Bytes<1> {
    typedef unsigned char T;
};
template <>
struct Bytes<2> {
    typedef unsigned short T;
};
template <>
struct Bytes<4> {
    typedef u32 T;
};
template <>
struct Bytes<8> {
    typedef uint2 T;
};
template <>
struct Bytes<16> {
    typedef uint4 T;
};

#ifndef CP_ROPE
#define CP_ROPE 0
#endif

#if CP_QUANT || CP_ROPE
#ifndef CP_QVEC
#error "CP_QVEC (8, 4, 2 or 1) must be defined with CP_QUANT or CP_ROPE"
#endif
typedef scalar_t src_t;  // the new rows
#if CP_QUANT
typedef kv_t dst_t;  // the fp8 cache
static_assert(kKvScaled, "a quantizing append writes an fp8 cache");
#else
typedef scalar_t dst_t;  // a cache of the new rows' dtype
#endif
constexpr u32 kVec = CP_QVEC;  // elements a unit
static_assert(kVec == 1 || kVec == 2 || kVec == 4 || kVec == 8, "CP_QVEC: 1, 2, 4 or 8");
constexpr u32 kSrcBytes = kVec * (u32)sizeof(scalar_t);
// A unit of the new row: kVec elements, one vector access (two 16-byte ones for 8 f32).
struct Unit {
    scalar_t e[kVec];
};
constexpr u32 kLoadBytes = kSrcBytes < 16 ? kSrcBytes : 16u;
__device__ __forceinline__ Unit load_unit(const src_t* p) {
    typedef typename Bytes<kLoadBytes>::T V;
    Unit u;
#pragma unroll
    for (u32 i = 0; i < kSrcBytes / kLoadBytes; ++i)
        reinterpret_cast<V*>(u.e)[i] = ldv(reinterpret_cast<const V*>(p) + i);
    return u;
}
// A unit into rows of the new rows' dtype: its bits (a V row, a rotated q or K row).
__device__ __forceinline__ void store_unit(src_t* p, const Unit& u, float) {
    typedef typename Bytes<kLoadBytes>::T V;
#pragma unroll
    for (u32 i = 0; i < kSrcBytes / kLoadBytes; ++i)
        stv(reinterpret_cast<V*>(p) + i, reinterpret_cast<const V*>(u.e)[i]);
}
#if CP_QUANT
// A unit into the fp8 cache: each element's code of x / scale.
__device__ __forceinline__ void store_unit(dst_t* p, const Unit& u, float scale) {
    typedef typename Bytes<kVec>::T V;
    V v;
    dst_t* c = reinterpret_cast<dst_t*>(&v);
#pragma unroll
    for (u32 i = 0; i < kVec; ++i) c[i] = fp8::encode<kv_t>(to_float(u.e[i]) / scale);
    stv(reinterpret_cast<V*>(p), v);
}
#endif
#else
#ifndef CP_VEC_BYTES
#error "CP_VEC_BYTES (16, 8, 4, 2 or 1) must be defined"
#endif
typedef typename Bytes<CP_VEC_BYTES>::T unit_t;
typedef unit_t src_t;
typedef unit_t dst_t;
constexpr u32 kVec = 1;
typedef unit_t Unit;
__device__ __forceinline__ Unit load_unit(const src_t* p) { return ldv(p); }
__device__ __forceinline__ void store_unit(dst_t* p, const Unit& u, float) { stv(p, u); }
#endif

// The page and offset query q writes, or false when the words do not name a
// valid slot. Reads only words[0 .. 17 + 2*queries + 2*sequences +
// sequences*table_width), the size the host sized them with; never trusts a
// word for memory safety.
__device__ __forceinline__ bool append_slot(const u32* __restrict__ words, u32 q, u32 queries, u32 sequences,
                                            u32 table_width, u32 page_size, u32 num_pages, u32& page, u32& off) {
    const u64 table = pw::page_table(queries, sequences);
    const u32 s = words[pw::q_seq(queries) + q];
    const u32 p = words[pw::q_pos(queries) + q];
    if (s >= sequences) return false;  // padded or corrupt entry
    if (p >= words[pw::kv_len(queries) + s]) return false;  // at or past its kv_len: a padded entry (length 0)
    const u32 col = p / page_size;
    if (col >= table_width) return false;  // past the table
    page = words[table + (u64)s * table_width + col];
    if (page >= num_pages) return false;  // includes CP_NO_PAGE
    off = p - col * page_size;
    return true;
}

// One head row of `units` units: the block's bx lanes (threadIdx.x) stride
// over it, two independent loads per lane in flight.
__device__ __forceinline__ void put_row(const src_t* __restrict__ src, dst_t* __restrict__ dst, u32 units,
                                        float scale) {
    u32 u = threadIdx.x;
    for (; u + blockDim.x < units; u += 2u * blockDim.x) {
        const u32 w = u + blockDim.x;
        const Unit a = load_unit(src + (u64)u * kVec);
        const Unit b = load_unit(src + (u64)w * kVec);
        store_unit(dst + (u64)u * kVec, a, scale);
        store_unit(dst + (u64)w * kVec, b, scale);
    }
    if (u < units) store_unit(dst + (u64)u * kVec, load_unit(src + (u64)u * kVec), scale);
}

// Token t's rows (every KV head, K then V) into page `page`, offset `off`.
__device__ __forceinline__ void put_token(const AppendParams& p, u64 t, u32 page, u32 off) {
    const src_t* const nk = static_cast<const src_t*>(p.new_k);
    const src_t* const nv = static_cast<const src_t*>(p.new_v);
    dst_t* const kc = static_cast<dst_t*>(p.k_cache);
    dst_t* const vc = static_cast<dst_t*>(p.v_cache);
    const u64 kbase = (u64)page * p.dst_page_k + (u64)off * p.dst_slot_k;
    const u64 vbase = (u64)page * p.dst_page_v + (u64)off * p.dst_slot_v;
    for (u32 h = 0; h < p.heads; ++h) {
        float ks = 1.0f, vs = 1.0f;
#if CP_QUANT
        if (p.k_scale) ks = p.k_scale[h * p.k_scale_stride];
        if (p.v_scale) vs = p.v_scale[h * p.v_scale_stride];
#endif
        put_row(nk + t * p.src_tok_k + (u64)h * p.src_head_k, kc + kbase + (u64)h * p.dst_head_k, p.units_k, ks);
        if (p.units_v)
            put_row(nv + t * p.src_tok_v + (u64)h * p.src_head_v, vc + vbase + (u64)h * p.dst_head_v, p.units_v, vs);
    }
}

#if CP_ROPE
// What a rotary build does to a row before it rotates or writes it, each
// step rounded to CP_DTYPE as the separate kernel writes it: the bias row b
// added (layers.cu's bias_add: Qwen2's q / k / v biases), then RMSNorm with
// weight w and factor inv (rms_norm: Qwen3's q / k norms, MLA's latent norm).
// Null: the step is skipped.
struct Prep {
    const scalar_t* bias;
    const scalar_t* norm;
    float inv;
};

// Unit u of a row, prepared.
__device__ __forceinline__ Unit prep_unit(const src_t* src, u32 u, const Prep& pr) {
    Unit a = load_unit(src + (u64)u * kVec);
    if (pr.bias || pr.norm) {
#pragma unroll
        for (u32 j = 0; j < kVec; ++j) {
            const u32 i = u * kVec + j;
            float x = to_float(a.e[j]);
            if (pr.bias) x = to_float(from_float<scalar_t>(x + to_float(pr.bias[i])));
            if (pr.norm) x = to_float(from_float<scalar_t>(x * pr.inv * to_float(pr.norm[i])));
            a.e[j] = from_float<scalar_t>(x);
        }
    }
    return a;
}

// The Prep of a row of `units` units: with a norm weight, its factor
// rsqrt(mean(x^2) + eps) over the biased row (rms_norm's, its sum in another
// order: one pass over the row before the one that writes it).
__device__ __forceinline__ Prep row_prep(const src_t* src, u32 units, const scalar_t* bias, const scalar_t* norm,
                                         float eps) {
    Prep pr = {bias, nullptr, 1.0f};
    if (norm) {
        float ss = 0.f;
        for (u32 u = 0; u < units; ++u) {
            const Unit a = prep_unit(src, u, pr);
#pragma unroll
            for (u32 j = 0; j < kVec; ++j) ss += to_float(a.e[j]) * to_float(a.e[j]);
        }
        pr.norm = norm;
        pr.inv = rsqrtf(ss / (float)(units * kVec) + eps);
    }
    return pr;
}

// kVec table entries t[0 .. kVec) (a rotary table row's, from a unit's
// first element): 16-byte loads where `vec` says the row is 16-byte aligned
// (rope_token checks), else one float at a time.
__device__ __forceinline__ void table_unit(const float* __restrict__ t, bool vec, float (&out)[kVec]) {
    if constexpr (kVec % 4 == 0) {
        if (vec) {
#pragma unroll
            for (u32 k = 0; k < kVec / 4; ++k) {
                const float4 f = ldv(reinterpret_cast<const float4*>(t) + k);
                out[4 * k] = f.x;
                out[4 * k + 1] = f.y;
                out[4 * k + 2] = f.z;
                out[4 * k + 3] = f.w;
            }
            return;
        }
    }
#pragma unroll
    for (u32 j = 0; j < kVec; ++j) out[j] = t[j];
}

// Rotate-half of unit pairs u .. u + n - 1 of one prepared head row by the
// position's table rows cs / sn (half = hu units; tv: both 16-byte aligned):
// units u and u + hu hold elements i and i + half, which become
// x[i] c - x[i + half] s and x[i + half] c + x[i] s (f32, as layers.cu's
// rope), rounded to CP_DTYPE, then stored (dst: the row itself, or the cache).
template <class D>
__device__ __forceinline__ void rope_units(const src_t* src, D* dst, u32 u, u32 n, u32 hu, const float* __restrict__ cs,
                                           const float* __restrict__ sn, bool tv, float scale, const Prep& pr) {
    for (const u32 stop = u + n; u < stop; ++u) {
        const Unit a = prep_unit(src, u, pr), b = prep_unit(src, u + hu, pr);
        float cu[kVec], su[kVec];
        table_unit(cs + u * kVec, tv, cu);
        table_unit(sn + u * kVec, tv, su);
        Unit ra, rb;
#pragma unroll
        for (u32 j = 0; j < kVec; ++j) {
            const float x = to_float(a.e[j]), y = to_float(b.e[j]);
            const float c = cu[j], s = su[j];
            ra.e[j] = from_float<scalar_t>(x * c - y * s);
            rb.e[j] = from_float<scalar_t>(y * c + x * s);
        }
        store_unit(dst + (u64)u * kVec, ra, scale);
        store_unit(dst + (u64)(u + hu) * kVec, rb, scale);
    }
}

// One side of a token's write (its K or its V rows): the new rows, their
// cache rows, units a row, the fp8 scales (null: 1), the bias [Hkv, dim]
// and RMSNorm weight [dim] of its rows (null: none).
struct Side {
    const src_t* src;
    dst_t* dst;
    u32 src_head, dst_head, units;
    const float* scale;
    u32 scale_stride;
    const scalar_t* bias;
    const scalar_t* norm;
    __device__ __forceinline__ float scale_of(u32 h) const {
        return CP_QUANT && scale ? scale[h * scale_stride] : 1.0f;
    }
};

// Row h of a [heads, units * kVec] bias (null: none).
__device__ __forceinline__ const scalar_t* bias_row(const scalar_t* bias, u32 h, u32 units) {
    return bias ? bias + (u64)h * units * kVec : nullptr;
}

// Query t of a rotary build: one flat range of work items the block row's
// lanes stride over: its Hq q rows (rotated in place; none without rope_q),
// the Hkv rows of the rotated side (K, or V with rope_v: MLA's rotary part)
// into the cache, and the Hkv rows of the other side (copied); K and V only
// when the query has a slot. A rotated row is hu items (its unit pairs), or
// one (the whole row: RMSNorm first) when q or the rotated side has a norm
// weight; a copied row is one item a unit, or one with a norm weight. The
// position is the query's q_pos word, clamped to rope_max_pos - 1 (the
// table's last row).
__device__ __forceinline__ void rope_token(const AppendParams& p, u32 t, bool slot, u32 page, u32 off) {
    u32 pos = p.words[pw::q_pos(p.tokens) + t];
    if (pos >= p.rope_max_pos) pos = p.rope_max_pos - 1;
    const Side k = {static_cast<const src_t*>(p.new_k) + (u64)t * p.src_tok_k,
                    static_cast<dst_t*>(p.k_cache) + (u64)page * p.dst_page_k + (u64)off * p.dst_slot_k,
                    p.src_head_k,
                    p.dst_head_k,
                    p.units_k,
                    p.k_scale,
                    p.k_scale_stride,
                    static_cast<const scalar_t*>(p.rope_k_bias),
                    static_cast<const scalar_t*>(p.rope_k_norm)};
    const Side v = {static_cast<const src_t*>(p.new_v) + (u64)t * p.src_tok_v,
                    static_cast<dst_t*>(p.v_cache) + (u64)page * p.dst_page_v + (u64)off * p.dst_slot_v,
                    p.src_head_v,
                    p.dst_head_v,
                    p.units_v,
                    p.v_scale,
                    p.v_scale_stride,
                    static_cast<const scalar_t*>(p.rope_v_bias),
                    static_cast<const scalar_t*>(p.rope_v_norm)};
    const Side& r = p.rope_v ? v : k;  // rotated
    const Side& c = p.rope_v ? k : v;  // copied
    const u32 hu = r.units >> 1, half = hu * kVec;
    const float* const cs = p.rope_cos + (u64)pos * half;
    const float* const sn = p.rope_sin + (u64)pos * half;
    const bool tv = ((reinterpret_cast<u64>(cs) | reinterpret_cast<u64>(sn)) & 15u) == 0;  // (kVec: 4 or 8 floats)
    src_t* const q = static_cast<src_t*>(p.rope_q);
    const scalar_t* const wq = static_cast<const scalar_t*>(p.rope_q_norm);
    const scalar_t* const bq = static_cast<const scalar_t*>(p.rope_q_bias);
    const u32 per = (wq || r.norm) ? 1u : hu;  // items a rotated row
    const u32 n = (wq || r.norm) ? hu : 1u;  // unit pairs an item
    const u32 cper = c.norm ? 1u : c.units;  // items a copied row
    const u32 nq = q ? p.q_heads * per : 0u;
    const u32 nr = slot ? p.heads * per : 0u;
    const u32 end = nq + nr + (slot ? p.heads * cper : 0u);
    for (u32 e = threadIdx.x; e < end; e += blockDim.x) {
        if (e < nq) {
            const u32 h = e / per;
            src_t* const row = q + (u64)t * p.src_tok_q + (u64)h * p.src_head_q;
            const Prep pr = row_prep(row, r.units, bias_row(bq, h, r.units), wq, p.rope_eps);
            rope_units(row, row, (e - h * per) * n, n, hu, cs, sn, tv, 1.0f, pr);
        } else if (e < nq + nr) {
            const u32 h = (e - nq) / per;
            const src_t* const row = r.src + (u64)h * r.src_head;
            const Prep pr = row_prep(row, r.units, bias_row(r.bias, h, r.units), r.norm, p.rope_eps);
            rope_units(row, r.dst + (u64)h * r.dst_head, (e - nq - h * per) * n, n, hu, cs, sn, tv, r.scale_of(h), pr);
        } else {
            const u32 i = e - nq - nr, h = i / cper, u0 = (i - h * cper) * (c.units / cper);
            const src_t* const row = c.src + (u64)h * c.src_head;
            const Prep pr = row_prep(row, c.units, bias_row(c.bias, h, c.units), c.norm, p.rope_eps);
            for (u32 u = u0; u < u0 + c.units / cper; ++u)
                store_unit(c.dst + (u64)h * c.dst_head + (u64)u * kVec, prep_unit(row, u, pr), c.scale_of(h));
        }
    }
}
#endif

// new_k:   [queries, Hkv, D] rows (strides src_tok_k, src_head_k), new_v alike with Dv
// k_cache: [pages, page_size, Hkv, D] rows (strides dst_page_k, dst_slot_k, dst_head_k), v_cache alike
// words:   the plan's metadata (docs/layout.md); q_seq, q_pos and the page
//          table are read on the device, so a graph replays with new positions.
// Launch:  block (bx, by), grid ceil(queries / by): thread row y of a block
//          handles query blockIdx.x * by + y, its bx lanes stride over the
//          units of each KV head's K row, then its V row (units_v = 0: no V).
// A query whose sequence, column or page is out of range writes nothing
// (a rotary build still rotates its q rows). Rotary builds: rope_q [queries,
// Hq, Dr] (strides src_tok_q, src_head_q), rope_cos / rope_sin [rope_max_pos,
// Dr / 2], Dr the rotated side's dim (D, or Dv with rope_v); the block row's
// lanes stride over rope_token's work items.
extern "C" __global__ void paged_append(const AppendParams p) {
    const u32 q = blockIdx.x * blockDim.y + threadIdx.y;
    if (q >= p.tokens) return;
    u32 page = 0, off = 0;
    const bool slot =
        append_slot(p.words, q, p.tokens, p.sequences, p.table_width, p.page_size, p.num_pages, page, off);
#if CP_ROPE
    rope_token(p, q, slot, page, off);
#else
    if (slot) put_token(p, q, page, off);
#endif
}

// Write rows by an explicit slot mapping (vLLM's reshape_and_cache_flash on
// the [pages, page_size, Hkv, D] layout, any strides): token t goes to slot
// slots[t] = page * page_size + offset. A slot < 0 (vLLM's -1: a padded
// token) or >= num_slots writes nothing.
// Launch:  as paged_append: block (bx, by), grid ceil(tokens / by).
#if !CP_ROPE
extern "C" __global__ void write_slots(const AppendParams p) {
    const u32 t = blockIdx.x * blockDim.y + threadIdx.y;
    if (t >= p.tokens) return;
    const long long s = p.slots[t];
    if (s < 0 || (u64)s >= p.num_slots) return;
    const u64 page = (u64)s / p.page_size;
    put_token(p, t, (u32)page, (u32)((u64)s - page * p.page_size));
}
#endif

#if !CP_QUANT && !CP_ROPE
// Copy whole pages inside both caches, in every layer: for each pair i,
// page pairs[2i] of each layer of k_cache and v_cache is copied to page
// pairs[2i + 1] of the same layer.
// k_cache: [layers, pages, ...] with each page one contiguous block of
//          page_units_k units, pages page_k units apart and layers layer_k
//          units apart (64-bit offsets, so a cache may exceed 2^32 units);
//          v_cache alike.
// pairs:   [num_pairs, 2] (src, dst) page ids; a pair naming a page
//          >= num_pages is skipped. Destinations must be distinct and no
//          destination may be a source (the page manager and
//          cupaged.copy_pages guarantee it).
// Launch:  grid (num_pairs, chunks, zl), any block size; block (i, c, z) handles
//          pair i in layers z, z + zl, ..., units c*blockDim.x + threadIdx.x
//          strided by chunks*blockDim.x over page_units_k + page_units_v.
extern "C" __global__ void copy_pages(unit_t* __restrict__ k_cache, unit_t* __restrict__ v_cache,
                                      const u32* __restrict__ pairs, u32 num_pairs, u32 num_pages, u32 layers,
                                      u32 page_units_k, u32 page_units_v, u64 page_k, u64 page_v, u64 layer_k,
                                      u64 layer_v) {
    const u32 i = blockIdx.x;
    if (i >= num_pairs) return;
    const u32 src = pairs[2u * i], dst = pairs[2u * i + 1u];
    if (src >= num_pages || dst >= num_pages || src == dst) return;
    const u32 units = page_units_k + page_units_v;
    const u32 stride = gridDim.y * blockDim.x;
    for (u32 layer = blockIdx.z; layer < layers; layer += gridDim.z) {
        const unit_t* sk = k_cache + layer * layer_k + src * page_k;
        const unit_t* sv = v_cache + layer * layer_v + src * page_v;
        unit_t* dk = k_cache + layer * layer_k + dst * page_k;
        unit_t* dv = v_cache + layer * layer_v + dst * page_v;
        u32 u = blockIdx.y * blockDim.x + threadIdx.x;
        for (; u + stride < units; u += 2u * stride) {
            const u32 w = u + stride;
            const unit_t a = ldv(u < page_units_k ? sk + u : sv + (u - page_units_k));
            const unit_t b = ldv(w < page_units_k ? sk + w : sv + (w - page_units_k));
            stv(u < page_units_k ? dk + u : dv + (u - page_units_k), a);
            stv(w < page_units_k ? dk + w : dv + (w - page_units_k), b);
        }
        if (u < units) {
            if (u < page_units_k)
                stv(dk + u, ldv(sk + u));
            else
                stv(dv + (u - page_units_k), ldv(sv + (u - page_units_k)));
        }
    }
}
#endif
