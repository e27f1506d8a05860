"""PyTorch (and JAX) tensors through cupaged, zero-copy, by DLPack.

cupaged's ops take NumPy arrays (CPU backend) and CuPy arrays (GPU backend).
This module views torch tensors as such arrays without copying, runs the op
and views the results back as torch tensors::

    from cupaged import interop
    plan = interop.torch_plan(host_plan, q)             # TorchPlan; q: any tensor on the target device
    plan.append(new_k, new_v, k_cache, v_cache)        # torch tensors; the caches are written in place
    out = plan.attention(q, k_cache, v_cache, scale)   # torch tensor [queries, Hq, Dv]
    interop.argmax_into(logits, next_tokens)           # logits [batch, vocab]; next_tokens int64 [batch]

Every public op has a torch form here: ``TorchPlan`` (``attention``, ``mla``,
``append``, ``workspace``) from ``torch_plan(host_plan, like)`` or
``TorchPlan(device_plan)``; ``split_workspace``; ``argmax_into``/``argmax``;
the layers ``embed``, ``rms_norm``, ``linear``, ``rope``, ``silu_mul``; and
``TorchKVCache`` (a ``PagedKVCache`` whose ``k``/``v`` are torch tensors).
``as_array(t)`` / ``as_torch(a)`` are the two views on their own.

**Zero copy.** CPU tensors become NumPy arrays (``numpy.from_dlpack``), CUDA
tensors CuPy arrays (``cupy.from_dlpack``); back, ``torch.from_numpy`` /
``torch.from_dlpack``. DLPack and NumPy have no bfloat16, so a bfloat16
tensor travels as its int16 view and is re-viewed as ``ml_dtypes.bfloat16``
(and back as ``torch.bfloat16``): the same bytes. fp8 tensors
(``torch.float8_e4m3fn`` / ``float8_e5m2``, K/V caches) travel as their
uint8 view: on the CPU re-viewed as the ml_dtypes fp8 type, on CUDA kept as
raw uint8 storage (CuPy has no fp8 dtype) whose format the ops here pass as
``kv_dtype`` themselves. Strided tensors (an HND cache view, the halves of a
combined KV tensor, column views of an MLA cache) keep their strides. Every view is checked to
start at the tensor's own data pointer, so a copy cannot pass unnoticed. An
``out``/``lse`` you pass is written in place and returned itself.

**Overlap.** Before anything is viewed or launched, every operand an op
writes (``out``, ``lse``, ``append``'s caches, ``rope``'s ``x``) is checked
against every other operand: operands whose storages' byte ranges
(``untyped_storage().data_ptr()`` .. ``+ nbytes()``; a NumPy/CuPy operand
counts as its own span) are disjoint are independent; otherwise the byte
spans the tensors themselves reach (from data pointer, sizes and strides)
must be disjoint, else PagedAttentionError, naming both. So two disjoint
slices of one buffer are fine; ``out`` aliasing ``q`` through another view of
its storage, or reaching into the cache, is rejected with nothing written.
(``rms_norm`` allows ``out`` to be exactly ``x``.)

**Streams (CUDA).** cupaged launches on CuPy's current stream; torch orders
its work on ``torch.cuda.current_stream()``. Each CUDA op here runs inside
``torch_stream(device)``, which makes CuPy's current stream a CuPy wrapper
of torch's current stream handle (``cupy.cuda.Stream.from_external``, or
``ExternalStream`` on CuPy < 14 / older torch; one per (device, handle), kept for
the process, so a plan uploaded under it is recognised later). Kernels thus
run in torch's stream order with no synchronisation, and the DLPack
exchanges see one stream, so they add no waits. A plan is bound to the
stream it was uploaded on: call a TorchPlan's ops under the same torch stream
(``with torch.cuda.stream(s):``) as ``torch_plan``, else PagedAttentionError.

**Autograd.** Tensors are read and written as raw memory: inputs that
require grad are read through ``detach()``; an operand that would be written
must not require grad (PagedAttentionError).

**Mixing.** NumPy arrays may stand in for CPU tensors and CuPy arrays for
CUDA tensors in any argument (e.g. ``interop.rope(q, plan.plan.words, cos,
sin)``); results are torch tensors, except a passed ``out``, returned as it
came. A CPU tensor with a CuPy array (or a CUDA tensor with a NumPy array), a
tensor on another device type, or a non-array raises PagedAttentionError.

**JAX.** ``jax.Array`` implements DLPack, so ``cupy.from_dlpack(x)`` (GPU) and
``numpy.from_dlpack(x)`` (CPU) view it without a copy, and ``as_array(x)``
does the same for any DLPack producer; every op here accepts such arrays as
inputs. JAX arrays are immutable: write into NumPy/CuPy (or torch) outputs
and hand results to JAX with ``jax.numpy.from_dlpack(out)``. (No bfloat16 by
DLPack on CPU: NumPy cannot hold it.)

Torch is imported only when a tensor is converted; this module imports
without it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _runtime as _backend
from .. import dtypes
from .._runtime.arrays import Array
from ..cache import PagedKVCache, StepReport
from ..errors import PagedAttentionError
from ..ops import layers as _layers
from ..ops import sampling as _rowwise
from ..ops.attention.options import MISSING, ROWS, _Missing, document, renamed
from ..plan import DevicePlan, HostPlan, SplitWorkspace

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "as_array",
    "as_torch",
    "is_torch",
    "torch_stream",
    "TorchPlan",
    "torch_plan",
    "split_workspace",
    "TorchKVCache",
    "argmax_into",
    "argmax",
    "embed",
    "rms_norm",
    "linear",
    "rope",
    "silu_mul",
]

_DL_CPU, _DL_CUDA, _DL_CUDA_MANAGED = 1, 2, 13


def is_torch(x: object) -> bool:
    """True for a torch.Tensor (torch itself is not imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _bf16():
    return dtypes.np_dtype("bf16")


#: torch fp8 dtype names -> cupaged's K/V format tokens.
_FP8 = {d.torch_name: d.token for d in dtypes.TABLE if d.scaled}


def fp8_format(x: Any) -> str | None:
    """The fp8 format token ("e4m3" / "e5m2") of an fp8 torch tensor, else None."""
    return _FP8.get(str(x.dtype).removeprefix("torch.")) if is_torch(x) else None


def _check_same_memory(name: str, t, a) -> None:
    """The view ``a`` starts at tensor ``t``'s data pointer (no copy was made)."""
    if t.numel() and _backend.address(a) != t.data_ptr():
        raise PagedAttentionError(
            f"{name}: the DLPack view does not share the tensor's memory "
            f"({_backend.address(a):#x} != {t.data_ptr():#x})"
        )


# ---------------------------------------------------------------------------
# Views


def as_array(x: Any, name: str = "array") -> Array:
    """A NumPy (CPU) or CuPy (CUDA) view of ``x`` sharing its memory.

    ``x``: a torch tensor, a NumPy or CuPy array (returned as is) or any
    DLPack producer (a JAX array, ...). Same shape, strides and dtype;
    torch.bfloat16 becomes ``ml_dtypes.bfloat16``. Raises PagedAttentionError
    naming ``name`` for anything else.
    """
    if _backend.array_backend(x) is not None:
        return x
    if is_torch(x):
        return _torch_to_array(name, x)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        dev_type, dev_id = (int(v) for v in x.__dlpack_device__())
        try:
            if dev_type == _DL_CPU:
                return np.from_dlpack(x)
            if dev_type in (_DL_CUDA, _DL_CUDA_MANAGED):
                import cupy

                with cupy.cuda.Device(dev_id):
                    return cupy.from_dlpack(x)
        except (BufferError, TypeError, ValueError, RuntimeError) as e:
            raise PagedAttentionError(f"{name}: cannot view {type(x).__name__} by DLPack ({e})") from None
        raise PagedAttentionError(f"{name}: expected CPU or CUDA memory, got DLPack device type {dev_type}")
    raise PagedAttentionError(
        f"{name}: expected a torch tensor or a NumPy/CuPy array, got {type(x).__module__}.{type(x).__name__}"
    )


def _torch_to_array(name: str, t):
    import torch

    t = t.detach()
    bf16 = t.dtype == torch.bfloat16
    fp8 = fp8_format(t)
    try:
        if t.device.type == "cpu":
            if fp8:
                a = np.from_dlpack(t.view(torch.uint8)).view(dtypes.np_dtype(fp8))
            else:
                a = np.from_dlpack(t.view(torch.int16)).view(_bf16()) if bf16 else np.from_dlpack(t)
        elif t.device.type == "cuda":
            import cupy

            with cupy.cuda.Device(t.device.index):
                try:
                    a = cupy.from_dlpack(t.view(torch.uint8)) if fp8 else cupy.from_dlpack(t)
                except (BufferError, TypeError, ValueError, RuntimeError):
                    if not bf16:
                        raise
                    a = cupy.from_dlpack(t.view(torch.int16)).view(_bf16())
        else:
            raise PagedAttentionError(f"{name}: expected a CPU or CUDA tensor, got device {t.device}")
    except PagedAttentionError:
        raise
    except (BufferError, TypeError, ValueError, RuntimeError) as e:
        raise PagedAttentionError(f"{name}: cannot view a {t.dtype} tensor on {t.device} as an array ({e})") from None
    _check_same_memory(name, t, a)
    return a


def as_torch(a: Any) -> Tensor:
    """A torch tensor sharing the memory of ``a`` (NumPy: CPU; CuPy: CUDA);
    a torch tensor is returned as is. ``ml_dtypes.bfloat16`` becomes
    torch.bfloat16. The tensor keeps ``a`` alive."""
    import torch

    if isinstance(a, torch.Tensor):
        return a
    backend = _backend.array_backend(a)
    if backend is None:
        raise PagedAttentionError(f"a: expected a NumPy or CuPy array, got {type(a).__name__}")
    bf16 = str(a.dtype) == "bfloat16"
    fp8 = dtypes.lookup(a.dtype)
    if backend == _backend.CPU and fp8 is not None and fp8.scaled:
        t = torch.from_numpy(a.view(np.uint8)).view(getattr(torch, fp8.torch_name))
    elif backend == _backend.CPU:
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if bf16 else torch.from_numpy(a)
    else:
        try:
            t = torch.from_dlpack(a)
        except (BufferError, TypeError, ValueError, RuntimeError):
            if not bf16:
                raise
            t = torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16)
    _check_same_memory("a", t, a)
    return t


