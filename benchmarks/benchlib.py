"""Shared pieces of the benchmark scripts: backends (GPU through CuPy with
CUDA-event timing and an L2 flush; CPU smoke mode), dtype lookup, a measured
device-to-device copy bandwidth, and table printing."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

# The source tree these scripts live in wins over an installed cupaged (which
# may be an older copy).
_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "cupaged" / "__init__.py").is_file():
    sys.path.insert(0, str(_ROOT))


class Gpu:
    name = "gpu"

    def __init__(self, flush: bool = True):
        import cupy

        self.cp = cupy
        # All work on one non-default stream made current for the process: CUDA
        # cannot capture the legacy default stream (bench_decode's graphs).
        self.stream = cupy.cuda.Stream(non_blocking=True).use()
        self.flush_buf = cupy.empty(256 << 20, np.uint8) if flush else None
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        self.device = f"{props['name'].decode()} (device {dev.id})"
        self.sms = int(props["multiProcessorCount"])

    def asarray(self, a):
        return self.cp.asarray(a)

    def empty(self, shape, dtype):
        return self.cp.empty(shape, dtype)

    def random(self, shape, dtype, rng_seed: int = 0):
        """Standard normal data of ``dtype`` made on the device."""
        g = self.cp.random.default_rng(rng_seed)
        x = g.standard_normal(shape, dtype=np.float32)
        return x.astype(dtype)

    def sync(self):
        self.cp.cuda.get_current_stream().synchronize()

    def time(self, fn, reps: int, warmup: int) -> float:
        """Median seconds of ``fn`` over CUDA-event-timed single runs."""
        cp = self.cp
        for _ in range(warmup):
            fn()
        times = []
        start, end = cp.cuda.Event(), cp.cuda.Event()
        for _ in range(reps):
            if self.flush_buf is not None:
                self.flush_buf.fill(1)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e-3)
        return statistics.median(times)

    def memcpy(self, nbytes: int):
        """A function doing one device-to-device copy of ``nbytes``."""
        src, dst = self.cp.empty(nbytes, np.uint8), self.cp.empty(nbytes, np.uint8)
        src.fill(3)
        stream = self.cp.cuda.get_current_stream()
        return lambda: dst.data.copy_from_device_async(src.data, nbytes, stream)


class Cpu:
    name = "cpu"
    device = "CPU backend (kernels through the g++ shim; timings say nothing about a GPU)"
    sms = 2

    def asarray(self, a):
        return np.ascontiguousarray(a)

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def random(self, shape, dtype, rng_seed: int = 0):
        return np.random.default_rng(rng_seed).standard_normal(shape).astype(dtype)

    def sync(self):
        pass

    def time(self, fn, reps: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def memcpy(self, nbytes: int):
        src, dst = np.full(nbytes, 3, np.uint8), np.empty(nbytes, np.uint8)
        return lambda: np.copyto(dst, src)


def backend(cpu: bool, flush: bool = True):
    """The GPU backend, or the CPU one with ``cpu``; exits with a message when
    a GPU is asked for and none is usable."""
    if cpu:
        return Cpu()
    try:
        import cupy

        if not cupy.cuda.is_available():
            raise RuntimeError("cupy.cuda.is_available() is False")
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"no usable GPU ({type(e).__name__}: {e}); use --cpu for a smoke run") from None
    return Gpu(flush)


def dtype_of(name: str, be) -> np.dtype:
    import ml_dtypes

    dt = np.dtype({"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}[name])
    if be.name == "gpu":
        try:
            be.empty(1, dt)
        except Exception as e:  # a CuPy without bfloat16: the same bytes as float16
            print(f"note: this CuPy cannot allocate {dt.name} ({type(e).__name__}); timing float16, same bytes")
            dt = np.dtype(np.float16)
    return dt


def copy_bandwidth(be, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Measured device-to-device copy bandwidth in bytes/s, counting the
    bytes read plus the bytes written (2 x nbytes per copy)."""
    t = be.time(be.memcpy(nbytes), reps, 3)
    return 2 * nbytes / t


