// sample.cu: per-request sampling of [batch, vocab] logits inside a decode
// graph (cupaged/ops/sample.py has the Python side and the semantics).
//
// sample_rows: row r of the logits belongs to slot s = rows[r]; the slot's
// parameters are the u32 words params[s * CP_SP_FIELDS + field] (float fields
// hold float32 bits), its token counts counts[s * vocab + t] (bit 31: t is
// in the context, bits 0..30: times t was generated). Per row:
//   x  = the logit as float32, penalised (vLLM): a token with a nonzero count
//        word is divided (x > 0) or multiplied (x <= 0) by the repetition
//        penalty; then x -= frequency * generated + presence * (generated > 0)
//   temperature 0: the token is the first index of the maximum of x (NaN
//        counts as the largest; with no penalty this is row_argmax bit for bit)
//   else z = x / temperature, M = max z; a row whose z holds NaN or +inf, or
//        whose M is -inf, takes the greedy token. Kept: exp(z - M) >= min_p,
//        z >= the top_k-th largest kept z (ties kept), and the smallest set of
//        largest z whose mass exp(z - M) reaches top_p of the kept mass (ties
//        at the boundary kept). The token is the argmax over kept tokens of
//        z + Gumbel(u), u from Philox4x32-10 keyed by the slot's 64-bit seed,
//        counter (token index, the slot's step, 0, 0): it depends on nothing
//        but the row, the slot's parameters, counts, seed and step.
//   out[s] = the token, logprob[(clock[0] % ring_rows) * stride + s] = its
//   log-softmax under the raw logits (NaN unless the slot's logprobs word is
//   set) and, with top_n > 0 (at most max_n), the top_n largest raw logits'
//   tokens and logprobs at top_ids / top_lp[((clock % ring_rows) * stride +
//   s) * max_n + j]; counts[s, token] += 1, step += 1.
//
// Grid (batch), one block per row, block a multiple of 32 (<= 1024); rows
// are read with 16-byte loads after a scalar head (any element alignment).
// Passes over the row (L2-resident after the first): one (the greedy argmax,
// max z, and the log-sum-exp when logprobs are asked for), then when
// sampling 4 radix passes for top-k and 4 for top-p when they are on (8-bit
// digits of the order key; counts and 2^-32 fixed-point masses in a 256-bin
// shared histogram of integer atomics, so the result does not depend on
// thread timing) and one for the draw, and one per top logprob. Reads vocab
// logits (and vocab count words when a penalty is on) per pass; writes 8 + 4
// + 4 + 4 bytes (+ 8 per top logprob). The greedy pass costs what row_argmax
// costs (one pass, one block reduction).
//
// Defines: CP_DTYPE (f32, f16, bf16) selects scalar_t; CP_SP_* the parameter
// fields and CP_SP_CONTEXT_BIT (cupaged/ops/sample.py).
#include "common.cuh"

#define CP_SP_BINS 256u

__device__ __forceinline__ float word_float(u32 w) { return __uint_as_float(w); }

// Raw storage bits of scalar_t and their value as float32 (exact).
template <int Bytes>
struct RawOf;
template <>
struct RawOf<4> {
    typedef u32 type;
};
template <>
struct RawOf<2> {
    typedef unsigned short type;
};
typedef RawOf<(int)sizeof(scalar_t)>::type raw_t;
__device__ __forceinline__ float bits_float(u32 b, float*) { return __uint_as_float(b); }
__device__ __forceinline__ float bits_float(u32 b, __half*) {
    return __half2float(__ushort_as_half((unsigned short)b));
}
__device__ __forceinline__ float bits_float(u32 b, __nv_bfloat16*) { return __uint_as_float(b << 16); }
#define CP_SP_ELEM_BITS (8u * (u32)sizeof(raw_t))
#define CP_SP_VEC (128u / CP_SP_ELEM_BITS)  // elements per 16-byte load

