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
if ! "$PYTHON" - <<'PY' >/dev/null 2>&1
import importlib.metadata as md
import megatron.core, tokenizers, transformers, sentencepiece, datasets, pyarrow, tensorboard, matplotlib, pytest, numpy, psutil
assert md.version("megatron-core") == "0.16.1", md.version("megatron-core")
PY
then
  echo "[ensure_deps] installing requirements.txt"
  "$PYTHON" -m pip install --quiet -r "$ROOT/requirements.txt"
fi
# ninja drives torch.utils.cpp_extension, which builds the C++ CPU quantization kernels at first
# use (without it they fall back to the slower torch reference). A system ninja on PATH is fine.
if ! command -v ninja >/dev/null 2>&1 && ! "$PYTHON" -c "import ninja" >/dev/null 2>&1; then
  echo "[ensure_deps] installing ninja"
  "$PYTHON" -m pip install --quiet ninja
fi
