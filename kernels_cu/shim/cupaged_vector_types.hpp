// cupaged_vector_types.hpp: CUDA's built-in vector types (float4, int2, uint3,
// dim3, ...) and their make_* functions for the CPU shim. Alignments follow
// CUDA's vector_types.h; every type is may_alias so kernels can reinterpret
// memory as float4 the way CUDA code does.
#pragma once

#define CUPAGED_VEC1(T, N, A)                                    \
    struct __attribute__((aligned(A), may_alias)) N##1 { T x; }; \
    inline N##1 make_##N##1(T x) { return N##1 {x}; }
#define CUPAGED_VEC2(T, N, A)                                       \
    struct __attribute__((aligned(A), may_alias)) N##2 { T x, y; }; \
    inline N##2 make_##N##2(T x, T y) { return N##2 {x, y}; }
#define CUPAGED_VEC3(T, N, A)                                          \
    struct __attribute__((aligned(A), may_alias)) N##3 { T x, y, z; }; \
    inline N##3 make_##N##3(T x, T y, T z) { return N##3 {x, y, z}; }
#define CUPAGED_VEC4(T, N, A)                                             \
    struct __attribute__((aligned(A), may_alias)) N##4 { T x, y, z, w; }; \
    inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4 {x, y, z, w}; }
#define CUPAGED_VECS(T, N, A1, A2, A3, A4) \
    CUPAGED_VEC1(T, N, A1) CUPAGED_VEC2(T, N, A2) CUPAGED_VEC3(T, N, A3) CUPAGED_VEC4(T, N, A4)

CUPAGED_VECS(signed char, char, 1, 2, 1, 4)
CUPAGED_VECS(unsigned char, uchar, 1, 2, 1, 4)
CUPAGED_VECS(short, short, 2, 4, 2, 8)
CUPAGED_VECS(unsigned short, ushort, 2, 4, 2, 8)
CUPAGED_VECS(int, int, 4, 8, 4, 16)
CUPAGED_VECS(unsigned int, uint, 4, 8, 4, 16)
CUPAGED_VECS(long, long, 8, 16, 8, 16)
CUPAGED_VECS(unsigned long, ulong, 8, 16, 8, 16)
CUPAGED_VECS(long long, longlong, 8, 16, 8, 16)
CUPAGED_VECS(unsigned long long, ulonglong, 8, 16, 8, 16)
CUPAGED_VECS(float, float, 4, 8, 4, 16)
CUPAGED_VECS(double, double, 8, 16, 8, 16)

#undef CUPAGED_VECS
#undef CUPAGED_VEC4
#undef CUPAGED_VEC3
#undef CUPAGED_VEC2
#undef CUPAGED_VEC1

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

static_assert(sizeof(float4) == 16 && alignof(float4) == 16, "float4 layout");
static_assert(sizeof(float2) == 8 && alignof(float2) == 8, "float2 layout");
static_assert(sizeof(uint4) == 16 && alignof(uint4) == 16, "uint4 layout");
static_assert(sizeof(ushort2) == 4 && alignof(ushort2) == 4, "ushort2 layout");
static_assert(sizeof(ushort4) == 8 && alignof(ushort4) == 8, "ushort4 layout");
static_assert(sizeof(uint3) == 12, "uint3 layout");
