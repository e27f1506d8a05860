// gate_spill.cu: a kernel that must spill, to prove the NVRTC gate fails on
// spills. 64 loaded values stay live at once under __launch_bounds__(1024, 2),
// which caps the kernel at 32 registers, plus a dynamically indexed local
// array (stack frame).
extern "C" __global__ void __launch_bounds__(1024, 2)
    spill_heavy(const float* __restrict__ x, float* __restrict__ out, int n, int pick) {
    float v[64];
#pragma unroll
    for (int i = 0; i < 64; i++) v[i] = x[i * n + threadIdx.x];
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 64; i++) acc += v[i] * v[63 - i];
    float big[64];
    for (int i = 0; i < 64; i++) big[i] = v[(i * 5) & 63] * acc;
    out[threadIdx.x] = acc + big[pick & 63];
}
