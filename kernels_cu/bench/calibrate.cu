// calibrate.cu: the microbenchmarks that replace the performance model's
// assumed constants (cupaged/tools/archs.py) with measurements; python -m
// cupaged.tools.calibrate runs them on a GPU and prints each figure beside
// the constant of archs.py it calibrates. Every kernel also runs on the CPU
// backend (the g++ shim), where the timings mean nothing and only the values
// computed are checked (tests/tools/test_calibrate.py). The tensor-core
// helpers are ptx.cuh's (mma.sync, wgmma), the fp8 decode is fp8.cuh's:
// what the attention kernels run. Expected figures are for an H200 SXM
// (sm_90, 132 SMs), each with its source.
//
// Constants: kThreads (256), kBlocksPerSm (2), kMmaChains (8), kCvtChains (8)
// and kWgPerGroup (8) come from cupaged/tools/calibrate.py (DEFINES), which
// sizes the launches with them (the values in brackets are its).
//
// Timers (cal::cycles, cal::nanos): clock64() and %globaltimer on a GPU (the
// one inline PTX outside ptx.cuh: a timer read, nothing to emulate), so
// a block's cycles over its nanoseconds is the SM clock it ran at; on the
// CPU a counter. The throughput kernels run one wave of persistent blocks
// (grid blocks_per_sm x SMs, every block resident) and thread 0 of each
// writes its cycles and nanoseconds: clk [blocks][2]. Rates are the work
// over the CUDA-event time of the launch, per clock at that SM clock.
//
// (a) cal_mma_f16 / cal_mma_bf16: mma.sync.m16n8k16 f16 / bf16 -> f32 rate.
//     grid (kBlocksPerSm x SMs), block kThreads (8 warps), launch bounds to match. Each
//     warp keeps kMmaChains independent accumulators and issues kMmaChains
//     mma a loop iteration on fixed A / B fragments: registers only, no
//     memory traffic in the loop. seed [32 lanes][6] u32: each lane's A (4)
//     and B (2) registers; out [threads][kMmaChains][4] f32: every
//     accumulator, iters x the lane's fragment of A B (exact for the small
//     integers the host gives). 4096 FLOP a warp-wide mma. Expected: at most
//     ~660 TFLOP/s, 2/3 of the 989 TFLOP/s dense peak (FlashAttention-3,
//     Shah et al., arXiv 2407.08608, section 2: without wgmma, mma.sync
//     reaches about 2/3 of Hopper's tensor peak); archs.py mma_sync_flops.
// (b) cal_wgmma_<dt>_n<N> (the CAL_WGMMA build, sm_90a only, holds these
//     alone): wgmma.mma_async m64nNk16 -> f32 with A [64 x 16] and B [N x 16]
//     both from shared memory through descriptors (K-major, no swizzle: LBO
//     128 B, SBO 256 B, element (mn, k) at (mn % 8) 16 + (mn / 8) 256 +
//     (k % 8) 2 + (k / 8) 128 bytes: the canonical layout of ptx.cuh's
//     notes), bf16 at N = 32, 64, 256 and f16 at N = 256 (the N ptx.cuh
//     instantiates). grid (SMs), block kThreads (two warpgroups, each with its
//     own accumulators over the same A and B), dynamic shared memory 1024 +
//     2048 + 32 N bytes, filled from seed [64] u32 (words repeating). A loop
//     iteration is one wgmma-group of kWgPerGroup products; wait_group 1
//     keeps one group in flight while the next issues (accumulators reused
//     across wgmma of one shape need no fence: PTX ISA, wgmma.fence).
//     out [threads][N / 2] f32: the accumulators. A product: 2 x 64 x N x 16
//     FLOP and 2048 + 32 N operand bytes read from shared memory. Expected:
//     the dense peak 989.4 TFLOP/s = 132 SMs x 4096 FLOP/clk x 1.83 GHz
//     (NVIDIA H200 datasheet; FlashAttention-3: wgmma is what reaches it) at
//     large N, sustained GEMMs 790-853 (anchors.md; archs.py wgmma_flops).
//     If the operands are read at 128 B/clk/SM (32 banks x 4 B; archs.py
//     smem_bytes_per_clk), N = 32 (3072 B per 16 clk at peak: 192 B/clk) is
//     bound by it, N = 64 (4096 B per 32 clk) at it, N = 256 (10240 B per
//     128 clk) below it: the B/clk/SM the tool prints says which holds. No
//     global memory traffic in the loop.
// (c) cal_cvt_f16 / cal_cvt_bf16 / cal_cvt_e4m3: conversion rate. grid
//     (kBlocksPerSm x SMs), block kThreads, kCvtChains pairs of chains a thread,
//     registers only. f16 / bf16: x' = cvt.rn.{f16,bf16}x2.f32(x, y) and
//     y' = cvt(y, x), the u32 bits read as f32 (SASS F2FP.PACK_AB, nothing
//     else in the loop); e4m3: x' = fp8::x2_to_h2<e4m3>(x), the two codes in
//     x's low 16 bits (cvt.rn.f16x2.e4m3x2 from sm_89: SASS
//     F2FP.F16.E4M3.UNPACK_B; fp8.cuh's integer path before). in / out
//     [threads][kCvtChains][2] u32 (out: after iters steps). Expected: 16
//     conversions/clk/SM (CUDA C++ Programming Guide, arithmetic
//     instructions throughput table, type conversions, cc 8.x / 9.0;
//     archs.py lanes_per_clk of F2FP's class in cupaged/tools/sass.py).
// (d) cal_chase: dependent loads, the latency Little's law is fed with.
//     Block 0's warp 0 walks next [] (u32 word indices: one cycle over random
//     128-byte lines of the buffer; every lane on the same word; L1
//     bypassed, ld.global.cg) warm steps, then hops timed steps. grid 1 x
//     block 32: an idle chip. grid (1 + loaders) x block kThreads: blocks 1 ..
//     stream-read load_src (chunks of chunk_vecs 16-byte vectors a round, 8
//     loads in flight a thread) until the chase is done (the done word,
//     polled once a round) or max_rounds, so the chase meets a loaded memory
//     system. Traffic: one 128-byte line a hop (the chase), 16 bytes a
//     vector (the loaders). result [4] u64: the last index, the sum of the indices visited,
//     nanoseconds and cycles of the timed hops; load_out [loaders][2] u32:
//     xor of the words read, rounds done. Expected: ~700 ns loaded DRAM
//     latency over a buffer >> L2 (issue #11's assumption; random lines also
//     pay TLB misses); unloaded, HBM ~400-800 cycles (220-440 ns at 1.83 GHz)
//     and L2 hits ~200-400 cycles (the secondary sources archs.py cites for
//     latency_ns / l2_latency_ns; Luo et al., arXiv 2402.13499, measure
//     Hopper's hierarchy by pointer chase too).
// (e) cal_paged_read: the decode kernels' read pattern (NHD, docs/layout.md),
//     read only. grid (sequences, kv_heads), block kThreads; block (s, h) reads
//     head h's rows of its tokens: rows of 2^row_log2 16-byte vectors (D x
//     itemsize bytes) at a stride of kv_heads rows inside pages of
//     2^page_log2 slots, pages in the order of table [s][pages_per_seq] (a
//     permutation), 8 loads in flight a thread, L2 only (ld.global.cg, as the
//     kernels' cp.async.cg). sums [sequences][kv_heads] u32: the words read,
//     summed mod 2^32. Beside it, over the same bytes: cal_read (grid-stride
//     contiguous read, passes times over: passes > 1 over an L2-sized prefix
//     gives the L2 rate; sums [blocks]) and cal_copy (grid-stride 16-byte
//     copy, read + write). Memory traffic: every byte read once (the paged
//     read, cal_read at one pass), or read once and written once (cal_copy).
//     Expected: ~4.3 TB/s read + write for a large
//     device-to-device copy on this H200 (anchors.md; KINDS.md measured it
//     through PyTorch), of 4.8 TB/s nominal (datasheet); archs.py copy_bw and
//     its DRAM efficiencies of short (256-byte) and long rows.
// (f) cal_gap_first / cal_gap_second: what a launch costs after the one
//     before it on the stream. first: grid (SMs), block kThreads; each block
//     spins spin_ns nanoseconds, then thread 0 writes block + 1 to marks[block]
//     and its end time to ends[block]; it lets a dependent launch start at
//     once (ptx::launch_dependents). second: grid (SMs), block kThreads;
//     thread 0 of each block writes its start time, waits for the grid
//     before it (ptx::grid_dependency_wait: at once unless it is a
//     programmatic dependent launch), writes the time after the wait and the
//     sum of every block's mark: out [blocks][3] u64 (start, after the wait,
//     sum), the sum SMs (SMs + 1) / 2 when the wait saw the first grid's
//     writes. The tool times first alone and first + second, eagerly and as
//     a graph, second ordinary and (sm_90) dependent: the difference is the
//     second launch's cost, its gap and its small grid (archs.py launch_us:
//     ~2 - 3 us a kernel node in a graph, an estimate), and the dependent
//     one's release after the first grid (pdl_release_us: 0.7 - 1 us, an
//     estimate; CUDA C++ Programming Guide, 'Programmatic Dependent Launch
//     and Synchronization'). No memory traffic beyond the marks.
#include "../common.cuh"
#include "../ptx.cuh"

