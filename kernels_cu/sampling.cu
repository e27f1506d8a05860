// sampling.cu: row-wise sampling over [batch, vocab] logits.
//
// row_argmax: out[row] = the first index of the maximum of logits[row, :].
// NaN counts as larger than every number (the first NaN of a row wins) and
// -0.0 ties with +0.0, exactly like numpy.argmax (cupaged.reference.row_argmax).
//
// Values are compared through an order-preserving unsigned key made from the
// raw bits, so no floating-point compare is involved: the result does not
// depend on fast-math flags, denormal flushing or the f16/bf16 conversion.
//
// Defines: CP_DTYPE (f32, f16, bf16) selects scalar_t.
#include "common.cuh"

// Bit layout of each storage type: width and the bit pattern of +inf.
template <typename T>
struct FloatBits;
template <>
struct FloatBits<float> {
    typedef u32 raw_t;
    enum : u32 { kBits = 32u, kInf = 0x7f800000u };
};
template <>
struct FloatBits<__half> {
    typedef unsigned short raw_t;
    enum : u32 { kBits = 16u, kInf = 0x7c00u };
};
template <>
struct FloatBits<__nv_bfloat16> {
    typedef unsigned short raw_t;
    enum : u32 { kBits = 16u, kInf = 0x7f80u };
};

typedef FloatBits<scalar_t>::raw_t raw_t;
#define CP_ELEM_BITS ((u32)FloatBits<scalar_t>::kBits)
#define CP_VEC_ELEMS (128u / CP_ELEM_BITS)  // elements per 16-byte uint4 load
#define CP_KEY_NONE 0u  // below every value's key
#define CP_IDX_NONE 0xffffffffu

// Order-preserving key of a value given its raw bits (low kBits of b):
// key(a) < key(b) iff a < b, both zeros map to one key, every NaN maps to the
// largest key, and no value maps to CP_KEY_NONE.
__device__ __forceinline__ u32 order_key(u32 b) {
    const u32 sign = 1u << (CP_ELEM_BITS - 1u);
    const u32 all = sign | (sign - 1u);
    const u32 mag = b & (sign - 1u);
    if (mag > FloatBits<scalar_t>::kInf) return all;  // NaN
    if (mag == 0u) return sign;  // -0.0 == +0.0
    return (b & sign) ? (~b & all) : (b | sign);  // negatives reversed below positives
}

// Keep (key, idx) if it beats the best so far: a larger key, or the same key
// at a smaller index. A total order, so any reduction tree gives one answer.
__device__ __forceinline__ void argmax_merge(u32& best_key, u32& best_idx, u32 key, u32 idx) {
    if (key > best_key || (key == best_key && idx < best_idx)) {
        best_key = key;
        best_idx = idx;
    }
}

// Each thread visits its indices in increasing order, so within a thread a
// strictly larger key is the only reason to move.
__device__ __forceinline__ void argmax_visit(u32& best_key, u32& best_idx, u32 bits, u32 idx) {
    const u32 key = order_key(bits);
    if (key > best_key) {
        best_key = key;
        best_idx = idx;
    }
}

// The CP_VEC_ELEMS elements of one uint4, lowest address first (little endian).
__device__ __forceinline__ void argmax_visit_vec(u32& best_key, u32& best_idx, uint4 v, u32 first) {
    const u32 words[4] = {v.x, v.y, v.z, v.w};
    const u32 per_word = 32u / CP_ELEM_BITS;
    const u32 mask = CP_ELEM_BITS == 32u ? 0xffffffffu : ((1u << CP_ELEM_BITS) - 1u);
#pragma unroll
    for (u32 w = 0; w < 4u; ++w)
#pragma unroll
        for (u32 e = 0; e < per_word; ++e)
            argmax_visit(best_key, best_idx, (words[w] >> (e * CP_ELEM_BITS)) & mask, first + w * per_word + e);
}

__device__ __forceinline__ void warp_argmax(u32& key, u32& idx) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u32 other_key = __shfl_xor_sync(CP_FULL_MASK, key, o);
        const u32 other_idx = __shfl_xor_sync(CP_FULL_MASK, idx, o);
        argmax_merge(key, idx, other_key, other_idx);
    }
}

// logits: [batch, vocab] scalar_t, C-contiguous; any alignment of the element
//         type (a row need not start on a 16-byte boundary).
// out:    [batch] int64.
// Launch: grid (batch), block (a multiple of 32, at most 1024); vocab >= 1.
// Each row: a scalar head up to the first 16-byte boundary, 16-byte vector
// loads for the body, a scalar tail.
extern "C" __global__ void row_argmax(const scalar_t* __restrict__ logits, long long* __restrict__ out, u32 vocab) {
    __shared__ u32 warp_key[32];
    __shared__ u32 warp_idx[32];

    const u32 tid = threadIdx.x, nthreads = blockDim.x;
    const raw_t* row = reinterpret_cast<const raw_t*>(logits) + (u64)blockIdx.x * vocab;

    const u32 misalign = (u32)((u64)row & 15u);
    u32 head = ((16u - misalign) & 15u) / (u32)sizeof(raw_t);
    if (head > vocab) head = vocab;
    const u32 nvec = (vocab - head) / CP_VEC_ELEMS;
    const u32 tail = head + nvec * CP_VEC_ELEMS;

    u32 best_key = CP_KEY_NONE, best_idx = CP_IDX_NONE;
    for (u32 i = tid; i < head; i += nthreads) argmax_visit(best_key, best_idx, row[i], i);

    // Body: four independent 16-byte loads in flight per thread, then the rest.
    const uint4* body = reinterpret_cast<const uint4*>(row + head);
    u32 v = tid;
    for (; v + 3u * nthreads < nvec; v += 4u * nthreads) {
        const uint4 a = ldv(body + v), b = ldv(body + v + nthreads), c = ldv(body + v + 2u * nthreads),
                    d = ldv(body + v + 3u * nthreads);
        argmax_visit_vec(best_key, best_idx, a, head + v * CP_VEC_ELEMS);
        argmax_visit_vec(best_key, best_idx, b, head + (v + nthreads) * CP_VEC_ELEMS);
        argmax_visit_vec(best_key, best_idx, c, head + (v + 2u * nthreads) * CP_VEC_ELEMS);
        argmax_visit_vec(best_key, best_idx, d, head + (v + 3u * nthreads) * CP_VEC_ELEMS);
    }
    for (; v < nvec; v += nthreads) argmax_visit_vec(best_key, best_idx, ldv(body + v), head + v * CP_VEC_ELEMS);

    for (u32 i = tail + tid; i < vocab; i += nthreads) argmax_visit(best_key, best_idx, row[i], i);

    // Block reduction: warps by shuffle, then warp 0 over the per-warp bests.
    warp_argmax(best_key, best_idx);
    const u32 warp = tid >> 5, lane = tid & 31u;
    if (lane == 0) {
        warp_key[warp] = best_key;
        warp_idx[warp] = best_idx;
    }
    __syncthreads();
    if (warp == 0) {
        best_key = lane < (nthreads >> 5) ? warp_key[lane] : CP_KEY_NONE;
        best_idx = lane < (nthreads >> 5) ? warp_idx[lane] : CP_IDX_NONE;
        warp_argmax(best_key, best_idx);
        if (lane == 0) out[blockIdx.x] = (long long)best_idx;
    }
}
