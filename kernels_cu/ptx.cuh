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

// x << s for 0 <= s <= 64, 0 at 64 (PTX shl.b64 clamps the shift at the register's width; C++ leaves a
// shift by 64 undefined, so the CPU version says so itself).
#ifdef CUPAGED_CPU
__device__ __forceinline__ u64 shl64(u64 x, u32 s) { return s >= 64 ? 0ull : x << s; }
#else
__device__ __forceinline__ u64 shl64(u64 x, u32 s) {
    u64 r;
    asm("shl.b64 %0, %1, %2;" : "=l"(r) : "l"(x), "r"(s));
    return r;
}
#endif

// Two floats as one register of two 16-bit T (f16 or bf16), lo in the low half.
template <typename T>
__device__ __forceinline__ u32 pack2(float lo, float hi);
template <>
__device__ __forceinline__ u32 pack2<__half>(float lo, float hi) {
    return (u32)__half_as_ushort(__float2half_rn(lo)) | ((u32)__half_as_ushort(__float2half_rn(hi)) << 16);
}
template <>
__device__ __forceinline__ u32 pack2<__nv_bfloat16>(float lo, float hi) {
    return (u32)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           ((u32)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}

#ifdef CUPAGED_CPU
// ---------------------------------------------------------------- CPU versions
namespace cpu {
// Execution counters of this module's helpers (relaxed atomics: blocks run on
// several workers). Order and names: cupaged_ptx_counter_names(). They count
// once cupaged_ptx_counting(1) has been called (cupaged.tools.counters.reset
// does): until then a count is a test of a flag no worker writes, not an
// atomic add whose cache line the workers pass back and forth (that traffic
// took ~12% of paged_prefill_simt's CPU time, a count per cp.async).
enum Counter : int { kMma16816, kLdmatrixX4, kLdmatrixX4Trans, kCpAsync16, kCpAsync16Zero, kNumCounters };
inline unsigned long long counters[kNumCounters];
inline bool counting = false;
inline void count(Counter c) {
    if (__builtin_expect(counting, false)) __atomic_fetch_add(&counters[c], 1ull, __ATOMIC_RELAXED);
}
inline float half_bits_to_float(unsigned short b, __half*) { return __half2float(__ushort_as_half(b)); }
inline float half_bits_to_float(unsigned short b, __nv_bfloat16*) { return __bfloat162float(__ushort_as_bfloat16(b)); }
template <typename T>
inline float elem(u32 reg, int hi) {
    return half_bits_to_float((unsigned short)(hi ? reg >> 16 : reg & 0xffffu), (T*)nullptr);
}

struct MmaLane {
    const u32* a;
    const u32* b;
    float* d;
};

// D = A B + D for the whole warp, from the fragments every lane posted.
template <typename T>
inline void mma_16816_warp(void** lanes, unsigned, void*) {
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
            float acc = d[i];  // 16-bit products are exact in f32; only the sum rounds
            for (int k = 0; k < 16; ++k) acc = fmaf(A[row][k], B[k][col], acc);
            d[i] = acc;
        }
    }
}

struct LdmLane {
    const unsigned short* row;
    u32* r;
};