// The constants the launches share, defined once in cupaged/tools/calibrate.py (DEFINES) and passed here.
#if !defined(CAL_THREADS) || !defined(CAL_BLOCKS_PER_SM) || !defined(CAL_MMA_CHAINS) || !defined(CAL_CVT_CHAINS) || \
    !defined(CAL_WG_PER_GROUP)
#error "calibrate.cu: its CAL_* constants come from cupaged/tools/calibrate.py (DEFINES)"
#endif

namespace cal {

constexpr u32 kThreads = CAL_THREADS;  // every kernel's block

// SM cycles and global nanoseconds (GPU); a counter on the CPU backend.
__device__ __forceinline__ u64 cycles() {
#if defined(__CUDA_ARCH__)
    return (u64)clock64();
#else
    static u64 n = 0;
    return __atomic_add_fetch(&n, 1ull, __ATOMIC_RELAXED);
#endif
}
__device__ __forceinline__ u64 nanos() {
#if defined(__CUDA_ARCH__)
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#else
    return cycles();
#endif
}

struct Timer {
    u64 c0, n0;
    __device__ __forceinline__ void start() {
        n0 = nanos();
        c0 = cycles();
    }
    // Thread 0 of the block writes its cycles and nanoseconds to clk[block].
    __device__ __forceinline__ void stop(u64* __restrict__ clk) {
        const u64 c1 = cycles(), n1 = nanos();
        if (threadIdx.x == 0) {
            clk[2 * blockIdx.x] = c1 - c0;
            clk[2 * blockIdx.x + 1] = n1 - n0;
        }
    }
};

}  // namespace cal