// f(i, value) for every index i of this thread's share of the row, in
// increasing order: a scalar head up to the first 16-byte boundary, 16-byte
// loads for the body, a scalar tail (the row need not be 16-byte aligned).
template <typename F>
__device__ __forceinline__ void for_row(const scalar_t* row, u32 vocab, F f) {
    const raw_t* r = reinterpret_cast<const raw_t*>(row);
    const u32 tid = threadIdx.x, nt = blockDim.x;
    u32 head = ((16u - (u32)((u64)r & 15u)) & 15u) / (u32)sizeof(raw_t);
    if (head > vocab) head = vocab;
    const u32 nvec = (vocab - head) / CP_SP_VEC, tail = head + nvec * CP_SP_VEC;
    for (u32 i = tid; i < head; i += nt) f(i, bits_float(r[i], (scalar_t*)0));
    const uint4* body = reinterpret_cast<const uint4*>(r + head);
    const u32 per_word = 32u / CP_SP_ELEM_BITS;
    const u32 emask = CP_SP_ELEM_BITS == 32u ? 0xffffffffu : ((1u << CP_SP_ELEM_BITS) - 1u);
    for (u32 v = tid; v < nvec; v += nt) {
        const uint4 q = ldv(body + v);
        const u32 w[4] = {q.x, q.y, q.z, q.w};
        const u32 first = head + v * CP_SP_VEC;
#pragma unroll
        for (u32 j = 0; j < 4u; ++j)
#pragma unroll
            for (u32 e = 0; e < per_word; ++e)
                f(first + j * per_word + e, bits_float((w[j] >> (e * CP_SP_ELEM_BITS)) & emask, (scalar_t*)0));
    }
    for (u32 i = tail + tid; i < vocab; i += nt) f(i, bits_float(r[i], (scalar_t*)0));
}

// Order-preserving key of a float32: key(a) < key(b) iff a < b, both zeros
// one key, every NaN the largest key, no value maps to 0.
__device__ __forceinline__ u32 f32_key(float f) {
    const u32 b = __float_as_uint(f);
    const u32 mag = b & 0x7fffffffu;
    if (mag > 0x7f800000u) return 0xffffffffu;  // NaN
    if (mag == 0u) return 0x80000000u;  // -0.0 == +0.0
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Philox4x32-10 (Salmon et al., Random123): the first output word of
// counter (c0, c1, 0, 0) under key (k0, k1).
__device__ __forceinline__ u32 philox_word(u32 c0, u32 c1, u32 k0, u32 k1) {
    u32 x0 = c0, x1 = c1, x2 = 0u, x3 = 0u;
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const u32 hi0 = __umulhi(0xD2511F53u, x0), lo0 = 0xD2511F53u * x0;
        const u32 hi1 = __umulhi(0xCD9E8D57u, x2), lo1 = 0xCD9E8D57u * x2;
        x0 = hi1 ^ x1 ^ k0;
        x1 = lo1;
        x2 = hi0 ^ x3 ^ k1;
        x3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return x0;
}

// Gumbel noise from a 32-bit word: u = (w >> 9 + 0.5) / 2^23 lies in (0, 1).
__device__ __forceinline__ float gumbel(u32 w) {
    const float u = ((float)(w >> 9) + 0.5f) * (1.0f / 8388608.0f);
    return -logf(-logf(u));
}

__device__ __forceinline__ void keep_best(u32& key, u32& idx, u32 k, u32 i) {
    if (k > key || (k == key && i < idx)) {
        key = k;
        idx = i;
    }
}

// Block-wide reductions over 32-entry shared scratch (every thread calls them).
// reused: the scratch was read since the last barrier (wait before writing it).
__device__ __forceinline__ void block_argmax(u32& key, u32& idx, u32* sk, u32* si, bool reused) {
    for (int o = 16; o > 0; o >>= 1) {
        const u32 k = __shfl_xor_sync(0xffffffffu, key, o), i = __shfl_xor_sync(0xffffffffu, idx, o);
        keep_best(key, idx, k, i);
    }
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u, warps = blockDim.x >> 5;
    if (reused) __syncthreads();
    if (lane == 0) {
        sk[warp] = key;
        si[warp] = idx;
    }
    __syncthreads();
    key = 0u;
    idx = 0xffffffffu;
    for (u32 w = 0; w < warps; ++w) keep_best(key, idx, sk[w], si[w]);
}

// Log-sum-exp state (m, s): sum exp(x - m); m = -inf with s = 0 when empty.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    const float mm = fmaxf(m, m2);
    if (mm == neg_inf()) return;
    s = (m == neg_inf() ? 0.0f : s * expf(m - mm)) + (m2 == neg_inf() ? 0.0f : s2 * expf(m2 - mm));
    m = mm;
}

__device__ __forceinline__ void block_lse_max(float& m, float& s, float& zmax, u32& bad, float* sf, u32* su) {
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
        zmax = fmaxf(zmax, __shfl_xor_sync(0xffffffffu, zmax, o));
        bad |= __shfl_xor_sync(0xffffffffu, bad, o);
    }
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31u, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) {
        sf[warp] = m;
        sf[32 + warp] = s;
        sf[64 + warp] = zmax;
        su[warp] = bad;
    }
    __syncthreads();
    m = neg_inf();
    s = 0.0f;
    zmax = neg_inf();
    bad = 0u;
    for (u32 w = 0; w < warps; ++w) {
        lse_merge(m, s, sf[w], sf[32 + w]);
        zmax = fmaxf(zmax, sf[64 + w]);
        bad |= su[w];
    }
}