template <bool Trans>
inline void ldmatrix_x4_warp(void** lanes, unsigned, void*) {
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
// Counting on (on != 0) or off, for this module's ptx and wgmma counters.
extern "C" __attribute__((visibility("default"), used)) inline void cupaged_ptx_counting(int on) {
    cpu::counting = on != 0;
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
// here too. A thread's queue lives in its fiber's local storage (FiberPub::local: no thread-local lookup), reset
// when the fiber starts copying in another block (or kernel).
namespace cpu {
constexpr unsigned kMaxAsync = 160;  // queued copies per thread; beyond, the oldest lands at once
struct AsyncCopy {
    void* dst;
    const void* src;  // null: 16 zero bytes
    unsigned group;
};
struct AsyncQueue {
    unsigned long long serial;  // BlockPub::serial of the block that queued these
    unsigned n, committed;
    AsyncCopy q[kMaxAsync];
};
static_assert(sizeof(AsyncQueue) <= ::cupaged::kFiberLocalBytes, "the cp.async queue fits a fiber's local storage");
inline void land(const AsyncCopy& c) {
    if (c.src)
        memcpy(c.dst, c.src, 16);
    else
        memset(c.dst, 0, 16);
}
inline AsyncQueue& async_queue() {
    const ::cupaged::FiberPub* f = ::cupaged::cur();
    AsyncQueue& aq = *static_cast<AsyncQueue*>(f->local);
    if (aq.serial != f->block->serial) {
        aq.serial = f->block->serial;
        aq.n = aq.committed = 0;
    }
    return aq;
}
// Land every queued copy of a group older than the newest `keep` committed ones.
inline void async_wait(unsigned keep) {
    AsyncQueue& aq = async_queue();
    unsigned m = 0;
    for (unsigned i = 0; i < aq.n; ++i) {
        if (aq.q[i].group + keep < aq.committed)
            land(aq.q[i]);
        else
            aq.q[m++] = aq.q[i];
    }
    aq.n = m;
}
}  // namespace cpu

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid CUPAGED_SRC_LOC) {
    cpu::count(valid ? cpu::kCpAsync16 : cpu::kCpAsync16Zero);
    CUPAGED_CHECK_ALIGNED(smem, 16, "cp.async shared-memory destination");
    if (valid) CUPAGED_CHECK_ALIGNED(gmem, 16, "cp.async global source");
#ifdef CUPAGED_CP_ASYNC_EAGER
    cpu::land(cpu::AsyncCopy{smem, valid ? gmem : nullptr, 0u});  // lands at issue
    return;
#endif
    cpu::AsyncQueue& aq = cpu::async_queue();
    if (aq.n == cpu::kMaxAsync) {  // full: the oldest copy lands now (a GPU may land any copy early)
        cpu::land(aq.q[0]);
        memmove(&aq.q[0], &aq.q[1], (cpu::kMaxAsync - 1) * sizeof(cpu::AsyncCopy));
        --aq.n;
    }
    aq.q[aq.n++] = cpu::AsyncCopy{smem, valid ? gmem : nullptr, aq.committed};
}
__device__ __forceinline__ void cp_async_commit() { ++cpu::async_queue().committed; }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    cpu::async_wait((unsigned)N);
}

#else
// ---------------------------------------------------------------- GPU versions
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// d += a b, [16 x 16] x [16 x 8], f32 accumulate.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]);
// One specialization per 16-bit input type, from one template (CT the C++
// type, TYPE its PTX type token).
#define CP_MMA_16816(CT, TYPE)                                                                         \
    template <>                                                                                        \
    __device__ __forceinline__ void mma_16816<CT>(float (&d)[4], const u32(&a)[4], const u32(&b)[2]) { \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." #TYPE "." #TYPE                          \
                     ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"          \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                  \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));              \
    }
CP_MMA_16816(__half, f16)
CP_MMA_16816(__nv_bfloat16, bf16)
#undef CP_MMA_16816

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
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                 "r"(valid ? 16u : 0u)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

