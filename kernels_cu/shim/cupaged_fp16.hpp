// cupaged_fp16.hpp: __half, __half2, __nv_bfloat16 and __nv_bfloat162 for the
// CPU shim, with the API of CUDA's cuda_fp16.h / cuda_bf16.h that kernels use.
//
// Conversions are exact bit manipulation with round-to-nearest-even (ties,
// subnormals, overflow to inf); a NaN converts to the canonical NaN 0x7fff as
// on the GPU. Arithmetic rounds once per operation like the GPU: an op done in
// float and rounded to 16 bits is exact for + - * / (float has more than
// 2p+2 bits), and fma goes through double with round-to-odd.
#pragma once
#include <cstring>

#include "cupaged_vector_types.hpp"

namespace cupaged {

inline unsigned f32_bits(float f) { return __builtin_bit_cast(unsigned, f); }
inline float f32_from(unsigned u) { return __builtin_bit_cast(float, u); }

// float -> binary16, round to nearest even.
inline unsigned short f2h(float f) {
    const unsigned x = f32_bits(f);
    const unsigned sign = (x >> 16) & 0x8000u;
    const unsigned u = x & 0x7fffffffu;
    if (u >= 0x7f800000u) return u == 0x7f800000u ? (unsigned short)(sign | 0x7c00u) : (unsigned short)0x7fffu;
    if (u >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520: rounds to inf
    if (u >= 0x38800000u) {  // normal half (>= 2^-14)
        unsigned r = u - 0x38000000u;  // rebias 127 -> 15
        r += 0xfffu + ((r >> 13) & 1u);
        return (unsigned short)(sign | (r >> 13));
    }
    if (u <= 0x33000000u) return (unsigned short)sign;  // <= 2^-25: rounds to zero (tie to even)
    const unsigned e = u >> 23;  // 102..112: subnormal half
    const unsigned m = (u & 0x7fffffu) | 0x800000u;
    const unsigned shift = 126u - e;  // 14..24
    unsigned q = m >> shift;
    const unsigned rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return (unsigned short)(sign | q);
}

// binary16 -> float, exact (NaN payloads kept, quiet bit as stored).
inline float h2f(unsigned short h) {
    const unsigned sign = (unsigned)(h & 0x8000u) << 16;
    const unsigned e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) return f32_from(f32_bits((float)m * 0x1p-24f) | sign);
    if (e == 31) return f32_from(sign | 0x7f800000u | (m << 13));
    return f32_from(sign | ((e + 112u) << 23) | (m << 13));
}

// float -> bfloat16, round to nearest even.
inline unsigned short f2bf(float f) {
    unsigned x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    x += 0x7fffu + ((x >> 16) & 1u);
    return (unsigned short)(x >> 16);
}
inline float bf2f(unsigned short b) { return f32_from((unsigned)b << 16); }

// double -> float rounded to odd: a later round-to-nearest-even to 16 bits
// then gives the correctly rounded result of the original double.
inline float d2f_odd(double d) {
    float f = (float)d;
    if (d != d || (double)f == d) return f;
    unsigned b = f32_bits(f);
    if (__builtin_fabs((double)f) > __builtin_fabs(d)) --b;  // truncate toward zero
    return f32_from(b | 1u);
}

// a * b + c exactly, rounded to odd double (inputs are 16-bit values, so a*b
// is exact in double; TwoSum gives the error of the addition).
inline double fma_odd(double a, double b, double c) {
    const double p = a * b, s = p + c;
    if (s != s || __builtin_isinf(s)) return s;
    const double bb = s - p, err = (p - (s - bb)) + (c - bb);
    if (err == 0.0) return s;
    const unsigned long long sb = __builtin_bit_cast(unsigned long long, s);
    if (sb & 1ull) return s;
    return __builtin_nextafter(s, err > 0 ? __builtin_inf() : -__builtin_inf());
}

}  // namespace cupaged

struct __half_raw {
    unsigned short x;
};
struct __nv_bfloat16_raw {
    unsigned short x;
};
struct __half2_raw {
    unsigned short x, y;
};
struct __nv_bfloat162_raw {
    unsigned short x, y;
};

struct __half;
struct __nv_bfloat16;
inline __half __float2half(float f);
inline __half __double2half(double d);
inline float __half2float(__half h);
inline __nv_bfloat16 __float2bfloat16(float f);
inline __nv_bfloat16 __double2bfloat16(double d);
inline float __bfloat162float(__nv_bfloat16 h);

