"""The GPU projections' cuBLAS calls, checked without a GPU: libcublas is
replaced by a NumPy stand-in that implements cublasGemmEx /
cublasGemmStridedBatchedEx's column-major contract on the raw pointers, so
the arguments the engine passes (transposes, m/n/k, leading dims, batch
strides, alpha/beta) must give x @ W.T per head and the residual add. What
this cannot check is cuBLAS itself under a real capture (unverified until a
GPU is lent)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cupaged.engine import projections as proj

DT = {0: np.float32, 2: np.float16}


def _view(ptr, dtype, count):
    buf = (ctypes.c_char * (count * np.dtype(dtype).itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype, count=count)


def _ptr(p):
    return p.value if isinstance(p, ctypes.c_void_p) else int(p)


def _scalar(ref):
    return ctypes.cast(ref, ctypes.POINTER(ctypes.c_float)).contents.value


class FakeCublas:
    """cuBLAS's column-major GEMM contract on host memory."""

    def __init__(self):
        self.calls = []

    def _gemm(self, transa, transb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc):
        dt = DT[at]
        a_rows = k if transa else m  # stored column-major: a_rows x a_cols with ld lda
        a = _view(_ptr(A), dt, lda * ((m if transa else k) - 1) + a_rows).astype(np.float64)
        b_rows = n if transb else k
        b = _view(_ptr(B), dt, ldb * ((k if transb else n) - 1) + b_rows).astype(np.float64)
        c = _view(_ptr(C), dt, ldc * (n - 1) + m)
        opa = np.array([[a[(l + i * lda) if transa else (i + l * lda)] for l in range(k)] for i in range(m)])
        opb = np.array([[b[(j + l * ldb) if transb else (l + j * ldb)] for j in range(n)] for l in range(k)])
        res = _scalar(alpha) * (opa @ opb)
        for j in range(n):
            for i in range(m):
                old = float(c[i + j * ldc]) if _scalar(beta) else 0.0
                c[i + j * ldc] = res[i, j] + _scalar(beta) * old
        return 0

    def cublasGemmEx(self, h, transa, transb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc, comp, algo):
        self.calls.append(("gemm", comp))
        return self._gemm(transa, transb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ct, ldc)

    def cublasGemmStridedBatchedEx(
        self, h, transa, transb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct, ldc, sc, count, comp, algo
    ):
        self.calls.append(("batched", count))
        isz = np.dtype(DT[at]).itemsize
        for i in range(count):
            self._gemm(
                transa,
                transb,
                m,
                n,
                k,
                alpha,
                _ptr(A) + i * sa * isz,
                at,
                lda,
                _ptr(B) + i * sb * isz,
                bt,
                ldb,
                beta,
                _ptr(C) + i * sc * isz,
                ct,
                ldc,
            )
        return 0


class Dev:
    """A host array posing as a device array (shape, dtype, strides, itemsize,
    flags, data.ptr); ``view=True`` keeps a strided view as it is."""

    def __init__(self, a, view=False):
        self.a = a if view else np.ascontiguousarray(a)
        self.shape, self.dtype, self.flags = self.a.shape, self.a.dtype, self.a.flags
        self.strides, self.itemsize = self.a.strides, self.a.itemsize
        self.data = type("Ptr", (), {"ptr": self.a.ctypes.data})()


@pytest.fixture
def gpu_projections(monkeypatch):
    fake = FakeCublas()
    blas = object.__new__(proj._Cublas)
    blas.lib, blas.handle, blas._stream = fake, None, 7
    blas.one, blas.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    p = object.__new__(proj.Projections)
    p.gpu, p._blas = True, blas
    monkeypatch.setattr(proj, "stream_for", lambda a: type("S", (), {"ptr": 7})())
    return p, fake


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_linear_call_computes_x_times_w_transposed(gpu_projections, dtype):
    p, fake = gpu_projections
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 5)).astype(dtype), rng.standard_normal((4, 5)).astype(dtype)
    out = Dev(np.zeros((3, 4), dtype))
    p.linear(Dev(x), Dev(w), out)
    exp = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(out.a.astype(np.float64), exp, rtol=2e-3, atol=2e-3)
    p.linear(Dev(x), Dev(w), out, accumulate=True)  # beta = 1: the residual add
    np.testing.assert_allclose(out.a.astype(np.float64), 2 * exp, rtol=4e-3, atol=4e-3)
    assert fake.calls == [("gemm", proj._COMPUTE_32F)] * 2


