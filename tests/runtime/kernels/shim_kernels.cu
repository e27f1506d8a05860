// Test kernels for the CPU backend's shim (tests/test_shim.py). Plain CUDA C:
// everything but the cupaged_warp_collective test would compile under NVRTC.
// Lines marked "// @NAME" are found by the tests to check reported lines.
#include "../../../kernels_cu/common.cuh"
#include "../../../kernels_cu/vec4.cuh"

// ---- identity and launch geometry --------------------------------------------------
// out[global linear thread][12]: threadIdx, blockIdx, blockDim, gridDim.
extern "C" __global__ void geometry(int* out) {
    const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const unsigned nthreads = blockDim.x * blockDim.y * blockDim.z;
    const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    int* o = out + 12 * (block * nthreads + t);
    o[0] = threadIdx.x;
    o[1] = threadIdx.y;
    o[2] = threadIdx.z;
    o[3] = blockIdx.x;
    o[4] = blockIdx.y;
    o[5] = blockIdx.z;
    o[6] = blockDim.x;
    o[7] = blockDim.y;
    o[8] = blockDim.z;
    o[9] = gridDim.x;
    o[10] = gridDim.y;
    o[11] = gridDim.z;
}

// Every parameter type the launcher converts.
extern "C" __global__ void arg_types(double* out, const float* in, int i, unsigned u, long long ll,
                                     unsigned long long ull, float f, double d) {
    if (threadIdx.x != 0) return;
    out[0] = in[0];
    out[1] = i;
    out[2] = u;
    out[3] = (double)ll;
    out[4] = (double)ull;
    out[5] = f;
    out[6] = d;
}

// ---- warp collectives ------------------------------------------------------------------
// mode 0 idx, 1 up, 2 down, 3 xor. Threads outside `mask` do not take part (out = -1).
extern "C" __global__ void shfl_int(const int* in, int* out, int mode, int arg, int width, unsigned mask) {
    const unsigned t = threadIdx.x, lane = t & 31;
    if (!(mask >> lane & 1u)) {
        out[t] = -1;
        return;
    }
    const int v = in[t];
    int r = 0;
    switch (mode) {
        case 0:
            r = __shfl_sync(mask, v, arg, width);
            break;
        case 1:
            r = __shfl_up_sync(mask, v, (unsigned)arg, width);
            break;
        case 2:
            r = __shfl_down_sync(mask, v, (unsigned)arg, width);
            break;
        default:
            r = __shfl_xor_sync(mask, v, arg, width);
            break;
    }
    out[t] = r;
}

// Shuffles of the other value types: out columns float, double, u64, __half bits, bf162 bits.
extern "C" __global__ void shfl_types(const float* fin, const double* din, const unsigned long long* uin, float* fout,
                                      double* dout, unsigned long long* uout, unsigned short* hout, unsigned* b2out) {
    const unsigned t = threadIdx.x;
    fout[t] = __shfl_xor_sync(CP_FULL_MASK, fin[t], 5);
    dout[t] = __shfl_down_sync(CP_FULL_MASK, din[t], 3, 16);
    uout[t] = __shfl_up_sync(CP_FULL_MASK, uin[t], 7);
    hout[t] = __half_as_ushort(__shfl_sync(CP_FULL_MASK, __float2half(fin[t]), 31 - (int)t % 32));
    __nv_bfloat162 b = __floats2bfloat162_rn(fin[t], -fin[t]);
    b = __shfl_xor_sync(CP_FULL_MASK, b, 1);
    b2out[t] = (unsigned)__bfloat16_as_ushort(b.x) | ((unsigned)__bfloat16_as_ushort(b.y) << 16);
}

// Votes over the lanes in `mask` (others do not take part).
extern "C" __global__ void votes(const int* pred, unsigned* ballot, int* any, int* all, unsigned* uni, unsigned mask) {
    const unsigned t = threadIdx.x, lane = t & 31;
    if (!(mask >> lane & 1u)) return;
    const int p = pred[t];
    ballot[t] = __ballot_sync(mask, p);
    any[t] = __any_sync(mask, p);
    all[t] = __all_sync(mask, p);
    uni[t] = __uni_sync(mask, p);
}