struct SlotParams {
    float temperature, top_p, min_p, rep, pres, freq;
    u32 top_k, seed_lo, seed_hi, step;
    bool penalised, logprobs;
};

// The penalised logit x of token i of logit value x (before the temperature).
__device__ __forceinline__ float penalised(float x, const u32* crow, const SlotParams& p, u32 i) {
    if (p.penalised) {
        const u32 c = crow[i];
        if (c != 0u) {
            if (p.rep != 1.0f) x = x > 0.0f ? x / p.rep : x * p.rep;
            const u32 n = c & ~CP_SP_CONTEXT_BIT;
            if (n != 0u) x -= p.freq * (float)n + p.pres;
        }
    }
    return x;
}

// Radix select over the order keys of z for the tokens with keep(i): the
// largest key K whose weight (count, or fixed-point mass) of kept tokens
// with key >= K reaches the target; weight_target(total) turns the kept
// total into the target (a value <= 0 or > total turns the filter off: 0
// returned, every key >= 0). Four passes of 8-bit digits.
template <typename Weight, typename Keep, typename Target>
__device__ u32 radix_select(const scalar_t* row, u32 vocab, Weight weight, Keep keep, Target weight_target, u64* hist,
                            double* need_s, u32* prefix_s) {
    u32 prefix = 0u, mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (u32 b = threadIdx.x; b < CP_SP_BINS; b += blockDim.x) hist[b] = 0ull;
        __syncthreads();
        for_row(row, vocab, [&](u32 i, float raw) {
            u32 key;
            float z;
            if (!keep(i, raw, key, z) || (key & mask) != prefix) return;
            const u64 w = weight(z);
            if (w) atomicAdd(&hist[(key >> shift) & 255u], w);
        });
        __syncthreads();
        if (threadIdx.x == 0) {
            double need;
            if (shift == 24) {
                u64 total = 0ull;
                for (u32 b = 0; b < CP_SP_BINS; ++b) total += hist[b];
                need = weight_target((double)total);
                if (!(need > 0.0) || need > (double)total) need = -1.0;  // off
            } else {
                need = *need_s;
            }
            u32 digit = 0u;
            if (need > 0.0) {
                for (int d = 255; d >= 0; --d) {
                    const double h = (double)hist[d];
                    if (h >= need) {
                        digit = (u32)d;
                        break;
                    }
                    need -= h;
                }
            }
            *need_s = need;
            *prefix_s = prefix | (digit << shift);
        }
        __syncthreads();
        if (*need_s <= 0.0) return 0u;
        prefix = *prefix_s;
        mask |= 255u << shift;
        __syncthreads();
    }
    return prefix;
}