// The integer conversions CUDA's types offer under __CUDACC__.
#define CUPAGED_16BIT_INT_MEMBERS(T, TO_FLOAT, FROM_FLOAT)                                               \
    T(short v) { __x = FROM_FLOAT((float)v); }                                                           \
    T(unsigned short v) { __x = FROM_FLOAT((float)v); }                                                  \
    T(int v) { __x = FROM_FLOAT((float)v); }                                                             \
    T(unsigned int v) { __x = FROM_FLOAT((float)v); }                                                    \
    T(long long v) { __x = FROM_FLOAT((float)v); }                                                       \
    T(unsigned long long v) { __x = FROM_FLOAT((float)v); }                                              \
    T& operator=(short v) {                                                                              \
        __x = FROM_FLOAT((float)v);                                                                      \
        return *this;                                                                                    \
    }                                                                                                    \
    T& operator=(unsigned short v) {                                                                     \
        __x = FROM_FLOAT((float)v);                                                                      \
        return *this;                                                                                    \
    }                                                                                                    \
    T& operator=(int v) {                                                                                \
        __x = FROM_FLOAT((float)v);                                                                      \
        return *this;                                                                                    \
    }                                                                                                    \
    T& operator=(unsigned int v) {                                                                       \
        __x = FROM_FLOAT((float)v);                                                                      \
        return *this;                                                                                    \
    }                                                                                                    \
    T& operator=(long long v) {                                                                          \
        __x = FROM_FLOAT((float)v);                                                                      \
        return *this;                                                                                    \
    }                                                                                                    \
    T& operator=(unsigned long long v) {                                                                 \
        __x = FROM_FLOAT((float)v);                                                                      \
        return *this;                                                                                    \
    }                                                                                                    \
    operator short() const { return (short)::cupaged::f2i_rz<short>(TO_FLOAT(__x)); }                    \
    operator unsigned short() const { return ::cupaged::f2i_rz<unsigned short>(TO_FLOAT(__x)); }         \
    operator int() const { return ::cupaged::f2i_rz<int>(TO_FLOAT(__x)); }                               \
    operator unsigned int() const { return ::cupaged::f2i_rz<unsigned int>(TO_FLOAT(__x)); }             \
    operator long long() const { return ::cupaged::f2i_rz<long long>(TO_FLOAT(__x)); }                   \
    operator unsigned long long() const { return ::cupaged::f2i_rz<unsigned long long>(TO_FLOAT(__x)); } \
    operator bool() const { return (__x & 0x7fffu) != 0u; }

namespace cupaged {
// float -> integer toward zero, saturating, NaN -> 0 (the GPU's cvt.rzi.sat).
template <class I>
inline I f2i_rz(float f) {
    if (f != f) return 0;
    constexpr bool sgn = (I)-1 < (I)0;
    constexpr double lo = sgn ? -(double)(1ull << (sizeof(I) * 8 - 1)) : 0.0;
    constexpr double hi = sgn ? (double)(1ull << (sizeof(I) * 8 - 1)) : 2.0 * (double)(1ull << (sizeof(I) * 8 - 1));
    if ((double)f <= lo) return sgn ? (I)(1ull << (sizeof(I) * 8 - 1)) : (I)0;
    if ((double)f >= hi) return (I) ~(sgn ? (1ull << (sizeof(I) * 8 - 1)) : 0ull);
    return (I)f;
}
}  // namespace cupaged

struct __attribute__((aligned(2), may_alias)) __half {
    unsigned short __x;
    __half() = default;
    constexpr __half(const __half_raw& r) : __x(r.x) {}
    __half& operator=(const __half_raw& r) {
        __x = r.x;
        return *this;
    }
    operator __half_raw() const { return __half_raw{__x}; }
    __half(float f) : __x(::cupaged::f2h(f)) {}
    __half(double d) : __x(::cupaged::f2h(::cupaged::d2f_odd(d))) {}
    operator float() const { return ::cupaged::h2f(__x); }
    __half& operator=(float f) {
        __x = ::cupaged::f2h(f);
        return *this;
    }
    __half& operator=(double d) {
        __x = ::cupaged::f2h(::cupaged::d2f_odd(d));
        return *this;
    }
    CUPAGED_16BIT_INT_MEMBERS(__half, ::cupaged::h2f, ::cupaged::f2h)
};

