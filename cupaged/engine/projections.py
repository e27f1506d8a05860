"""The engine's matrix products: ``linear`` (x @ W.T into a preallocated out,
optionally accumulated: the fused residual add) and ``linear_heads`` (one
product per head, MLA's absorbed up-projections).

* CPU backend (NumPy arrays): ``ops.layers.linear`` and
  ``ops.layers.linear_heads`` with ``host=True``: for float32, NumPy's BLAS
  (``np.matmul(x, W.T, out=...)``) issued into the CPU stream, so the
  products are recorded into CPU graphs and replayed with the kernels; for
  float16 / bfloat16 the CPU kernels (the same CUDA C through g++).
* GPU backend (CuPy arrays): cuBLAS (``cublasGemmEx`` /
  ``cublasGemmStridedBatchedEx``, float32 accumulation, beta = 1 for the
  residual add) on the stream cupaged captures, so the products are recorded
  into the decode graph with the kernels. Nothing is allocated and nothing
  synchronizes per call; alpha and beta are host scalars read at capture
  (pointer mode host).

Why not ``cupy.matmul(..., out=)``: CuPy's cuBLAS bindings refuse to run
while a stream is capturing (``cublas.setStream`` raises NotImplementedError
during capture, CuPy 13/14), and ``cupy.matmul`` has no beta for the
residual add. So the engine calls libcublas directly through ctypes, found
the way CuPy finds it (``cuda.pathfinder``), with its own handle bound to
the engine's stream and its own workspace (``cublasSetWorkspace``, as the
cuBLAS documentation asks for graph capture), set outside any capture.

The GPU path follows cuBLAS's column-major convention: a row-major
``out[M, N] = x[M, K] @ W[N, K].T`` is the column-major product
``gemm(T, N, m=N, n=M, k=K, A=W, lda=K, B=x, ldb=K, C=out, ldc=N)``.
"""

from __future__ import annotations

import ctypes

import numpy as np

from .._runtime import GPU, array_backend, stream_for, zeros
from .._runtime.arrays import Array
from ..errors import PagedAttentionError
from ..ops import layers

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h)
_OP_N, _OP_T = 0, 1
_CUDA_R = {"float32": 0, "float16": 2, "bfloat16": 14}
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1
_POINTER_MODE_HOST = 0
#: cuBLAS workspace the engine's handle uses (32 MiB: NVIDIA's advice for Hopper).
WORKSPACE_BYTES = 32 << 20


def _rows(x: Array, outer: int) -> bool:
    """x's last dim is contiguous and its ``outer`` outer strides are whole
    elements (a row view; checked by ``ops.layers`` on the CPU path)."""
    item = x.itemsize
    return (x.shape[-1] <= 1 or x.strides[-1] == item) and all(s >= 0 and s % item == 0 for s in x.strides[:outer])


def _ld(x: Array, dim: int, packed: int) -> int:
    """x's stride along ``dim`` in elements (cuBLAS's leading dimension or
    batch stride); ``packed`` where the dim has one entry (any value is
    valid there, and cuBLAS wants ld >= the row length)."""
    return x.strides[dim] // x.itemsize if x.shape[dim] > 1 else packed


def _load_cublas():
    """libcublas through ctypes, found as CuPy finds it."""
    errors = []
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib  # comes with cuda-python / CuPy 14

        return ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)
    except Exception as e:  # noqa: BLE001 -- try the loader's search path next
        errors.append(str(e))
    for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so"):
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
    raise PagedAttentionError(
        f"like: the engine's GPU projections run on cuBLAS, which was not found ({'; '.join(errors)}); install the "
        f"CUDA line's cuBLAS (pip install nvidia-cublas-cu12, or nvidia-cublas for CUDA 13)"
    )


class _Cublas:
    """A cuBLAS handle of one device with its own workspace, bound to a stream."""

    def __init__(self, like):
        lib = self.lib = _load_cublas()
        vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasDestroy_v2.argtypes = [vp]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        lib.cublasSetPointerMode_v2.argtypes = [vp, i]
        lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        lib.cublasGemmStridedBatchedEx.argtypes = [
            vp,
            i,
            i,
            i,
            i,
            i,
            vp,
            vp,
            i,
            i,
            ll,
            vp,
            i,
            i,
            ll,
            vp,
            vp,
            i,
            i,
            ll,
            i,
            i,
            i,
        ]
        import cupy  # the GPU backend: CuPy is loaded

        with cupy.cuda.Device(like.device.id):
            h = vp()
            self.check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        self.handle = h
        self.workspace = zeros(like, WORKSPACE_BYTES, np.uint8)
        self._stream = None
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def check(status: int, what: str) -> None:
        """Raise RuntimeError naming the call ``what`` unless ``status`` is 0 (CUBLAS_STATUS_SUCCESS)."""
        if status != 0:
            raise RuntimeError(f"{what} failed: cuBLAS status {status}")

    def bind(self, stream) -> None:
        """Use ``stream`` (a cupaged GpuStream); setting the stream resets the
        workspace, so both are set together, only when the stream changes."""
        if self._stream == stream.ptr:
            return
        lib, h = self.lib, self.handle
        self.check(lib.cublasSetStream_v2(h, ctypes.c_void_p(stream.ptr)), "cublasSetStream")
        self.check(
            lib.cublasSetWorkspace_v2(h, ctypes.c_void_p(int(self.workspace.data.ptr)), WORKSPACE_BYTES),
            "cublasSetWorkspace",
        )
        self.check(lib.cublasSetPointerMode_v2(h, _POINTER_MODE_HOST), "cublasSetPointerMode")
        self._stream = stream.ptr

    def __del__(self):
        h = getattr(self, "handle", None)
        if h is not None:
            try:
                self.lib.cublasDestroy_v2(h)
            except Exception:  # noqa: BLE001 -- interpreter shutdown
                pass


