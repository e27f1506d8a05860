// layers.cu: the small dense kernels a decoder step needs besides attention
// and append, so a whole step can be captured into one graph on either
// backend: embedding lookup, RMSNorm, a linear layer with an optional
// residual accumulate, rotary embedding by device-resident positions, and
// SwiGLU, plus what an engine's projections need around them (a bias add, one
// Linear per head for MLA's absorbed up-projections). Storage type scalar_t
// (CP_DTYPE); all arithmetic in float32.
//
// Layout: arrays are row-major and contiguous, except rms_norm's x and out,
// rope's x and the x of linear / linear_heads, which may be strided row views
// (columns of one fused projection's output buffer):
// their innermost dim is contiguous and their outer strides, in elements, are
// kernel arguments (u32; offsets computed in 64 bits), rows not overlapping.
#include "common.cuh"

#define LAYER_THREADS 128

// out[r, :] = table[tokens[r], :]; a token outside 0..vocab-1 gives zeros.
// grid (rows), block LAYER_THREADS.
extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
    embed(const long long* __restrict__ tokens, const scalar_t* __restrict__ table, scalar_t* __restrict__ out, u32 dim,
          u32 vocab) {
    const u32 r = blockIdx.x;
    const long long t = tokens[r];
    const bool ok = t >= 0 && t < (long long)vocab;
    const scalar_t* src = table + (u64)(ok ? t : 0) * dim;
    for (u32 i = threadIdx.x; i < dim; i += blockDim.x) out[(u64)r * dim + i] = ok ? src[i] : from_float<scalar_t>(0.f);
}

__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float t = 0.f;
    for (u32 w = 0; w < (blockDim.x >> 5); ++w) t += red[w];
    __syncthreads();
    return t;
}

// out[t, h] = x[t, h] / sqrt(mean(x[t, h]^2) + eps) * w over the dim elements
// of each row: x, out [tokens, heads, dim] (heads 1 for [rows, dim]), row
// (t, h) of x at x + t * x_row + h * x_head, of out at out + t * out_row +
// h * out_head (elements). out may be x, the same view (each thread writes
// only the elements it read). grid (tokens, heads), block LAYER_THREADS.
extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
    rms_norm(const scalar_t* x, const scalar_t* __restrict__ w, scalar_t* out, u32 dim, float eps, u32 x_row,
             u32 x_head, u32 out_row, u32 out_head) {
    __shared__ float red[LAYER_THREADS / 32];
    const scalar_t* xr = x + (u64)blockIdx.x * x_row + (u64)blockIdx.y * x_head;
    scalar_t* orow = out + (u64)blockIdx.x * out_row + (u64)blockIdx.y * out_head;
    float ss = 0.f;
    for (u32 i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = to_float(xr[i]);
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, red) / (float)dim + eps);
    for (u32 i = threadIdx.x; i < dim; i += blockDim.x)
        orow[i] = from_float<scalar_t>(to_float(xr[i]) * inv * to_float(w[i]));
}

// out[m, n] = sum_k x[m, k] * w[n, k]  (+ out[m, n] when accumulate != 0).
// w is [N, K] row-major (a Linear layer's weight); row m of x starts at
// x + m * x_row (elements: a column slice of a wider buffer passes). One warp
// per output element, lanes stride over K; grid (ceil(N / 4), M), block 128.
extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
    linear(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w, scalar_t* out, u32 n_out, u32 k_in,
           u32 accumulate, u32 x_row) {
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 n = blockIdx.x * (LAYER_THREADS / 32) + warp;
    const u32 m = blockIdx.y;
    if (n >= n_out) return;  // whole warp leaves together
    const scalar_t* xr = x + (u64)m * x_row;
    const scalar_t* wr = w + (u64)n * k_in;
    float acc = 0.f;
    for (u32 k = lane; k < k_in; k += 32) acc = fmaf(to_float(xr[k]), to_float(wr[k]), acc);
    acc = warp_sum(acc);
    if (lane == 0) {
        scalar_t* o = out + (u64)m * n_out + n;
        *o = from_float<scalar_t>(accumulate ? acc + to_float(*o) : acc);
    }
}