struct __attribute__((aligned(2), may_alias)) __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    constexpr __nv_bfloat16(const __nv_bfloat16_raw& r) : __x(r.x) {}
    __nv_bfloat16& operator=(const __nv_bfloat16_raw& r) {
        __x = r.x;
        return *this;
    }
    operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
    __nv_bfloat16(float f) : __x(::cupaged::f2bf(f)) {}
    __nv_bfloat16(double d) : __x(::cupaged::f2bf(::cupaged::d2f_odd(d))) {}
    operator float() const { return ::cupaged::bf2f(__x); }
    __nv_bfloat16& operator=(float f) {
        __x = ::cupaged::f2bf(f);
        return *this;
    }
    __nv_bfloat16& operator=(double d) {
        __x = ::cupaged::f2bf(::cupaged::d2f_odd(d));
        return *this;
    }
    CUPAGED_16BIT_INT_MEMBERS(__nv_bfloat16, ::cupaged::bf2f, ::cupaged::f2bf)
};
#undef CUPAGED_16BIT_INT_MEMBERS

typedef __half half;
typedef __nv_bfloat16 nv_bfloat16;

struct __attribute__((aligned(4), may_alias)) __half2 {
    __half x, y;
    __half2() = default;
    constexpr __half2(const __half& a, const __half& b) : x(a), y(b) {}
    __half2(const __half2_raw& r) : x(__half_raw{r.x}), y(__half_raw{r.y}) {}
    operator __half2_raw() const { return __half2_raw{x.__x, y.__x}; }
};
struct __attribute__((aligned(4), may_alias)) __nv_bfloat162 {
    __nv_bfloat16 x, y;
    __nv_bfloat162() = default;
    constexpr __nv_bfloat162(const __nv_bfloat16& a, const __nv_bfloat16& b) : x(a), y(b) {}
    __nv_bfloat162(const __nv_bfloat162_raw& r) : x(__nv_bfloat16_raw{r.x}), y(__nv_bfloat16_raw{r.y}) {}
    operator __nv_bfloat162_raw() const { return __nv_bfloat162_raw{x.__x, y.__x}; }
};
typedef __half2 half2;
typedef __nv_bfloat162 nv_bfloat162;

static_assert(sizeof(__half) == 2 && sizeof(__half2) == 4 && alignof(__half2) == 4, "__half layout");
static_assert(sizeof(__nv_bfloat16) == 2 && sizeof(__nv_bfloat162) == 4, "__nv_bfloat16 layout");

