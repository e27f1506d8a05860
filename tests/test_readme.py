"""The README's Python examples run as written (on the CPU backend)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        namespace = {}
        exec(compile(code, str(README), "exec"), namespace)
    out = namespace["out"]
    assert out.shape == (2, 8, 64) and namespace["lse"].shape == (2, 8)
    assert len(namespace["report"].copied_pages) == 1