# ---------------------------------------------------------------------------
# Streams

_stream_wrappers: dict = {}


@contextlib.contextmanager
def torch_stream(device: int) -> Iterator[Any]:
    """Within the block, CuPy's current device is ``device`` and its current
    stream there is torch's current CUDA stream (the same handle), so
    cupaged launches in torch's stream order. Yields the CuPy stream."""
    import cupy
    import torch

    device = int(device)
    ts = torch.cuda.current_stream(device)
    handle = int(ts.cuda_stream)
    with cupy.cuda.Device(device):
        current = cupy.cuda.get_current_stream(device)
        if int(current.ptr) == handle:  # already torch's stream (e.g. both on the default stream)
            yield current
            return
        s = _stream_wrappers.get((device, handle))
        if s is None:
            if handle == 0:
                s = cupy.cuda.Stream.null
            elif hasattr(cupy.cuda.Stream, "from_external") and hasattr(ts, "__cuda_stream__"):
                s = cupy.cuda.Stream.from_external(ts)
            else:
                s = cupy.cuda.ExternalStream(handle, device)
            _stream_wrappers[(device, handle)] = s
        with s:
            yield s


def _cuda_device(objs) -> int | None:
    """Device of the first CUDA torch tensor among ``objs`` (None: none)."""
    for x in objs:
        if is_torch(x) and x.device.type == "cuda":
            return int(x.device.index)
    return None


