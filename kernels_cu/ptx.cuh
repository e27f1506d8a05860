// ptx.cuh: every piece of inline PTX cupaged uses, each behind a small
// __device__ function: the tensor-core product mma.sync m16n8k16 (f16 / bf16
// inputs, f32 accumulate), ldmatrix (8x8 tiles of 16-bit elements from shared
// memory into mma fragments, plain and transposed) and cp.async (16-byte
// global -> shared copies that do not occupy registers, with zero fill).
//
// Each helper has a CPU version under CUPAGED_CPU (defined only by the g++
// shim, kernels_cu/shim/cupaged_shim.h; this is the one file in kernels_cu/
// that may mention it). The warp-wide instructions run there through
// cupaged_warp_collective: every lane posts its registers, the last lane to
// arrive computes the instruction for the whole warp with the fragment
// layouts of the PTX ISA, so the CPU result is what the GPU computes, up to
// the order of the f32 additions inside one mma. cp.async copies are queued
// per thread there and land at the cp.async.wait_group that covers them,
// the latest point a GPU allows, so a read that comes too early reads stale
// data on the CPU too; the __syncthreads a kernel needs after the wait on a
// GPU stays in the kernel (it also publishes the copies to other threads).
// Built with CUPAGED_CP_ASYNC_EAGER (the CPU backend's
// CUPAGED_CPU_CP_ASYNC=eager, a per-process choice) copies land instead at
// issue, the earliest point a GPU allows: a copy issued into a buffer that
// is still being read then overwrites it, so a pipeline that refills a
// stage before its readers are done fails there. The test suite runs every
// tensor-core kernel in both modes. Both addresses of a copy are checked for
// 16-byte alignment (a GPU faults on a misaligned cp.async; x86 would not).
// The CPU versions also count what they execute (cpu::Counter below: one
// count per warp-wide mma / ldmatrix, one per thread's cp.async), readable
// from Python through cupaged_ptx_counters() in the module; the performance
// model (cupaged/tools/counters.py) reads them. The GPU versions count nothing.
//
// Fragments of mma.sync.aligned.m16n8k16.row.col (PTX ISA, "Matrix
// Fragments for mma.m16n8k16 with floating point type"); lane = 4 * g + t,
// g = lane >> 2 (group), t = lane & 3 (thread in group); a u32 register holds
// two 16-bit elements, the lower-indexed one in its low half:
//   A [16 x 16] row-major: a[0] row g,   cols 2t, 2t+1     a[2] row g,   cols 2t+8, 2t+9
//                          a[1] row g+8, cols 2t, 2t+1     a[3] row g+8, cols 2t+8, 2t+9
//   B [16 x 8] (k x n):    b[0] rows 2t, 2t+1, col g       b[1] rows 2t+8, 2t+9, col g
//   C, D [16 x 8] f32:     c[0], c[1] row g, cols 2t, 2t+1;  c[2], c[3] row g+8, same cols
// ldmatrix.x4: lanes 8i .. 8i+7 give the 8 row addresses (16 bytes each) of
// tile i; register i of lane l receives row l>>2, elements 2(l&3), 2(l&3)+1
// of tile i, or with .trans its column l>>2, rows 2(l&3), 2(l&3)+1. So the
// tiles (rows 0-7, cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) of a
// row-major 16x16 block give its A fragment; the tiles of a [n][k] block
// give B fragments directly, those of a [k][n] block through .trans.
#pragma once
#include "common.cuh"