// ============================================================================
// wgmma (sm_90a): warpgroup matrix products with shared-memory operand
// descriptors. A separate block from the helpers above (it has its own CPU
// emulation and counters); GPU versions exist only when compiling for sm_90a
// (the kernels that use them are registered for sm_90a alone).
//
// PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"
// (9.7.15): a warpgroup is 4 consecutive warps (warp w of a block is warp
// w % 4 of warpgroup w / 4); wgmma.mma_async.m64nNk16 computes
// D [64 x N] (+)= A [64 x 16] B [16 x N] with f32 D in registers, A from
// registers or shared memory, B from shared memory. Fragments:
//   D: warp w4 of the warpgroup holds rows 16 w4 .. 16 w4 + 15; lane 4g + t
//      holds d[4j + 0], d[4j + 1] = row g, cols 8j + 2t, 8j + 2t + 1 and
//      d[4j + 2], d[4j + 3] = row g + 8, same cols (j < N / 8): the mma.sync
//      C fragment repeated along N.
//   A from registers: warp w4 holds rows 16 w4 .. + 15 in the mma.sync
//      m16n8k16 A fragment (a[0] row g cols 2t.., a[1] row g + 8, a[2] row g
//      cols 8 + 2t.., a[3] row g + 8 cols 8 + 2t..).
// Shared-memory operands (9.7.15.5.1.2) are described by a 64-bit matrix
// descriptor: bits 0-13 start address, 16-29 leading dimension byte offset
// (LBO), 32-45 stride dimension byte offset (SBO), each (x & 0x3FFFF) >> 4;
// 49-51 base offset (0 here: every swizzle pattern starts on its own
// boundary); 62-63 swizzle (0 none, 1 128-byte, 2 64-byte, 3 32-byte). The
// canonical layouts, in elements of 16 bits (T = 8 elements = 16 bytes) and
// CuTe notation, with the swizzle Swizzle<B, 4, 3> on byte addresses (bits
// 4 .. 4 + B of the address XOR bits 7 .. 7 + B; B = 3 / 2 / 1 / 0 for 128 /
// 64 / 32-byte / none):
//   K-major, none:     ((8, m), (T, 2k)) : ((T, SBO), (1, LBO))
//   K-major, swizzled: ((8, m), (T, 2k)) : ((2^B T, SBO), (1, T))
//   MN-major, none:    ((T, 1, m), (8, k)) : ((1, T, SBO), (T, LBO))
//   MN-major, swizzled:((T, 2^B, m), (8, k)) : ((1, T, LBO), (2^B T, SBO))
// where the first mode is the M (A) or N (B) index and the second the K
// index; K-major is imm-trans = 0, MN-major imm-trans = 1 (16-bit types).
// wgmma.fence orders register accesses before the first wgmma of a
// sequence; commit_group closes a group of this warp's wgmma; wait_group<N>
// waits until at most N groups are pending: only then may D be read, and
// the operands' shared memory be written.
//
// CPU emulation: every warp computes its 16 rows through
// cupaged_warp_collective (the last lane to arrive reads A and B with the
// layouts above, from the calling worker's shared memory window); the
// product is queued per warp and runs at the wait_group that covers it, the
// latest point a GPU allows (so D read before the wait, or an operand
// overwritten before it, shows on the CPU too). Counted per warp part:
// wgmma (instructions), wgmma_flop (2 x 16 x N x 16) and wgmma_smem_bytes
// (A from shared memory: 16 rows x 32 bytes; B: N x 32 bytes shared by the
// warpgroup's 4 warps, a quarter each), readable through
// cupaged_wgmma_counters().

enum : u32 { kSwizzleNone = 0u, kSwizzle128B = 1u, kSwizzle64B = 2u, kSwizzle32B = 3u };

__device__ __forceinline__ u64 wgmma_encode(u32 x) { return (u64)((x & 0x3FFFFu) >> 4); }
// Descriptor d with its start address moved by off 16-byte units: a 32-bit add (the start address field,
// bits 0-13, stays below 2^14 for shared memory: no carry out of the low word), so a descriptor kept in
// uniform registers stays there (a 64-bit add costs a carry chain and the moves back to uniform registers).
__device__ __forceinline__ u64 wgmma_desc_at(u64 d, u32 off) { return (u64)(u32)(d >> 32) << 32 | (u32)((u32)d + off); }

