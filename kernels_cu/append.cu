// append.cu: writing new K/V rows into the paged caches, and copying pages
// for copy-on-write. Layout of caches, positions and metadata words:
// docs/layout.md.
//
// Both kernels move raw bytes: a row is copied bit for bit whatever its
// dtype (NaN payloads and -0.0 included), so one variant serves f32, f16 and
// bf16 alike.
//
// Defines: CP_VEC_BYTES (16, 8, 4 or 2): the copy unit. The host picks the
// widest unit that divides every row (or page) size and every base address.
// Every unit is read and written through ldv / stv (common.cuh): the CPU
// backend checks each address is aligned to the unit, as a GPU requires.
#include "common.cuh"
#include "plan_words.cuh"

#ifndef CP_VEC_BYTES
#error "CP_VEC_BYTES (16, 8, 4 or 2) must be defined"
#endif

#if CP_VEC_BYTES == 16
typedef uint4 unit_t;
#elif CP_VEC_BYTES == 8
typedef uint2 unit_t;
#elif CP_VEC_BYTES == 4
typedef u32 unit_t;
#elif CP_VEC_BYTES == 2
typedef unsigned short unit_t;
#else
#error "CP_VEC_BYTES must be 16, 8, 4 or 2"
#endif

// The cache slot (page * page_size + offset) query q writes, or
// 0xffffffffffffffff when the words do not name a valid one. Reads only
// words[0 .. 17 + 2*queries + 2*sequences + sequences*table_width), the size
// the host sized them with; never trusts a word for memory safety.
__device__ __forceinline__ u64 append_slot(const u32* __restrict__ words, u32 q, u32 queries, u32 sequences,
                                           u32 table_width, u32 page_size, u32 num_pages) {
    const u64 table = pw::page_table(queries, sequences);
    const u32 s = words[pw::q_seq(queries) + q];
    const u32 p = words[pw::q_pos(queries) + q];
    if (s >= sequences) return ~0ull;                         // padded or corrupt entry
    if (p >= words[pw::kv_len(queries) + s]) return ~0ull;    // at or past its kv_len: a padded entry (length 0)
    const u32 col = p / page_size;
    if (col >= table_width) return ~0ull;                    // past the table
    const u32 page = words[table + (u64)s * table_width + col];
    if (page >= num_pages) return ~0ull;                     // includes CP_NO_PAGE
    return (u64)page * page_size + (p - col * page_size);
}

// Copy one K row (units_k units) and one V row (units_v units): the block's
// bx lanes (threadIdx.x) stride over the units of the K row then the V row,
// two independent loads per lane in flight.
__device__ __forceinline__ void copy_row(const unit_t* __restrict__ src_k, const unit_t* __restrict__ src_v,
                                         unit_t* __restrict__ dst_k, unit_t* __restrict__ dst_v, u32 units_k,
                                         u32 units_v) {
    const u32 units = units_k + units_v;
    u32 u = threadIdx.x;
    for (; u + blockDim.x < units; u += 2u * blockDim.x) {
        const u32 w = u + blockDim.x;
        const unit_t a = ldv(u < units_k ? src_k + u : src_v + (u - units_k));
        const unit_t b = ldv(w < units_k ? src_k + w : src_v + (w - units_k));
        stv(u < units_k ? dst_k + u : dst_v + (u - units_k), a);
        stv(w < units_k ? dst_k + w : dst_v + (w - units_k), b);
    }
    if (u < units) {
        if (u < units_k) stv(dst_k + u, ldv(src_k + u)); else stv(dst_v + (u - units_k), ldv(src_v + (u - units_k)));
    }
}

// new_k:   [queries, Hkv, D]      as units_k copy units per row
// new_v:   [queries, Hkv, Dv]     as units_v copy units per row
// k_cache: [pages, page_size, Hkv, D]   (a slot is one row of units_k)
// v_cache: [pages, page_size, Hkv, Dv]  (a slot is one row of units_v)
// words:   the plan's metadata (docs/layout.md); q_seq, q_pos and the page
//          table are read on the device, so a graph replays with new positions.
// Launch:  block (bx, by), grid ceil(queries / by): thread row y of a block
//          handles query blockIdx.x * by + y, its bx lanes stride over the
//          units_k + units_v units of the K row then the V row.
// A query whose sequence, column or page is out of range writes nothing.
extern "C" __global__ void paged_append(const unit_t* __restrict__ new_k, const unit_t* __restrict__ new_v,
                                        unit_t* __restrict__ k_cache, unit_t* __restrict__ v_cache,
                                        const u32* __restrict__ words, u32 queries, u32 sequences,
                                        u32 table_width, u32 page_size, u32 num_pages, u32 units_k,
                                        u32 units_v) {
    const u32 q = blockIdx.x * blockDim.y + threadIdx.y;
    if (q >= queries) return;
    const u64 slot = append_slot(words, q, queries, sequences, table_width, page_size, num_pages);
    if (slot == ~0ull) return;

    copy_row(new_k + (u64)q * units_k, new_v + (u64)q * units_v, k_cache + slot * units_k,
             v_cache + slot * units_v, units_k, units_v);
}