def _context(objs):
    dev = _cuda_device(objs)
    return contextlib.nullcontext() if dev is None else torch_stream(dev)


# ---------------------------------------------------------------------------
# Overlap


def _region(x):
    """(device, storage lo, storage hi, lo, hi) byte ranges of ``x``, or None
    when it holds no bytes or is not a tensor/array."""
    if is_torch(x):
        if x.numel() == 0 or x.device.type not in ("cpu", "cuda") or x.layout != sys.modules["torch"].strided:
            return None  # as_array rejects what has no plain memory
        st = x.untyped_storage()
        dev = ("cpu", 0) if x.device.type == "cpu" else ("cuda", x.device.index)
        ptr, item = x.data_ptr(), x.element_size()
        strides = [s * item for s in x.stride()]
        s_lo = st.data_ptr()
        s_hi = s_lo + st.nbytes()
    elif _backend.array_backend(x) is not None:
        if x.size == 0:
            return None
        dev = ("cpu", 0) if isinstance(x, np.ndarray) else ("cuda", int(x.device.id))
        ptr, item, strides = _backend.address(x), x.itemsize, list(x.strides)
        s_lo = s_hi = None
    else:
        return None
    lo = ptr + sum((n - 1) * s for n, s in zip(x.shape, strides) if s < 0)
    hi = ptr + sum((n - 1) * s for n, s in zip(x.shape, strides) if s > 0) + item
    return (dev, lo if s_lo is None else s_lo, hi if s_hi is None else s_hi, lo, hi)