// The CAL_WGMMA build (sm_90a) holds the wgmma kernels alone; the others are the plain build's.
#ifndef CAL_WGMMA
namespace cal {
constexpr u32 kBlocksPerSm = CAL_BLOCKS_PER_SM;  // the throughput kernels' one wave
constexpr u32 kMmaChains = CAL_MMA_CHAINS;
constexpr u32 kCvtChains = CAL_CVT_CHAINS;
constexpr u32 kLoadsInFlight = 8;  // 16-byte loads a thread issues before it uses one

__device__ __forceinline__ u32 sum4(uint4 v) { return v.x + v.y + v.z + v.w; }

// The block's u32 values summed mod 2^32 (every thread calls it; thread 0 gets it).
__device__ __forceinline__ u32 block_sum(u32 v) {
    __shared__ u32 part[kThreads / 32];
    v = __reduce_add_sync(CP_FULL_MASK, v);
    if ((threadIdx.x & 31u) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    u32 s = 0;
    if (threadIdx.x == 0)
        for (u32 w = 0; w < (blockDim.x + 31u) / 32u; ++w) s += part[w];
    return s;
}

// ---------------------------------------------------------------- (a) mma.sync
template <typename T>
__device__ __forceinline__ void mma_loop(const u32* __restrict__ seed, u32 iters, float* __restrict__ out,
                                         u64* __restrict__ clk) {
    const u32 lane = threadIdx.x & 31u;
    const u32 a[4] = {seed[6 * lane], seed[6 * lane + 1], seed[6 * lane + 2], seed[6 * lane + 3]};
    const u32 b[2] = {seed[6 * lane + 4], seed[6 * lane + 5]};
    float d[kMmaChains][4];
#pragma unroll
    for (u32 c = 0; c < kMmaChains; ++c) d[c][0] = d[c][1] = d[c][2] = d[c][3] = 0.0f;
    Timer t;
    t.start();
    for (u32 it = 0; it < iters; ++it) {
#pragma unroll
        for (u32 c = 0; c < kMmaChains; ++c) ptx::mma_16816<T>(d[c], a, b);
    }
    t.stop(clk);
    float* const o = out + (u64)(blockIdx.x * blockDim.x + threadIdx.x) * (kMmaChains * 4);
#pragma unroll
    for (u32 c = 0; c < kMmaChains; ++c)
#pragma unroll
        for (u32 i = 0; i < 4; ++i) o[4 * c + i] = d[c][i];
}

// ---------------------------------------------------------------- (c) conversions
enum CvtOp : u32 { kCvtF16, kCvtBf16, kCvtE4m3 };

template <u32 kOp>
__device__ __forceinline__ u32 cvt_step(u32 x, u32 y) {
    if constexpr (kOp == kCvtF16) {
        const __half2 h = __floats2half2_rn(__uint_as_float(x), __uint_as_float(y));
        return *reinterpret_cast<const u32*>(&h);
    } else if constexpr (kOp == kCvtBf16) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(__uint_as_float(x), __uint_as_float(y));
        return *reinterpret_cast<const u32*>(&h);
    } else {
        return fp8::x2_to_h2<cp_fp8_e4m3>(x);
    }
}

template <u32 kOp>
__device__ __forceinline__ void cvt_loop(const u32* __restrict__ in, u32 iters, u32* __restrict__ out,
                                         u64* __restrict__ clk) {
    const u64 base = (u64)(blockIdx.x * blockDim.x + threadIdx.x) * (2 * kCvtChains);
    u32 x[kCvtChains], y[kCvtChains];
#pragma unroll
    for (u32 c = 0; c < kCvtChains; ++c) {
        x[c] = in[base + 2 * c];
        y[c] = in[base + 2 * c + 1];
    }
    Timer t;
    t.start();
    for (u32 it = 0; it < iters; ++it) {
#pragma unroll
        for (u32 c = 0; c < kCvtChains; ++c) {
            const u32 nx = cvt_step<kOp>(x[c], y[c]);
            const u32 ny = cvt_step<kOp>(y[c], x[c]);
            x[c] = nx;
            y[c] = ny;
        }
    }
    t.stop(clk);
#pragma unroll
    for (u32 c = 0; c < kCvtChains; ++c) {
        out[base + 2 * c] = x[c];
        out[base + 2 * c + 1] = y[c];
    }
}

// ---------------------------------------------------------------- (e) reads
// Eight 16-byte loads of one thread issued before any is summed.
__device__ __forceinline__ u32 sum8(const uint4 (&v)[kLoadsInFlight]) {
    u32 s = 0;
#pragma unroll
    for (u32 u = 0; u < kLoadsInFlight; ++u) s += sum4(v[u]);
    return s;
}

}  // namespace cal