// This thread's shared-memory writes (st.shared, and cp.async copies once
// waited for: generic-proxy writes) made visible to the async proxy that
// wgmma.mma_async reads shared memory through (PTX ISA: a cross-proxy
// fence); each writer issues it before the barrier that precedes the wgmma.
// A no-op on the CPU and below sm_90 (no async proxy there).
__device__ __forceinline__ void fence_proxy_async_shared() {
#if !defined(CUPAGED_CPU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Programmatic dependent launch (PTX ISA griddepcontrol; CUDA Programming
// Guide, "Programmatic Dependent Launch and Synchronization"). A kernel
// launched with programmatic stream serialization (Stream.launch(...,
// dependent=True): cuLaunchKernelEx on sm_90 and later) may start while the
// grid before it on the stream still runs; grid_dependency_wait() returns once
// that grid has completed and its memory is visible, so such a kernel calls
// it before its first global access (tests/tools/test_dependent_launch.py
// reads the PTX for it). launch_dependents() lets the dependent grid's blocks
// start now instead of when this grid's blocks exit; it changes nothing this
// grid computes. Both are no-ops on the CPU (launches run in order) and below
// sm_90, and when the launch has no dependent.
__device__ __forceinline__ void grid_dependency_wait() {
#if !defined(CUPAGED_CPU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void launch_dependents() {
#if !defined(CUPAGED_CPU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

#ifdef CUPAGED_CPU
namespace cpu {
enum WgCounter : int { kWgmma, kWgmmaFlop, kWgmmaSmemBytes, kNumWgCounters };
inline unsigned long long wg_counters[kNumWgCounters];
inline void wg_count(WgCounter c, unsigned long long n) {
    if (__builtin_expect(counting, false)) __atomic_fetch_add(&wg_counters[c], n, __ATOMIC_RELAXED);
}
// The shared-memory window of the calling worker: its dynamic shared memory,
// from a 1024-byte boundary, so that address bits 4-9 (the swizzles) are the
// pointer's own.
inline unsigned char* wg_window() {
    return reinterpret_cast<unsigned char*>(reinterpret_cast<uintptr_t>(cupaged_rt_dynamic_shared()) &
                                            ~(uintptr_t)1023);
}
inline u32 wg_shared_address(const void* p) { return (u32)(static_cast<const unsigned char*>(p) - wg_window()); }
// Element (mn, k) of a shared-memory operand (16-bit elements): its byte
// address in the window, from the descriptor and the canonical layouts.
inline u32 wg_address(u64 desc, u32 mn, u32 k, u32 trans) {
    const u32 start = (u32)(desc & 0x3FFFu) << 4;
    const u32 lbo = (u32)((desc >> 16) & 0x3FFFu) << 4;
    const u32 sbo = (u32)((desc >> 32) & 0x3FFFu) << 4;
    const u32 mode = (u32)(desc >> 62) & 3u;
    const u32 b = mode == 1u ? 3u : mode == 2u ? 2u : mode == 3u ? 1u : 0u;
    u32 off;
    if (!trans) {  // K-major
        off = b ? (mn % 8) * (16u << b) + (mn / 8) * sbo + (k % 8) * 2 + (k / 8) * 16
                : (mn % 8) * 16 + (mn / 8) * sbo + (k % 8) * 2 + (k / 8) * lbo;
    } else {  // MN-major
        const u32 w = 8u << b;  // elements along MN in one swizzle row
        off = b ? (mn % w) * 2 + (mn / w) * lbo + (k % 8) * (16u << b) + (k / 8) * sbo
                : (mn % 8) * 2 + (mn / 8) * sbo + (k % 8) * 16 + (k / 8) * lbo;
    }
    const u32 a = start + off;
    const u32 mask = (1u << b) - 1u;
    return a ^ (((a >> 7) & mask) << 4);
}
template <typename T>
inline float wg_elem(u64 desc, u32 mn, u32 k, u32 trans) {
    unsigned short bits;
    memcpy(&bits, wg_window() + wg_address(desc, mn, k, trans), 2);
    return half_bits_to_float(bits, (T*)nullptr);
}

struct WgLane {
    float* d;
    u32 a[4];
    u64 da, db;
    u32 warp4;  // this warp within its warpgroup
};
struct WgOp {
    float* d[32];
    u32 a[32][4];
    u64 da, db;
    u32 n, warp4, group;
    bool rs, acc;
    unsigned char ta, tb, bf16;
};
constexpr unsigned kMaxWgOps = 48;  // queued per warp; beyond, the oldest runs at once
struct WgQueue {
    const char* kernel;
    uint3 bid;
    unsigned n, committed;
    WgOp q[kMaxWgOps];
};
inline WgQueue& wg_queue() {
    static thread_local WgQueue* table[::cupaged::kMaxThreadsPerBlock / 32] = {};
    const ::cupaged::FiberPub* f = ::cupaged::cur();
    WgQueue*& slot = table[f->linear / 32];
    if (!slot) slot = static_cast<WgQueue*>(calloc(1, sizeof(WgQueue)));
    const uint3 b = f->block->bid;
    if (slot->kernel != f->block->kernel || slot->bid.x != b.x || slot->bid.y != b.y || slot->bid.z != b.z) {
        slot->kernel = f->block->kernel;
        slot->bid = b;
        slot->n = slot->committed = 0;
    }
    return *slot;
}
template <typename T>
inline void wg_run_t(const WgOp& op) {
    float A[16][16];
    for (int r = 0; r < 16; ++r)
        for (int k = 0; k < 16; ++k) {
            if (op.rs) {
                const int l = 4 * (r % 8) + (k % 8) / 2, reg = (r / 8) + 2 * (k / 8);
                A[r][k] = elem<T>(op.a[l][reg], k & 1);
            } else {
                A[r][k] = wg_elem<T>(op.da, 16 * op.warp4 + r, k, op.ta);
            }
        }
    float B[16][256];
    for (u32 k = 0; k < 16; ++k)
        for (u32 c = 0; c < op.n; ++c) B[k][c] = wg_elem<T>(op.db, c, k, op.tb);
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        float* d = op.d[l];
        for (u32 j = 0; j < op.n / 8; ++j)
            for (int i = 0; i < 4; ++i) {
                const int row = g + 8 * (i >> 1), col = 8 * j + 2 * t + (i & 1);
                float acc = op.acc ? d[4 * j + i] : 0.0f;  // 16-bit products are exact in f32; only the sum rounds
                for (int k = 0; k < 16; ++k) acc = fmaf(A[row][k], B[k][col], acc);
                d[4 * j + i] = acc;
            }
    }
    wg_count(kWgmma, 1);
    wg_count(kWgmmaFlop, 2ull * 16 * op.n * 16);
    wg_count(kWgmmaSmemBytes, (op.rs ? 0u : 16u * 32u) + op.n * 32u / 4u);
}
inline void wg_run(const WgOp& op) {
    if (op.bf16)
        wg_run_t<__nv_bfloat16>(op);
    else
        wg_run_t<__half>(op);
}
struct WgIssue {
    u32 n;
    bool rs, acc;
    unsigned char ta, tb, bf16;
};
inline void wg_issue_warp(void** lanes, unsigned, void* ctx) {
    const WgIssue& is = *static_cast<const WgIssue*>(ctx);
    WgQueue& wq = wg_queue();
    if (wq.n == kMaxWgOps) {  // full: the oldest runs now (a GPU may complete any wgmma early)
        wg_run(wq.q[0]);
        memmove(&wq.q[0], &wq.q[1], (kMaxWgOps - 1) * sizeof(WgOp));
        --wq.n;
    }
    WgOp& op = wq.q[wq.n++];
    const WgLane* l0 = static_cast<const WgLane*>(lanes[0]);
    for (int l = 0; l < 32; ++l) {
        const WgLane* p = static_cast<const WgLane*>(lanes[l]);
        op.d[l] = p->d;
        for (int i = 0; i < 4; ++i) op.a[l][i] = p->a[i];
    }
    op.da = l0->da;
    op.db = l0->db;
    op.n = is.n;
    op.warp4 = l0->warp4;
    op.group = wq.committed;
    op.rs = is.rs;
    op.acc = is.acc;
    op.ta = is.ta;
    op.tb = is.tb;
    op.bf16 = is.bf16;
}
inline void wg_commit_warp(void**, unsigned, void*) { ++wg_queue().committed; }
// Run every queued product of a group older than the newest `keep` committed ones.
inline void wg_wait_warp(void**, unsigned, void* ctx) {
    const unsigned keep = *static_cast<const unsigned*>(ctx);
    WgQueue& wq = wg_queue();
    unsigned m = 0;
    for (unsigned i = 0; i < wq.n; ++i) {
        if (wq.q[i].group + keep < wq.committed)
            wg_run(wq.q[i]);
        else
            wq.q[m++] = wq.q[i];
    }
    wq.n = m;
}
template <typename T>
constexpr unsigned char wg_is_bf16 = 0;
template <>
constexpr unsigned char wg_is_bf16<__nv_bfloat16> = 1;
}  // namespace cpu

extern "C" __attribute__((visibility("default"), used)) inline unsigned long long* cupaged_wgmma_counters() {
    return cpu::wg_counters;
}
extern "C" __attribute__((visibility("default"), used)) inline const char* cupaged_wgmma_counter_names() {
    return "wgmma,wgmma_flop,wgmma_smem_bytes";
}

__device__ __forceinline__ u64 wgmma_desc(const void* smem, u32 lbo, u32 sbo, u32 swizzle) {
    return wgmma_encode(cpu::wg_shared_address(smem)) | wgmma_encode(lbo) << 16 | wgmma_encode(sbo) << 32 |
           (u64)swizzle << 62;
}
__device__ __forceinline__ void wgmma_fence() {}
template <typename T, u32 kN, u32 kTransA, u32 kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[kN / 2], u64 desc_a, u64 desc_b, bool accumulate) {
    static_assert(kN % 8 == 0 && kN >= 8 && kN <= 256, "N: a multiple of 8 up to 256");
    cpu::WgLane me{d, {0u, 0u, 0u, 0u}, desc_a, desc_b, (threadIdx.x >> 5) & 3u};
    cpu::WgIssue is{kN, false, accumulate, (unsigned char)kTransA, (unsigned char)kTransB, cpu::wg_is_bf16<T>};
    cupaged_warp_collective(CP_FULL_MASK, &me, &cpu::wg_issue_warp, &is);
}
template <typename T, u32 kN, u32 kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[kN / 2], const u32 (&a)[4], u64 desc_b, bool accumulate) {
    static_assert(kN % 8 == 0 && kN >= 8 && kN <= 256, "N: a multiple of 8 up to 256");
    cpu::WgLane me{d, {a[0], a[1], a[2], a[3]}, 0ull, desc_b, (threadIdx.x >> 5) & 3u};
    cpu::WgIssue is{kN, true, accumulate, 0, (unsigned char)kTransB, cpu::wg_is_bf16<T>};
    cupaged_warp_collective(CP_FULL_MASK, &me, &cpu::wg_issue_warp, &is);
}
__device__ __forceinline__ void wgmma_commit() {
    int me = 0;
    cupaged_warp_collective(CP_FULL_MASK, &me, &cpu::wg_commit_warp, nullptr);
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    static_assert(N >= 0 && N <= 7, "wait_group 0 .. 7");
    unsigned keep = (unsigned)N;
    int me = 0;
    cupaged_warp_collective(CP_FULL_MASK, &me, &cpu::wg_wait_warp, &keep);
}
template <u32 kN>
__device__ __forceinline__ void wgmma_fence_operand(float (&)[kN]) {}

