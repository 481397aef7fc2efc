#!/usr/bin/env bash
# Installs what the project needs, only if it is missing, so that the README's two commands
# (quickstart, tests) work on a fresh machine. Sourced or run; safe to repeat.
#
# torch is installed on its own first with an exact pin: on the CPU machines `torch==2.13.0` resolves
# to the local CPU wheel, while an unpinned torch pulled in by another package would fetch a
# multi-GB CUDA build. A GPU machine that already has a working torch keeps it.
set -euo pipefail
PYTHON=${PYTHON:-python3}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  echo "[ensure_deps] installing torch==2.13.0"
  "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
# Every line of requirements.txt (torch aside, handled above) must be installed at a version it
# allows, so a dependency added there can never be missing here (the check reads the file, it
# keeps no list of its own).
if ! "$PYTHON" - "$ROOT/requirements.txt" <<'PY'
import importlib.metadata as md
import sys
try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh virtual environment has pip's vendored copy only
    from pip._vendor.packaging.requirements import Requirement
missing = []
for line in open(sys.argv[1], encoding="utf-8"):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    req = Requirement(line)
    if req.name == "torch" or (req.marker is not None and not req.marker.evaluate()):
        continue
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        missing.append(req.name)
        continue
    if version not in req.specifier:
        missing.append(f"{req.name} {version} (wants {req.specifier})")
if missing:
    print("[ensure_deps] missing: " + ", ".join(missing))
    sys.exit(1)
PY
then
  # without its torch line: the torch installed above (or a GPU machine's CUDA build) stays
  echo "[ensure_deps] installing requirements.txt"
  grep -v '^torch==' "$ROOT/requirements.txt" | "$PYTHON" -m pip install --quiet -r /dev/stdin
fi
# ninja drives torch.utils.cpp_extension, which builds the C++ CPU quantization kernels at first
# use (without it they fall back to the slower torch reference). A system ninja on PATH is fine.
if ! command -v ninja >/dev/null 2>&1 && ! "$PYTHON" -c "import ninja" >/dev/null 2>&1; then
  echo "[ensure_deps] installing ninja"
  "$PYTHON" -m pip install --quiet ninja
fi