namespace ptx {

// Two floats as one register of two 16-bit T (f16 or bf16), lo in the low half.
template <typename T> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<__half>(float lo, float hi) {
    return (u32)__half_as_ushort(__float2half_rn(lo)) | ((u32)__half_as_ushort(__float2half_rn(hi)) << 16);
}
template <> __device__ __forceinline__ u32 pack2<__nv_bfloat16>(float lo, float hi) {
    return (u32)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           ((u32)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}

#ifdef CUPAGED_CPU
// ---------------------------------------------------------------- CPU versions
namespace cpu {
// Execution counters of this module's helpers (relaxed atomics: blocks run on
// several workers). Order and names: cupaged_ptx_counter_names().
enum Counter : int { kMma16816, kLdmatrixX4, kLdmatrixX4Trans, kCpAsync16, kCpAsync16Zero, kNumCounters };
inline unsigned long long counters[kNumCounters];
inline void count(Counter c) { __atomic_fetch_add(&counters[c], 1ull, __ATOMIC_RELAXED); }
inline float half_bits_to_float(unsigned short b, __half*) { return __half2float(__ushort_as_half(b)); }
inline float half_bits_to_float(unsigned short b, __nv_bfloat16*) {
    return __bfloat162float(__ushort_as_bfloat16(b));
}
template <typename T> inline float elem(u32 reg, int hi) {
    return half_bits_to_float((unsigned short)(hi ? reg >> 16 : reg & 0xffffu), (T*)nullptr);
}

struct MmaLane {
    const u32* a;
    const u32* b;
    float* d;
};

// D = A B + D for the whole warp, from the fragments every lane posted.
template <typename T> inline void mma_16816_warp(void** lanes, unsigned, void*) {
    count(kMma16816);
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
        const MmaLane* p = static_cast<const MmaLane*>(lanes[l]);
        const int g = l >> 2, t = l & 3;
        for (int h = 0; h < 2; ++h) {
            A[g][2 * t + h] = elem<T>(p->a[0], h);
            A[g + 8][2 * t + h] = elem<T>(p->a[1], h);
            A[g][2 * t + 8 + h] = elem<T>(p->a[2], h);
            A[g + 8][2 * t + 8 + h] = elem<T>(p->a[3], h);
            B[2 * t + h][g] = elem<T>(p->b[0], h);
            B[2 * t + 8 + h][g] = elem<T>(p->b[1], h);
        }
    }
    for (int l = 0; l < 32; ++l) {
        float* d = static_cast<const MmaLane*>(lanes[l])->d;
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
            float acc = d[i];   // 16-bit products are exact in f32; only the sum rounds
            for (int k = 0; k < 16; ++k) acc = fmaf(A[row][k], B[k][col], acc);
            d[i] = acc;
        }
    }
}

struct LdmLane {
    const unsigned short* row;
    u32* r;
};

template <bool Trans> inline void ldmatrix_x4_warp(void** lanes, unsigned, void*) {
    count(Trans ? kLdmatrixX4Trans : kLdmatrixX4);
    u32 out[32][4];
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 4; ++i) {
            unsigned lo, hi;
            if (!Trans) {
                const unsigned short* row = static_cast<const LdmLane*>(lanes[8 * i + g])->row;
                lo = row[2 * t];
                hi = row[2 * t + 1];
            } else {
                lo = static_cast<const LdmLane*>(lanes[8 * i + 2 * t])->row[g];
                hi = static_cast<const LdmLane*>(lanes[8 * i + 2 * t + 1])->row[g];
            }
            out[l][i] = lo | (hi << 16);
        }
    }
    // Written only after every lane's rows are read: a lane's registers may
    // alias nothing in shared memory, but keep the instruction's all-read-
    // then-write semantics anyway.
    for (int l = 0; l < 32; ++l)
        for (int i = 0; i < 4; ++i) static_cast<const LdmLane*>(lanes[l])->r[i] = out[l][i];
}
}  // namespace cpu

// The counters of this module, for Python (ctypes): a pointer to
// cpu::kNumCounters unsigned 64-bit counts (writable: Python zeroes them),
// their comma-separated names, in order.
extern "C" __attribute__((visibility("default"), used)) inline unsigned long long* cupaged_ptx_counters() {
    return cpu::counters;
}
extern "C" __attribute__((visibility("default"), used)) inline const char* cupaged_ptx_counter_names() {
    return "mma_16816,ldmatrix_x4,ldmatrix_x4_trans,cp_async_16,cp_async_16_zero";
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    cpu::MmaLane me{a, b, d};
    cupaged_warp_collective(CP_FULL_MASK, &me, &cpu::mma_16816_warp<T>, nullptr);
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* smem_row) {
    cpu::LdmLane me{static_cast<const unsigned short*>(smem_row), r};
    cupaged_warp_collective(CP_FULL_MASK, &me, &cpu::ldmatrix_x4_warp<false>, nullptr);
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* smem_row) {
    cpu::LdmLane me{static_cast<const unsigned short*>(smem_row), r};
    cupaged_warp_collective(CP_FULL_MASK, &me, &cpu::ldmatrix_x4_warp<true>, nullptr);
}

