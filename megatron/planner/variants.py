"""Which variants the planner compares, with exactly the flags a user would launch them with.

Why the recipe's flags: the SDP4Bit variants are defined once, in ``examples/sdp4bit/common.sh``
(``sdp4bit_variant_args``: the reference scripts' flags); the planner asks that function rather
than keeping a second copy. A run's own quantization flags are removed from its argument list
first, so every variant starts from the same baseline run and differs only by its flags.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple

from megatron.distributed.quant.config import QuantizationConfig

__all__ = ["Variant", "RECIPE_VARIANTS", "recipe_variant_flags", "strip_quantization_flags",
           "recipe_command", "variants_for"]

ROOT = Path(__file__).resolve().parents[2]
COMMON_SH = ROOT / "examples" / "sdp4bit" / "common.sh"

RECIPE_VARIANTS: Tuple[Tuple[str, str, Tuple[str, ...]], ...] = (
    ("baseline", "baseline", ()),
    ("qWD", "qwd", ()),
    ("qW", "qw", ()),
    ("TLq", "tlq", ()),
    ("TLq-HS", "tlq-hs", ()),
    ("SDP4Bit", "sdp4bit", ()),
    ("SDP4Bit+LoCo", "sdp4bit", ("--loco",)),
)
"""(label, the recipe's VARIANT, extra flags)."""


@dataclass(frozen=True)
class Variant:
    """One row of the planner's table."""

    label: str
    argv: Tuple[str, ...]
    """The run's flags with this variant's."""
    args: argparse.Namespace
    quant: QuantizationConfig


def recipe_variant_flags(variant: str) -> List[str]:
    """The flags ``examples/sdp4bit/common.sh`` gives ``VARIANT=variant``."""
    script = f'source {shlex.quote(str(COMMON_SH))}; sdp4bit_variant_args {shlex.quote(variant)}; ' \
             'printf "%s\\n" "${QUANT_ARGS[@]}"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False)
    if out.returncode:
        raise ValueError(f"{COMMON_SH}: variant {variant!r}: {out.stderr.strip()}")
    return [t for t in out.stdout.splitlines() if t]


def _quant_actions() -> List[argparse.Action]:
    from megatron.distributed.quant.arguments import add_quantization_args

    parser = argparse.ArgumentParser(add_help=False)
    add_quantization_args(parser)
    return [a for a in parser._actions if a.option_strings]


def strip_quantization_flags(argv: Sequence[str]) -> List[str]:
    """``argv`` without the quantized layer's flags (and their values)."""
    takes_value = {}
    for action in _quant_actions():
        for opt in action.option_strings:
            takes_value[opt] = action.nargs != 0
    out: List[str] = []
    skip = False
    for tok in argv:
        if skip:
            skip = False
            continue
        opt = tok.split("=", 1)[0]
        if opt in takes_value:
            skip = takes_value[opt] and "=" not in tok
            continue
        out.append(tok)
    return out


def recipe_command(recipe: str, nodes: int, gpus_per_node: int) -> List[str]:
    """``pretrain_gpt.py``'s flags in ``recipe`` (e.g. examples/sdp4bit/run_1.3b.sh) for the
    baseline variant, from its ``ECHO_ONLY=1`` line."""
    import os

    env = dict(os.environ, ECHO_ONLY="1", VARIANT="baseline", NNODES=str(nodes),
               GPUS_PER_NODE=str(gpus_per_node), DATA_PATH="mock")
    out = subprocess.run(["bash", recipe], capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise ValueError(f"{recipe}: ECHO_ONLY=1 failed: {out.stderr.strip()[-400:]}")
    line = [ln for ln in out.stdout.splitlines() if "pretrain_gpt.py" in ln]
    if not line:
        raise ValueError(f"{recipe}: no pretrain_gpt.py command in its ECHO_ONLY=1 output")
    tokens = shlex.split(line[-1])
    return tokens[next(i for i, t in enumerate(tokens) if t.endswith("pretrain_gpt.py")) + 1:]


def parse_run_args(argv: Sequence[str]) -> argparse.Namespace:
    """The trainer's parser on ``argv``, without the launch-time validation (which needs the
    launched world)."""
    from megatron.training.arguments import parse_args

    return parse_args(list(argv), validate=False)


def variants_for(argv: Sequence[str], labels: Sequence[str] = ()) -> List[Variant]:
    """The variants of :data:`RECIPE_VARIANTS` (those in ``labels``, or all) built on ``argv``."""
    known = [label for label, _, _ in RECIPE_VARIANTS]
    unknown = sorted(set(labels) - set(known))
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; choose from {', '.join(known)}")
    base = strip_quantization_flags(argv)
    out = []
    for label, recipe_variant, extra in RECIPE_VARIANTS:
        if labels and label not in labels:
            continue
        full = tuple(base) + tuple(recipe_variant_flags(recipe_variant)) + extra
        args = parse_run_args(full)
        out.append(Variant(label, full, args, QuantizationConfig.from_args(args)))
    return out
