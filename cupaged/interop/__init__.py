"""Tensors of other frameworks through cupaged, zero-copy (DLPack): PyTorch
in ``cupaged.interop.torch`` (re-exported here); JAX arrays pass through
``cupy.from_dlpack`` / ``numpy.from_dlpack``, see that module's docstring."""

from __future__ import annotations

from .torch import (
    TorchKVCache,
    TorchPlan,
    argmax,
    argmax_into,
    as_array,
    as_torch,
    embed,
    is_torch,
    linear,
    rms_norm,
    rope,
    silu_mul,
    split_workspace,
    torch_plan,
    torch_stream,
)

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
