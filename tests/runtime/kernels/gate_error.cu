// gate_error.cu: does not compile (an undeclared name), to prove the NVRTC
// gate reports compile errors with the log and fails.
extern "C" __global__ void broken(float* out) { out[threadIdx.x] = not_declared_anywhere; }