extern "C" __global__ void __launch_bounds__(cal::kThreads, cal::kBlocksPerSm)
    cal_mma_f16(const u32* __restrict__ seed, u32 iters, float* __restrict__ out, u64* __restrict__ clk) {
    cal::mma_loop<__half>(seed, iters, out, clk);
}
extern "C" __global__ void __launch_bounds__(cal::kThreads, cal::kBlocksPerSm)
    cal_mma_bf16(const u32* __restrict__ seed, u32 iters, float* __restrict__ out, u64* __restrict__ clk) {
    cal::mma_loop<__nv_bfloat16>(seed, iters, out, clk);
}

extern "C" __global__ void __launch_bounds__(cal::kThreads, cal::kBlocksPerSm)
    cal_cvt_f16(const u32* __restrict__ in, u32 iters, u32* __restrict__ out, u64* __restrict__ clk) {
    cal::cvt_loop<cal::kCvtF16>(in, iters, out, clk);
}
extern "C" __global__ void __launch_bounds__(cal::kThreads, cal::kBlocksPerSm)
    cal_cvt_bf16(const u32* __restrict__ in, u32 iters, u32* __restrict__ out, u64* __restrict__ clk) {
    cal::cvt_loop<cal::kCvtBf16>(in, iters, out, clk);
}
extern "C" __global__ void __launch_bounds__(cal::kThreads, cal::kBlocksPerSm)
    cal_cvt_e4m3(const u32* __restrict__ in, u32 iters, u32* __restrict__ out, u64* __restrict__ clk) {
    cal::cvt_loop<cal::kCvtE4m3>(in, iters, out, clk);
}