// ---- conversions ------------------------------------------------------------
inline __half __float2half(float f) { return __half_raw{::cupaged::f2h(f)}; }
inline __half __float2half_rn(float f) { return __half_raw{::cupaged::f2h(f)}; }
inline __half __double2half(double d) { return __half_raw{::cupaged::f2h(::cupaged::d2f_odd(d))}; }
inline float __half2float(__half h) { return ::cupaged::h2f(h.__x); }
inline __half2 __float2half2_rn(float f) { return __half2(__float2half(f), __float2half(f)); }
inline __half2 __floats2half2_rn(float a, float b) { return __half2(__float2half(a), __float2half(b)); }
inline __half2 __float22half2_rn(float2 v) { return __half2(__float2half(v.x), __float2half(v.y)); }
inline float2 __half22float2(__half2 h) { return float2{__half2float(h.x), __half2float(h.y)}; }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline __half2 __halves2half2(__half a, __half b) { return __half2(a, b); }
inline __half2 __half2half2(__half a) { return __half2(a, a); }
inline __half2 __lows2half2(__half2 a, __half2 b) { return __half2(a.x, b.x); }
inline __half2 __highs2half2(__half2 a, __half2 b) { return __half2(a.y, b.y); }
inline __half2 __low2half2(__half2 a) { return __half2(a.x, a.x); }
inline __half2 __high2half2(__half2 a) { return __half2(a.y, a.y); }
inline __half2 __lowhigh2highlow(__half2 a) { return __half2(a.y, a.x); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline short __half_as_short(__half h) { return (short)h.__x; }
inline __half __ushort_as_half(unsigned short u) { return __half_raw{u}; }
inline __half __short_as_half(short s) { return __half_raw{(unsigned short)s}; }
inline __half __int2half_rn(int i) { return __float2half((float)i); }
inline __half __uint2half_rn(unsigned i) { return __float2half((float)i); }
inline __half __short2half_rn(short i) { return __float2half((float)i); }
inline __half __ushort2half_rn(unsigned short i) { return __float2half((float)i); }
inline int __half2int_rz(__half h) { return ::cupaged::f2i_rz<int>(__half2float(h)); }
inline unsigned __half2uint_rz(__half h) { return ::cupaged::f2i_rz<unsigned>(__half2float(h)); }
inline int __half2int_rn(__half h) { return ::cupaged::f2i_rz<int>(__builtin_rintf(__half2float(h))); }

inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16_raw{::cupaged::f2bf(f)}; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16_raw{::cupaged::f2bf(f)}; }
inline __nv_bfloat16 __float2bfloat16_rz(float f) {
    const unsigned x = ::cupaged::f32_bits(f);
    return __nv_bfloat16_raw{(x & 0x7fffffffu) > 0x7f800000u ? (unsigned short)0x7fffu : (unsigned short)(x >> 16)};
}
inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16_raw{::cupaged::f2bf(::cupaged::d2f_odd(d))}; }
inline float __bfloat162float(__nv_bfloat16 h) { return ::cupaged::bf2f(h.__x); }
inline __nv_bfloat162 __float2bfloat162_rn(float f) { return __nv_bfloat162(__float2bfloat16(f), __float2bfloat16(f)); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162(__float2bfloat16(a), __float2bfloat16(b));
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) {
    return __nv_bfloat162(__float2bfloat16(v.x), __float2bfloat16(v.y));
}
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return float2{__bfloat162float(h.x), __bfloat162float(h.y)}; }
inline float __low2float(__nv_bfloat162 h) { return __bfloat162float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return __bfloat162float(h.y); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 h) { return h.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 h) { return h.y; }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162(a, b); }
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 a) { return __nv_bfloat162(a, a); }
inline __nv_bfloat162 __lows2bfloat162(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(a.x, b.x); }
inline __nv_bfloat162 __highs2bfloat162(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(a.y, b.y); }
inline __nv_bfloat162 __low2bfloat162(__nv_bfloat162 a) { return __nv_bfloat162(a.x, a.x); }
inline __nv_bfloat162 __high2bfloat162(__nv_bfloat162 a) { return __nv_bfloat162(a.y, a.y); }
inline __nv_bfloat162 __lowhigh2highlow(__nv_bfloat162 a) { return __nv_bfloat162(a.y, a.x); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline short __bfloat16_as_short(__nv_bfloat16 h) { return (short)h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16_raw{u}; }
inline __nv_bfloat16 __short_as_bfloat16(short s) { return __nv_bfloat16_raw{(unsigned short)s}; }
inline __nv_bfloat16 __int2bfloat16_rn(int i) { return __double2bfloat16((double)i); }
inline int __bfloat162int_rz(__nv_bfloat16 h) { return ::cupaged::f2i_rz<int>(__bfloat162float(h)); }
inline __nv_bfloat16 __half2bfloat16(__half h) { return __float2bfloat16(__half2float(h)); }  // not CUDA API; handy

// ---- arithmetic, one rounding per operation ------------------------------------
// Generated once for __half (H, ::cupaged::h2f/f2h) and once for __nv_bfloat16.
#define CUPAGED_16BIT_MATH(H, H2, TOF, FROMF)                                                              \
    inline H __hadd(H a, H b) { return H##_raw{FROMF(TOF(a.__x) + TOF(b.__x))}; }                          \
    inline H __hsub(H a, H b) { return H##_raw{FROMF(TOF(a.__x) - TOF(b.__x))}; }                          \
    inline H __hmul(H a, H b) { return H##_raw{FROMF(TOF(a.__x) * TOF(b.__x))}; }                          \
    inline H __hdiv(H a, H b) { return H##_raw{FROMF(TOF(a.__x) / TOF(b.__x))}; }                          \
    inline H __hadd_rn(H a, H b) { return __hadd(a, b); }                                                  \
    inline H __hsub_rn(H a, H b) { return __hsub(a, b); }                                                  \
    inline H __hmul_rn(H a, H b) { return __hmul(a, b); }                                                  \
    inline H __hadd_sat(H a, H b) {                                                                        \
        return H##_raw{FROMF(__builtin_fminf(__builtin_fmaxf(TOF(a.__x) + TOF(b.__x), 0.f), 1.f))};        \
    }                                                                                                      \
    inline H __hmul_sat(H a, H b) {                                                                        \
        return H##_raw{FROMF(__builtin_fminf(__builtin_fmaxf(TOF(a.__x) * TOF(b.__x), 0.f), 1.f))};        \
    }                                                                                                      \
    inline H __hfma(H a, H b, H c) {                                                                       \
        return H##_raw{FROMF(::cupaged::d2f_odd(::cupaged::fma_odd(TOF(a.__x), TOF(b.__x), TOF(c.__x))))}; \
    }                                                                                                      \
    inline H __hneg(H a) { return H##_raw{(unsigned short)(a.__x ^ 0x8000u)}; }                            \
    inline H __habs(H a) { return H##_raw{(unsigned short)(a.__x & 0x7fffu)}; }                            \
    inline H __hmax(H a, H b) { return H##_raw{FROMF(__builtin_fmaxf(TOF(a.__x), TOF(b.__x)))}; }          \
    inline H __hmin(H a, H b) { return H##_raw{FROMF(__builtin_fminf(TOF(a.__x), TOF(b.__x)))}; }          \
    inline bool __heq(H a, H b) { return TOF(a.__x) == TOF(b.__x); }                                       \
    inline bool __hne(H a, H b) {                                                                          \
        float x = TOF(a.__x), y = TOF(b.__x);                                                              \
        return x < y || x > y;                                                                             \
    }                                                                                                      \
    inline bool __hlt(H a, H b) { return TOF(a.__x) < TOF(b.__x); }                                        \
    inline bool __hle(H a, H b) { return TOF(a.__x) <= TOF(b.__x); }                                       \
    inline bool __hgt(H a, H b) { return TOF(a.__x) > TOF(b.__x); }                                        \
    inline bool __hge(H a, H b) { return TOF(a.__x) >= TOF(b.__x); }                                       \
    inline bool __hequ(H a, H b) { return !__hne(a, b); }                                                  \
    inline bool __hneu(H a, H b) { return !__heq(a, b); }                                                  \
    inline bool __hltu(H a, H b) { return !__hge(a, b); }                                                  \
    inline bool __hleu(H a, H b) { return !__hgt(a, b); }                                                  \
    inline bool __hgtu(H a, H b) { return !__hle(a, b); }                                                  \
    inline bool __hgeu(H a, H b) { return !__hlt(a, b); }                                                  \
    inline bool __hisnan(H a) {                                                                            \
        float x = TOF(a.__x);                                                                              \
        return x != x;                                                                                     \
    }                                                                                                      \
    inline int __hisinf(H a) {                                                                             \
        float x = TOF(a.__x);                                                                              \
        return __builtin_isinf(x) ? (x < 0 ? -1 : 1) : 0;                                                  \
    }                                                                                                      \
    inline H operator+(const H& a, const H& b) { return __hadd(a, b); }                                    \
    inline H operator-(const H& a, const H& b) { return __hsub(a, b); }                                    \
    inline H operator*(const H& a, const H& b) { return __hmul(a, b); }                                    \
    inline H operator/(const H& a, const H& b) { return __hdiv(a, b); }                                    \
    inline H& operator+=(H& a, const H& b) {                                                               \
        a = __hadd(a, b);                                                                                  \
        return a;                                                                                          \
    }                                                                                                      \
    inline H& operator-=(H& a, const H& b) {                                                               \
        a = __hsub(a, b);                                                                                  \
        return a;                                                                                          \
    }                                                                                                      \
    inline H& operator*=(H& a, const H& b) {                                                               \
        a = __hmul(a, b);                                                                                  \
        return a;                                                                                          \
    }                                                                                                      \
    inline H& operator/=(H& a, const H& b) {                                                               \
        a = __hdiv(a, b);                                                                                  \
        return a;                                                                                          \
    }                                                                                                      \
    inline H operator+(const H& a) { return a; }                                                           \
    inline H operator-(const H& a) { return __hneg(a); }                                                   \
    inline bool operator==(const H& a, const H& b) { return __heq(a, b); }                                 \
    inline bool operator!=(const H& a, const H& b) { return __hneu(a, b); }                                \
    inline bool operator<(const H& a, const H& b) { return __hlt(a, b); }                                  \
    inline bool operator<=(const H& a, const H& b) { return __hle(a, b); }                                 \
    inline bool operator>(const H& a, const H& b) { return __hgt(a, b); }                                  \
    inline bool operator>=(const H& a, const H& b) { return __hge(a, b); }                                 \
    inline H2 __hadd2(H2 a, H2 b) { return H2(__hadd(a.x, b.x), __hadd(a.y, b.y)); }                       \
    inline H2 __hsub2(H2 a, H2 b) { return H2(__hsub(a.x, b.x), __hsub(a.y, b.y)); }                       \
    inline H2 __hmul2(H2 a, H2 b) { return H2(__hmul(a.x, b.x), __hmul(a.y, b.y)); }                       \
    inline H2 __h2div(H2 a, H2 b) { return H2(__hdiv(a.x, b.x), __hdiv(a.y, b.y)); }                       \
    inline H2 __hfma2(H2 a, H2 b, H2 c) { return H2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); }       \
    inline H2 __hneg2(H2 a) { return H2(__hneg(a.x), __hneg(a.y)); }                                       \
    inline H2 __habs2(H2 a) { return H2(__habs(a.x), __habs(a.y)); }                                       \
    inline H2 __hmax2(H2 a, H2 b) { return H2(__hmax(a.x, b.x), __hmax(a.y, b.y)); }                       \
    inline H2 __hmin2(H2 a, H2 b) { return H2(__hmin(a.x, b.x), __hmin(a.y, b.y)); }                       \
    inline bool __hbeq2(H2 a, H2 b) { return __heq(a.x, b.x) && __heq(a.y, b.y); }                         \
    inline bool __hbneu2(H2 a, H2 b) { return __hneu(a.x, b.x) && __hneu(a.y, b.y); }                      \
    inline H2 operator+(const H2& a, const H2& b) { return __hadd2(a, b); }                                \
    inline H2 operator-(const H2& a, const H2& b) { return __hsub2(a, b); }                                \
    inline H2 operator*(const H2& a, const H2& b) { return __hmul2(a, b); }                                \
    inline H2 operator/(const H2& a, const H2& b) { return __h2div(a, b); }                                \
    inline H2& operator+=(H2& a, const H2& b) {                                                            \
        a = __hadd2(a, b);                                                                                 \
        return a;                                                                                          \
    }                                                                                                      \
    inline H2& operator-=(H2& a, const H2& b) {                                                            \
        a = __hsub2(a, b);                                                                                 \
        return a;                                                                                          \
    }                                                                                                      \
    inline H2& operator*=(H2& a, const H2& b) {                                                            \
        a = __hmul2(a, b);                                                                                 \
        return a;                                                                                          \
    }                                                                                                      \
    inline H2& operator/=(H2& a, const H2& b) {                                                            \
        a = __h2div(a, b);                                                                                 \
        return a;                                                                                          \
    }                                                                                                      \
    inline H2 operator-(const H2& a) { return __hneg2(a); }                                                \
    inline bool operator==(const H2& a, const H2& b) { return __hbeq2(a, b); }                             \
    inline bool operator!=(const H2& a, const H2& b) { return __hbneu2(a, b); }

CUPAGED_16BIT_MATH(__half, __half2, ::cupaged::h2f, ::cupaged::f2h)
CUPAGED_16BIT_MATH(__nv_bfloat16, __nv_bfloat162, ::cupaged::bf2f, ::cupaged::f2bf)
#undef CUPAGED_16BIT_MATH

// A few elementwise functions (computed in float, rounded once).
inline __half hexp(__half a) { return __float2half(__builtin_expf(__half2float(a))); }
inline __half hlog(__half a) { return __float2half(__builtin_logf(__half2float(a))); }
inline __half hsqrt(__half a) { return __float2half(__builtin_sqrtf(__half2float(a))); }
inline __half hrsqrt(__half a) { return __float2half(1.0f / __builtin_sqrtf(__half2float(a))); }
inline __nv_bfloat16 hexp(__nv_bfloat16 a) { return __float2bfloat16(__builtin_expf(__bfloat162float(a))); }
inline __nv_bfloat16 hlog(__nv_bfloat16 a) { return __float2bfloat16(__builtin_logf(__bfloat162float(a))); }
inline __nv_bfloat16 hsqrt(__nv_bfloat16 a) { return __float2bfloat16(__builtin_sqrtf(__bfloat162float(a))); }
inline __nv_bfloat16 hrsqrt(__nv_bfloat16 a) { return __float2bfloat16(1.0f / __builtin_sqrtf(__bfloat162float(a))); }