// logits: [batch, vocab] scalar_t, C-contiguous. rows: [batch] int32 slots.
// params: [stride, CP_SP_FIELDS] u32. counts: [stride, vocab] u32.
// out: [stride] int64 by slot. logprob: [ring_rows, stride] float32.
// top_ids, top_lp: [ring_rows, stride, max_n] int32 / float32.
// clock: u32 [1] (the ring row: clock[0] % ring_rows).
extern "C" __global__ void __launch_bounds__(1024)
    sample_rows(const scalar_t* __restrict__ logits, u32 vocab, const int* __restrict__ rows, u32* params, u32* counts,
                long long* out, float* logprob, int* top_ids, float* top_lp, u32 max_n, const u32* __restrict__ clock,
                u32 ring_rows, u32 stride) {
    __shared__ u64 hist[CP_SP_BINS];
    __shared__ float sf[96];
    __shared__ u32 sk[32], si[32];
    __shared__ double need_s;
    __shared__ u32 prefix_s;

    const u32 slot = (u32)rows[blockIdx.x];
    if (slot >= stride) return;  // an absurd slot id reads and writes nothing (uniform per block)
    const scalar_t* row = logits + (u64)blockIdx.x * vocab;
    u32* pw = params + (u64)slot * CP_SP_FIELDS;
    u32* crow = counts + (u64)slot * vocab;
    SlotParams p;
    p.temperature = word_float(pw[CP_SP_TEMPERATURE]);
    p.top_p = word_float(pw[CP_SP_TOP_P]);
    p.min_p = word_float(pw[CP_SP_MIN_P]);
    p.rep = word_float(pw[CP_SP_REPETITION]);
    p.pres = word_float(pw[CP_SP_PRESENCE]);
    p.freq = word_float(pw[CP_SP_FREQUENCY]);
    p.top_k = pw[CP_SP_TOP_K];
    p.seed_lo = pw[CP_SP_SEED_LO];
    p.seed_hi = pw[CP_SP_SEED_HI];
    p.step = pw[CP_SP_STEP];
    p.logprobs = pw[CP_SP_LOGPROBS] != 0u;
    p.penalised = p.rep != 1.0f || p.pres != 0.0f || p.freq != 0.0f;
    const bool greedy = !(p.temperature > 0.0f);

    // Pass 1: greedy argmax of x, log-sum-exp of the raw logits (when the
    // slot asks for logprobs), max of z.
    u32 gkey = 0u, gidx = 0xffffffffu, bad = 0u;
    float rm = neg_inf(), rs = 0.0f, zmax = neg_inf();
    for_row(row, vocab, [&](u32 i, float raw) {
        const float x = penalised(raw, crow, p, i);
        const u32 k = f32_key(x);
        if (k > gkey) {  // indices rise within a thread: only a larger key moves
            gkey = k;
            gidx = i;
        }
        if (p.logprobs) lse_merge(rm, rs, raw, 1.0f);
        if (!greedy) {
            const float z = x / p.temperature;
            if (z != z || z == -neg_inf()) bad = 1u;
            zmax = fmaxf(zmax, z);
        }
    });
    block_argmax(gkey, gidx, sk, si, false);
    if (p.logprobs || !greedy) block_lse_max(rm, rs, zmax, bad, sf, sk);  // (uniform per block)
    u32 token = gidx;

    if (!greedy && !bad && zmax != neg_inf()) {
        const float M = zmax;
        // keep0: min-p; z and its key out
        auto keep0 = [&](u32 i, float raw, u32& key, float& z) {
            z = penalised(raw, crow, p, i) / p.temperature;
            key = f32_key(z);
            return expf(z - M) >= p.min_p;
        };
        u32 tk = 0u;
        if (p.top_k != 0u) {
            const double k = (double)p.top_k;
            tk = radix_select(
                row, vocab, [](float) { return 1ull; }, keep0, [k](double) { return k; }, hist, &need_s, &prefix_s);
        }
        auto keep1 = [&](u32 i, float raw, u32& key, float& z) { return keep0(i, raw, key, z) && key >= tk; };
        u32 tp = 0u;
        if (p.top_p < 1.0f) {
            const double top_p = (double)p.top_p;
            tp = radix_select(
                row, vocab, [&](float z) { return (u64)(expf(z - M) * 4294967296.0f); }, keep1,
                [top_p](double total) { return top_p * total; }, hist, &need_s, &prefix_s);
        }
        u32 bkey = 0u, bidx = 0xffffffffu;
        for_row(row, vocab, [&](u32 i, float raw) {
            u32 key;
            float z;
            if (!keep1(i, raw, key, z) || key < tp) return;
            const u32 k = f32_key(z + gumbel(philox_word(i, p.step, p.seed_lo, p.seed_hi)));
            if (k > bkey) {
                bkey = k;
                bidx = i;
            }
        });
        block_argmax(bkey, bidx, sk, si, true);
        if (bidx < vocab) token = bidx;
    }

    const u64 at = (u64)(clock[0] % ring_rows) * stride + slot;
    const float lse = rm + logf(rs);
    // Top-n logprobs: n block argmaxes of the raw logits, each below the last
    // pick in the order (larger value first, NaN largest; ties: lower index).
    const u32 top_n = p.logprobs ? min(min(pw[CP_SP_TOP_N], max_n), vocab) : 0u;
    u32 pkey = 0u, pidx = 0u;
    for (u32 n = 0; n < top_n; ++n) {
        u32 key = 0u, idx = 0xffffffffu;
        for_row(row, vocab, [&](u32 i, float raw) {
            const u32 k = f32_key(raw);
            if (n > 0u && (k > pkey || (k == pkey && i <= pidx))) return;
            if (k > key) {
                key = k;
                idx = i;
            }
        });
        block_argmax(key, idx, sk, si, true);
        if (threadIdx.x == 0) {
            top_ids[at * max_n + n] = (int)idx;
            top_lp[at * max_n + n] = to_float(row[idx]) - lse;
        }
        pkey = key;
        pidx = idx;
    }

    if (threadIdx.x == 0) {
        if (token >= vocab) token = 0u;  // (cannot happen: every key beats 0)
        out[slot] = (long long)token;
        logprob[at] = p.logprobs ? to_float(row[token]) - lse : __int_as_float(0x7fc00000);
        crow[token] += 1u;
        pw[CP_SP_STEP] = p.step + 1u;
    }
}