// Write rows by an explicit slot mapping (vLLM's reshape_and_cache on the
// [pages, page_size, Hkv, D] layout): row t of new_k / new_v goes to slot
// slots[t] = page * page_size + offset of k_cache / v_cache. A slot < 0
// (vLLM's -1: a padded token) or >= num_slots writes nothing.
// new_k:   [tokens, units_k] units; new_v: [tokens, units_v] units.
// slots:   int64 [tokens].
// Launch:  as paged_append: block (bx, by), grid ceil(tokens / by).
extern "C" __global__ void write_slots(const unit_t* __restrict__ new_k, const unit_t* __restrict__ new_v,
                                       unit_t* __restrict__ k_cache, unit_t* __restrict__ v_cache,
                                       const long long* __restrict__ slots, u32 tokens, u64 num_slots,
                                       u32 units_k, u32 units_v) {
    const u32 t = blockIdx.x * blockDim.y + threadIdx.y;
    if (t >= tokens) return;
    const long long s = slots[t];
    if (s < 0 || (u64)s >= num_slots) return;
    const u64 slot = (u64)s;
    copy_row(new_k + (u64)t * units_k, new_v + (u64)t * units_v, k_cache + slot * units_k,
             v_cache + slot * units_v, units_k, units_v);
}

// Copy whole pages inside both caches, in every layer: for each pair i,
// page pairs[2i] of each layer of k_cache and v_cache is copied to page
// pairs[2i + 1] of the same layer.
// k_cache: [layers, pages, page_units_k] units; v_cache: [layers, pages, page_units_v] units
//          (layer-major; page offsets are 64-bit, so a cache may exceed 2^32 units).
// pairs:   [num_pairs, 2] (src, dst) page ids; a pair naming a page
//          >= num_pages is skipped. Destinations must be distinct and no
//          destination may be a source (the page manager and
//          cupaged.copy_pages guarantee it).
// Launch:  grid (num_pairs, chunks, zl), any block size; block (i, c, z) handles
//          pair i in layers z, z + zl, ..., units c*blockDim.x + threadIdx.x
//          strided by chunks*blockDim.x over page_units_k + page_units_v.
extern "C" __global__ void copy_pages(unit_t* __restrict__ k_cache, unit_t* __restrict__ v_cache,
                                      const u32* __restrict__ pairs, u32 num_pairs, u32 num_pages, u32 layers,
                                      u32 page_units_k, u32 page_units_v) {
    const u32 i = blockIdx.x;
    if (i >= num_pairs) return;
    const u32 src = pairs[2u * i], dst = pairs[2u * i + 1u];
    if (src >= num_pages || dst >= num_pages || src == dst) return;
    const u32 units = page_units_k + page_units_v;
    const u32 stride = gridDim.y * blockDim.x;
    for (u32 layer = blockIdx.z; layer < layers; layer += gridDim.z) {
        const u64 base = (u64)layer * num_pages;
        const unit_t* sk = k_cache + (base + src) * page_units_k;
        const unit_t* sv = v_cache + (base + src) * page_units_v;
        unit_t* dk = k_cache + (base + dst) * page_units_k;
        unit_t* dv = v_cache + (base + dst) * page_units_v;
        u32 u = blockIdx.y * blockDim.x + threadIdx.x;
        for (; u + stride < units; u += 2u * stride) {
            const u32 w = u + stride;
            const unit_t a = ldv(u < page_units_k ? sk + u : sv + (u - page_units_k));
            const unit_t b = ldv(w < page_units_k ? sk + w : sv + (w - page_units_k));
            stv(u < page_units_k ? dk + u : dv + (u - page_units_k), a);
            stv(w < page_units_k ? dk + w : dv + (w - page_units_k), b);
        }
        if (u < units) {
            if (u < page_units_k) stv(dk + u, ldv(sk + u)); else stv(dv + (u - page_units_k), ldv(sv + (u - page_units_k)));
        }
    }
}