class Projections:
    """Matrix products on the backend of ``like`` (see the module docstring)."""

    def __init__(self, like: Array):
        self.gpu = array_backend(like) == GPU
        self._blas = _Cublas(like) if self.gpu else None

    @staticmethod
    def _dtype(*arrays: Array) -> int:
        name = str(arrays[0].dtype)
        if name not in _CUDA_R or any(str(a.dtype) != name for a in arrays):
            raise PagedAttentionError(
                f"linear: expected float32, float16 or bfloat16 operands of one dtype, got "
                f"{', '.join(str(a.dtype) for a in arrays)}"
            )
        return _CUDA_R[name]

    def linear(self, x: Array, w: Array, out: Array, *, accumulate: bool = False) -> None:
        """out[M, N] (+)= x[M, K] @ w[N, K].T; w and out C-contiguous, x any
        view whose last dim is contiguous (its row stride is cuBLAS's ldb)."""
        if not self.gpu:
            layers.linear(x, w, out, accumulate=accumulate, host=True)
            return
        m, k = x.shape
        n = w.shape[0]
        if (
            w.shape[1] != k
            or out.shape != (m, n)
            or not (_rows(x, 1) and w.flags.c_contiguous and out.flags.c_contiguous)
        ):
            raise PagedAttentionError(
                f"linear: expected x [M, K] (rows), w [N, K], out [M, N] C-contiguous; got {x.shape}, {w.shape}, "
                f"{out.shape}"
            )
        if m == 0:
            return
        dt = self._dtype(x, w, out)
        b = self._blas
        assert b is not None  # made with the GPU backend
        b.bind(stream_for(out))
        vp = ctypes.c_void_p
        b.check(
            b.lib.cublasGemmEx(
                b.handle,
                _OP_T,
                _OP_N,
                n,
                m,
                k,
                ctypes.byref(b.one),
                vp(w.data.ptr),
                dt,
                k,
                vp(x.data.ptr),
                dt,
                _ld(x, 0, k),
                ctypes.byref(b.one if accumulate else b.zero),
                vp(out.data.ptr),
                dt,
                n,
                _COMPUTE_32F,
                _GEMM_DEFAULT,
            ),
            "cublasGemmEx",
        )

    def linear_heads(self, x: Array, w: Array, out: Array, *, accumulate: bool = False) -> None:
        """out[M, H, N] (+)= x[M, H, K] @ w[H, N, K].T per head; w and out
        C-contiguous, x any view whose last dim is contiguous (its row and
        head strides are cuBLAS's ldb and strideB)."""
        if not self.gpu:
            layers.linear_heads(x, w, out, accumulate=accumulate, host=True)
            return
        m, h, k = x.shape
        n = w.shape[1]
        if (
            w.shape != (h, n, k)
            or out.shape != (m, h, n)
            or not (_rows(x, 2) and w.flags.c_contiguous and out.flags.c_contiguous)
        ):
            raise PagedAttentionError(
                f"linear_heads: expected x [M, H, K] (rows), w [H, N, K], out [M, H, N] C-contiguous; got "
                f"{x.shape}, {w.shape}, {out.shape}"
            )
        if m == 0:
            return
        dt = self._dtype(x, w, out)
        b = self._blas
        assert b is not None  # made with the GPU backend
        b.bind(stream_for(out))
        vp = ctypes.c_void_p
        # per head: A = w[h] (stride N*K), B = head h's rows of x (ldb: x's row
        # stride, stride: its head stride), C = head h's rows of out (ldc H*N, stride N)
        b.check(
            b.lib.cublasGemmStridedBatchedEx(
                b.handle,
                _OP_T,
                _OP_N,
                n,
                m,
                k,
                ctypes.byref(b.one),
                vp(w.data.ptr),
                dt,
                k,
                n * k,
                vp(x.data.ptr),
                dt,
                _ld(x, 0, h * k),
                _ld(x, 1, k),
                ctypes.byref(b.one if accumulate else b.zero),
                vp(out.data.ptr),
                dt,
                h * n,
                n,
                h,
                _COMPUTE_32F,
                _GEMM_DEFAULT,
            ),
            "cublasGemmStridedBatchedEx",
        )
