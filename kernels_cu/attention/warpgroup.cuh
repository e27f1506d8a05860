// warpgroup.cuh: what warpgroups of one block use to take turns and to split
// the register file (sm_90a kernels; PTX ISA "bar.sync / bar.arrive",
// "setmaxnreg"):
//   wgb::sync(id, n)    bar.sync id, n: arrive at named barrier id (1 .. 15;
//                       0 is __syncthreads') and wait until n threads (a
//                       multiple of 32) have arrived since it last completed;
//   wgb::arrive(id, n)  bar.arrive id, n: arrive without waiting (the
//                       signalling side of a producer / consumer pair, or of
//                       warpgroups taking turns: FlashAttention-3's ping-pong);
//   wgb::regs_inc<R>() / wgb::regs_dec<R>()  setmaxnreg.inc / .dec: this
//                       warpgroup's per-thread register budget (24 .. 256, a
//                       multiple of 8), every thread of the warpgroup.
// On the CPU backend: the shim's named barriers (cupaged_shim.h, counting
// threads as the PTX ISA does); setmaxnreg is a no-op there (a fiber has no
// register file to split).
#pragma once

namespace wgb {
#ifdef CUPAGED_CPU
// The caller's line goes into the runtime's reports (deadlocks, mismatched counts).
__device__ __forceinline__ void sync(unsigned id, unsigned n, CUPAGED_LOC) { cupaged_bar_sync(id, n, cupaged_loc); }
__device__ __forceinline__ void arrive(unsigned id, unsigned n, CUPAGED_LOC) { cupaged_bar_arrive(id, n, cupaged_loc); }
template <unsigned kRegs>
__device__ __forceinline__ void regs_inc() {
    static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: 24 .. 256, a multiple of 8");
}
template <unsigned kRegs>
__device__ __forceinline__ void regs_dec() {
    static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: 24 .. 256, a multiple of 8");
}
#else
__device__ __forceinline__ void sync(unsigned id, unsigned n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void arrive(unsigned id, unsigned n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
template <unsigned kRegs>
__device__ __forceinline__ void regs_inc() {
    static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: 24 .. 256, a multiple of 8");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <unsigned kRegs>
__device__ __forceinline__ void regs_dec() {
    static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: 24 .. 256, a multiple of 8");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
#endif
}  // namespace wgb