#elif defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ u64 wgmma_desc(const void* smem, u32 lbo, u32 sbo, u32 swizzle) {
    return wgmma_encode(smem_addr(smem)) | wgmma_encode(lbo) << 16 | wgmma_encode(sbo) << 32 | (u64)swizzle << 62;
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keep the compiler from moving accesses of accumulator registers across a
// wgmma issue or wait (they are read and written asynchronously).
template <u32 kN>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[kN]) {
#pragma unroll
    for (u32 i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// One specialization per (type, N), all from one template: CP_WGMMA_SS / CP_WGMMA_RS below,
// instantiated for N = 32, 64, 128, 256 (SS: A and B from descriptors, RS: A from registers) and
// each 16-bit input type (CT the C++ type, TYPE its PTX type token: f16, bf16). In the asm
// text D is %0 .. %NR - 1 (NR = N / 2 f32 registers a thread: CP_WG_D<NR>, CP_WG_OUT<NR>);
// the numbers after NR are the indices of the other operands, as the asm text names them.
template <typename T, u32 kN, u32 kTransA, u32 kTransB>
struct WgSS;
template <typename T, u32 kN, u32 kTransB>
struct WgRS;
#define CP_WG_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
#define CP_WG_D32                                                             \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define CP_WG_D64                                                                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "          \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define CP_WG_D128                                                                                 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                      \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "             \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "             \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "             \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
#define CP_WG_OUT16(d)                                                                                          \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define CP_WG_OUT32(d)                                                                                          \
    CP_WG_OUT16(d), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),  \
        "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), \
        "+f"(d[31])
#define CP_WG_OUT64(d)                                                                                          \
    CP_WG_OUT32(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]),  \
        "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), \
        "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), \
        "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
        "+f"(d[63])