// out[m, h, n] = sum_k x[m, h, k] * w[h, n, k]  (+ out[m, h, n] when accumulate
// != 0): one Linear per head h, w [heads, N, K] row-major (MLA's absorbed
// up-projections: the query through W_UK^T, the latent output through W_UV).
// Row m of head h of x starts at x + m * x_row + h * x_head, of out at
// out + m * out_row + h * out_head (elements). One warp per output element,
// lanes stride over K; grid (ceil(N / 4), M, heads), block 128.
extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
    linear_heads(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w, scalar_t* out, u32 n_out, u32 k_in,
                 u32 x_row, u32 x_head, u32 out_row, u32 out_head, u32 accumulate) {
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 n = blockIdx.x * (LAYER_THREADS / 32) + warp;
    const u32 m = blockIdx.y, h = blockIdx.z;
    if (n >= n_out) return;  // whole warp leaves together
    const scalar_t* xr = x + (u64)m * x_row + (u64)h * x_head;
    const scalar_t* wr = w + ((u64)h * n_out + n) * k_in;
    float acc = 0.f;
    for (u32 k = lane; k < k_in; k += 32) acc = fmaf(to_float(xr[k]), to_float(wr[k]), acc);
    acc = warp_sum(acc);
    if (lane == 0) {
        scalar_t* o = out + (u64)m * out_row + (u64)h * out_head + n;
        *o = from_float<scalar_t>(accumulate ? acc + to_float(*o) : acc);
    }
}

// x[r, i] += b[i] for x [rows, n] (a Linear layer's bias after its product).
// grid (rows), block LAYER_THREADS.
extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
    bias_add(scalar_t* x, const scalar_t* __restrict__ b, u32 n) {
    scalar_t* xr = x + (u64)blockIdx.x * n;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) xr[i] = from_float<scalar_t>(to_float(xr[i]) + to_float(b[i]));
}

// Rotary embedding (rotate-half form) in place on x [rows, heads, dim]:
// with half = dim / 2, p = positions[r * position_stride] (clamped to
// max_pos - 1), c = cos_t[p, i], s = sin_t[p, i]:
//   x[i] <- x[i] c - x[i + half] s,  x[i + half] <- x[i + half] c + x[i] s.
// Head h of row r starts at x + r * x_row + h * x_head (elements: a strided
// view such as the q and k columns of a fused QKV buffer).
// Positions are read on the device (plan words or a DeviceScalars word),
// so a captured graph rotates by the current position on every replay.
// grid (rows), block LAYER_THREADS.
extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
    rope(scalar_t* x, const u32* __restrict__ positions, u32 position_stride, const float* __restrict__ cos_t,
         const float* __restrict__ sin_t, u32 heads, u32 dim, u32 max_pos, u32 x_row, u32 x_head) {
    const u32 r = blockIdx.x, half = dim >> 1;
    u32 p = positions[(u64)r * position_stride];
    if (p >= max_pos) p = max_pos - 1;
    scalar_t* xr = x + (u64)r * x_row;
    for (u32 e = threadIdx.x; e < heads * half; e += blockDim.x) {
        const u32 h = e / half, i = e - h * half;
        scalar_t* xh = xr + (u64)h * x_head;
        const float c = cos_t[(u64)p * half + i], s = sin_t[(u64)p * half + i];
        const float a = to_float(xh[i]), b = to_float(xh[i + half]);
        xh[i] = from_float<scalar_t>(a * c - b * s);
        xh[i + half] = from_float<scalar_t>(b * c + a * s);
    }
}

// out[r, i] = silu(gu[r, i]) * gu[r, f + i]; gu is [rows, 2f] (gate, up).
// grid (rows), block LAYER_THREADS.
extern "C" __global__ void __launch_bounds__(LAYER_THREADS)
    silu_mul(const scalar_t* __restrict__ gu, scalar_t* __restrict__ out, u32 f) {
    const u32 r = blockIdx.x;
    const scalar_t* g = gu + (u64)r * 2 * f;
    for (u32 i = threadIdx.x; i < f; i += blockDim.x) {
        const float a = to_float(g[i]);
        out[(u64)r * f + i] = from_float<scalar_t>(a / (1.f + __expf(-a)) * to_float(g[f + i]));
    }
}
