// fp8.cuh: the two fp8 K/V storage formats (cupaged/dtypes.py rows e4m3 and
// e5m2, OCP E4M3FN and E5M2) and every conversion the kernels make with them.
// Included by common.cuh; compiled unchanged by NVRTC and by g++ (the shim).
//
// A cache element is a code c; the value it stands for is c * scale, with a
// float32 scale per tensor or per KV head that the kernels apply outside the
// conversions (folded into the score scale for K and into the output for V),
// so every conversion here is exact:
//   * decoding: every e4m3 and e5m2 value is an f16, a bf16 and an f32 value
//     (f16 has e5m2's exponent range and more mantissa; e4m3's range is
//     inside f16's normal range), NaN stays NaN, e5m2's infinities stay
//     infinite;
//   * encoding (appends): round to nearest, ties to even, saturating to the
//     largest finite value (infinities included); NaN stays NaN (e4m3: code
//     0x7f, e5m2: 0x7e, with the input's sign), as ml_dtypes' float32 ->
//     float8 conversion of a value clamped to +-max_finite.
// On sm_89 and later a pair of codes becomes an f16 pair in one cvt
// instruction (cvt.rn.f16x2.e4m3x2 / .e5m2x2); elsewhere (sm_80, the CPU
// backend) the same bits come from integer operations and one f16 multiply.
#pragma once

// Storage types: one byte, distinct C++ types so that overloads pick the format.
struct cp_fp8_e4m3 {
    unsigned char bits;
};
struct cp_fp8_e5m2 {
    unsigned char bits;
};
typedef cp_fp8_e4m3 cp_type_e4m3;
typedef cp_fp8_e5m2 cp_type_e5m2;

namespace fp8 {

template <typename F>
struct Format;
template <>
struct Format<cp_fp8_e4m3> {
    static constexpr unsigned kMan = 3, kBias = 7;
    static constexpr unsigned kMaxCode = 0x7eu;  // 448
    static constexpr unsigned kNanCode = 0x7fu;
    static constexpr unsigned kMaxBits = 0x43e00000u;  // 448.0f
    static constexpr unsigned kMinNormalBits = 121u << 23;  // 2^-6
};
template <>
struct Format<cp_fp8_e5m2> {
    static constexpr unsigned kMan = 2, kBias = 15;
    static constexpr unsigned kMaxCode = 0x7bu;  // 57344
    static constexpr unsigned kNanCode = 0x7eu;
    static constexpr unsigned kMaxBits = 0x47600000u;  // 57344.0f
    static constexpr unsigned kMinNormalBits = 113u << 23;  // 2^-14
};

template <typename T>
struct is_fp8 {
    static constexpr bool value = false;
};
template <>
struct is_fp8<cp_fp8_e4m3> {
    static constexpr bool value = true;
};
template <>
struct is_fp8<cp_fp8_e5m2> {
    static constexpr bool value = true;
};

// The code nearest to f (ties to even), saturating to +-max finite; NaN -> NaN.
template <typename F>
__device__ __forceinline__ F encode(float f) {
    typedef Format<F> M;
    const unsigned u = __float_as_uint(f);
    const unsigned sign = (u >> 24) & 0x80u;
    const unsigned a = u & 0x7fffffffu;
    unsigned code;
    if (a > 0x7f800000u) {
        code = M::kNanCode;
    } else if (a >= M::kMaxBits) {
        code = M::kMaxCode;  // infinities too
    } else if (a >= M::kMinNormalBits) {
        constexpr unsigned sh = 23u - M::kMan;
        unsigned r = a - ((127u - M::kBias) << 23);  // the exponent rebased
        r += (1u << (sh - 1u)) - 1u + ((r >> sh) & 1u);
        code = r >> sh;
    } else {  // a subnormal code (or 0): round a / 2^(1 - bias - man) to an integer
        const unsigned e = a >> 23;
        const unsigned m = (a & 0x7fffffu) | (e ? 0x800000u : 0u);
        const unsigned shift = 151u - M::kBias - M::kMan - (e ? e : 1u);  // >= 21
        code = 0u;
        if (shift <= 24u) {
            const unsigned q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
            code = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
        }
    }
    F r;
    r.bits = (unsigned char)(sign | code);
    return r;
}

// Two codes (bits 0..7: element 0, bits 8..15: element 1) as an f16 pair
// (element 0 in the low half), exactly.
template <typename F>
__device__ __forceinline__ unsigned x2_to_h2(unsigned x);
template <>
__device__ __forceinline__ unsigned x2_to_h2<cp_fp8_e5m2>(unsigned x) {
    // an e5m2 code is the high byte of the f16 of the same value
    return __byte_perm(x, 0u, 0x1404u);
}
template <>
__device__ __forceinline__ unsigned x2_to_h2<cp_fp8_e4m3>(unsigned x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned d;
    const unsigned short a = (unsigned short)x;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"(a));
    return d;
#else
    const unsigned t = __byte_perm(x, 0u, 0x1404u);  // code 0 in bits 8..15, code 1 in bits 24..31
    // sign, then exponent and mantissa one place down: the f16 of value / 256
    unsigned h = (t & 0x80008000u) | ((t >> 1) & 0x3f803f80u);
    const unsigned k256 = 0x5c005c00u;  // f16 256.0 twice: the multiply is exact
    __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&h), *reinterpret_cast<const __half2*>(&k256));
    h = *reinterpret_cast<const unsigned*>(&v);
    // the NaN codes (exponent and mantissa all ones) as f16 NaN
    const unsigned nan = ((t & 0x7f007f00u) + 0x01000100u) & 0x80008000u;
    return h | ((nan >> 15) * 0x7fffu);
#endif
}
// Two codes as a pair of T (f16 or bf16), element 0 in the low half, exactly.
template <typename T, typename F>
__device__ __forceinline__ unsigned x2_to(unsigned x);
template <typename T, typename F>
struct X2To;
template <typename F>
struct X2To<__half, F> {
    __device__ __forceinline__ static unsigned run(unsigned x) { return x2_to_h2<F>(x); }
};
template <typename F>
struct X2To<__nv_bfloat16, F> {
    __device__ __forceinline__ static unsigned run(unsigned x) {
        const unsigned h = x2_to_h2<F>(x);
        const __half2 v = *reinterpret_cast<const __half2*>(&h);
        const __nv_bfloat162 b = __floats2bfloat162_rn(__low2float(v), __high2float(v));
        return *reinterpret_cast<const unsigned*>(&b);
    }
};
template <typename T, typename F>
__device__ __forceinline__ unsigned x2_to(unsigned x) {
    return X2To<T, F>::run(x);
}

// Four codes (one byte each of x) as two pairs of T: lo = elements 0, 1; hi = 2, 3.
template <typename T, typename F>
__device__ __forceinline__ void x4_to(unsigned x, unsigned& lo, unsigned& hi) {
    lo = x2_to<T, F>(x);
    hi = x2_to<T, F>(x >> 16);
}

// Two codes as floats.
template <typename F>
__device__ __forceinline__ float2 x2_to_float2(unsigned x) {
    const unsigned h = x2_to_h2<F>(x);
    return __half22float2(*reinterpret_cast<const __half2*>(&h));
}
template <typename F>
__device__ __forceinline__ float to_float(F c) {
    return x2_to_float2<F>(c.bits).x;
}

}  // namespace fp8
