// common.cuh: what every cupaged kernel shares. Compiled unchanged by NVRTC
// (GPU) and by g++ through the CPU shim (kernels_cu/shim/cupaged_shim.h).
//
// Compile-time choices arrive as #defines from the Python side (see
// cupaged/_runtime/source.py). CP_DTYPE is one of the tokens of
// cupaged/dtypes.py (f32, f16, bf16) and selects scalar_t below: the storage
// of q / out and of every dense kernel. CP_KV_DTYPE (attention, appends)
// selects kv_t, the K/V cache storage (those three, or the fp8 formats e4m3 /
// e5m2 of fp8.cuh), read through kv_to_float.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned int u32;
typedef unsigned long long u64;

// Dynamic shared memory: the CPU shim defines its own version of this macro.
#ifndef CUPAGED_DYNAMIC_SHARED
#define CUPAGED_DYNAMIC_SHARED(T, name) extern __shared__ __align__(16) T name[]
#endif

#define CP_CAT_(a, b) a##b
#define CP_CAT(a, b) CP_CAT_(a, b)

typedef float cp_type_f32;
typedef __half cp_type_f16;
typedef __nv_bfloat16 cp_type_bf16;
#ifdef CP_DTYPE
typedef CP_CAT(cp_type_, CP_DTYPE) scalar_t;
#endif

// Conversions to and from float for the three storage types.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
    return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
    return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

#include "fp8.cuh"
__device__ __forceinline__ float to_float(cp_fp8_e4m3 x) { return fp8::to_float(x); }
__device__ __forceinline__ float to_float(cp_fp8_e5m2 x) { return fp8::to_float(x); }
template <>
__device__ __forceinline__ cp_fp8_e4m3 from_float<cp_fp8_e4m3>(float x) {
    return fp8::encode<cp_fp8_e4m3>(x);
}
template <>
__device__ __forceinline__ cp_fp8_e5m2 from_float<cp_fp8_e5m2>(float x) {
    return fp8::encode<cp_fp8_e5m2>(x);
}

#ifdef CP_KV_DTYPE
typedef CP_CAT(cp_type_, CP_KV_DTYPE) kv_t;
// True for an fp8 cache: its codes are scaled by k_scale / v_scale (fp8.cuh).
constexpr bool kKvScaled = fp8::is_fp8<kv_t>::value;
// A K/V cache element as float, exactly (an fp8 code without its scale).
__device__ __forceinline__ float kv_to_float(kv_t x) { return to_float(x); }
#endif

// Vector accesses to global memory: every 16-byte (and 8-byte) load or store
// of a vector type (uint4, float4, uint2, float2) in a kernel goes through
// ldv / stv. Under NVRTC they are a plain dereference (the same PTX as
// `*p`, ld.global.nc kept for __restrict__ pointers). Under the CPU shim they
// first check that p is aligned to sizeof(V), as a GPU requires (x86 would
// tolerate the access), and raise a KernelError naming the kernel, the block,
// the thread and the caller's source line: the shim defines
// CUPAGED_SRC_LOC (a defaulted std::source_location parameter) and
// CUPAGED_CHECK_ALIGNED. cp.async's 16-byte copies get the same check in
// ptx.cuh (ptx::cp_async_16).
#ifndef CUPAGED_SRC_LOC
#define CUPAGED_SRC_LOC
#define CUPAGED_CHECK_ALIGNED(p, bytes, what) ((void)0)
#endif
template <typename V>
__device__ __forceinline__ V ldv(const V* p CUPAGED_SRC_LOC) {
    CUPAGED_CHECK_ALIGNED(p, sizeof(V), "load");
    return *p;
}
template <typename V>
__device__ __forceinline__ void stv(V* p, const V& v CUPAGED_SRC_LOC) {
    CUPAGED_CHECK_ALIGNED(p, sizeof(V), "store");
    *p = v;
}

// -inf without <cfloat> or INFINITY, identical under both compilers.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

#define CP_FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(CP_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(CP_FULL_MASK, v, o));
    return v;
}