def test_linear_heads_call_is_one_product_per_head(gpu_projections):
    p, fake = gpu_projections
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((3, 2, 5)).astype(np.float32), rng.standard_normal((2, 4, 5)).astype(np.float32)
    out = Dev(np.zeros((3, 2, 4), np.float32))
    p.linear_heads(Dev(x), Dev(w), out)
    np.testing.assert_allclose(out.a, np.einsum("mhk,hnk->mhn", x, w), rtol=1e-5, atol=1e-5)
    assert fake.calls == [("batched", 2)]


def test_x_as_a_row_view_is_read_at_its_strides(gpu_projections):
    """x a column slice of a NaN-padded buffer (the engine's fused products:
    MLA's q_a beside k_rope and the latent, its no-rope query beside q_rope):
    cuBLAS's ldb is x's row stride, strideB its head stride; the NaN columns
    are never read."""
    p, fake = gpu_projections
    rng = np.random.default_rng(2)
    buf = np.full((3, 9), np.nan, np.float32)
    x = buf[:, 2:7]
    x[...] = rng.standard_normal((3, 5))
    w = rng.standard_normal((4, 5)).astype(np.float32)
    out = Dev(np.zeros((3, 4), np.float32))
    p.linear(Dev(x, view=True), Dev(w), out)
    np.testing.assert_allclose(out.a, x @ w.T, rtol=1e-5, atol=1e-5)
    buf3 = np.full((3, 2, 8), np.nan, np.float32)
    x3 = buf3[..., :5]
    x3[...] = rng.standard_normal((3, 2, 5))
    w3 = rng.standard_normal((2, 4, 5)).astype(np.float32)
    out3 = Dev(np.zeros((3, 2, 4), np.float32))
    p.linear_heads(Dev(x3, view=True), Dev(w3), out3)
    np.testing.assert_allclose(out3.a, np.einsum("mhk,hnk->mhn", x3, w3), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match=r"linear: expected x \[M, K\] \(rows\)"):
        p.linear(Dev(buf[:, ::2], view=True), Dev(np.zeros((4, 5), np.float32)), out)


def test_gpu_linear_refuses_mixed_dtypes(gpu_projections):
    p, _ = gpu_projections
    with pytest.raises(Exception, match="expected float32, float16 or bfloat16 operands of one dtype"):
        p.linear(
            Dev(np.zeros((1, 2), np.float32)), Dev(np.zeros((3, 2), np.float16)), Dev(np.zeros((1, 3), np.float32))
        )


@pytest.mark.parametrize("call", ["cublasGemmEx", "cublasGemmStridedBatchedEx"])
def test_a_failing_cublas_call_raises_naming_it(gpu_projections, monkeypatch, call):
    p, fake = gpu_projections
    monkeypatch.setattr(fake, call, lambda *args: 13)
    x = Dev(np.zeros((1, 2, 2), np.float32))
    with pytest.raises(RuntimeError, match=f"{call} failed: cuBLAS status 13"):
        if call == "cublasGemmEx":
            p.linear(
                Dev(np.zeros((1, 2), np.float32)), Dev(np.zeros((3, 2), np.float32)), Dev(np.zeros((1, 3), np.float32))
            )
        else:
            p.linear_heads(x, Dev(np.zeros((2, 3, 2), np.float32)), Dev(np.zeros((1, 2, 3), np.float32)))
