"""Checkpoints: a Hugging Face model folder (``config.json`` and the
``*.safetensors`` files ``save_pretrained`` writes, sharded or not) or an
in-memory state dict, as one name -> host array mapping.

Safetensors files are read through a NumPy memory map: the format is an
8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and byte range) and the raw little-endian data, so every tensor is a
zero-copy view of the mapped file (bfloat16 as ``ml_dtypes.bfloat16``, which
the safetensors package's NumPy API cannot return). The header is checked in
full before anything is mapped: a known dtype, a byte range of exactly
shape x itemsize, ranges in order inside the file; a truncated file names
the tensor that runs past its end.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import CheckpointError

#: safetensors dtype names -> NumPy dtypes.
SAFETENSORS_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
#: Largest JSON header read (the format's own limit is 100 MB).
MAX_HEADER = 100 << 20


class SafetensorsFile:
    """One safetensors file, checked and memory-mapped: ``names``,
    ``info(name)`` -> (dtype, shape), ``get(name)`` -> a read-only view."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path}: truncated: {size} bytes; a safetensors file starts with "
                                          f"an 8-byte header length")
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER:
                    raise CheckpointError(f"{self.path}: not a safetensors file: header length {n} bytes "
                                          f"(at most {MAX_HEADER})")
                if 8 + n > size:
                    raise CheckpointError(f"{self.path}: truncated: the header needs {8 + n} bytes, the file has "
                                          f"{size}")
                text = fh.read(n)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read: {e}") from None
        try:
            header = json.loads(text.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: not a safetensors file: its header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: not a safetensors file: its header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        data = size - 8 - n
        self._start = 8 + n
        self._tensors: dict[str, tuple] = {}
        for name, info in header.items():
            if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
                raise CheckpointError(f"{self.path}: tensor {name!r}: expected dtype, shape and data_offsets in the "
                                      f"header, got {info!r}")
            dt = SAFETENSORS_DTYPES.get(info["dtype"])
            if dt is None:
                raise CheckpointError(f"{self.path}: tensor {name!r}: dtype {info['dtype']!r} is not supported "
                                      f"(known: {', '.join(SAFETENSORS_DTYPES)})")
            shape, offs = info["shape"], info["data_offsets"]
            if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                    and isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                    and 0 <= offs[0] <= offs[1]):
                raise CheckpointError(f"{self.path}: tensor {name!r}: malformed shape {shape!r} or data_offsets "
                                      f"{offs!r}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if offs[1] - offs[0] != nbytes:
                raise CheckpointError(f"{self.path}: tensor {name!r}: {info['dtype']} {shape} needs {nbytes} bytes, "
                                      f"its data_offsets {offs} span {offs[1] - offs[0]}")
            if offs[1] > data:
                raise CheckpointError(f"{self.path}: truncated: tensor {name!r} ends at data byte {offs[1]}, the "
                                      f"file holds {data} data bytes ({size} bytes in all)")
            self._tensors[name] = (dt, tuple(shape), offs[0], offs[1])
        self._map = None

    @property
    def names(self):
        return self._tensors.keys()

    def info(self, name: str) -> tuple:
        dt, shape, _, _ = self._tensors[name]
        return dt, shape

    def get(self, name: str) -> np.ndarray:
        """A read-only view of tensor ``name`` in the memory-mapped file (a
        copy only when its bytes are not aligned to its item size)."""
        dt, shape, a, b = self._tensors[name]
        if b == a:
            return np.zeros(shape, dt)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._map[self._start + a:self._start + b]
        if (self._start + a) % dt.itemsize:
            raw = raw.copy()
        return raw.view(dt).reshape(shape)


class Checkpoint:
    """Tensors by name from safetensors files or a state dict, all host
    (NumPy) arrays. ``get(name, shape)`` checks presence and shape."""

    def __init__(self, tensors: dict, where: str, files=()):
        self._tensors = tensors          # name -> (source, key): SafetensorsFile or a dict of arrays
        self.where = where
        self.files = tuple(files)

    @staticmethod
    def read_config(path) -> dict:
        """The ``config.json`` dict of a model folder."""
        root = Path(path)
        if not root.is_dir():
            raise CheckpointError(f"path: expected a model folder (config.json and *.safetensors), got {str(path)!r}"
                                  f"{' (no such folder)' if not root.exists() else ' (not a folder)'}")
        cfg_path = root / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{root}: missing config.json (a folder written by save_pretrained has one)")
        try:
            return json.loads(cfg_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{cfg_path}: not readable JSON: {e}") from None

    @classmethod
    def from_folder(cls, path) -> "Checkpoint":
        """The tensors of every ``*.safetensors`` file of a model folder
        (``model.safetensors.index.json``, when present, must name only files
        that exist); each file's header is checked, no data is read."""
        root = Path(path)
        files = sorted(root.glob("*.safetensors"))
        index = root / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text()).get("weight_map", {})
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
                raise CheckpointError(f"{index}: not a readable index: {e}") from None
            missing = sorted({f for f in weight_map.values() if not (root / f).is_file()})
            if missing:
                raise CheckpointError(f"{root}: missing safetensors shard(s) {', '.join(missing)} named by "
                                      f"{index.name}")
        if not files:
            others = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
            hint = f" (found {', '.join(others)}: save with save_pretrained(safe_serialization=True))" if others \
                else ""
            raise CheckpointError(f"{root}: missing weights: no *.safetensors file{hint}")
        tensors: dict = {}
        for p in files:
            st = SafetensorsFile(p)
            for name in st.names:
                tensors.setdefault(name, (st, name))
        return cls(tensors, str(root), files)

    @classmethod
    def from_state_dict(cls, state: dict, where: str = "state dict") -> "Checkpoint":
        """A checkpoint of host arrays (NumPy arrays, or torch tensors, which
        are copied to the host; bfloat16 through its int16 view)."""
        arrays = {}
        for name, t in state.items():
            arrays[name] = ({name: t}, name)
        return cls(arrays, where)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self):
        return self._tensors.keys()

    def get(self, name: str, shape=None) -> np.ndarray:
        """The host array of tensor ``name``; CheckpointError when it is
        missing or not of ``shape``."""
        entry = self._tensors.get(name)
        if entry is None:
            raise CheckpointError(f"{self.where}: missing tensor {name!r}")
        src, key = entry
        a = src.get(key) if isinstance(src, SafetensorsFile) else _host(src[key])
        if shape is not None and tuple(a.shape) != tuple(shape):
            raise CheckpointError(f"{self.where}: tensor {name!r}: expected shape {list(shape)}, got {list(a.shape)}")
        return a

    def dtype_of(self, name: str) -> np.dtype:
        entry = self._tensors.get(name)
        if entry is None:
            raise CheckpointError(f"{self.where}: missing tensor {name!r}")
        src, key = entry
        if isinstance(src, SafetensorsFile):
            return src.info(key)[0]
        return _host(src[key]).dtype


def _host(t) -> np.ndarray:
    """A NumPy view or copy of a NumPy array or torch tensor."""
    if isinstance(t, np.ndarray):
        return t
    mod = type(t).__module__
    if mod.startswith("torch"):
        import torch        # only reached with a torch tensor in hand
        t = t.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(t)
