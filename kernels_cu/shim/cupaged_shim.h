// cupaged_shim.h: force-included (g++ -include) into every kernel module of
// the CPU backend, so that the CUDA C in kernels_cu/ compiles unchanged with
// g++ and runs on the fibers of cupaged_rt.cpp.
//
// Kernel sources never mention this file. The one sanctioned dependency runs
// the other way: a header with inline PTX may provide a CPU version of a
// helper under #ifdef CUPAGED_CPU, using cupaged_warp_collective() below.
//
// What kernels must not do on the CPU backend (see docs of cupaged._cpu):
// include system headers after this one (they may collide with the keyword
// macros), spin-wait on another thread (fibers are never pre-empted), or rely
// on warp-synchronous execution without __syncwarp (also wrong on Volta+).
#pragma once
#ifndef CUPAGED_CPU
#define CUPAGED_CPU 1
#endif

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <cmath>
#include <source_location>
#include <type_traits>
#include <utility>

#include "cupaged_rt.hpp"
#include "cupaged_fp16.hpp"

// ---- keywords -------------------------------------------------------------------
#define __device__
#define __host__
#ifdef CUPAGED_KERNEL_SCAN
// Preprocessing pass of cupaged._cpu that lists the kernels: keep the token.
#define __global__ __global__
#else
#define __global__
#endif
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static thread_local
#define __constant__
#define __managed__
#define __grid_constant__

// Dynamic shared memory: the worker's buffer of cupaged::kMaxDynamicShared
// bytes (16-byte aligned). Works at block and at namespace scope.
#define CUPAGED_DYNAMIC_SHARED(T, name) static thread_local T* const name = static_cast<T*>(cupaged_rt_dynamic_shared())

// ---- built-in variables ---------------------------------------------------------
#define threadIdx (::cupaged::cur()->tid)
#define blockIdx (::cupaged::cur()->block->bid)
#define blockDim (::cupaged::cur()->block->bdim)
#define gridDim (::cupaged::cur()->block->gdim)
static constexpr int warpSize = 32;

// A compiler barrier around every runtime call: other fibers run inside it and
// read or write shared and global memory.
#define CUPAGED_FENCE() asm volatile("" ::: "memory")
#define CUPAGED_LOC std::source_location cupaged_loc = std::source_location::current()

// ---- block barrier ----------------------------------------------------------------
inline void __syncthreads(CUPAGED_LOC) {
    CUPAGED_FENCE();
    cupaged_rt_barrier(::cupaged::kBarSync, 0, cupaged_loc);
    CUPAGED_FENCE();
}
inline int __syncthreads_count(int pred, CUPAGED_LOC) {
    CUPAGED_FENCE();
    const int r = cupaged_rt_barrier(::cupaged::kBarCount, pred, cupaged_loc);
    CUPAGED_FENCE();
    return r;
}
inline int __syncthreads_and(int pred, CUPAGED_LOC) {
    CUPAGED_FENCE();
    const int r = cupaged_rt_barrier(::cupaged::kBarAnd, pred, cupaged_loc);
    CUPAGED_FENCE();
    return r;
}
inline int __syncthreads_or(int pred, CUPAGED_LOC) {
    CUPAGED_FENCE();
    const int r = cupaged_rt_barrier(::cupaged::kBarOr, pred, cupaged_loc);
    CUPAGED_FENCE();
    return r;
}

// ---- named barriers (PTX bar.sync / bar.arrive id, count) -------------------------------
// Ids 1 .. 15; count: the threads that arrive (a multiple of 32; 0: the whole block). bar.sync waits for
// them, bar.arrive only counts itself in (a producer signalling a consumer, warpgroups taking turns).
inline void cupaged_bar_sync(unsigned id, unsigned count, CUPAGED_LOC) {
    CUPAGED_FENCE();
    cupaged_rt_named_barrier(id, count, 1, cupaged_loc);
    CUPAGED_FENCE();
}
inline void cupaged_bar_arrive(unsigned id, unsigned count, CUPAGED_LOC) {
    CUPAGED_FENCE();
    cupaged_rt_named_barrier(id, count, 0, cupaged_loc);
    CUPAGED_FENCE();
}