#define CP_WG_OUT128(d)                                                                                            \
    CP_WG_OUT32(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]),     \
        "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]),    \
        "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),    \
        "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),    \
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]),    \
        "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]),    \
        "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]),    \
        "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]),    \
        "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), \
        "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),          \
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]),          \
        "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]),          \
        "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define CP_WGMMA_SS(CT, TYPE, N, NR, IA, IB, IP, ITA, ITB)                                                 \
    template <u32 kTransA, u32 kTransB>                                                                    \
    struct WgSS<CT, N, kTransA, kTransB> {                                                                 \
        __device__ __forceinline__ static void run(float (&d)[NR], u64 da, u64 db, bool acc) {             \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP                                          \
                         ", 0;\n"                                                                          \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TYPE "." #TYPE " " CP_WG_D##NR \
                         "%" #IA ", %" #IB ", p, 1, 1, %" #ITA ", %" #ITB ";\n}\n"                         \
                         : CP_WG_OUT##NR(d)                                                                \
                         : "l"(da), "l"(db), "r"((u32)acc), "n"(kTransA), "n"(kTransB)                     \
                         : "memory");                                                                      \
        }                                                                                                  \
    };
#define CP_WGMMA_RS(CT, TYPE, N, NR, IA0, IA1, IA2, IA3, IB, IP, ITB)                                       \
    template <u32 kTransB>                                                                                  \
    struct WgRS<CT, N, kTransB> {                                                                           \
        __device__ __forceinline__ static void run(float (&d)[NR], const u32 (&a)[4], u64 db, bool acc) {   \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP                                           \
                         ", 0;\n"                                                                           \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TYPE "." #TYPE " " CP_WG_D##NR  \
                         "{%" #IA0 ", %" #IA1 ", %" #IA2 ", %" #IA3 "}, %" #IB ", p, 1, 1, %" #ITB ";\n}\n" \
                         : CP_WG_OUT##NR(d)                                                                 \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"((u32)acc), "n"(kTransB) \
                         : "memory");                                                                       \
        }                                                                                                   \
    };
