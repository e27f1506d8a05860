// vec4.cuh: four floats one thread computes on together (a register
// micro-tile's four rows, or four output dims), with component-wise
// operations that round exactly as the scalar ones: v4::fma(a, b, c) is
// fmaf(a[i], b[i], c[i]) for each i (rounded once), v4::mul a[i] * b[i]; v4::exp2 is
// 2^a[i] (exp2f; on the CPU backend the shim's cupaged_exp2f, in every form).
//
// On the GPU a V4 is four float registers and every operation four scalar
// instructions (FFMA, FMUL): the compiled code is what the scalar loops give.
// On the CPU backend with FMA (g++ -mfma) a V4 is one SSE register and an
// operation one instruction (vfmadd231ps, vmulps) instead of four scalar ones
// with their spills: the same bits, about four times fewer instructions in a
// micro-tile loop (paged_prefill_simt). Without FMA the CPU backend uses the
// scalar form too.
#pragma once

#if defined(CUPAGED_CPU) && defined(__FMA__)
#include <immintrin.h>
#define CUPAGED_V4_SSE 1
#else
#define CUPAGED_V4_SSE 0
#endif

#if CUPAGED_V4_SSE
#if defined(__AVX2__)
#define CUPAGED_EXP2F4 1
// cupaged_exp2f of four floats (AVX2: four doubles), the same operations in the same order.
inline __m128 cupaged_exp2f4(__m128 xf) {
    using namespace ::cupaged::exp2_poly;
    const __m128 c = _mm_min_ps(_mm_max_ps(xf, _mm_set1_ps(kLo)), _mm_set1_ps(kHi));  // NaN lanes: replaced below
    const __m256d x = _mm256_cvtps_pd(c);
    const __m256d shift = _mm256_set1_pd(kShift);
    const __m256d big = _mm256_add_pd(x, shift);
    const __m256d r = _mm256_sub_pd(x, _mm256_sub_pd(big, shift));
    __m256d p = _mm256_set1_pd(kC[6]);
    for (int k = 5; k >= 0; --k) p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(kC[k]));
    const __m256i bits = _mm256_slli_epi64(_mm256_add_epi64(_mm256_castpd_si256(big), _mm256_set1_epi64x(1023)), 52);
    const __m128 e = _mm256_cvtpd_ps(_mm256_mul_pd(p, _mm256_castsi256_pd(bits)));
    return _mm_blendv_ps(e, xf, _mm_cmpunord_ps(xf, xf));
}
#else
#define CUPAGED_EXP2F4 0
#endif
#endif

namespace v4 {

#if CUPAGED_V4_SSE
struct V4 {
    __m128 v;
};
// p: 16-byte aligned (a float4 on the GPU; the CPU form accepts any).
__device__ __forceinline__ V4 load(const float* p) { return V4{_mm_loadu_ps(p)}; }
__device__ __forceinline__ void store(float* p, V4 a) { _mm_storeu_ps(p, a.v); }
// A register array's four floats, and back.
__device__ __forceinline__ V4 from(const float (&f)[4]) { return V4{_mm_loadu_ps(f)}; }
__device__ __forceinline__ void to(float (&f)[4], V4 a) { _mm_storeu_ps(f, a.v); }
__device__ __forceinline__ V4 splat(float x) { return V4{_mm_set1_ps(x)}; }
__device__ __forceinline__ V4 zero() { return V4{_mm_setzero_ps()}; }
__device__ __forceinline__ V4 fma(V4 a, V4 b, V4 c) { return V4{_mm_fmadd_ps(a.v, b.v, c.v)}; }
__device__ __forceinline__ V4 mul(V4 a, V4 b) { return V4{_mm_mul_ps(a.v, b.v)}; }
__device__ __forceinline__ V4 sub(V4 a, V4 b) { return V4{_mm_sub_ps(a.v, b.v)}; }
// a where c, else b (a blend: neither is rounded or read for its value).
__device__ __forceinline__ V4 select(bool c, V4 a, V4 b) {
    return V4{_mm_blendv_ps(b.v, a.v, _mm_castsi128_ps(_mm_set1_epi32(-(int)c)))};
}
// 2^a of each: the shim's cupaged_exp2f (four at once with AVX2, the same bits).
__device__ __forceinline__ V4 exp2(V4 a) {
#if CUPAGED_EXP2F4
    return V4{cupaged_exp2f4(a.v)};
#else
    float f[4];
    _mm_storeu_ps(f, a.v);
    return V4{_mm_set_ps(cupaged_exp2f(f[3]), cupaged_exp2f(f[2]), cupaged_exp2f(f[1]), cupaged_exp2f(f[0]))};
#endif
}
#else
struct V4 {
    float x, y, z, w;
};
__device__ __forceinline__ V4 load(const float* p) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    return V4{f.x, f.y, f.z, f.w};
}
__device__ __forceinline__ void store(float* p, V4 a) {
    float4 f;
    f.x = a.x;
    f.y = a.y;
    f.z = a.z;
    f.w = a.w;
    *reinterpret_cast<float4*>(p) = f;
}
__device__ __forceinline__ V4 from(const float (&f)[4]) { return V4{f[0], f[1], f[2], f[3]}; }
__device__ __forceinline__ void to(float (&f)[4], V4 a) {
    f[0] = a.x;
    f[1] = a.y;
    f[2] = a.z;
    f[3] = a.w;
}
__device__ __forceinline__ V4 splat(float x) { return V4{x, x, x, x}; }
__device__ __forceinline__ V4 zero() { return V4{0.0f, 0.0f, 0.0f, 0.0f}; }
__device__ __forceinline__ V4 fma(V4 a, V4 b, V4 c) {
    return V4{fmaf(a.x, b.x, c.x), fmaf(a.y, b.y, c.y), fmaf(a.z, b.z, c.z), fmaf(a.w, b.w, c.w)};
}
__device__ __forceinline__ V4 mul(V4 a, V4 b) { return V4{a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w}; }
__device__ __forceinline__ V4 sub(V4 a, V4 b) { return V4{a.x - b.x, a.y - b.y, a.z - b.z, a.w - b.w}; }
__device__ __forceinline__ V4 select(bool c, V4 a, V4 b) { return c ? a : b; }
// 2^a of each: exp2f on a GPU, the shim's cupaged_exp2f on the CPU backend (as the vector form).
#ifdef CUPAGED_CPU
__device__ __forceinline__ V4 exp2(V4 a) {
    return V4{cupaged_exp2f(a.x), cupaged_exp2f(a.y), cupaged_exp2f(a.z), cupaged_exp2f(a.w)};
}
#else
__device__ __forceinline__ V4 exp2(V4 a) { return V4{exp2f(a.x), exp2f(a.y), exp2f(a.z), exp2f(a.w)}; }
#endif
#endif

// A float4's components as a V4 (a register value, not memory).
__device__ __forceinline__ V4 of(float4 f) {
#if CUPAGED_V4_SSE
    return V4{_mm_set_ps(f.w, f.z, f.y, f.x)};
#else
    return V4{f.x, f.y, f.z, f.w};
#endif
}

}  // namespace v4