// ---- warp collectives -------------------------------------------------------------
namespace cupaged {
template <class T>
concept WarpValue =
    (std::is_arithmetic_v<T> || std::is_pointer_v<T> || std::is_same_v<T, __half> || std::is_same_v<T, __half2> ||
     std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __nv_bfloat162>) &&
    sizeof(T) <= 8;

inline unsigned long long warp_op(int kind, unsigned mask, unsigned long long v, int b, int width,
                                  const std::source_location& loc) {
    CUPAGED_FENCE();
    const unsigned long long r = cupaged_rt_warp_op(kind, mask, v, b, width, loc);
    CUPAGED_FENCE();
    return r;
}

template <class T>
inline unsigned long long to_bits(T v) {
    unsigned long long u = 0;
    __builtin_memcpy(&u, &v, sizeof(T));
    return u;
}
template <class T>
inline T from_bits(unsigned long long u) {
    T v;
    __builtin_memcpy(&v, &u, sizeof(T));
    return v;
}
template <class T>
inline T shfl(int kind, unsigned mask, T v, int b, int width, const std::source_location& loc) {
    return from_bits<T>(warp_op(kind, mask, to_bits(v), b, width, loc));
}
}  // namespace cupaged

template <::cupaged::WarpValue T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = warpSize, CUPAGED_LOC) {
    return ::cupaged::shfl(::cupaged::kShflIdx, mask, var, srcLane, width, cupaged_loc);
}
template <::cupaged::WarpValue T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned int delta, int width = warpSize, CUPAGED_LOC) {
    return ::cupaged::shfl(::cupaged::kShflUp, mask, var, (int)delta, width, cupaged_loc);
}
template <::cupaged::WarpValue T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned int delta, int width = warpSize, CUPAGED_LOC) {
    return ::cupaged::shfl(::cupaged::kShflDown, mask, var, (int)delta, width, cupaged_loc);
}
template <::cupaged::WarpValue T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = warpSize, CUPAGED_LOC) {
    return ::cupaged::shfl(::cupaged::kShflXor, mask, var, laneMask, width, cupaged_loc);
}
inline unsigned __ballot_sync(unsigned mask, int pred, CUPAGED_LOC) {
    return (unsigned)::cupaged::warp_op(::cupaged::kBallot, mask, pred != 0, 0, 32, cupaged_loc);
}
inline int __any_sync(unsigned mask, int pred, CUPAGED_LOC) {
    return (int)::cupaged::warp_op(::cupaged::kAny, mask, pred != 0, 0, 32, cupaged_loc);
}
inline int __all_sync(unsigned mask, int pred, CUPAGED_LOC) {
    return (int)::cupaged::warp_op(::cupaged::kAll, mask, pred != 0, 0, 32, cupaged_loc);
}
inline unsigned __uni_sync(unsigned mask, int pred, CUPAGED_LOC) {
    const unsigned b = (unsigned)::cupaged::warp_op(::cupaged::kBallot, mask, pred != 0, 0, 32, cupaged_loc);
    return b == 0 || b == (mask & ~0u);
}
inline void __syncwarp(unsigned mask = 0xffffffffu, CUPAGED_LOC) {
    ::cupaged::warp_op(::cupaged::kSyncwarp, mask, 0, 0, 32, cupaged_loc);
}
// Lanes of the current warp that have not exited (the CPU cannot know which
// lanes a GPU would run converged; this is the widest answer).
inline unsigned __activemask() { return cupaged_rt_activemask(); }
inline unsigned __reduce_add_sync(unsigned mask, unsigned v, CUPAGED_LOC) {
    return (unsigned)::cupaged::warp_op(::cupaged::kReduceAddU, mask, v, 0, 32, cupaged_loc);
}
inline int __reduce_add_sync(unsigned mask, int v, CUPAGED_LOC) {
    return (int)(unsigned)::cupaged::warp_op(::cupaged::kReduceAddU, mask, (unsigned)v, 0, 32, cupaged_loc);
}
inline unsigned __reduce_min_sync(unsigned mask, unsigned v, CUPAGED_LOC) {
    return (unsigned)::cupaged::warp_op(::cupaged::kReduceMinU, mask, v, 0, 32, cupaged_loc);
}
inline int __reduce_min_sync(unsigned mask, int v, CUPAGED_LOC) {
    return (int)(unsigned)::cupaged::warp_op(::cupaged::kReduceMinI, mask, (unsigned)v, 0, 32, cupaged_loc);
}
inline unsigned __reduce_max_sync(unsigned mask, unsigned v, CUPAGED_LOC) {
    return (unsigned)::cupaged::warp_op(::cupaged::kReduceMaxU, mask, v, 0, 32, cupaged_loc);
}
inline int __reduce_max_sync(unsigned mask, int v, CUPAGED_LOC) {
    return (int)(unsigned)::cupaged::warp_op(::cupaged::kReduceMaxI, mask, (unsigned)v, 0, 32, cupaged_loc);
}
inline unsigned __reduce_and_sync(unsigned mask, unsigned v, CUPAGED_LOC) {
    return (unsigned)::cupaged::warp_op(::cupaged::kReduceAnd, mask, v, 0, 32, cupaged_loc);
}
inline unsigned __reduce_or_sync(unsigned mask, unsigned v, CUPAGED_LOC) {
    return (unsigned)::cupaged::warp_op(::cupaged::kReduceOr, mask, v, 0, 32, cupaged_loc);
}
inline unsigned __reduce_xor_sync(unsigned mask, unsigned v, CUPAGED_LOC) {
    return (unsigned)::cupaged::warp_op(::cupaged::kReduceXor, mask, v, 0, 32, cupaged_loc);
}
template <::cupaged::WarpValue T>
inline unsigned __match_any_sync(unsigned mask, T value, CUPAGED_LOC) {
    return (unsigned)::cupaged::warp_op(::cupaged::kMatchAny, mask, ::cupaged::to_bits(value), 0, 32, cupaged_loc);
}
template <::cupaged::WarpValue T>
inline unsigned __match_all_sync(unsigned mask, T value, int* pred, CUPAGED_LOC) {
    const unsigned long long r =
        ::cupaged::warp_op(::cupaged::kMatchAll, mask, ::cupaged::to_bits(value), 0, 32, cupaged_loc);
    *pred = (int)(r >> 32);
    return (unsigned)r;
}