#define CP_WGMMA_TYPE(CT, TYPE)                                \
    CP_WGMMA_SS(CT, TYPE, 32, 16, 16, 17, 18, 19, 20)          \
    CP_WGMMA_SS(CT, TYPE, 64, 32, 32, 33, 34, 35, 36)          \
    CP_WGMMA_SS(CT, TYPE, 128, 64, 64, 65, 66, 67, 68)         \
    CP_WGMMA_SS(CT, TYPE, 256, 128, 128, 129, 130, 131, 132)   \
    CP_WGMMA_RS(CT, TYPE, 32, 16, 16, 17, 18, 19, 20, 21, 22)  \
    CP_WGMMA_RS(CT, TYPE, 64, 32, 32, 33, 34, 35, 36, 37, 38)  \
    CP_WGMMA_RS(CT, TYPE, 128, 64, 64, 65, 66, 67, 68, 69, 70) \
    CP_WGMMA_RS(CT, TYPE, 256, 128, 128, 129, 130, 131, 132, 133, 134)
CP_WGMMA_TYPE(__half, f16)
CP_WGMMA_TYPE(__nv_bfloat16, bf16)
#undef CP_WGMMA_TYPE
#undef CP_WGMMA_RS
#undef CP_WGMMA_SS
#undef CP_WG_OUT128
#undef CP_WG_OUT64
#undef CP_WG_OUT32
#undef CP_WG_OUT16
#undef CP_WG_D128
#undef CP_WG_D64
#undef CP_WG_D32
#undef CP_WG_D16
template <typename T, u32 kN, u32 kTransA, u32 kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[kN / 2], u64 desc_a, u64 desc_b, bool accumulate) {
    WgSS<T, kN, kTransA, kTransB>::run(d, desc_a, desc_b, accumulate);
}
template <typename T, u32 kN, u32 kTransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[kN / 2], const u32 (&a)[4], u64 desc_b, bool accumulate) {
    WgRS<T, kN, kTransB>::run(d, a, desc_b, accumulate);
}
#endif