// Reductions and matches over the full warp; activemask after some lanes exit.
extern "C" __global__ void warp_reduce_match(const unsigned* in, unsigned* out, int* match_pred) {
    const unsigned t = threadIdx.x;
    const unsigned v = in[t];
    unsigned* o = out + 8 * t;
    o[0] = __reduce_add_sync(CP_FULL_MASK, v);
    o[1] = __reduce_min_sync(CP_FULL_MASK, v);
    o[2] = __reduce_max_sync(CP_FULL_MASK, (int)v);
    o[3] = __reduce_and_sync(CP_FULL_MASK, v);
    o[4] = __reduce_or_sync(CP_FULL_MASK, v);
    o[5] = __reduce_xor_sync(CP_FULL_MASK, v);
    o[6] = __match_any_sync(CP_FULL_MASK, v % 3);
    int pred = -1;
    __match_all_sync(CP_FULL_MASK, v % 3, &pred);
    match_pred[t] = pred;
    if ((t & 31) >= 24) return;
    __syncthreads();  // lanes 24-31 have exited by now
    const unsigned am = __activemask();
    __syncthreads();  // ... and none of the others yet
    o[7] = am;
}

// __syncwarp orders shared-memory traffic between lanes: rotate values by one lane.
extern "C" __global__ void syncwarp_rotate(const int* in, int* out) {
    __shared__ int buf[64];
    const unsigned t = threadIdx.x;
    buf[t] = in[t];
    __syncwarp();
    out[t] = buf[(t & ~31u) | ((t + 1) & 31u)];
}

// Sum of a block of any size (partial warps included), with masks that name
// only lanes that exist: ballot finds them, shfl_down adds within range.
extern "C" __global__ void block_sum_partial(const float* in, float* out) {
    __shared__ float part[32];
    const unsigned t = threadIdx.x, lane = t & 31, warp = t / 32;
    float v = in[blockIdx.x * blockDim.x + t];
    const unsigned live = __ballot_sync(CP_FULL_MASK, 1);
    const unsigned n = __popc(live);
    for (unsigned o = 16; o > 0; o >>= 1) {
        const float other = __shfl_down_sync(live, v, o);
        if (lane + o < n) v += other;
    }
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (t == 0) {
        float s = 0.f;
        for (unsigned w = 0; w < (blockDim.x + 31) / 32; ++w) s += part[w];
        out[blockIdx.x] = s;
    }
}

// The common.cuh reductions on full warps.
extern "C" __global__ void warp_sum_max(const float* in, float* sum, float* mx) {
    const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
    sum[t] = warp_sum(in[t]);
    mx[t] = warp_max(in[t]);
}

// ---- block barriers and shared memory -------------------------------------------------------
// Threads with t % 3 == 0 exit at once; the others still pass two barriers.
extern "C" __global__ void early_exit(const int* in, int* out) {
    __shared__ int buf[1024];
    const unsigned t = threadIdx.x, n = blockDim.x;
    if (t % 3 == 0) {
        out[t] = -7;
        return;
    }
    buf[t] = in[t];
    __syncthreads();
    const unsigned src = (t + 1) % n;
    int v = (src % 3 == 0) ? -1 : buf[src];
    __syncthreads();
    buf[t] = v * 2;
    __syncthreads();
    out[t] = buf[t];
}