// The CPU side of warp-wide PTX (mma.sync fragments and the like): every lane
// in `mask` posts `lane_data`; the last lane to arrive calls
// fn(all_lane_data, mask, ctx) once, with all_lane_data[lane] the pointer each
// lane posted (null for lanes outside the mask) and ctx that lane's ctx; then
// all lanes proceed. fn must not call barriers or collectives itself.
inline void cupaged_warp_collective(unsigned mask, void* lane_data,
                                    void (*fn)(void** all_lane_data, unsigned mask, void* ctx), void* ctx,
                                    CUPAGED_LOC) {
    CUPAGED_FENCE();
    cupaged_rt_warp_collective(mask, lane_data, fn, ctx, cupaged_loc);
    CUPAGED_FENCE();
}
// The lane of the calling thread (%laneid).
inline unsigned cupaged_lane_id() { return ::cupaged::cur()->linear & 31u; }

// ---- errors -------------------------------------------------------------------
[[noreturn]] inline void __trap(CUPAGED_LOC) {
    cupaged_rt_trap("__trap()", cupaged_loc.file_name(), cupaged_loc.line(), cupaged_loc.function_name());
}
[[noreturn]] inline void __brkpt(CUPAGED_LOC) {
    cupaged_rt_trap("__brkpt()", cupaged_loc.file_name(), cupaged_loc.line(), cupaged_loc.function_name());
}
// assert() in a kernel raises KernelError, with or without <cassert>: glibc's
// assert calls __assert_fail, which each module defines for itself.
extern "C" __attribute__((visibility("hidden"), noreturn)) inline void __assert_fail(const char* expr, const char* file,
                                                                                     unsigned int line,
                                                                                     const char* function) noexcept {
    char what[512];
    snprintf(what, sizeof what, "assertion failed: %s", expr);
    cupaged_rt_trap(what, file, line, function);
}
#undef assert
#ifdef NDEBUG
#define assert(e) ((void)0)
#else
#define assert(e) ((e) ? (void)0 : __assert_fail(#e, __FILE__, __LINE__, __PRETTY_FUNCTION__))
#endif

