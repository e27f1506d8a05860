// sass_loops.cu: a fixed kernel for the SASS loop finder (tests/tools/test_sass_loops.py).
// stream_sum: a tile loop with two 16-byte loads per iteration (the hot loop),
// a loop nested in it with no load, and after it a loop of 4-byte loads only.
// Loops are kept rolled (#pragma unroll 1) so the SASS has one of each.
extern "C" __global__ void stream_sum(const float4* __restrict__ src, float* __restrict__ out, unsigned n_tiles,
                                      unsigned inner) {
    float acc = 0.f;
#pragma unroll 1
    for (unsigned t = 0; t < n_tiles; ++t) {
        const float4 a = src[(2u * t) * blockDim.x + threadIdx.x];
        const float4 b = src[(2u * t + 1u) * blockDim.x + threadIdx.x];
        float s = a.x + a.y + a.z + a.w + b.x + b.y + b.z + b.w;
#pragma unroll 1
        for (unsigned i = 0; i < (inner ^ t); ++i) s = s * 0.5f + 1.0f;   // trip count varies: no loop versioning
        acc += s;
    }
    const float* scalars = reinterpret_cast<const float*>(src);
#pragma unroll 1
    for (unsigned t = threadIdx.x; t < n_tiles; t += blockDim.x) acc += scalars[t];
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
