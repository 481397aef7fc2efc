#!/usr/bin/env python3
"""Benchmark-only launcher: ``pretrain_gpt.py`` with a ring-volume gradient reduce-scatter on gloo.

    torchrun ... bench/emulated_network/pretrain_a2a_rs.py --rs-algo ring [--rs-async thread] \\
        <pretrain_gpt.py flags>

``--rs-algo a2a`` (default) or ``ring`` selects the exact reduce-scatter of ``ring_volume_rs.py``
that replaces gloo's all-reduce-based one in megatron-core's gradient sync; ``--rs-async thread``
(default) or ``sync`` says how the calls megatron-core makes with ``async_op=True``
(``--overlap-grad-reduce``) are served: on a worker thread, overlapping the backward pass, or
synchronously (see ``ring_volume_rs``). ``--rs-script tools/planner.py`` runs the planner instead
of ``pretrain_gpt.py`` (``--measure`` then times this reduce-scatter, the one the run calls).
Works with fp32 and bf16 (``--grad-reduce-in-bf16``) gradient buffers. Every other flag goes to
``pretrain_gpt.py`` unchanged. Prints one ``[ring_volume_rs] ... calls=N ... async_calls=M`` line
per rank at the end, so a run can show that the replacement was used. Not for training: benchmark baselines only.
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

_OPTS = {"--rs-algo": ("a2a", ring_volume_rs.ALGOS),
         "--rs-async": ("thread", ring_volume_rs.ASYNC_MODES),
         "--rs-script": ("pretrain_gpt.py", ("pretrain_gpt.py", "tools/planner.py"))}


def parse_launcher_args(argv):
    """({'--rs-algo': X, '--rs-async': Y}, remaining argv) -- the launcher's own flags
    (``--flag V`` or ``--flag=V``) removed, everything else kept in order."""
    vals = {k: default for k, (default, _) in _OPTS.items()}
    rest, i = [], 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in _OPTS:
            if "=" in a:
                vals[name], i = a.split("=", 1)[1], i + 1
            else:
                if i + 1 >= len(argv):
                    raise SystemExit(f"{name} needs a value")
                vals[name], i = argv[i + 1], i + 2
            continue
        rest.append(a)
        i += 1
    for name, (_, choices) in _OPTS.items():
        if vals[name] not in choices:
            raise SystemExit(f"{name} must be one of {choices}, got {vals[name]!r}")
    return vals, rest


def split_argv(argv):
    """(algo, remaining argv) -- ``--rs-algo X`` / ``--rs-algo=X`` (and ``--rs-async``) removed."""
    vals, rest = parse_launcher_args(argv)
    return vals["--rs-algo"], rest


def main(argv=None) -> int:
    vals, rest = parse_launcher_args(list(sys.argv[1:] if argv is None else argv))
    ring_volume_rs.install(vals["--rs-algo"], async_mode=vals["--rs-async"])
    if vals["--rs-script"] == "tools/planner.py":   # --measure with this reduce-scatter
        sys.path.insert(0, os.path.join(REPO, "tools"))
        import planner as script
    else:
        import pretrain_gpt as script

    try:
        return script.main(rest)
    finally:
        print(ring_volume_rs.summary() + f" rank={os.environ.get('RANK', '?')}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