// ---- alignment of vector accesses (common.cuh's ldv / stv, ptx.cuh's cp_async_16) ----
// A GPU faults on a vector access that is not aligned to its size; x86 does
// not. These raise a KernelError naming the access and the caller's line.
#define CUPAGED_SRC_LOC , CUPAGED_LOC
#define CUPAGED_CHECK_ALIGNED(p, bytes, what) ::cupaged::check_aligned((p), (bytes), (what), cupaged_loc)
namespace cupaged {
inline void check_aligned(const void* p, unsigned bytes, const char* what, const std::source_location& loc) {
    if (__builtin_expect(reinterpret_cast<std::uintptr_t>(p) % bytes == 0, 1)) return;
    char msg[192];
    snprintf(msg, sizeof msg, "misaligned %u-byte %s at address %p (a GPU faults: expected a multiple of %u)", bytes,
             what, p, bytes);
    cupaged_rt_trap(msg, loc.file_name(), loc.line(), loc.function_name());
}
}  // namespace cupaged

// ---- memory fences and cache-hinted loads/stores ------------------------------------
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
template <class T>
inline T __ldg(const T* p) {
    return *p;
}
template <class T>
inline T __ldca(const T* p) {
    return *p;
}
template <class T>
inline T __ldcg(const T* p) {
    return *p;
}
template <class T>
inline T __ldcs(const T* p) {
    return *p;
}
template <class T>
inline T __ldlu(const T* p) {
    return *p;
}
template <class T>
inline T __ldcv(const T* p) {
    return *p;
}
template <class T>
inline void __stwb(T* p, T v) {
    *p = v;
}
template <class T>
inline void __stcg(T* p, T v) {
    *p = v;
}
template <class T>
inline void __stcs(T* p, T v) {
    *p = v;
}
template <class T>
inline void __stwt(T* p, T v) {
    *p = v;
}

// ---- atomics (real atomics: blocks run concurrently on the workers) ---------------------
#define CUPAGED_ATOMIC_INT(T)                                                                                   \
    inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }                        \
    inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); }                        \
    inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }                      \
    inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); }                        \
    inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }                          \
    inline T atomicXor(T* p, T v) { return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST); }                        \
    inline T atomicCAS(T* p, T cmp, T v) {                                                                      \
        __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                     \
        return cmp;                                                                                             \
    }                                                                                                           \
    inline T atomicMax(T* p, T v) {                                                                             \
        T old = __atomic_load_n(p, __ATOMIC_RELAXED);                                                           \
        while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) { \
        }                                                                                                       \
        return old;                                                                                             \
    }                                                                                                           \
    inline T atomicMin(T* p, T v) {                                                                             \
        T old = __atomic_load_n(p, __ATOMIC_RELAXED);                                                           \
        while (old > v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) { \
        }                                                                                                       \
        return old;                                                                                             \
    }
