// Test kernels for the wgmma helpers of kernels_cu/ptx.cuh (tests/runtime/test_wgmma.py),
// in plain CUDA C that NVRTC compiles for sm_90a. CP_DTYPE (f16 | bf16) selects the
// 16-bit input type, WG_N the N of wgmma.m64nNk16.
#include "../../../kernels_cu/ptx.cuh"

#ifndef WG_N
#define WG_N 32
#endif

// One warpgroup (128 threads) computes D [64 x N] (+)= sum over k-steps of
// A_ks [64 x 16] B_ks [16 x N]. a_img / b_img: the images of A and B in shared
// memory as the test lays them out from the PTX ISA's canonical layouts (byte
// addresses relative to a 1024-byte boundary), copied raw to such a boundary of
// dynamic shared memory (B after A, at b_off bytes). a_koff / b_koff [ksteps]:
// byte offset of each k-step's start address; lbo / sbo / swizzle: descriptor
// fields. d [128][N / 2]: raw accumulator registers of each thread, in and out;
// a_regs [128][4]: raw A registers of each thread (mode rs). mode: bit 0 rs
// (A from registers), bit 1 imm-trans-a, bit 2 imm-trans-b; accumulate: the
// first k-step adds to d (else it overwrites it). early [128][N / 2]: the
// registers read right after the issue, before the wait (CPU only: unchanged).
extern "C" __global__ void __launch_bounds__(128)
    wgmma_gemm(const u32* __restrict__ a_img, u32 a_words, const u32* __restrict__ b_img, u32 b_words, u32 b_off,
               const u32* __restrict__ a_koff, const u32* __restrict__ b_koff, u32 ksteps, u32 a_lbo, u32 a_sbo,
               u32 a_swz, u32 b_lbo, u32 b_sbo, u32 b_swz, u32 mode, u32 accumulate, float* __restrict__ d,
               const u32* __restrict__ a_regs, float* __restrict__ early) {
    constexpr u32 kN = WG_N, kD = kN / 2;
    CUPAGED_DYNAMIC_SHARED(unsigned char, smem_raw);
    unsigned char* const base = reinterpret_cast<unsigned char*>((reinterpret_cast<u64>(smem_raw) + 1023) & ~1023ull);
    const u32 tid = threadIdx.x;
    for (u32 i = tid; i < a_words; i += 128) reinterpret_cast<u32*>(base)[i] = a_img[i];
    for (u32 i = tid; i < b_words; i += 128) reinterpret_cast<u32*>(base + b_off)[i] = b_img[i];
    float acc[kD];
    for (u32 i = 0; i < kD; ++i) acc[i] = d[tid * kD + i];
    u32 a[4];
    for (u32 i = 0; i < 4; ++i) a[i] = a_regs[tid * 4 + i];
    __syncthreads();
    ptx::wgmma_fence_operand(acc);
    ptx::wgmma_fence();
    for (u32 ks = 0; ks < ksteps; ++ks) {
        const u64 da = ptx::wgmma_desc(base + a_koff[ks], a_lbo, a_sbo, a_swz);
        const u64 db = ptx::wgmma_desc(base + b_off + b_koff[ks], b_lbo, b_sbo, b_swz);
        const bool add = ks > 0 || accumulate;
        switch (mode) {
            case 0:
                ptx::wgmma_ss<scalar_t, kN, 0, 0>(acc, da, db, add);
                break;
            case 2:
                ptx::wgmma_ss<scalar_t, kN, 1, 0>(acc, da, db, add);
                break;
            case 4:
                ptx::wgmma_ss<scalar_t, kN, 0, 1>(acc, da, db, add);
                break;
            case 6:
                ptx::wgmma_ss<scalar_t, kN, 1, 1>(acc, da, db, add);
                break;
            case 1:
                ptx::wgmma_rs<scalar_t, kN, 0>(acc, a, db, add);
                break;
            default:
                ptx::wgmma_rs<scalar_t, kN, 1>(acc, a, db, add);
                break;
        }
    }
    ptx::wgmma_commit();
#ifdef CUPAGED_CPU
    for (u32 i = 0; i < kD; ++i) early[tid * kD + i] = acc[i];  // before the wait: untouched on the CPU
#endif
    ptx::wgmma_wait<0>();
    ptx::wgmma_fence_operand(acc);
    for (u32 i = 0; i < kD; ++i) d[tid * kD + i] = acc[i];
}

// The descriptors of [base + off] (LBO, SBO, swizzle as given) and of [base],
// base a 1024-byte boundary of dynamic shared memory.
extern "C" __global__ void wgmma_desc_fields(u64* out, u32 off, u32 lbo, u32 sbo, u32 sw) {
    CUPAGED_DYNAMIC_SHARED(unsigned char, smem_raw);
    unsigned char* const base = reinterpret_cast<unsigned char*>((reinterpret_cast<u64>(smem_raw) + 1023) & ~1023ull);
    out[0] = ptx::wgmma_desc(base + off, lbo, sbo, sw);
    out[1] = ptx::wgmma_desc(base, 0, 0, 0);
}