// ============================================================================
// Path markers. ptx::cold_path() sits in the body of code that runs only
// on rare inputs (the careful paths that keep masked Inf / NaN values out of
// the tensor-core products), ptx::edge_tile() in the body of a tile loop's
// branch for the tiles some row sees only part of (the causal diagonal, a
// window's or a split's edge: the masked softmax), each executed by whole
// warps. On a GPU they are `pmevent 7` / `pmevent 6` (SASS PMTRIG 0x80 /
// 0x40, performance-monitor triggers with no effect outside profiling); on
// the CPU each counts once per warp (lane 0), readable through
// cupaged_marker_counters(), so the performance model
// (cupaged/tools/model.py) learns how often the SASS regions holding them
// run (per token and per block) instead of assuming once per iteration of
// the loop around them.
#ifdef CUPAGED_CPU
namespace cpu {
inline unsigned long long marker_counters[2];
}  // namespace cpu
extern "C" __attribute__((visibility("default"), used)) inline unsigned long long* cupaged_marker_counters() {
    return cpu::marker_counters;
}
extern "C" __attribute__((visibility("default"), used)) inline const char* cupaged_marker_counter_names() {
    return "cold_path,edge_tile";
}
__device__ __forceinline__ void cold_path() {
    if ((threadIdx.x & 31u) == 0) __atomic_fetch_add(&cpu::marker_counters[0], 1ull, __ATOMIC_RELAXED);
}
__device__ __forceinline__ void edge_tile() {
    if ((threadIdx.x & 31u) == 0) __atomic_fetch_add(&cpu::marker_counters[1], 1ull, __ATOMIC_RELAXED);
}
#else
__device__ __forceinline__ void cold_path() { asm volatile("pmevent 7;"); }
__device__ __forceinline__ void edge_tile() { asm volatile("pmevent 6;"); }
#endif

}  // namespace ptx
