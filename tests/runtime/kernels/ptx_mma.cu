// Test kernels for kernels_cu/ptx.cuh (tests/runtime/test_ptx.py): each PTX helper
// on its own, in plain CUDA C that NVRTC also compiles. CP_DTYPE (f16 | bf16)
// selects the 16-bit input type.
#include "../../../kernels_cu/ptx.cuh"

// One m16n8k16 product from fragments loaded straight from global memory with
// the PTX ISA layouts (no ldmatrix): C [16 x 8] f32 = A [16 x 16] B [16 x 8] + C.
// A row-major, B row-major [k][n], C row-major; one warp.
extern "C" __global__ void mma_direct(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                                      float* __restrict__ c) {
    const u32 lane = threadIdx.x & 31u, g = lane >> 2, t = lane & 3u;
    auto bits = [](scalar_t x) -> u32 { return (u32) * reinterpret_cast<const unsigned short*>(&x); };
    u32 af[4], bf[2];
    af[0] = bits(a[g * 16 + 2 * t]) | bits(a[g * 16 + 2 * t + 1]) << 16;
    af[1] = bits(a[(g + 8) * 16 + 2 * t]) | bits(a[(g + 8) * 16 + 2 * t + 1]) << 16;
    af[2] = bits(a[g * 16 + 2 * t + 8]) | bits(a[g * 16 + 2 * t + 9]) << 16;
    af[3] = bits(a[(g + 8) * 16 + 2 * t + 8]) | bits(a[(g + 8) * 16 + 2 * t + 9]) << 16;
    bf[0] = bits(b[(2 * t) * 8 + g]) | bits(b[(2 * t + 1) * 8 + g]) << 16;
    bf[1] = bits(b[(2 * t + 8) * 8 + g]) | bits(b[(2 * t + 9) * 8 + g]) << 16;
    float d[4];
    for (u32 i = 0; i < 4; ++i) d[i] = c[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
    ptx::mma_16816<scalar_t>(d, af, bf);
    for (u32 i = 0; i < 4; ++i) c[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = d[i];
}

// C [64 x 32] f32 = A [64 x K] B, K a multiple of 16 up to 128, with every
// helper: cp.async stages A and B in shared memory (rows of A at or past
// a_rows are zero-filled, not read), ldmatrix.x4 loads the A fragments, B
// fragments come from ldmatrix.x4.trans when B is [K x 32] row-major
// (b_is_nk 0) or from ldmatrix.x4 when it is given as B^T [32 x K] (b_is_nk
// 1), and mma.sync accumulates. 4 warps, warp w computes rows 16w..16w+15.
// Rows are padded by 8 elements in shared memory (conflict-free ldmatrix).
extern "C" __global__ void __launch_bounds__(128)
    mma_gemm(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b, float* __restrict__ c, u32 k_dim,
             u32 a_rows, u32 b_is_nk) {
    constexpr u32 M = 64, N = 32, KMAX = 128;
    constexpr u32 AP = KMAX + 8;  // A row pitch in shared memory
    constexpr u32 BP = (KMAX > N ? KMAX : N) + 8;
    __shared__ __align__(16) scalar_t sa[M * AP];
    __shared__ __align__(16) scalar_t sb[KMAX * (N + 8) > N * BP ? KMAX * (N + 8) : N * BP];
    const u32 tid = threadIdx.x, warp = tid >> 5, lane = tid & 31u;
    const u32 kc = k_dim / 8;  // 16-byte chunks per row of A (and of B^T)
    for (u32 i = tid; i < M * kc; i += 128) {
        const u32 r = i / kc, ch = i - r * kc;
        const bool ok = r < a_rows;
        ptx::cp_async_16(&sa[r * AP + ch * 8], ok ? a + (u64)r * k_dim + ch * 8 : a, ok);
    }
    if (b_is_nk) {
        for (u32 i = tid; i < N * kc; i += 128) {
            const u32 r = i / kc, ch = i - r * kc;
            ptx::cp_async_16(&sb[r * BP + ch * 8], b + (u64)r * k_dim + ch * 8, true);
        }
    } else {
        for (u32 i = tid; i < k_dim * (N / 8); i += 128) {
            const u32 r = i / (N / 8), ch = i - r * (N / 8);
            ptx::cp_async_16(&sb[r * (N + 8) + ch * 8], b + (u64)r * N + ch * 8, true);
        }
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    __syncthreads();

    float acc[N / 8][4];
    for (u32 j = 0; j < N / 8; ++j)
        for (u32 i = 0; i < 4; ++i) acc[j][i] = 0.0f;
    const u32 tile = lane >> 3, r8 = lane & 7u;
    for (u32 k0 = 0; k0 < k_dim; k0 += 16) {
        u32 af[4];
        // A tiles: (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15).
        ptx::ldmatrix_x4(af, &sa[(warp * 16 + r8 + 8 * (tile & 1)) * AP + k0 + 8 * (tile >> 1)]);
        for (u32 n0 = 0; n0 < N; n0 += 16) {
            u32 bq[4];
            if (b_is_nk) {
                // B^T tiles: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
                ptx::ldmatrix_x4(bq, &sb[(n0 + r8 + 8 * (tile >> 1)) * BP + k0 + 8 * (tile & 1)]);
            } else {
                // B tiles, transposed: (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
                ptx::ldmatrix_x4_trans(bq, &sb[(k0 + r8 + 8 * (tile & 1)) * (N + 8) + n0 + 8 * (tile >> 1)]);
            }
            const u32 b0[2] = {bq[0], bq[1]}, b1[2] = {bq[2], bq[3]};
            ptx::mma_16816<scalar_t>(acc[n0 / 8], af, b0);
            ptx::mma_16816<scalar_t>(acc[n0 / 8 + 1], af, b1);
        }
    }
    const u32 g = lane >> 2, t = lane & 3u;
    for (u32 j = 0; j < N / 8; ++j)
        for (u32 i = 0; i < 4; ++i) c[(warp * 16 + g + 8 * (i >> 1)) * N + j * 8 + 2 * t + (i & 1)] = acc[j][i];
}

// pack2: out[i] = the two 16-bit roundings of in[2i], in[2i+1] as one word.
extern "C" __global__ void pack_pairs(const float* __restrict__ in, u32* __restrict__ out, u32 n) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = ptx::pack2<scalar_t>(in[2 * i], in[2 * i + 1]);
}

// cp.async groups: out[0..3] the 16 shared bytes of this thread (as words)
// right after two copies were committed as two groups, out[4..7] after
// wait_group 1 (the first group, a copy of src, must have landed), out[8..11]
// after wait_group 0 (the second, a zero fill). Shared memory starts as 0xA5.
extern "C" __global__ void cp_async_groups(const uint4* __restrict__ src, u32* __restrict__ out) {
    __shared__ __align__(16) u32 a[32][4], b[32][4];
    const u32 t = threadIdx.x;
    for (u32 i = 0; i < 4; ++i) a[t][i] = b[t][i] = 0xA5A5A5A5u;
    ptx::cp_async_16(a[t], src + t, true);
    ptx::cp_async_commit();
    ptx::cp_async_16(b[t], src + t, false);
    ptx::cp_async_commit();
    u32* o = out + 12 * t;
    for (u32 i = 0; i < 4; ++i) o[i] = a[t][i] ^ b[t][i];
    ptx::cp_async_wait<1>();
    for (u32 i = 0; i < 4; ++i) o[4 + i] = a[t][i];
    ptx::cp_async_wait<0>();
    for (u32 i = 0; i < 4; ++i) o[8 + i] = b[t][i];
}