// (d) Block 0, warp 0: the chase; blocks 1 .. : the loaders (see the opening comment).
extern "C" __global__ void __launch_bounds__(cal::kThreads)
    cal_chase(const u32* __restrict__ next, u32 start, u32 warm, u32 hops, u64* __restrict__ result, volatile u32* done,
              const uint4* __restrict__ load_src, u32 load_chunks, u32 chunk_vecs, u32 max_rounds,
              u32* __restrict__ load_out) {
    if (blockIdx.x == 0) {
        if (threadIdx.x >= 32) return;
        u32 p = start;
        for (u32 i = 0; i < warm; ++i) p = __ldcg(next + p);
        cal::Timer t;
        t.start();
        u64 sum = 0;
        for (u32 i = 0; i < hops; ++i) {
            p = __ldcg(next + p);
            sum += p;
        }
        const u64 c1 = cal::cycles(), n1 = cal::nanos();
        if (threadIdx.x == 0) {
            result[0] = p;
            result[1] = sum;
            result[2] = n1 - t.n0;
            result[3] = c1 - t.c0;
            __threadfence();
            *done = 1u;
        }
        return;
    }
    const u32 b = blockIdx.x - 1, loaders = gridDim.x - 1;
    u32 acc = 0, rounds = 0;
    for (; rounds < max_rounds; ++rounds) {
        if (*done) break;
        const uint4* const src = load_src + (u64)((rounds * loaders + b) % load_chunks) * chunk_vecs;
        u32 j = threadIdx.x;
        for (; j + (cal::kLoadsInFlight - 1) * blockDim.x < chunk_vecs; j += cal::kLoadsInFlight * blockDim.x) {
            uint4 v[cal::kLoadsInFlight];
#pragma unroll
            for (u32 u = 0; u < cal::kLoadsInFlight; ++u) v[u] = ldv(src + j + u * blockDim.x);
#pragma unroll
            for (u32 u = 0; u < cal::kLoadsInFlight; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
        for (; j < chunk_vecs; j += blockDim.x) {
            const uint4 v = ldv(src + j);
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    }
    acc = __reduce_xor_sync(CP_FULL_MASK, acc);
    __shared__ u32 part[cal::kThreads / 32];
    if ((threadIdx.x & 31u) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 x = 0;
        for (u32 w = 0; w < (blockDim.x + 31u) / 32u; ++w) x ^= part[w];
        load_out[2 * b] = x;
        load_out[2 * b + 1] = rounds;
    }
}

// (e) Block (s, h): head h's rows of sequence s, through its page table row.
extern "C" __global__ void __launch_bounds__(cal::kThreads)
    cal_paged_read(const uint4* __restrict__ cache, const u32* __restrict__ table, u32 pages_per_seq, u32 tokens,
                   u32 kv_heads, u32 row_log2, u32 page_log2, u32* __restrict__ sums) {
    const u32 s = blockIdx.x, h = blockIdx.y;
    const u32* const row_table = table + (u64)s * pages_per_seq;
    const u32 n = tokens << row_log2, vec_mask = (1u << row_log2) - 1u, slot_mask = (1u << page_log2) - 1u;
    const u32 step = blockDim.x;
    u32 acc = 0, c = threadIdx.x;
    for (; c + (cal::kLoadsInFlight - 1) * step < n; c += cal::kLoadsInFlight * step) {
        uint4 v[cal::kLoadsInFlight];
#pragma unroll
        for (u32 u = 0; u < cal::kLoadsInFlight; ++u) {
            const u32 cc = c + u * step, token = cc >> row_log2;
            const u64 row = ((u64)row_table[token >> page_log2] << page_log2 | (token & slot_mask)) * kv_heads + h;
            v[u] = __ldcg(cache + (row << row_log2 | (cc & vec_mask)));
        }
        acc += cal::sum8(v);
    }
    for (; c < n; c += step) {
        const u32 token = c >> row_log2;
        const u64 row = ((u64)row_table[token >> page_log2] << page_log2 | (token & slot_mask)) * kv_heads + h;
        acc += cal::sum4(__ldcg(cache + (row << row_log2 | (c & vec_mask))));
    }
    acc = cal::block_sum(acc);
    if (threadIdx.x == 0) sums[(u64)s * kv_heads + h] = acc;
}

// (e) The same bytes read contiguously (grid-stride), passes times over, summed per block.
extern "C" __global__ void __launch_bounds__(cal::kThreads)
    cal_read(const uint4* __restrict__ src, u64 n, u32 passes, u32* __restrict__ sums) {
    const u64 step = (u64)gridDim.x * blockDim.x;
    u32 acc = 0;
    for (u32 pass = 0; pass < passes; ++pass) {
        u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
        for (; i + (cal::kLoadsInFlight - 1) * step < n; i += cal::kLoadsInFlight * step) {
            uint4 v[cal::kLoadsInFlight];
#pragma unroll
            for (u32 u = 0; u < cal::kLoadsInFlight; ++u) v[u] = __ldcg(src + i + u * step);
            acc += cal::sum8(v);
        }
        for (; i < n; i += step) acc += cal::sum4(__ldcg(src + i));
    }
    acc = cal::block_sum(acc);
    if (threadIdx.x == 0) sums[blockIdx.x] = acc;
}

// (e) A grid-stride 16-byte copy of n vectors.
extern "C" __global__ void __launch_bounds__(cal::kThreads)
    cal_copy(const uint4* __restrict__ src, uint4* __restrict__ dst, u64 n) {
    const u64 step = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + (cal::kLoadsInFlight - 1) * step < n; i += cal::kLoadsInFlight * step) {
        uint4 v[cal::kLoadsInFlight];
#pragma unroll
        for (u32 u = 0; u < cal::kLoadsInFlight; ++u) v[u] = ldv(src + i + u * step);
#pragma unroll
        for (u32 u = 0; u < cal::kLoadsInFlight; ++u) stv(dst + i + u * step, v[u]);
    }
    for (; i < n; i += step) stv(dst + i, ldv(src + i));
}

// (f) Two launches back to back: the first spins, marks and stamps its end; the second stamps its start and the
// end of its wait, and sums the marks.
extern "C" __global__ void __launch_bounds__(cal::kThreads)
    cal_gap_first(u64 spin_ns, u32* __restrict__ marks, u64* __restrict__ ends) {
    ptx::launch_dependents();
    const u64 t0 = cal::nanos();
    if (threadIdx.x == 0)
        while (cal::nanos() - t0 < spin_ns) {
        }
    __syncthreads();
    if (threadIdx.x == 0) {
        marks[blockIdx.x] = blockIdx.x + 1;
        ends[blockIdx.x] = cal::nanos();
    }
}
extern "C" __global__ void __launch_bounds__(cal::kThreads)
    cal_gap_second(const u32* __restrict__ marks, u32 blocks, u64* __restrict__ out) {
    const u64 t0 = cal::nanos();
    ptx::grid_dependency_wait();
    if (threadIdx.x == 0) {
        const u64 t1 = cal::nanos();
        u64 sum = 0;
        for (u32 b = 0; b < blocks; ++b) sum += marks[b];
        out[3 * blockIdx.x] = t0;
        out[3 * blockIdx.x + 1] = t1;
        out[3 * blockIdx.x + 2] = sum;
    }
}

#else
// ---------------------------------------------------------------- (b) wgmma (sm_90a builds)
namespace cal {
// A at the 1024-byte boundary of dynamic shared memory, B 2048 bytes after it.
constexpr u32 kWgPerGroup = CAL_WG_PER_GROUP;  // wgmma a group
static_assert(kThreads % 128 == 0, "whole warpgroups");
constexpr u32 kWgA = 64u * 16u * 2u;
constexpr u32 kWgLbo = 128u, kWgSbo = 256u;

template <typename T, u32 kN>
__device__ __forceinline__ void wgmma_loop(const u32* __restrict__ seed, u32 iters, float* __restrict__ out,
                                           u64* __restrict__ clk) {
    CUPAGED_DYNAMIC_SHARED(unsigned char, smem_raw);
    unsigned char* const base = reinterpret_cast<unsigned char*>((reinterpret_cast<u64>(smem_raw) + 1023) & ~1023ull);
    constexpr u32 kWords = (kWgA + kN * 32u) / 4u;
    for (u32 i = threadIdx.x; i < kWords; i += blockDim.x) reinterpret_cast<u32*>(base)[i] = seed[i & 63u];
    ptx::fence_proxy_async_shared();
    __syncthreads();
    const u64 da = ptx::wgmma_desc(base, kWgLbo, kWgSbo, ptx::kSwizzleNone);
    const u64 db = ptx::wgmma_desc(base + kWgA, kWgLbo, kWgSbo, ptx::kSwizzleNone);
    float d[kN / 2];
#pragma unroll
    for (u32 i = 0; i < kN / 2; ++i) d[i] = 0.0f;
    Timer t;
    t.start();
    ptx::wgmma_fence_operand(d);
    ptx::wgmma_fence();
#pragma unroll 1
    for (u32 it = 0; it < iters; ++it) {
#pragma unroll
        for (u32 j = 0; j < kWgPerGroup; ++j) ptx::wgmma_ss<T, kN, 0, 0>(d, da, db, true);
        ptx::wgmma_commit();
        ptx::wgmma_wait<1>();
    }
    ptx::wgmma_wait<0>();
    ptx::wgmma_fence_operand(d);
    t.stop(clk);
    float* const o = out + (u64)(blockIdx.x * blockDim.x + threadIdx.x) * (kN / 2);
#pragma unroll
    for (u32 i = 0; i < kN / 2; ++i) o[i] = d[i];
}
}  // namespace cal

// One kernel a (type, N), written out: the GPU backend finds kernels by their names in the text.
extern "C" __global__ void __launch_bounds__(cal::kThreads, 1)
    cal_wgmma_bf16_n32(const u32* __restrict__ seed, u32 iters, float* __restrict__ out, u64* __restrict__ clk) {
    cal::wgmma_loop<__nv_bfloat16, 32>(seed, iters, out, clk);
}
extern "C" __global__ void __launch_bounds__(cal::kThreads, 1)
    cal_wgmma_bf16_n64(const u32* __restrict__ seed, u32 iters, float* __restrict__ out, u64* __restrict__ clk) {
    cal::wgmma_loop<__nv_bfloat16, 64>(seed, iters, out, clk);
}
extern "C" __global__ void __launch_bounds__(cal::kThreads, 1)
    cal_wgmma_bf16_n256(const u32* __restrict__ seed, u32 iters, float* __restrict__ out, u64* __restrict__ clk) {
    cal::wgmma_loop<__nv_bfloat16, 256>(seed, iters, out, clk);
}
extern "C" __global__ void __launch_bounds__(cal::kThreads, 1)
    cal_wgmma_f16_n256(const u32* __restrict__ seed, u32 iters, float* __restrict__ out, u64* __restrict__ clk) {
    cal::wgmma_loop<__half, 256>(seed, iters, out, clk);
}
#endif
