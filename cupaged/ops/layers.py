"""Dense decoder-step kernels (``kernels_cu/layers.cu``): embedding, RMSNorm,
linear (+ residual accumulate), one linear per head (MLA's absorbed
up-projections), bias add, rotary embedding by device positions, SwiGLU.

They exist so that a whole decoder step is stream work on either backend and
can be captured into one graph (on the CPU backend only cupaged's stream work
is captured, not NumPy expressions). Every function writes into a
preallocated ``out``, allocates nothing and never synchronizes.

``host=True`` (the engine's CPU path): on the CPU backend with float32
arrays, the same layer is host code issued into the stream with
``Stream.host_call``, so it runs in stream order and is recorded into a CPU
graph like a kernel launch: products of up to ``host_products.MAX_ROWS`` rows
the few-row products (kernels_cu/host/products.cpp, on the worker pool), wider
ones BLAS (``np.matmul``, on BLAS's own threads, or one for the rows
``CUPAGED_BLAS_ONE_THREAD_ROWS`` names: ``cupaged._runtime.cpu.blas_one_thread``);
RMSNorm, SwiGLU and RoPE the row-wise layers (kernels_cu/host/layers.cpp,
``host_layers``); bias add and embedding NumPy. Scratch arrays and argument
structs are made when the work is issued (once per capture: a replay
allocates nothing but what NumPy's BLAS call itself may). Arithmetic in
float32 as the kernels', rounding and summation order aside. Other dtypes
and the GPU backend run the kernel.
"""

from __future__ import annotations

import numpy as np

from .. import dtypes
from .._runtime import address, array_backend, backend_of, checks, get_kernel, register, stream_for
from .._runtime import cpu as _cpu
from .._runtime import host_layers as _layers
from .._runtime import host_products as _products
from .._runtime.cpu import blas_one_thread
from ..errors import PagedAttentionError

THREADS = 128
#: A CUDA grid's y and z dimensions (rows and heads of linear_heads).
MAX_GRID_Y = 65535
register("layers", [{"CP_DTYPE": t} for t in dtypes.QUERY_TOKENS])


def _kernel(like, name):
    return get_kernel(like, "layers", name, {"CP_DTYPE": dtypes.token(like.dtype)})


def _on_host(host: bool, *arrays) -> bool:
    """Whether the ``host=True`` NumPy path applies: CPU backend, float32."""
    return host and all(type(a) is np.ndarray and a.dtype == np.float32 for a in arrays)


def _same(ref_name, ref, **arrays):
    backend_of(**{ref_name: ref}, **arrays)
    checks.same_dtype(ref_name, ref, **arrays)