// cp.async: each thread queues its copies; commit closes a group; wait<N>
// performs the copies of every committed group but the newest N. So a copy
// lands at the latest moment the GPU allows, and a kernel that reads shared
// memory before the wait (and barrier) that the GPU needs reads stale data
// here too. Queues are per thread of the block on each worker, reset when a
// thread of another block (or kernel) starts copying.
namespace cpu {
constexpr unsigned kMaxAsync = 96;   // queued copies per thread; beyond, the oldest lands at once
struct AsyncCopy {
    void* dst;
    const void* src;   // null: 16 zero bytes
    unsigned group;
};
struct AsyncQueue {
    const char* kernel;
    uint3 bid;
    unsigned n, committed;
    AsyncCopy q[kMaxAsync];
};
inline void land(const AsyncCopy& c) {
    if (c.src) memcpy(c.dst, c.src, 16);
    else memset(c.dst, 0, 16);
}
inline AsyncQueue& async_queue() {
    static thread_local AsyncQueue* table = nullptr;   // one queue per thread of a block, per worker
    if (!table) table = static_cast<AsyncQueue*>(calloc(::cupaged::kMaxThreadsPerBlock, sizeof(AsyncQueue)));
    const ::cupaged::FiberPub* f = ::cupaged::cur();
    AsyncQueue& aq = table[f->linear];
    const uint3 b = f->block->bid;
    if (aq.kernel != f->block->kernel || aq.bid.x != b.x || aq.bid.y != b.y || aq.bid.z != b.z) {
        aq.kernel = f->block->kernel;
        aq.bid = b;
        aq.n = aq.committed = 0;
    }
    return aq;
}
// Land every queued copy of a group older than the newest `keep` committed ones.
inline void async_wait(unsigned keep) {
    AsyncQueue& aq = async_queue();
    unsigned m = 0;
    for (unsigned i = 0; i < aq.n; ++i) {
        if (aq.q[i].group + keep < aq.committed) land(aq.q[i]);
        else aq.q[m++] = aq.q[i];
    }
    aq.n = m;
}
}  // namespace cpu

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid CUPAGED_SRC_LOC) {
    cpu::count(valid ? cpu::kCpAsync16 : cpu::kCpAsync16Zero);
    CUPAGED_CHECK_ALIGNED(smem, 16, "cp.async shared-memory destination");
    if (valid) CUPAGED_CHECK_ALIGNED(gmem, 16, "cp.async global source");
#ifdef CUPAGED_CP_ASYNC_EAGER
    cpu::land(cpu::AsyncCopy{smem, valid ? gmem : nullptr, 0u});   // lands at issue
    return;
#endif
    cpu::AsyncQueue& aq = cpu::async_queue();
    if (aq.n == cpu::kMaxAsync) {   // full: the oldest copy lands now (a GPU may land any copy early)
        cpu::land(aq.q[0]);
        memmove(&aq.q[0], &aq.q[1], (cpu::kMaxAsync - 1) * sizeof(cpu::AsyncCopy));
        --aq.n;
    }
    aq.q[aq.n++] = cpu::AsyncCopy{smem, valid ? gmem : nullptr, aq.committed};
}
__device__ __forceinline__ void cp_async_commit() { ++cpu::async_queue().committed; }
template <int N> __device__ __forceinline__ void cp_async_wait() { cpu::async_wait((unsigned)N); }

#else
// ---------------------------------------------------------------- GPU versions
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// d += a b, [16 x 16] x [16 x 8], f32 accumulate.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8x8 tiles of 16-bit elements; smem_row: this lane's row (16-byte aligned).
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(smem_row)));
}

// 16 bytes global -> shared, bypassing L1 (.cg); !valid writes 16 zero bytes
// and reads nothing (source size 0). Both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(smem)), "l"(gmem), "r"(valid ? 16u : 0u) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}
#endif

}  // namespace ptx
