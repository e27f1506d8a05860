"""The engine's matrix products: ``linear`` (x @ W.T into a preallocated out,
optionally accumulated: the fused residual add) and ``linear_heads`` (one
product per head, MLA's absorbed up-projections).

* CPU backend (NumPy arrays): the CPU kernels, ``ops.layers.linear`` and
  ``ops.layers.linear_heads`` (the same CUDA C through g++).
* GPU backend (CuPy arrays): cuBLAS through CuPy's bindings
  (``cublasGemmEx`` / ``cublasGemmStridedBatchedEx``, float32 accumulation,
  beta = 1 for the residual add), on CuPy's current stream, which is the
  stream cupaged captures: the products are recorded into the decode graph
  like every kernel. Nothing is allocated and nothing synchronizes; alpha and
  beta are host scalars read at capture (pointer mode host).

The GPU path is written against cuBLAS's column-major convention: a
row-major ``out[M, N] = x[M, K] @ W[N, K].T`` is the column-major
``out^T = op_T(W^T-storage) @ x^T``, i.e. ``gemm(T, N, m=N, n=M, k=K, A=W,
lda=K, B=x, ldb=K, C=out, ldc=N)``.
"""
from __future__ import annotations

import numpy as np

from .._runtime import GPU, array_backend
from ..errors import PagedAttentionError
from ..ops import layers

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h)
_OP_N, _OP_T = 0, 1
_CUDA_R = {"float32": 0, "float16": 2, "bfloat16": 14}
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1
_POINTER_MODE_HOST = 0


class Projections:
    """Matrix products on the backend of ``like`` (see the module docstring)."""

    def __init__(self, like):
        self.gpu = array_backend(like) == GPU
        if self.gpu:
            try:
                from cupy.cuda import device
                from cupy_backends.cuda.libs import cublas
            except Exception as e:      # noqa: BLE001 -- any failure to load cuBLAS means the same to the user
                raise PagedAttentionError(
                    f"like: the engine's GPU projections run on cuBLAS, which CuPy cannot load ({e}); install the "
                    f"CUDA line's cuBLAS (pip install nvidia-cublas-cu12, or nvidia-cublas for CUDA 13)") from None
            self._cublas, self._device = cublas, device
            # host scalars for alpha / beta, alive as long as this object
            self._one = np.ones(1, np.float32)
            self._zero = np.zeros(1, np.float32)

    def _dtype(self, *arrays) -> int:
        name = str(arrays[0].dtype)
        if name not in _CUDA_R or any(str(a.dtype) != name for a in arrays):
            raise PagedAttentionError(f"linear: expected float32, float16 or bfloat16 operands of one dtype, got "
                                      f"{', '.join(str(a.dtype) for a in arrays)}")
        return _CUDA_R[name]

    def linear(self, x, w, out, *, accumulate: bool = False) -> None:
        """out[M, N] (+)= x[M, K] @ w[N, K].T; all C-contiguous."""
        if not self.gpu:
            layers.linear(x, w, out, accumulate=accumulate)
            return
        m, k = x.shape
        n = w.shape[0]
        if w.shape[1] != k or out.shape != (m, n) or not (x.flags.c_contiguous and w.flags.c_contiguous
                                                          and out.flags.c_contiguous):
            raise PagedAttentionError(f"linear: expected x [M, K], w [N, K], out [M, N], C-contiguous; got "
                                      f"{x.shape}, {w.shape}, {out.shape}")
        if m == 0:
            return
        dt = self._dtype(x, w, out)
        cb = self._cublas
        handle = self._device.get_cublas_handle()
        cb.setPointerMode(handle, _POINTER_MODE_HOST)
        beta = self._one if accumulate else self._zero
        cb.gemmEx(handle, _OP_T, _OP_N, n, m, k, self._one.ctypes.data, w.data.ptr, dt, k, x.data.ptr, dt, k,
                  beta.ctypes.data, out.data.ptr, dt, n, _COMPUTE_32F, _GEMM_DEFAULT)

    def linear_heads(self, x, w, out, *, accumulate: bool = False) -> None:
        """out[M, H, N] (+)= x[M, H, K] @ w[H, N, K].T per head; C-contiguous."""
        if not self.gpu:
            layers.linear_heads(x, w, out, accumulate=accumulate)
            return
        m, h, k = x.shape
        n = w.shape[1]
        if w.shape != (h, n, k) or out.shape != (m, h, n) or not (x.flags.c_contiguous and w.flags.c_contiguous
                                                                  and out.flags.c_contiguous):
            raise PagedAttentionError(f"linear_heads: expected x [M, H, K], w [H, N, K], out [M, H, N], "
                                      f"C-contiguous; got {x.shape}, {w.shape}, {out.shape}")
        if m == 0:
            return
        dt = self._dtype(x, w, out)
        cb = self._cublas
        handle = self._device.get_cublas_handle()
        cb.setPointerMode(handle, _POINTER_MODE_HOST)
        beta = self._one if accumulate else self._zero
        # per head h: A = w[h] (stride N*K), B = rows of head h of x (ldb = H*K,
        # stride K), C = rows of head h of out (ldc = H*N, stride N)
        cb.gemmStridedBatchedEx(handle, _OP_T, _OP_N, n, m, k, self._one.ctypes.data,
                                w.data.ptr, dt, k, n * k, x.data.ptr, dt, h * k, k,
                                beta.ctypes.data, out.data.ptr, dt, h * n, n, h, _COMPUTE_32F, _GEMM_DEFAULT)