def _row_strides(name: str, a, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """``a`` is an f32/f16/bf16 array of a rank in ``ranks`` whose last dim
    is contiguous and whose rows (last-dim runs) do not overlap: C-contiguous
    or any strided view (``checks.row_view``: non-negative strides, e.g. the
    q and k columns of a fused QKV buffer). Returns its outer strides in
    elements ([row] or [row, head]), each within 32 bits (u32 kernel
    arguments); every dim within 32 bits. A C-contiguous array costs a flag
    read (its strides come from its shape)."""
    ndim = getattr(a, "ndim", None)
    if ndim not in ranks and array_backend(a) is not None:
        want = " or ".join(f"{r}-D" for r in ranks)
        raise PagedAttentionError(f"{name}: expected a {want} array, got shape {checks.shape_str(a.shape)} ({ndim}-D)")
    checks.float_array(name, a, ranks[0] if ndim is None else ndim, view=True)
    return checks.view_strides(name, a)


def _in_place_or_apart(x, out, xs: tuple[int, ...], os: tuple[int, ...]) -> tuple[int, int]:
    """``out`` (shaped like ``x``; ``xs``, ``os`` their ``_row_strides``) is
    x's very view (same address and strides) or shares no element with it.
    Returns their addresses. Two C-contiguous arrays are decided by their
    spans; any other pair by ``checks.no_overlap``."""
    xa, oa = address(x), address(out)
    if xs == os:
        if xa == oa:
            return xa, oa  # the same view
        if x.flags.c_contiguous and out.flags.c_contiguous and abs(xa - oa) >= x.nbytes:
            return xa, oa
    try:
        checks.no_overlap("out", out, x=x)
    except PagedAttentionError:
        raise PagedAttentionError(
            "out: expected memory disjoint from x (or x itself, the same view), but they overlap"
        ) from None
    return xa, oa


def embed(tokens, table, out, *, host: bool = False) -> None:
    """out[r] = table[tokens[r]]: tokens int64 [rows], table [vocab, dim],
    out [rows, dim]. A token outside 0..vocab-1 yields a zero row."""
    checks.float_array("table", table, 2)
    checks.float_array("out", out, 2)
    _same("table", table, out=out)
    backend_of(table=table, tokens=tokens)
    if str(tokens.dtype) != "int64" or tokens.ndim != 1 or not tokens.flags.c_contiguous:
        raise PagedAttentionError(
            f"tokens: expected a contiguous int64 [rows] array, got {tokens.dtype} {checks.shape_str(tokens.shape)}"
        )
    checks.shape_is("out", out, (tokens.shape[0], table.shape[1]))
    if _on_host(host, table, out):
        checks.no_overlap("out", out, table=table)
        vocab = table.shape[0]
        ok = np.zeros(tokens.shape[0], np.bool_)
        low = np.zeros(tokens.shape[0], np.bool_)

        def op():
            np.take(table, tokens, axis=0, out=out, mode="clip")
            np.greater_equal(tokens, 0, out=ok)
            np.less(tokens, vocab, out=low)
            np.logical_and(ok, low, out=ok)
            if not ok.all():
                out[~ok] = 0

        stream_for(out).host_call(op, tokens, table, out)
        return
    stream_for(out).launch(
        _kernel(out, "embed"),
        (tokens.shape[0],),
        (THREADS,),
        (tokens, table, out, np.uint32(table.shape[1]), np.uint32(table.shape[0])),
    )


def rms_norm(x, weight, out, eps: float = 1e-6, *, host: bool = False) -> None:
    """out = x / sqrt(mean(x^2) + eps) * weight over the last dim.

    x [rows, dim] or [tokens, heads, dim] (each head's dim normalized: Qwen3's
    per-head q/k norm), weight [dim], out shaped like x. x and out may be any
    views whose last dim is contiguous (outer strides arbitrary and
    non-negative, rows not overlapping: e.g. the q or k columns of a fused
    QKV buffer, ``qkv[:, :Hq * D].reshape(rows, Hq, D)``); out may be x
    itself (the same view) but must not otherwise overlap it.
    """
    xs = _row_strides("x", x, (2, 3))
    checks.float_array("weight", weight, 1)
    os = _row_strides("out", out, (2, 3))
    _same("x", x, weight=weight, out=out)
    checks.shape_is("weight", weight, x.shape[-1:])
    checks.shape_is("out", out, x.shape)
    heads = x.shape[1] if x.ndim == 3 else 1
    if heads > MAX_GRID_Y:
        raise PagedAttentionError(
            f"x: expected at most {MAX_GRID_Y} heads (grid limit), got {checks.shape_str(x.shape)}"
        )
    at = None if out is x else _in_place_or_apart(x, out, xs, os)
    if _on_host(host, x, weight, out):
        xa, oa = at or (address(x),) * 2
        stream_for(x).host_call(
            _layers.rms_norm(x, weight, out, eps, x_strides=xs, out_strides=os, x_at=xa, out_at=oa), x, weight, out
        )
        return
    three = x.ndim == 3
    stream_for(x).launch(
        _kernel(x, "rms_norm"),
        (x.shape[0], heads),
        (THREADS,),
        (
            x,
            weight,
            out,
            np.uint32(x.shape[-1]),
            np.float32(eps),
            np.uint32(xs[0]),
            np.uint32(xs[1] if three else 0),
            np.uint32(os[0]),
            np.uint32(os[1] if three else 0),
        ),
    )


def _host_product(lhs, rhs, out, accumulate: bool, rows: int, keep: tuple) -> None:
    """``out = lhs @ rhs`` (or ``out +=`` with ``accumulate``) as host work on
    the CPU stream; ``keep`` the arrays the recorded call holds. lhs [..., M, K],
    rhs [..., K, N], out [..., M, N]. A product of a few rows of float32 rows
    (``host_products.fits``: a decode step's projections) runs the CPU
    products (kernels_cu/host/products.cpp) straight from the weight on the
    worker pool's threads (one thread when ``rows`` <= blas_one_thread_rows);
    the rest is BLAS (``np.matmul``; ``rows`` picks its threads the same way),
    ``accumulate`` through a scratch array made once here, so a replay
    allocates nothing."""
    if lhs.ndim == 2 and _products.fits(lhs, rhs.T, out):
        parts = 1 if rows <= _cpu.blas_one_thread_rows() else _cpu.configured_workers()
        stream_for(keep[0]).host_call(_products.product(lhs, rhs.T, out, accumulate, parts), *keep)
        return
    tmp = np.zeros(out.shape, np.float32) if accumulate else out

    def product():
        np.matmul(lhs, rhs, out=tmp)

    if accumulate:

        def op():
            product()
            np.add(out, tmp, out=out)

    else:
        op = product

    stream_for(keep[0]).host_call(blas_one_thread(op, rows), *keep)


def linear(x, weight, out, *, accumulate: bool = False, host: bool = False) -> None:
    """out = x @ weight.T, or out += x @ weight.T with ``accumulate`` (a fused
    residual add). x [M, K] (any view whose last dim is contiguous: a
    column slice of a wider buffer), weight [N, K], out [M, N]; float32
    accumulation."""
    (x_row,) = _row_strides("x", x, (2,))
    checks.float_array("weight", weight, 2)
    checks.float_array("out", out, 2)
    _same("x", x, weight=weight, out=out)
    if weight.shape[1] != x.shape[1]:
        raise PagedAttentionError(
            f"weight: expected [N, {x.shape[1]}] (K like x), got {checks.shape_str(weight.shape)}"
        )
    checks.shape_is("out", out, (x.shape[0], weight.shape[0]))
    checks.no_overlap("out", out, x=x, weight=weight)
    m, n = x.shape[0], weight.shape[0]
    if _on_host(host, x, weight, out):
        if m == 0:
            return
        _host_product(x, weight.T, out, accumulate, m, keep=(x, weight, out))
        return
    stream_for(x).launch(
        _kernel(x, "linear"),
        ((n + THREADS // 32 - 1) // (THREADS // 32), m),
        (THREADS,),
        (x, weight, out, np.uint32(n), np.uint32(x.shape[1]), np.uint32(bool(accumulate)), np.uint32(x_row)),
    )


def linear_heads(x, weight, out, *, accumulate: bool = False, host: bool = False) -> None:
    """One linear layer per head: out[m, h] = x[m, h] @ weight[h].T (or +=
    with ``accumulate``). x [M, H, K] (any view whose last dim is
    contiguous: e.g. the no-rope columns of a [M, H, K + P] query), weight
    [H, N, K], out [M, H, N]; float32 accumulation. MLA's absorbed form uses
    it for the query through W_UK^T and the latent attention output through
    W_UV."""
    x_row, x_head = _row_strides("x", x, (3,))
    checks.float_array("weight", weight, 3)
    checks.float_array("out", out, 3)
    _same("x", x, weight=weight, out=out)
    m, h, k = (int(d) for d in x.shape)
    if weight.shape[0] != h or weight.shape[2] != k:
        raise PagedAttentionError(
            f"weight: expected [{h}, N, {k}] (heads and K like x), got {checks.shape_str(weight.shape)}"
        )
    n = int(weight.shape[1])
    checks.shape_is("out", out, (m, h, n))
    checks.no_overlap("out", out, x=x, weight=weight)
    if m > MAX_GRID_Y or h > MAX_GRID_Y:
        raise PagedAttentionError(
            f"x: expected at most {MAX_GRID_Y} rows and heads (grid limits), got {checks.shape_str(x.shape)}"
        )
    if m == 0 or n == 0:
        return
    if _on_host(host, x, weight, out):
        # per head: [H, M, K] @ [H, K, N] into out's [H, M, N] view
        _host_product(
            x.transpose(1, 0, 2),
            weight.transpose(0, 2, 1),
            out.transpose(1, 0, 2),
            accumulate,
            m,
            keep=(x, weight, out),
        )
        return
    stream_for(x).launch(
        _kernel(x, "linear_heads"),
        ((n + THREADS // 32 - 1) // (THREADS // 32), m, h),
        (THREADS,),
        (
            x,
            weight,
            out,
            np.uint32(n),
            np.uint32(k),
            np.uint32(x_row),
            np.uint32(x_head),
            np.uint32(h * n),
            np.uint32(n),
            np.uint32(bool(accumulate)),
        ),
    )


def bias_add(x, bias, *, host: bool = False) -> None:
    """x[r] += bias in place: x [rows, n], bias [n] (a linear layer's bias)."""
    checks.float_array("x", x, 2)
    checks.float_array("bias", bias, 1)
    _same("x", x, bias=bias)
    checks.shape_is("bias", bias, x.shape[1:])
    checks.no_overlap("x", x, bias=bias)
    if x.shape[0] == 0:
        return
    if _on_host(host, x, bias):
        stream_for(x).host_call(lambda: np.add(x, bias, out=x), x, bias)
        return
    stream_for(x).launch(_kernel(x, "bias_add"), (x.shape[0],), (THREADS,), (x, bias, np.uint32(x.shape[1])))


def rope(x, positions, cos, sin, *, position_stride: int = 1, host: bool = False) -> None:
    """Rotary embedding (rotate-half form) in place.

    x [rows, heads, dim] (dim even): any view whose last dim is contiguous
    (outer strides arbitrary and non-negative, rows not overlapping: e.g. the
    q and k heads of a fused QKV buffer, ``qkv.reshape(rows, H, D)[:, :Hq +
    Hkv]``; the heads between are not touched); positions uint32 with row r's position
    at positions[r * position_stride] (device memory: plan words, a
    DeviceScalars word, ...); cos, sin float32 [max_pos, dim // 2]. A position
    past the table is clamped to its last row.
    """
    xs = _row_strides("x", x, (3,))
    backend_of(x=x, positions=positions, cos=cos, sin=sin)
    if x.shape[2] % 2:
        raise PagedAttentionError(f"x: expected an even head dim, got {x.shape[2]}")
    checks.rope_tables(cos, sin, x.shape[2] // 2)
    if positions.dtype not in (np.uint32, np.int32) or not positions.flags.c_contiguous:
        raise PagedAttentionError(f"positions: expected a contiguous uint32 array, got {positions.dtype}")
    need = (x.shape[0] - 1) * position_stride + 1 if x.shape[0] else 0
    if position_stride < 1 or positions.size < need:
        raise PagedAttentionError(
            f"positions: expected at least {need} words for {x.shape[0]} rows with "
            f"stride {position_stride}, got {positions.size}"
        )
    if _on_host(host, x) and x.shape[0]:
        words = positions.view(np.uint32)  # read as u32, as the kernel
        stream_for(x).host_call(_layers.rope(x, words, cos, sin, position_stride, xs), x, positions, cos, sin)
        return
    stream_for(x).launch(
        _kernel(x, "rope"),
        (x.shape[0],),
        (THREADS,),
        (
            x,
            positions,
            np.uint32(position_stride),
            cos,
            sin,
            np.uint32(x.shape[1]),
            np.uint32(x.shape[2]),
            np.uint32(cos.shape[0]),
            np.uint32(xs[0]),
            np.uint32(xs[1]),
        ),
    )


def silu_mul(gate_up, out, *, host: bool = False) -> None:
    """out = silu(gate) * up with gate_up [rows, 2F] = (gate | up), out [rows, F]."""
    checks.float_array("gate_up", gate_up, 2)
    checks.float_array("out", out, 2)
    _same("gate_up", gate_up, out=out)
    if gate_up.shape[1] % 2:
        raise PagedAttentionError(f"gate_up: expected an even last dim, got {gate_up.shape[1]}")
    checks.shape_is("out", out, (gate_up.shape[0], gate_up.shape[1] // 2))
    checks.no_overlap("out", out, gate_up=gate_up)
    if _on_host(host, gate_up, out):
        stream_for(out).host_call(_layers.silu_mul(gate_up, out), gate_up, out)
        return
    stream_for(out).launch(
        _kernel(out, "silu_mul"), (out.shape[0],), (THREADS,), (gate_up, out, np.uint32(out.shape[1]))
    )
