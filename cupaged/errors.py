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