// Tree reduction in static shared memory (blockDim.x a power of two, <= 1024).
extern "C" __global__ void reduce_static(const float* in, float* out) {
    __shared__ float s[1024];
    const unsigned t = threadIdx.x;
    s[t] = in[blockIdx.x * blockDim.x + t];
    __syncthreads();
    for (unsigned h = blockDim.x / 2; h > 0; h >>= 1) {
        if (t < h) s[t] += s[t + h];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = s[0];
}

// The same in dynamic shared memory, with a float4 view of it at the start.
extern "C" __global__ void reduce_dynamic(const float* in, float* out, float* first4) {
    CUPAGED_DYNAMIC_SHARED(float, s);
    const unsigned t = threadIdx.x;
    s[t] = in[blockIdx.x * blockDim.x + t];
    __syncthreads();
    if (t == 0 && blockIdx.x == 0) {
        const float4 q = reinterpret_cast<const float4*>(s)[0];
        first4[0] = q.x;
        first4[1] = q.y;
        first4[2] = q.z;
        first4[3] = q.w;
    }
    for (unsigned h = blockDim.x / 2; h > 0; h >>= 1) {
        if (t < h) s[t] += s[t + h];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = s[0];
}

// Dynamic shared memory declared at namespace scope.
CUPAGED_DYNAMIC_SHARED(int, g_dyn_smem);
extern "C" __global__ void reverse_dynamic(int* out) {
    g_dyn_smem[threadIdx.x] = blockIdx.x * 1000 + threadIdx.x;
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = g_dyn_smem[blockDim.x - 1 - threadIdx.x];
}

// __syncthreads_count / _and / _or.
extern "C" __global__ void barrier_ops(const int* pred, int* out) {
    const int p = pred[threadIdx.x];
    const int c = __syncthreads_count(p);
    const int a = __syncthreads_and(p);
    const int o = __syncthreads_or(p);
    if (threadIdx.x == 0) {
        out[0] = c;
        out[1] = a;
        out[2] = o;
    }
}

// ---- atomics across blocks ------------------------------------------------------------------
extern "C" __global__ void atomics(int* ci, unsigned* cu, unsigned long long* cull, float* cf, int* mx, unsigned* umx,
                                   int* mn, unsigned* cas_count, double* cd) {
    const unsigned g = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(ci, 1);
    atomicSub(ci + 1, 2);
    atomicAdd(cu, g);
    atomicAdd(cull, 1ull << 33);
    atomicAdd(cf, 1.0f);
    atomicAdd(cd, 0.5);
    atomicMax(mx, (int)(g * 7919u % 100003u));
    atomicMax(umx, g);
    atomicMin(mn, -(int)g);
    unsigned old = *cas_count, seen;
    while ((seen = atomicCAS(cas_count, old, old + 1u)) != old) old = seen;
    __threadfence();
}

// ---- fp16 / bf16 -------------------------------------------------------------------------
// Conversions both ways plus a few paired ones; grid-stride loops.
extern "C" __global__ void half_from_bits(const unsigned short* h, float* f, float* b, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        f[i] = __half2float(__ushort_as_half(h[i]));
        b[i] = __bfloat162float(__ushort_as_bfloat16(h[i]));
    }
}

extern "C" __global__ void half_to_bits(const float* f, unsigned short* h, unsigned short* h_rn, unsigned short* b,
                                        unsigned short* b_rn, unsigned short* h_ctor, unsigned short* b_ctor, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        h[i] = __half_as_ushort(__float2half(f[i]));
        h_rn[i] = __half_as_ushort(__float2half_rn(f[i]));
        b[i] = __bfloat16_as_ushort(__float2bfloat16(f[i]));
        b_rn[i] = __bfloat16_as_ushort(__float2bfloat16_rn(f[i]));
        h_ctor[i] = __half_as_ushort(__half(f[i]));
        b_ctor[i] = __bfloat16_as_ushort(from_float<__nv_bfloat16>(f[i]));
    }
}

// Paired conversions: out[4*i..] = low/high of __float22half2_rn and of __floats2bfloat162_rn.
extern "C" __global__ void half_pairs(const float* f, float* out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const __half2 h = __float22half2_rn(make_float2(f[i], -2.0f * f[i]));
        const __nv_bfloat162 b = __floats2bfloat162_rn(f[i], -2.0f * f[i]);
        out[4 * i + 0] = __low2float(h);
        out[4 * i + 1] = __high2float(h);
        out[4 * i + 2] = __low2float(b);
        out[4 * i + 3] = __high2float(b);
    }
}

