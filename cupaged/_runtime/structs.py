"""Kernel arguments passed by value as a C struct, on both backends.

One field table (``Field``: name, C type, comment) gives the C declaration
(``c_struct``, written into a generated header beside the kernels) and the
NumPy structured dtype that packs the same bytes (``struct_dtype``: C
alignment, pointers as uint64 device addresses).

A launch passes a ``StructArg``: the packed value (a structured NumPy
scalar, ``np.void``, of exactly the struct's size) plus the arrays its
pointer fields address. Both backends pass the value's bytes as the
parameter (``gpu.pack_args``; ``cpu.CpuFunction.bind`` checks the size
against the compiled kernel's parameter) and keep the arrays alive with the
argument, as they do for array arguments (a captured graph keeps them). A
bare structured scalar is accepted too; then nothing is kept alive by it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

# C types a struct field may have (besides pointers) -> NumPy type.
_SCALARS: dict[str, type[np.number]] = {"u32": np.uint32, "int": np.int32, "u64": np.uint64, "float": np.float32}


@dataclass(frozen=True)
class Field:
    """One field of a kernel argument struct: ``name``, ``ctype`` as the C
    header spells it (a pointer such as ``"const float*"``, or one of
    ``u32``, ``int``, ``u64``, ``float``) and a comment for the header."""

    name: str
    ctype: str
    doc: str

    @property
    def pointer(self) -> bool:
        return self.ctype.endswith("*")

    @property
    def np_type(self) -> type[np.number]:
        if self.pointer:
            return np.uint64  # a device address
        try:
            return _SCALARS[self.ctype]
        except KeyError:
            raise ValueError(f"field {self.name}: C type {self.ctype!r} has no NumPy counterpart") from None


def struct_dtype(fields: Iterable[Field]) -> np.dtype:
    """The NumPy structured dtype with the C layout of ``fields`` (C
    alignment: ``align=True``)."""
    return np.dtype([(f.name, f.np_type) for f in fields], align=True)


def c_struct(name: str, fields: Iterable[Field], restrict: bool = True) -> str:
    """The C declaration of struct ``name`` with ``fields`` (pointers
    ``__restrict__`` when ``restrict``), followed by a static_assert of its
    size against ``struct_dtype(fields)``."""
    dt = struct_dtype(fields)
    lines = [f"struct {name} {{"]
    for f in fields:
        decl = f"{f.ctype} __restrict__ {f.name};" if f.pointer and restrict else f"{f.ctype} {f.name};"
        lines.append(f"    {decl:<44}// {f.doc}" if f.doc else f"    {decl}")
    lines.append("};")
    lines.append(
        f'static_assert(sizeof({name}) == {dt.itemsize}, "{name}: the NumPy dtype packs {dt.itemsize} bytes");'
    )
    return "\n".join(lines) + "\n"


class StructArg:
    """A struct kernel argument: ``value``, a structured NumPy scalar
    (``np.void``) holding the struct's bytes, and ``refs``, the arrays its
    pointer fields address (kept alive with the argument)."""

    __slots__ = ("value", "refs")

    def __init__(self, value: object, refs: Iterable[Any] = ()) -> None:
        if not isinstance(value, np.void) or value.dtype.names is None:
            raise TypeError(f"value: expected a structured NumPy scalar (np.void), got {type(value).__name__}")
        self.value = value
        self.refs = tuple(refs)

    @property
    def nbytes(self) -> int:
        return self.value.dtype.itemsize

    def __getitem__(self, name: str) -> Any:
        """A field's value (``arg["q_begin"]``)."""
        return self.value[name]

    def __repr__(self) -> str:
        return f"StructArg({self.value.dtype.itemsize} bytes, {len(self.refs)} arrays)"
