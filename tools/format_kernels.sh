#!/usr/bin/env bash
# clang-format (.clang-format) over the CUDA C of kernels_cu/ and tests' kernels.
#   bash tools/format_kernels.sh           rewrite the files in place
#   bash tools/format_kernels.sh --check   list files that differ; exit 1 if any
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files 'kernels_cu/*.cu' 'kernels_cu/*.cuh' 'kernels_cu/**/*.cu' 'kernels_cu/**/*.cuh' \
        'kernels_cu/shim/*.h' 'kernels_cu/shim/*.hpp' 'kernels_cu/shim/*.cpp' 'tests/runtime/kernels/*.cu' | sort -u)
if [ "${1:-}" = "--check" ]; then
  bad=0
  for f in $files; do
    if ! clang-format --style=file "$f" | cmp -s - "$f"; then echo "not formatted: $f"; bad=1; fi
  done
  [ $bad = 0 ] && echo "clang-format: $(echo "$files" | wc -w) files formatted"
  exit $bad
fi
clang-format --style=file -i $files