CUPAGED_ATOMIC_INT(int)
CUPAGED_ATOMIC_INT(unsigned int)
CUPAGED_ATOMIC_INT(unsigned long long)
CUPAGED_ATOMIC_INT(long long)
#undef CUPAGED_ATOMIC_INT
inline unsigned short atomicCAS(unsigned short* p, unsigned short cmp, unsigned short v) {
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return cmp;
}
inline unsigned atomicInc(unsigned* p, unsigned limit) {  // ((old >= limit) ? 0 : old + 1)
    unsigned old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (
        !__atomic_compare_exchange_n(p, &old, old >= limit ? 0u : old + 1u, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
    }
    return old;
}
inline unsigned atomicDec(unsigned* p, unsigned limit) {  // ((old == 0 || old > limit) ? limit : old - 1)
    unsigned old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(p, &old, (old == 0u || old > limit) ? limit : old - 1u, true, __ATOMIC_SEQ_CST,
                                        __ATOMIC_RELAXED)) {
    }
    return old;
}
namespace cupaged {
// Read-modify-write of a value type through a CAS on its bits.
template <class V, class U, class F>
inline V atomic_rmw(V* p, F op) {
    U* q = reinterpret_cast<U*>(p);
    U old = __atomic_load_n(q, __ATOMIC_RELAXED);
    for (;;) {
        const U nu = __builtin_bit_cast(U, op(__builtin_bit_cast(V, old)));
        if (__atomic_compare_exchange_n(q, &old, nu, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) break;
    }
    return __builtin_bit_cast(V, old);
}
}  // namespace cupaged
inline float atomicAdd(float* p, float v) {
    return ::cupaged::atomic_rmw<float, unsigned>(p, [v](float x) { return x + v; });
}
inline double atomicAdd(double* p, double v) {
    return ::cupaged::atomic_rmw<double, unsigned long long>(p, [v](double x) { return x + v; });
}
inline float atomicExch(float* p, float v) {
    return __builtin_bit_cast(
        float, __atomic_exchange_n(reinterpret_cast<unsigned*>(p), __builtin_bit_cast(unsigned, v), __ATOMIC_SEQ_CST));
}
inline float atomicMax(float* p, float v) {  // not CUDA API (sm_90 has it for some types); NaN-ignoring
    return ::cupaged::atomic_rmw<float, unsigned>(p, [v](float x) { return fmaxf(x, v); });
}
inline float atomicMin(float* p, float v) {
    return ::cupaged::atomic_rmw<float, unsigned>(p, [v](float x) { return fminf(x, v); });
}
inline __half atomicAdd(__half* p, __half v) {
    return ::cupaged::atomic_rmw<__half, unsigned short>(p, [v](__half x) { return __hadd(x, v); });
}
inline __nv_bfloat16 atomicAdd(__nv_bfloat16* p, __nv_bfloat16 v) {
    return ::cupaged::atomic_rmw<__nv_bfloat16, unsigned short>(p, [v](__nv_bfloat16 x) { return __hadd(x, v); });
}
inline __half2 atomicAdd(__half2* p, __half2 v) {
    return ::cupaged::atomic_rmw<__half2, unsigned>(p, [v](__half2 x) { return __hadd2(x, v); });
}
inline __nv_bfloat162 atomicAdd(__nv_bfloat162* p, __nv_bfloat162 v) {
    return ::cupaged::atomic_rmw<__nv_bfloat162, unsigned>(p, [v](__nv_bfloat162 x) { return __hadd2(x, v); });
}
#define CUPAGED_ATOMIC_SCOPED(name)        \
    template <class T, class... R>         \
    inline T name##_block(T* p, R... r) {  \
        return name(p, r...);              \
    }                                      \
    template <class T, class... R>         \
    inline T name##_system(T* p, R... r) { \
        return name(p, r...);              \
    }
CUPAGED_ATOMIC_SCOPED(atomicAdd)
CUPAGED_ATOMIC_SCOPED(atomicSub)
CUPAGED_ATOMIC_SCOPED(atomicExch)
CUPAGED_ATOMIC_SCOPED(atomicMax)
CUPAGED_ATOMIC_SCOPED(atomicMin)
CUPAGED_ATOMIC_SCOPED(atomicCAS)
CUPAGED_ATOMIC_SCOPED(atomicAnd)
CUPAGED_ATOMIC_SCOPED(atomicOr)
CUPAGED_ATOMIC_SCOPED(atomicXor)
#undef CUPAGED_ATOMIC_SCOPED

// ---- integer min/max (CUDA's overload set) -------------------------------------------
#define CUPAGED_MINMAX(R, A, B)                                  \
    inline R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; } \
    inline R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }
CUPAGED_MINMAX(int, int, int)
CUPAGED_MINMAX(unsigned int, unsigned int, unsigned int)
CUPAGED_MINMAX(unsigned int, int, unsigned int)
CUPAGED_MINMAX(unsigned int, unsigned int, int)
CUPAGED_MINMAX(long, long, long)
CUPAGED_MINMAX(unsigned long, unsigned long, unsigned long)
CUPAGED_MINMAX(unsigned long, long, unsigned long)
CUPAGED_MINMAX(unsigned long, unsigned long, long)
CUPAGED_MINMAX(long long, long long, long long)
CUPAGED_MINMAX(unsigned long long, unsigned long long, unsigned long long)
CUPAGED_MINMAX(unsigned long long, long long, unsigned long long)
CUPAGED_MINMAX(unsigned long long, unsigned long long, long long)
#undef CUPAGED_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double min(double a, float b) { return fmin(a, b); }
inline double max(double a, float b) { return fmax(a, b); }
inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long llmin(long long a, long long b) { return a < b ? a : b; }
inline long long llmax(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

// ---- float math ----------------------------------------------------------------------
// fmaxf / fminf with glibc's results bit for bit (x >= y: x; x < y: y; unordered: the operand that is not
// NaN), as compares g++ inlines and vectorizes: without -ffinite-math-only each was a libm call in the
// softmax loops.
inline float cupaged_fmaxf(float x, float y) { return x >= y ? x : (x < y ? y : (y != y ? x : y)); }
inline float cupaged_fminf(float x, float y) { return x <= y ? x : (x > y ? y : (y != y ? x : y)); }
#define fmaxf cupaged_fmaxf
#define fminf cupaged_fminf
// cupaged_exp2f: 2^x within one ulp (the rounding of a value within 2.2e-9 relative of the exact one: about 1%
// of results differ from the correctly rounded float by one ulp; the GPU's exp2f is within two), exactly 0 at
// -inf and from -150 down, +inf at +inf and from 128, NaN for NaN, exact at integers; inline and without
// branches, so it costs a few instructions where libm's is a call; vec4.cuh's cupaged_exp2f4 computes four at
// once with the same bits (v4::exp2 on the CPU backend; the kernels' scalar exp2f stays libm's).
// x = n + r, n the nearest integer, |r| <= 1/2; 2^r by a degree-6 polynomial in r in double (each step a
// product and a sum, as the vector form computes them), times 2^n made from the exponent bits, rounded once
// to float (subnormal results included).
namespace cupaged::exp2_poly {
constexpr double kShift = 0x1.8p52;  // adding it rounds a double to an integer in the low mantissa bits
constexpr double kC[7] = {
    0x1.0000000000000p+0, 0x1.62e430c688ed1p-1,  0x1.ebfbdcf8b4463p-3, 0x1.c6aed61c2aebbp-5,
    0x1.3b2cc34713ce9p-7, 0x1.5f44dc126d04cp-10, 0x1.4258d7d6ff2a8p-13};  // kC[0] = 1: exact at integers
constexpr float kLo = -160.0f, kHi = 160.0f;  // clamped there: 2^-160 rounds to 0, 2^160 to +inf
}  // namespace cupaged::exp2_poly
inline float cupaged_exp2f(float xf) {
    using namespace ::cupaged::exp2_poly;
    const double x = (double)(xf < kLo ? kLo : xf > kHi ? kHi : xf != xf ? 0.0f : xf);
    const double big = x + kShift;
    const double r = x - (big - kShift);
    double p = kC[6];
    for (int k = 5; k >= 0; --k) p = p * r + kC[k];
    // 2^n from big's low bits (they hold n + 2^51): its exponent field is n + 1023, in [863, 1183].
    const unsigned long long bits = (__builtin_bit_cast(unsigned long long, big) + 1023ull) << 52;
    const float e = (float)(p * __builtin_bit_cast(double, bits));
    return xf != xf ? xf : e;
}
// glibc declares __expf, __logf, __sinf ... itself, so the CUDA intrinsics of
// those names are macros onto the (more accurate) libm functions.
#define __expf(x) (::expf(x))
#define __exp2f(x) (::exp2f(x))
#define __exp10f(x) (::exp10f(x))
#define __logf(x) (::logf(x))
#define __log2f(x) (::log2f(x))
#define __log10f(x) (::log10f(x))
#define __powf(x, y) (::powf((x), (y)))
#define __sinf(x) (::sinf(x))
#define __cosf(x) (::cosf(x))
#define __tanf(x) (::tanf(x))
#define __sincosf(x, s, c) (::sincosf((x), (s), (c)))
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
inline float rhypotf(float x, float y) { return 1.0f / hypotf(x, y); }
inline float norm3df(float a, float b, float c) { return (float)sqrt((double)a * a + (double)b * b + (double)c * c); }
inline float rnorm3df(float a, float b, float c) { return 1.0f / norm3df(a, b, c); }
inline float normcdff(float x) { return 0.5f * erfcf(-x * 0.70710678118654752f); }
inline double normcdf(double x) { return 0.5 * erfc(-x * 0.70710678118654752); }
inline float sinpif(float x) { return (float)sin(3.14159265358979323846 * (double)x); }
inline float cospif(float x) { return (float)cos(3.14159265358979323846 * (double)x); }
inline void sincospif(float x, float* s, float* c) {
    *s = sinpif(x);
    *c = cospif(x);
}
inline float fdividef(float a, float b) { return a / b; }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x >= 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __frsqrt_rn(float a) { return 1.0f / sqrtf(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline double __drcp_rn(double a) { return 1.0 / a; }

// ---- bit reinterpretation and conversions ------------------------------------------------
inline float __int_as_float(int x) { return __builtin_bit_cast(float, x); }
inline int __float_as_int(float x) { return __builtin_bit_cast(int, x); }
inline float __uint_as_float(unsigned x) { return __builtin_bit_cast(float, x); }
inline unsigned __float_as_uint(float x) { return __builtin_bit_cast(unsigned, x); }
inline double __longlong_as_double(long long x) { return __builtin_bit_cast(double, x); }
inline long long __double_as_longlong(double x) { return __builtin_bit_cast(long long, x); }
inline int __double2hiint(double x) { return (int)(__double_as_longlong(x) >> 32); }
inline int __double2loint(double x) { return (int)__double_as_longlong(x); }
inline double __hiloint2double(int hi, int lo) {
    return __longlong_as_double((long long)(((unsigned long long)(unsigned)hi << 32) | (unsigned)lo));
}
inline int __float2int_rn(float x) { return ::cupaged::f2i_rz<int>(rintf(x)); }
inline int __float2int_rz(float x) { return ::cupaged::f2i_rz<int>(x); }
inline int __float2int_rd(float x) { return ::cupaged::f2i_rz<int>(floorf(x)); }
inline int __float2int_ru(float x) { return ::cupaged::f2i_rz<int>(ceilf(x)); }
inline unsigned __float2uint_rn(float x) { return ::cupaged::f2i_rz<unsigned>(rintf(x)); }
inline unsigned __float2uint_rz(float x) { return ::cupaged::f2i_rz<unsigned>(x); }
inline unsigned __float2uint_rd(float x) { return ::cupaged::f2i_rz<unsigned>(floorf(x)); }
inline unsigned __float2uint_ru(float x) { return ::cupaged::f2i_rz<unsigned>(ceilf(x)); }
inline long long __float2ll_rn(float x) { return ::cupaged::f2i_rz<long long>(rintf(x)); }
inline long long __float2ll_rz(float x) { return ::cupaged::f2i_rz<long long>(x); }
inline float __int2float_rn(int x) { return (float)x; }
inline float __uint2float_rn(unsigned x) { return (float)x; }
inline float __ll2float_rn(long long x) { return (float)x; }
inline float __double2float_rn(double x) { return (float)x; }
inline double __int2double_rn(int x) { return (double)x; }

// ---- integer intrinsics -----------------------------------------------------------------
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    return __builtin_bswap32(x);
}
inline unsigned long long __brevll(unsigned long long x) {
    return ((unsigned long long)__brev((unsigned)x) << 32) | __brev((unsigned)(x >> 32));
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
    return (unsigned)((((unsigned long long)hi << 32 | lo) << (s & 31u)) >> 32);
}
inline unsigned __funnelshift_lc(unsigned lo, unsigned hi, unsigned s) {
    return (unsigned)((((unsigned long long)hi << 32 | lo) << (s > 32u ? 32u : s)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    return (unsigned)(((unsigned long long)hi << 32 | lo) >> (s & 31u));
}
inline unsigned __funnelshift_rc(unsigned lo, unsigned hi, unsigned s) {
    return (unsigned)(((unsigned long long)hi << 32 | lo) >> (s > 32u ? 32u : s));
}
inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline long long __mul64hi(long long a, long long b) { return (long long)(((__int128)a * b) >> 64); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline int __mul24(int a, int b) { return ((a << 8) >> 8) * ((b << 8) >> 8); }
inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffffu) * (b & 0xffffffu); }
inline int __hadd(int a, int b) { return (int)(((long long)a + b) >> 1); }
inline int __rhadd(int a, int b) { return (int)(((long long)a + b + 1) >> 1); }
inline unsigned __uhadd(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a + b) >> 1); }
inline unsigned __urhadd(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a + b + 1) >> 1); }
inline unsigned __sad(int a, int b, unsigned c) { return c + (unsigned)(a > b ? a - b : b - a); }
inline unsigned __usad(unsigned a, unsigned b, unsigned c) { return c + (a > b ? a - b : b - a); }

