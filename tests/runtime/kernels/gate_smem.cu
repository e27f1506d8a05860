// gate_smem.cu: a kernel that uses more dynamic shared memory than the 48 KiB
// a launch gets without opting in (tests/test_gpu_backend.py). Each block
// stages its slice of src in dynamic shared memory, then writes it reversed;
// the last word of the dynamic allocation is touched, so a launch that did
// not really get `shared_words` words of shared memory fails.
// Launch: grid (n / blockDim.x), block (blockDim.x), shared_mem = 4 * shared_words.
#include "../../../kernels_cu/common.cuh"

extern "C" __global__ void reverse_blocks(const float* __restrict__ src, float* __restrict__ dst,
                                          unsigned shared_words) {
    CUPAGED_DYNAMIC_SHARED(float, stage);
    const unsigned t = threadIdx.x, b = blockIdx.x * blockDim.x;
    stage[t] = src[b + t];
    if (t == 0) stage[shared_words - 1] = 0.f;
    __syncthreads();
    dst[b + t] = stage[blockDim.x - 1 - t] + stage[shared_words - 1];
}
