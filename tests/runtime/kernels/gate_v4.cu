// gate_v4.cu: test kernels for the NVRTC gate (tests/test_compile_check.py).
// copy_v4 moves float4 (16-byte) values, so its PTX must hold a 128-bit
// global load; copy_scalar moves one __half at a time and must not.
// Defines: GATE_SCALE (a float literal, default 1.0f).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef GATE_SCALE
#define GATE_SCALE 1.0f
#endif

extern "C" __global__ void copy_v4(const float4* __restrict__ src, float4* __restrict__ dst, unsigned n) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float4 v = src[i];
        v.x *= GATE_SCALE;
        v.y *= GATE_SCALE;
        v.z *= GATE_SCALE;
        v.w *= GATE_SCALE;
        dst[i] = v;
    }
}

extern "C" __global__ void copy_scalar(const __half* __restrict__ src, __nv_bfloat16* __restrict__ dst, unsigned n) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __float2bfloat16_rn(__half2float(src[i]) * GATE_SCALE);
}
