"""Write the kernel headers generated from Python definitions.

    python -m cupaged.tools.gen_headers [--check]

Each fact shared by Python and CUDA is defined once in Python and reaches
the kernels as a generated header, committed beside the kernels so readers
see it. ``--check`` writes nothing and exits 1 when a committed header
differs from what its generator gives (the test suite runs the same check).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import layout
from .._runtime.source import kernel_dir
from ..ops import append as append_op
from ..ops.attention import params as attention_params
from ..ops.attention.kernels import geometry

#: kernels_cu-relative path -> generator of its text.
GENERATED = {
    "plan_words.cuh": layout.plan_words_header,
    attention_params.HEADER_PATH: attention_params.header,
    append_op.HEADER_PATH: append_op.header,
    geometry.HEADER_PATH: geometry.header,
}


def stale() -> list[str]:
    """Generated headers whose committed text differs from the generator's."""
    return [
        rel
        for rel, gen in GENERATED.items()
        if not (kernel_dir() / rel).is_file() or (kernel_dir() / rel).read_text() != gen()
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupaged.tools.gen_headers", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only report stale headers (exit 1 if any)")
    args = p.parse_args(argv)
    if args.check:
        bad = stale()
        for rel in bad:
            print(f"stale: kernels_cu/{rel} (run python -m cupaged.tools.gen_headers)")
        return 1 if bad else 0
    for rel, gen in GENERATED.items():
        path = kernel_dir() / rel
        path.write_text(gen())
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
