"""Exceptions raised by cupaged."""


class PagedAttentionError(ValueError):
    """Invalid input to a cupaged operation.

    Raised before anything is launched or written. The message names the
    argument, what was expected and what came.
    """


class KernelError(RuntimeError):
    """A kernel failed while running on the CPU backend (a barrier or warp
    collective that cannot complete, a trap, an emulator limit). The message
    names the kernel and, for barriers, the waiting source lines."""


class CompileError(RuntimeError):
    """A kernel variant failed to compile (g++ for the CPU backend, NVRTC for
    the GPU backend). The message holds the compiler log."""


class ConfigError(ValueError):
    """A model's ``config.json`` that ``cupaged.Engine`` cannot run: an
    unsupported architecture, a missing field, or a field whose value it
    does not implement (an unknown rope scaling type, mixture-of-experts
    layers, a quantization config, ...). Raised while loading, before any
    weight is read; the message names the architecture, the field, what is
    supported and what came."""


class CheckpointError(ValueError):
    """A checkpoint folder or state dict that ``cupaged.Engine`` cannot load:
    a missing ``config.json`` or ``*.safetensors`` file, a truncated or
    malformed safetensors file, a missing tensor or one of the wrong shape.
    The message names the file (or tensor), what was expected and what came."""


class SetupError(RuntimeError):
    """The environment lacks something cupaged needs for the call: a C++
    compiler (or one too old) for the CPU backend, an optional extra (the
    NVRTC gate's ``gate`` extra, ``engine``, ...), a writable kernel cache.
    The message says in one line what is missing and how to fix it."""


def add_note(err: BaseException, note: str) -> None:
    """``err.add_note(note)`` (Python 3.11+); on 3.10 the note is kept in
    ``err.__notes__`` as PEP 678 defines it (3.10's traceback does not print it)."""
    if hasattr(err, "add_note"):
        err.add_note(note)
    else:
        err.__notes__ = [*getattr(err, "__notes__", []), note]  # type: ignore[attr-defined]  # PEP 678, 3.11+ stubs