// Half and bf16 arithmetic (one rounding per operation): add, mul, div, fma.
extern "C" __global__ void half_math(const unsigned short* a, const unsigned short* b, const unsigned short* c,
                                     unsigned short* h_out, unsigned short* b_out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const __half x = __ushort_as_half(a[i]), y = __ushort_as_half(b[i]), z = __ushort_as_half(c[i]);
        h_out[4 * i + 0] = __half_as_ushort(x + y);
        h_out[4 * i + 1] = __half_as_ushort(__hmul(x, y));
        h_out[4 * i + 2] = __half_as_ushort(x / y);
        h_out[4 * i + 3] = __half_as_ushort(__hfma(x, y, z));
        const __nv_bfloat16 p = __ushort_as_bfloat16(a[i]), q = __ushort_as_bfloat16(b[i]),
                            r = __ushort_as_bfloat16(c[i]);
        b_out[4 * i + 0] = __bfloat16_as_ushort(__hadd(p, q));
        b_out[4 * i + 1] = __bfloat16_as_ushort(p * q);
        b_out[4 * i + 2] = __bfloat16_as_ushort(__hdiv(p, q));
        b_out[4 * i + 3] = __bfloat16_as_ushort(__hfma(p, q, r));
    }
}

// ---- float math and vector types ---------------------------------------------------------
// The shim's exp2 (scalar and four at once, where AVX2 has it) and fmaxf / fminf against y: out [n][5].
extern "C" __global__ void exp2_forms(const float* x, const float* y, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float* o = out + 5 * i;
    o[0] = cupaged_exp2f(x[i]);
#if CUPAGED_EXP2F4
    float four[4];
    _mm_storeu_ps(four, cupaged_exp2f4(_mm_set_ps(0.0f, x[i], -1.0f, 2.5f)));
    o[1] = four[2];
#else
    o[1] = cupaged_exp2f(x[i]);
#endif
    o[2] = ::exp2f(x[i]);
    o[3] = fmaxf(x[i], y[i]);
    o[4] = fminf(x[i], y[i]);
}

extern "C" __global__ void math_funcs(const float* x, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = x[i];
    float* o = out + 20 * i;
    o[0] = expf(v);
    o[1] = __expf(v);
    o[2] = exp2f(v);
    o[3] = logf(fabsf(v) + 1.f);
    o[4] = __logf(fabsf(v) + 1.f);
    o[5] = sqrtf(fabsf(v));
    o[6] = rsqrtf(fabsf(v) + 1.f);
    o[7] = fmaxf(v, 0.25f);
    o[8] = fminf(v, 0.25f);
    o[9] = fmaf(v, 3.f, 1.f);
    o[10] = __fdividef(v, 3.f);
    o[11] = floorf(v);
    o[12] = ceilf(v);
    o[13] = sinf(v);
    o[14] = __cosf(v);
    o[15] = powf(fabsf(v), 1.5f);
    o[16] = tanhf(v);
    o[17] = __int_as_float(__float_as_int(v) ^ (int)0x80000000u);
    o[18] = (float)max(min((int)(v * 10.f), 7), -7);
    o[19] = __frcp_rn(v + 10.f);
}

extern "C" __global__ void vectors(const float4* in, float4* out, int2* iout, unsigned* sizes) {
    const unsigned t = threadIdx.x;
    const float4 a = __ldg(&in[t]);
    out[t] = make_float4(a.w, a.z, a.y, a.x);
    const float2 f2 = reinterpret_cast<const float2*>(in)[2 * t + 1];
    iout[t] = make_int2((int)f2.x, (int)f2.y);
    if (t == 0) {
        sizes[0] = sizeof(float4);
        sizes[1] = alignof(float4);
        sizes[2] = sizeof(uint2);
        sizes[3] = alignof(ushort4);
        sizes[4] = sizeof(__half2);
        sizes[5] = alignof(__nv_bfloat162);
    }
}

extern "C" __global__ void say_hello(int v) {
    if (threadIdx.x < 2) printf("hello %d from thread %d of block %d\n", v, (int)threadIdx.x, (int)blockIdx.x);
}

// ---- the warp-wide primitive for emulating inline PTX -----------------------------------------
#ifdef CUPAGED_CPU
static void sum_lanes(void** lane_data, unsigned mask, void* ctx) {
    int total = 0;
    for (int l = 0; l < 32; ++l)
        if (mask >> l & 1u) total += *static_cast<int*>(lane_data[l]);
    for (int l = 0; l < 32; ++l)
        if (mask >> l & 1u) *static_cast<int*>(lane_data[l]) = total + *static_cast<int*>(ctx);
}
extern "C" __global__ void warp_collective(const int* in, int* out, int bias) {
    int v = in[threadIdx.x];
    cupaged_warp_collective(0x0000ffffu << (threadIdx.x & 16u), &v, sum_lanes, &bias);
    out[threadIdx.x] = v;
}
#endif

