// cupaged_rt.hpp: the contract between kernel modules (compiled by g++ with
// cupaged_shim.h force-included) and the CPU runtime (cupaged_rt.cpp, built
// once into its own shared library and loaded RTLD_GLOBAL before any module).
//
// Each CUDA thread is a fiber. A fiber owns one region of kRegion bytes,
// aligned to kRegion:
//
//   [ guard | stack, kStack bytes, grows down | fiber state | guard ]
//   ^ region base                              ^ header (= stack top), in the last kTop bytes
//
// so the running fiber's state is found from the stack pointer alone, with no
// thread-local lookup: threadIdx.x is a few ALU instructions and a load. The
// header sits at one of kColors offsets (64 bytes apart) so that the headers
// and stack tops of a block's fibers do not all fall in the same cache sets.
// Everything but the stack and the state is PROT_NONE: an overflow faults.
#pragma once
#include <cstddef>
#include <cstdint>
#include <source_location>

#include "cupaged_vector_types.hpp"

#define CUPAGED_RT_API extern "C" __attribute__((visibility("default")))

namespace cupaged {

inline constexpr std::uintptr_t kRegion = 128 * 1024;  // one fiber: guard + stack + state
inline constexpr std::uintptr_t kStack = 64 * 1024;  // usable stack of one CUDA thread
inline constexpr std::uintptr_t kTop = 32 * 1024;  // the header lies in the last kTop bytes
inline constexpr std::uintptr_t kColors = 256;  // header offsets, 64 bytes apart
inline constexpr unsigned kMaxDynamicShared = 227 * 1024;
inline constexpr unsigned kMaxThreadsPerBlock = 1024;

inline constexpr unsigned kFiberLocalBytes = 4096;  // FiberPub::local

// What kernels read: the block being run by the current worker.
struct BlockPub {
    uint3 bid;  // blockIdx
    dim3 bdim;  // blockDim
    dim3 gdim;  // gridDim
    const char* kernel;  // kernel name, for messages
    unsigned long long serial;  // new at each block the worker runs: per-thread state of an older block is stale
};

// What kernels read: the first member of the runtime's fiber state.
struct FiberPub {
    uint3 tid;  // threadIdx
    unsigned linear;
    const BlockPub* block;
    // kFiberLocalBytes (16-byte aligned) of this fiber's that the kernel side keeps across the fiber's blocks
    // (ptx.cuh's cp.async queue): zero when the fiber is made, never touched by the runtime after.
    void* local;
};

// Address of the fiber state (and stack top) of the region based at r.
constexpr std::uintptr_t header_of_region(std::uintptr_t r) {
    return r + kRegion - kTop + (r / kRegion % kColors) * 64;
}

inline const FiberPub* fiber_at(std::uintptr_t sp) {
    return reinterpret_cast<const FiberPub*>(header_of_region(sp & ~(kRegion - 1)));
}

// The running fiber. Only valid on a fiber (inside a kernel).
__attribute__((always_inline)) inline const FiberPub* cur() {
    std::uintptr_t sp;
#if defined(__x86_64__)
    asm("movq %%rsp, %0" : "=r"(sp));
#elif defined(__aarch64__)
    asm("mov %0, sp" : "=r"(sp));
#else
    sp = reinterpret_cast<std::uintptr_t>(__builtin_frame_address(0));
#endif
    return fiber_at(sp);
}

// Warp collective kinds (cupaged_rt_warp_op).
enum WarpKind : int {
    kShflIdx = 1,
    kShflUp,
    kShflDown,
    kShflXor,
    kBallot,
    kAny,
    kAll,
    kSyncwarp,
    kReduceAddU,
    kReduceMinU,
    kReduceMaxU,
    kReduceMinI,
    kReduceMaxI,
    kReduceAnd,
    kReduceOr,
    kReduceXor,
    kMatchAny,
    kMatchAll,  // result: mask | (all_equal << 32)
    kGeneric,  // cupaged_rt_warp_collective
};

// Block barrier kinds (cupaged_rt_barrier); kBarNamed: a thread parked in a named barrier
// (cupaged_rt_named_barrier).
enum BarrierKind : int { kBarSync = 0, kBarCount, kBarAnd, kBarOr, kBarNamed };

// Named barriers of a block (PTX bar.sync / bar.arrive a, b): ids 1 .. kNamedBarriers - 1 (0 is
// __syncthreads' barrier).
inline constexpr unsigned kNamedBarriers = 16;

}  // namespace cupaged

// ---- runtime entry points (defined in cupaged_rt.cpp) ----------------------
// Called from fibers:
CUPAGED_RT_API int cupaged_rt_barrier(int kind, int pred, std::source_location loc);
// Named barrier `id` with `count` threads (0: every thread of the block): the calling thread arrives and,
// when `wait`, waits until `count` threads have arrived since the barrier last completed (bar.sync); else
// it goes on (bar.arrive). The count-th arrival completes the barrier: its waiters go on, it starts over.
CUPAGED_RT_API void cupaged_rt_named_barrier(unsigned id, unsigned count, int wait, std::source_location loc);
CUPAGED_RT_API unsigned long long cupaged_rt_warp_op(int kind, unsigned mask, unsigned long long value, int b,
                                                     int width, std::source_location loc);
CUPAGED_RT_API void cupaged_rt_warp_collective(unsigned mask, void* lane_data,
                                               void (*fn)(void** all_lane_data, unsigned mask, void* ctx), void* ctx,
                                               std::source_location loc);
CUPAGED_RT_API unsigned cupaged_rt_activemask();
CUPAGED_RT_API [[noreturn]] void cupaged_rt_trap(const char* what, const char* file, unsigned line,
                                                 const char* function);
CUPAGED_RT_API void* cupaged_rt_dynamic_shared();  // the calling worker's dynamic shared memory
// Called from the export stubs (on the launching thread):
CUPAGED_RT_API int cupaged_rt_launch(const char* kernel, const unsigned* grid3, const unsigned* block3,
                                     unsigned shared_mem, void (*thread_fn)(void* ctx), void* ctx);
// Called from Python:
CUPAGED_RT_API const char* cupaged_rt_last_error();  // of the calling thread's last failed launch
CUPAGED_RT_API int cupaged_rt_num_workers();
// Host work split in parts: task(ctx, part, parts) for part 0 .. parts - 1, part 0 on the calling thread and the
// others on the pool's threads (parts is min(the parts asked, workers)); returns when all are done (0; 1 if the
// pool could not start: cupaged_rt_last_error). One job at a time, launches included.
// How long an idle pool thread (and a caller waiting for one) polls before it sleeps, in microseconds (0: never).
CUPAGED_RT_API void cupaged_rt_set_spin(unsigned us);
CUPAGED_RT_API int cupaged_rt_parallel(void (*task)(void*, unsigned, unsigned), void* ctx, unsigned parts);
