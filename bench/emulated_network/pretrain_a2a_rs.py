#!/usr/bin/env python3
"""Benchmark-only launcher: ``pretrain_gpt.py`` with a ring-volume gradient reduce-scatter on gloo.

    torchrun ... bench/emulated_network/pretrain_a2a_rs.py --rs-algo a2a  <pretrain_gpt.py flags>

``--rs-algo a2a`` (default) or ``ring`` selects the exact reduce-scatter of ``ring_volume_rs.py``
that replaces gloo's all-reduce-based one in megatron-core's gradient sync; every other flag goes
to ``pretrain_gpt.py`` unchanged. Prints one ``[ring_volume_rs] ... calls=N`` line per rank at the
end, so a run can show that the replacement was used. Not for training: benchmark baselines only.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
for p in (HERE, REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

import ring_volume_rs  # noqa: E402


def split_argv(argv):
    """(algo, remaining argv) -- ``--rs-algo X`` / ``--rs-algo=X`` removed."""
    algo, rest, i = "a2a", [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--rs-algo":
            if i + 1 >= len(argv):
                raise SystemExit("--rs-algo needs a value")
            algo, i = argv[i + 1], i + 2
            continue
        if a.startswith("--rs-algo="):
            algo = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    if algo not in ring_volume_rs.ALGOS:
        raise SystemExit(f"--rs-algo must be one of {ring_volume_rs.ALGOS}, got {algo!r}")
    return algo, rest


def main(argv=None) -> int:
    algo, rest = split_argv(list(sys.argv[1:] if argv is None else argv))
    ring_volume_rs.install(algo)
    import pretrain_gpt

    try:
        return pretrain_gpt.main(rest)
    finally:
        print(ring_volume_rs.summary() + f" rank={os.environ.get('RANK', '?')}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