// ---- errors the CPU backend must report ---------------------------------------------------
// Half the block at one __syncthreads, half at another.
extern "C" __global__ void deadlock_split(int* out) {
    if (threadIdx.x < blockDim.x / 2) {
        __syncthreads();  // @SPLIT_A
        out[threadIdx.x] = 1;
    } else {
        out[threadIdx.x] = 2;
        __syncthreads();  // @SPLIT_B
    }
}

// One thread skips the first barrier and arrives at the second.
extern "C" __global__ void deadlock_skip(int* out) {
    if (threadIdx.x != 5) {
        __syncthreads();  // @SKIP_A
    }
    out[threadIdx.x] = 3;
    __syncthreads();  // @SKIP_B
}

// Lane 0 of warp 0 waits in a shuffle while everyone else waits at a barrier.
extern "C" __global__ void deadlock_shfl_vs_barrier(int* out) {
    int v = threadIdx.x;
    if (threadIdx.x == 0)
        v = __shfl_sync(CP_FULL_MASK, v, 1);  // @SHFL_WAIT
    else
        __syncthreads();  // @BAR_WAIT
    out[threadIdx.x] = v;
}

// Lanes 0-15 call a ballot while lanes 16-31 call a shuffle, both full mask.
extern "C" __global__ void different_collectives(int* out) {
    int v = threadIdx.x;
    if (threadIdx.x < 16)
        v = __ballot_sync(CP_FULL_MASK, v & 1);  // @COLL_BALLOT
    else
        v = __shfl_sync(CP_FULL_MASK, v, 0);  // @COLL_SHFL
    out[threadIdx.x] = v;
}

// Lane `early` returns (none if -1); the rest shuffle with a full mask.
extern "C" __global__ void exited_lane(int* out, int early) {
    if ((int)threadIdx.x == early) return;
    out[threadIdx.x] = warp_sum((float)threadIdx.x) > 0.f;
}

// A lane whose mask lacks its own bit, or a width that is not a power of two.
extern "C" __global__ void bad_mask(int* out, int which) {
    int v = threadIdx.x;
    if (which == 0)
        v = __shfl_sync(0x0000fffeu, v, 1);
    else
        v = __shfl_sync(CP_FULL_MASK, v, 1, 24);
    out[threadIdx.x] = v;
}

extern "C" __global__ void trap_kernel(int* out, int who) {
    out[threadIdx.x] = 1;
    if ((int)threadIdx.x == who) __trap();  // @TRAP
}

extern "C" __global__ void assert_kernel(const int* in) {
    assert(in[blockIdx.x * blockDim.x + threadIdx.x] >= 0);  // @ASSERT
}

// A bad address: the fault is reported with the kernel and thread, then the process dies.
extern "C" __global__ void null_deref(int* p) {
    if (threadIdx.x == 3) p[0] = 1;
}

// Recursion deep enough to overflow a 64 KiB fiber stack.
__device__ __noinline__ int deep(volatile int* p, int n) {
    volatile int pad[64];
    pad[n & 63] = n;
    if (n == 0) return *p;
    return deep(p, n - 1) + pad[(n * 7) & 63];
}
extern "C" __global__ void stack_overflow(int* out, int depth) { out[threadIdx.x] = deep(out, depth); }

// ---- timing -------------------------------------------------------------------------------
extern "C" __global__ void bench_empty(int* out) {
    if (threadIdx.x == 1u << 30) out[0] = 0;
}
extern "C" __global__ void bench_sync(int* out, int iters) {
    for (int i = 0; i < iters; ++i) __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = iters;
}
extern "C" __global__ void bench_shfl(float* out, int iters) {
    float v = threadIdx.x;
    for (int i = 0; i < iters; ++i) v += __shfl_xor_sync(CP_FULL_MASK, v, 1);
    out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}