// ---- export stubs (appended per kernel by cupaged._cpu, never by kernel sources) ------------
namespace cupaged {
template <class... A>
struct KernelCall {
    void (*k)(A...);
    void** args;
    template <std::size_t... I>
    void call(std::index_sequence<I...>) {
        k(*static_cast<A*>(args[I])...);
    }
    static void run(void* self) { static_cast<KernelCall*>(self)->call(std::index_sequence_for<A...>{}); }
};

template <class... A>
int launch(const char* name, void (*k)(A...), const unsigned* grid3, const unsigned* block3, unsigned smem,
           void** args) {
    KernelCall<A...> c{k, args};
    return cupaged_rt_launch(name, grid3, block3, smem, &KernelCall<A...>::run, &c);
}

// "x" followed by n in decimal: the code of an opaque parameter of n bytes
// (a struct passed by value).
struct OpaqueCode {
    char c[2 + 20];
};
constexpr OpaqueCode opaque_code(std::size_t n) {
    OpaqueCode t{};
    int digits = 1;
    for (std::size_t v = n; v >= 10; v /= 10) ++digits;
    t.c[0] = 'x';
    for (int i = digits; i >= 1; --i, n /= 10) t.c[i] = (char)('0' + n % 10);
    return t;
}
template <std::size_t N>
inline constexpr OpaqueCode kOpaqueCode = opaque_code(N);

// A parameter's kind for the launcher's checks: p pointer, iN/uN integer of N
// bytes, fN floating point, bN bool, xN anything else of N bytes (a struct:
// cupaged/_runtime/structs.py).
template <class T>
constexpr const char* param_code() {
    if constexpr (std::is_pointer_v<T>)
        return "p";
    else if constexpr (std::is_same_v<T, bool>)
        return "b1";
    else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>)
        return sizeof(T) == 1 ? "i1" : sizeof(T) == 2 ? "i2" : sizeof(T) == 4 ? "i4" : "i8";
    else if constexpr (std::is_integral_v<T>)
        return sizeof(T) == 1 ? "u1" : sizeof(T) == 2 ? "u2" : sizeof(T) == 4 ? "u4" : "u8";
    else if constexpr (std::is_same_v<T, float>)
        return "f4";
    else if constexpr (std::is_same_v<T, double>)
        return "f8";
    else
        return kOpaqueCode<sizeof(T)>.c;
}
template <class T>
const char* param_type_name() {  // "... [with T = const float*]"
    return __PRETTY_FUNCTION__;
}
template <class... A>
const char* param_info(void (*)(A...), int i, int what) {
    static const char* const codes[] = {param_code<A>()..., nullptr};
    static const char* (*const names[])() = {&param_type_name<A>..., nullptr};
    if (i < 0 || i >= (int)sizeof...(A)) return nullptr;
    return what == 0 ? codes[i] : names[i]();
}
template <class... A>
constexpr int param_count(void (*)(A...)) {
    return (int)sizeof...(A);
}
}  // namespace cupaged

#define CUPAGED_EXPORT_KERNEL(NAME)                                                                       \
    extern "C" __attribute__((visibility("default"))) int cupaged_launch_##NAME(                          \
        const unsigned* grid3, const unsigned* block3, unsigned smem, void** args) {                      \
        return ::cupaged::launch(#NAME, &NAME, grid3, block3, smem, args);                                \
    }                                                                                                     \
    extern "C" __attribute__((visibility("default"))) int cupaged_nparams_##NAME() {                      \
        return ::cupaged::param_count(&NAME);                                                             \
    }                                                                                                     \
    extern "C" __attribute__((visibility("default"))) const char* cupaged_param_##NAME(int i, int what) { \
        return ::cupaged::param_info(&NAME, i, what);                                                     \
    }