def _layout(x):
    strides = [s * x.element_size() for s in x.stride()] if is_torch(x) else list(x.strides)
    ptr = x.data_ptr() if is_torch(x) else _backend.address(x)
    return ptr, tuple(x.shape), tuple(strides), str(x.dtype).replace("torch.", "")


def _check_operands(writes: dict, reads: dict, alias_ok=()) -> None:
    """Writes must not require grad nor share a byte with any other operand
    (an exact alias named in ``alias_ok`` excepted). Raises before any view."""
    for name, w in writes.items():
        if is_torch(w) and w.requires_grad:
            raise PagedAttentionError(
                f"{name}: expected a tensor that does not require grad (cupaged writes it "
                f"in place, outside autograd); pass a detached tensor"
            )
    operands = [(n, x, _region(x)) for n, x in {**writes, **reads}.items()]
    for i, (wname, w, rw) in enumerate(operands[: len(writes)]):
        for oname, o, ro in operands[i + 1 :]:  # later writes, then every read
            if rw is None or ro is None:
                continue
            if ro[0] != rw[0] or ro[2] <= rw[1] or rw[2] <= ro[1]:  # other device, disjoint storages
                continue
            if ro[4] <= rw[3] or rw[4] <= ro[3]:  # disjoint spans in one storage
                continue
            if (wname, oname) in alias_ok and _layout(w) == _layout(o):
                continue
            raise PagedAttentionError(
                f"{wname}: expected memory disjoint from {oname}, but they overlap: bytes "
                f"[{rw[3]:#x}, {rw[4]:#x}) and [{ro[3]:#x}, {ro[4]:#x})"
            )


def _views(args: dict) -> dict:
    return {k: (None if v is None else as_array(v, k)) for k, v in args.items()}


def _score_views(arrays: dict) -> dict:
    """The array options (sinks, scales, ...) as arrays: a tensor's view;
    anything else as it came (the op's checks name what is wrong with it)."""
    return {k: as_array(v, k) if is_torch(v) else v for k, v in arrays.items()}


def _kv_dtype(kv_dtype, caches: dict):
    """``kv_dtype`` as given, or the format of the first fp8 torch cache
    among ``caches`` (their CUDA views are raw uint8 storage)."""
    if kv_dtype is not None:
        return kv_dtype
    return next((fp8_format(c) for c in caches.values() if fp8_format(c)), None)


# ---------------------------------------------------------------------------
# Plans


