#!/usr/bin/env bash
# The project's test command (README "Run the tests"; .ci/run calls exactly this).
# Installs missing dependencies, then runs the whole pytest suite on the CPU. The Triton kernels
# are exercised under TRITON_INTERPRET=1 by the tests that need it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/ensure_deps.sh
exec python3 -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