class Modeler:
    """The performance model's figure for each measured case, printed beside
    it (``python -m cupaged.tools.perf_model``; every ``modeled_*`` column is
    modeled, not measured). On a GPU the arch is the device's (or the closest
    modeled one); on the CPU backend the target, sm_90 (H200). Any failure
    (no NVRTC, ...) gives "n/a" and one note; timings are never affected."""

    def __init__(self, be, enabled: bool = True):
        self.enabled = enabled
        self.note = ""
        self.arch = "sm_90"
        self._warned = False
        if not enabled:
            return
        try:
            from cupaged.tools import perf_model

            self._pm = perf_model
            if be.name == "gpu":
                cc = be.cp.cuda.Device().compute_capability  # "90"
                self.arch, self.note = perf_model.arch_for(int(cc[:-1]), int(cc[-1]))
            else:
                self.note = "CPU backend run: modeled for the target GPU"
        except Exception as e:  # noqa: BLE001
            self.enabled, self.note = False, f"model unavailable ({type(e).__name__}: {e})"

    def legend(self) -> str:
        if not self.enabled:
            return f"modeled_*: n/a ({self.note or '--no-model'})"
        from cupaged.tools import archs

        a = archs.get(self.arch)
        return (
            f"modeled_*: MODELED by cupaged.tools.perf_model for {self.arch} ({a.device}; copy "
            f"{a.copy_bw / 1e12:.1f} TB/s assumed), not measured" + (f"; {self.note}" if self.note else "")
        )

    def _fail(self, e) -> dict:
        if not self._warned:
            print(f"note: modeled column n/a ({type(e).__name__}: {e})", file=sys.stderr)
            self._warned = True
        return {"modeled_ms": "n/a"}

    def shape(self, **kw) -> dict:
        """Modeled columns of one case: ``Shape`` fields (batch, ctx, new, hq,
        hkv, d, dv, rot, page, dtype, metric, layers, model_cfg)."""
        if not self.enabled:
            return {}
        try:
            row = self._pm.model_shape(self._pm.Shape("bench", "bench case", **kw), self.arch)
        except Exception as e:  # noqa: BLE001
            return self._fail(e)
        if row.status != "ok":
            return {"modeled_ms": f"n/a ({row.status})"}
        out = {"modeled_ms": f"{row.time_s * 1e3:.3f}", "modeled_bound": row.binding.split(" (")[0].replace(" ", "")}
        if row.tokens_per_s is not None:
            out["modeled_tokens_per_s"] = f"{row.tokens_per_s:.0f}"
        elif row.tflops is not None:
            out["modeled_TFLOPs"] = f"{row.tflops:.1f}"
        if row.gbps is not None and row.tokens_per_s is None:
            out["modeled_GBps"] = f"{row.gbps:.0f}"
            out["modeled_pct_copy"] = f"{100 * row.gbps * 1e9 / self.copy_bw():.0f}%"
        return out

    def copy_bw(self) -> float:
        from cupaged.tools import archs

        return archs.get(self.arch).copy_bw

    def copy(self, nbytes: float) -> dict:
        """A kernel that moves ``nbytes`` (read + write) at the modeled copy
        bandwidth, at least one launch (append, copy-on-write)."""
        if not self.enabled:
            return {}
        try:
            from cupaged.tools import archs

            a = archs.get(self.arch)
            t = max(nbytes / a.copy_bw, a.launch_us * 1e-6)
        except Exception as e:  # noqa: BLE001
            return self._fail(e)
        return {
            "modeled_ms": f"{t * 1e3:.4f}",
            "modeled_GBps": f"{nbytes / t / 1e9:.0f}",
            "modeled_bound": "launch" if t > nbytes / a.copy_bw else "HBM",
        }


def table(rows: list[dict], cols: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    lines = ["  ".join(c.rjust(widths[c]) for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).rjust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)