class TorchPlan:
    """A DevicePlan whose ops take torch tensors (or arrays of the plan's
    backend) and return torch tensors. ``plan``: the DevicePlan;
    ``host``, ``queries``, ``sequences``, ``page_size``, ... as on it."""

    def __init__(self, plan: DevicePlan):
        if not isinstance(plan, DevicePlan):
            raise PagedAttentionError(f"plan: expected a DevicePlan, got {type(plan).__name__}")
        self.plan = plan

    def __getattr__(self, name):
        if name in (
            "host",
            "queries",
            "sequences",
            "table_width",
            "page_size",
            "pages",
            "max_kv_len",
            "backend",
            "device",
            "stream",
        ):
            return getattr(self.plan, name)
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"TorchPlan({self.plan!r})"

    def _context(self):
        if self.plan.backend != _backend.GPU:
            return contextlib.nullcontext()
        import torch

        handle = int(torch.cuda.current_stream(self.plan.device).cuda_stream)
        if handle != self.plan.stream.ptr:
            raise PagedAttentionError(
                f"stream: torch's current stream on cuda:{self.plan.device} ({handle:#x}) is not the stream this "
                f"plan was uploaded on ({self.plan.stream.ptr:#x}); call it under the stream of torch_plan"
            )
        return torch_stream(self.plan.device)

    @document
    def attention(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        scale: float,
        causal: bool = True,
        *,
        workspace: SplitWorkspace | None = None,
        out: Tensor | None = None,
        lse: Tensor | None = None,
        return_lse: bool = False,
        **options: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``DevicePlan.attention`` on tensors: q [queries, Hq, D];
        k_cache [pages, page_size, Hkv, D]; v_cache [pages, page_size, Hkv, Dv]
        (any views whose innermost dim is contiguous; fp8 tensors
        ``torch.float8_e4m3fn`` / ``float8_e5m2``, or uint8 with ``kv_dtype``).
        The options as there, the array ones tensors or arrays:

        {options}

        Returns out [queries, Hq, Dv] (and float32 lse [queries, Hq] with
        ``return_lse`` or ``lse``): the ``out``/``lse`` passed, else new
        tensors."""
        return self._attend(
            "attention",
            dict(q=q, k_cache=k_cache, v_cache=v_cache),
            scale,
            causal,
            workspace,
            out,
            lse,
            return_lse,
            options,
        )

    @document
    def mla(
        self,
        q: Tensor,
        q_rot: Tensor | None | _Missing = MISSING,
        latent: Tensor | None = None,
        k_rot: Tensor | None | _Missing = MISSING,
        scale: float | None = None,
        causal: bool = True,
        *,
        workspace: SplitWorkspace | None = None,
        out: Tensor | None = None,
        lse: Tensor | None = None,
        return_lse: bool = False,
        **options: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``DevicePlan.mla`` on tensors: q [queries, H, R]; q_rot
        [queries, H, P]; latent [pages, page_size, 1, R]; k_rot
        [pages, page_size, 1, P] (q_rot and k_rot None: no rotary part;
        ``q_pos`` / ``k_pos``: their deprecated keyword names); views, fp8
        and the options as ``attention``'s:

        {options}

        Returns out [queries, H, R] (and lse [queries, H]) as ``attention``
        does."""
        rot = renamed(options, dict(q_rot=q_rot, k_rot=k_rot), dict(q_pos="q_rot", k_pos="k_rot"))
        inputs = dict(q=q, q_rot=rot["q_rot"], latent=latent, k_rot=rot["k_rot"])
        return self._attend(
            "mla",
            {k: None if v is MISSING else v for k, v in inputs.items()},
            scale,
            causal,
            workspace,
            out,
            lse,
            return_lse,
            options,
        )

    def _attend(self, op, inputs, scale, causal, workspace, out, lse, return_lse, options):
        # The array options (ROWS: sinks, scales, ...): tensors or arrays read like the inputs; the others
        # pass as they are.
        arrays = {k: v for k, v in options.items() if k in ROWS and ROWS[k].array and v is not None}
        _check_operands(dict(out=out, lse=lse), {**inputs, **arrays})
        options = dict(options, kv_dtype=_kv_dtype(options.get("kv_dtype"), inputs))
        with self._context():
            a = _views(inputs)
            o, l_ = _views(dict(out=out, lse=lse)).values()
            res = getattr(self.plan, op)(
                *a.values(),
                scale,
                causal,
                workspace=workspace,
                out=o,
                lse=l_,
                return_lse=return_lse,
                **{**options, **_score_views(arrays)},
            )
            if not (return_lse or lse is not None):
                return out if out is not None else as_torch(res)
            return (out if out is not None else as_torch(res[0]), lse if lse is not None else as_torch(res[1]))

    def append(
        self,
        new_k: Tensor,
        new_v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        *,
        kv_dtype: str | None = None,
        k_scale: Any = None,
        v_scale: Any = None,
    ) -> None:
        """``DevicePlan.append`` on tensors: new_k [queries, Hkv, D] and
        new_v [queries, Hkv, Dv] into k_cache [pages, page_size, Hkv, D] and
        v_cache [pages, page_size, Hkv, Dv], in place (views; fp8 tensors
        quantized with ``k_scale`` / ``v_scale`` as ``attention`` reads them)."""
        scales = {k: v for k, v in (("k_scale", k_scale), ("v_scale", v_scale)) if v is not None}
        _check_operands(dict(k_cache=k_cache, v_cache=v_cache), dict(new_k=new_k, new_v=new_v, **scales))
        kv_dtype = _kv_dtype(kv_dtype, dict(k_cache=k_cache, v_cache=v_cache))
        with self._context():
            self.plan.append(
                *_views(dict(new_k=new_k, new_v=new_v, k_cache=k_cache, v_cache=v_cache)).values(),
                kv_dtype=kv_dtype,
                **_score_views(scales),
            )

    def workspace(self, heads: int, value_dim: int, splits: int) -> SplitWorkspace:
        """A SplitWorkspace for this plan's queries on its device and stream."""
        with self._context():
            return SplitWorkspace(self.plan.queries, heads, value_dim, splits, self.plan.words)


def torch_plan(host_plan: HostPlan, like: Any) -> TorchPlan:
    """Upload ``host_plan`` to the device (and, for CUDA, torch's current
    stream) of ``like`` (a tensor or array) and wrap it in a TorchPlan."""
    if not isinstance(host_plan, HostPlan):
        raise PagedAttentionError(f"host_plan: expected a HostPlan, got {type(host_plan).__name__}")
    with _context([like]):
        return TorchPlan(host_plan.upload(as_array(like, "like")))


def split_workspace(queries: int, heads: int, value_dim: int, splits: int, like: Any) -> SplitWorkspace:
    """``SplitWorkspace(queries, heads, value_dim, splits, like)`` for a tensor
    ``like`` (its device; torch's current stream for CUDA)."""
    with _context([like]):
        return SplitWorkspace(queries, heads, value_dim, splits, as_array(like, "like"))


# ---------------------------------------------------------------------------
# Page manager


def _dtype_name(dtype):
    """torch.bfloat16 -> "bfloat16"; anything else unchanged."""
    return str(dtype).removeprefix("torch.") if type(dtype).__module__ == "torch" else dtype


class TorchKVCache:
    """``PagedKVCache`` with torch views of its caches: ``k`` [layers,
    num_pages, page_size, kv_heads, head_dim] and ``v`` [layers, num_pages,
    page_size, kv_heads, value_dim] (zero-copy views of ``cache.k``/``cache.v``;
    ``k[layer]`` is one layer's cache, what ``TorchPlan.attention`` takes) on
    the device of ``like`` (a tensor or array; None: CPU). ``dtype``: a torch
    dtype or a name. ``prepare`` returns a TorchPlan; other attributes are the
    PagedKVCache's (``add_sequence``, ``fork``, ``free``, ``reserve``,
    ``page_table``, ``stats`` ...)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: Any,
        *,
        layers: int = 1,
        value_dim: int | None = None,
        like: Any = None,
        prefix_cache: bool = False,
        k_scale: Any = None,
        v_scale: Any = None,
    ) -> None:
        with _context([like]):
            scales = {k: as_array(v, k) if is_torch(v) else v for k, v in (("k_scale", k_scale), ("v_scale", v_scale))}
            self.cache = PagedKVCache(
                num_pages,
                page_size,
                kv_heads,
                head_dim,
                _dtype_name(dtype),
                layers=layers,
                value_dim=value_dim,
                like=None if like is None else as_array(like, "like"),
                prefix_cache=prefix_cache,
                **scales,
            )
            self.k, self.v = as_torch(self.cache.k), as_torch(self.cache.v)
            fmt = dtypes.lookup(self.cache.kv_dtype)
            assert fmt is not None  # the cache's own K/V format
            if fmt.scaled:  # fp8 tensors (the CUDA arrays are raw uint8 storage)
                import torch

                t8 = getattr(torch, fmt.torch_name)
                self.k, self.v = self.k.view(t8), self.v.view(t8)

    def __getattr__(self, name):
        if name == "cache":
            raise AttributeError(name)
        return getattr(self.cache, name)

    def __repr__(self) -> str:
        return f"TorchKVCache({self.cache!r})"

    def prepare(self, seqs: Any, new_tokens: Any, *, reserve: Any = 0) -> tuple[TorchPlan, StepReport]:
        """``PagedKVCache.prepare``; returns (TorchPlan, StepReport)."""
        with _context([self.k]):
            plan, report = self.cache.prepare(seqs, new_tokens, reserve=reserve)
        return TorchPlan(plan), report

    def append(self, plan: TorchPlan, new_k: Tensor, new_v: Tensor, *, layer: int = 0) -> None:
        """``PagedKVCache.append``: layer ``layer``'s new rows, new_k
        [queries, Hkv, D] and new_v [queries, Hkv, Dv] (tensors)."""
        plan = plan if isinstance(plan, TorchPlan) else TorchPlan(plan)
        _check_operands(dict(k_cache=self.k, v_cache=self.v), dict(new_k=new_k, new_v=new_v))
        with plan._context():
            nk, nv = _views(dict(new_k=new_k, new_v=new_v)).values()
            self.cache.append(plan.plan, nk, nv, layer=layer)


# ---------------------------------------------------------------------------
# Row-wise and layers


def _call(fn, writes: dict, reads: dict, alias_ok=(), **kwargs):
    _check_operands(writes, reads, alias_ok)
    with _context([*writes.values(), *reads.values()]):
        a = _views({**reads, **writes})
        fn(**a, **kwargs)


def argmax_into(logits: Tensor, out: Tensor) -> Tensor:
    """``cupaged.argmax_into``: logits [batch, vocab] float; out int64
    [batch], written in place and returned."""
    _call(_rowwise.argmax_into, dict(out=out), dict(logits=logits))
    return out


def argmax(logits: Tensor) -> Tensor:
    """Row argmax of logits [batch, vocab] into a new int64 [batch] tensor."""
    with _context([logits]):
        return as_torch(_rowwise.argmax(as_array(logits, "logits")))


def embed(tokens: Tensor, table: Tensor, out: Tensor) -> Tensor:
    """``layers.embed``: tokens int64 [rows], table [vocab, dim] -> out [rows, dim] (returned)."""
    _call(_layers.embed, dict(out=out), dict(tokens=tokens, table=table))
    return out


def rms_norm(x: Tensor, weight: Tensor, out: Tensor, eps: float = 1e-6) -> Tensor:
    """``layers.rms_norm``: x [rows, dim], weight [dim] -> out [rows, dim]
    (may be exactly x; returned)."""
    _call(_layers.rms_norm, dict(out=out), dict(x=x, weight=weight), alias_ok={("out", "x")}, eps=eps)
    return out


def linear(x: Tensor, weight: Tensor, out: Tensor, *, accumulate: bool = False) -> Tensor:
    """``layers.linear``: out [M, N] (+)= x [M, K] @ weight [N, K].T (returned)."""
    _call(_layers.linear, dict(out=out), dict(x=x, weight=weight), accumulate=accumulate)
    return out


def rope(x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, *, position_stride: int = 1) -> Tensor:
    """``layers.rope`` in place on x [rows, heads, dim] (returned); positions
    uint32/int32 (e.g. ``plan.plan.words[...]``); cos, sin float32
    [max_pos, dim // 2]."""
    _call(_layers.rope, dict(x=x), dict(positions=positions, cos=cos, sin=sin), position_stride=position_stride)
    return x


def silu_mul(gate_up: Tensor, out: Tensor) -> Tensor:
    """``layers.silu_mul``: gate_up [rows, 2F] -> out [rows, F] (returned)."""
    _call(_layers.silu_mul, dict(out=out), dict(gate_up=gate_up))
    return out
