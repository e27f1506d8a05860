// Test kernels for the vector-access checks and the cp.async modes of the CPU
// backend (tests/runtime/test_vector_access.py): common.cuh's ldv / stv and
// ptx.cuh's cp_async_16 on addresses a test chooses, and a cp.async ring with
// a stage count the test chooses (one stage is a broken pipeline).
#include "../../../kernels_cu/common.cuh"
#include "../../../kernels_cu/ptx.cuh"

// out[t] = the 16 bytes at base + offset + 16 t (a 16-byte vector load).
extern "C" __global__ void load16_at(const unsigned char* __restrict__ base, u32 offset, uint4* __restrict__ out) {
    const uint4* p = reinterpret_cast<const uint4*>(base + offset) + threadIdx.x;
    out[threadIdx.x] = ldv(p);  // @LOAD16
}

// The 16 bytes at base + offset + 16 t = (t, t, t, t) (a 16-byte vector store).
extern "C" __global__ void store16_at(unsigned char* __restrict__ base, u32 offset) {
    uint4 v;
    v.x = v.y = v.z = v.w = threadIdx.x;
    stv(reinterpret_cast<uint4*>(base + offset) + threadIdx.x, v);  // @STORE16
}

// out[t] = the 16 bytes at base + offset + 16 t, through cp.async into shared memory.
extern "C" __global__ void cp_async_at(const unsigned char* __restrict__ base, u32 offset, uint4* __restrict__ out) {
    __shared__ __align__(16) uint4 s[32];
    ptx::cp_async_16(&s[threadIdx.x], reinterpret_cast<const uint4*>(base + offset) + threadIdx.x, true);  // @CPASYNC
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    __syncwarp();
    out[threadIdx.x] = s[threadIdx.x];
}

// A one-warp cp.async ring over `tiles` tiles of 32 x 16 bytes: tile j + 1
// is issued into stage (j + 1) % stages before tile j is read from stage
// j % stages (each lane reads its neighbour's copy). out[lane] = the sum of
// the words lane + 1 read. With stages == 2 this is a correct pipeline; with
// stages == 1 tile j + 1 is issued into the stage tile j is about to be read
// from: right only if copies land late (at the wait), wrong when they land
// at issue, as a GPU may do. CUPAGED_CPU_CP_ASYNC=eager catches it.
extern "C" __global__ void ring_sum(const uint4* __restrict__ src, u32 tiles, u32 stages,
                                    unsigned long long* __restrict__ out) {
    __shared__ __align__(16) uint4 ring[2][32];
    const u32 lane = threadIdx.x & 31u;
    ptx::cp_async_16(&ring[0][lane], src + lane, true);
    ptx::cp_async_commit();
    unsigned long long acc = 0;
    for (u32 j = 0; j < tiles; ++j) {
        if (j + 1 < tiles) ptx::cp_async_16(&ring[(j + 1) % stages][lane], src + (j + 1) * 32 + lane, true);
        ptx::cp_async_commit();
        ptx::cp_async_wait<1>();  // tile j has landed; tile j + 1 may be in flight
        __syncwarp();
        const uint4 v = ring[j % stages][(lane + 1) & 31u];
        acc += (unsigned long long)v.x + v.y + v.z + v.w;
        __syncwarp();  // every lane has read stage j % stages before it is refilled
    }
    out[lane] = acc;
}
