"""The flags of Megatron-LM's own GPT / Llama launch scripts (tests/data/megatron_lm_scripts/)
parse, and each acts, is a documented no-op, or is refused in one line that says why.

Per script: every flag is known to the parser; a ``noop`` flag's help is the parser's NOOP text
and an acting flag's is not; the script's acting and no-op flags validate together (on a CPU-only
machine without the ``act-cuda`` ones, which are then each refused); each ``refuse`` flag added
to them stops the parse with one line naming the flag.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

from megatron.training.arguments import parse_args
from megatron.training.arguments.parser import NOOP, build_parser

SCRIPTS_DIR = Path(__file__).parent / "data" / "megatron_lm_scripts"
SCRIPTS = sorted(p.name for p in SCRIPTS_DIR.glob("*.txt"))
VERDICTS = ("act", "act-cuda", "noop", "refuse")


def _load(name: str) -> Tuple[int, List[Tuple[str, List[str]]]]:
    """(world size, [(verdict, [flag, values...])]) of one fixture."""
    world, lines = 1, []
    for raw in (SCRIPTS_DIR / name).read_text().splitlines():
        if raw.startswith("# world-size:"):
            world = int(raw.split(":")[1])
        if not raw.strip() or raw.startswith("#"):
            continue
        verdict, *tokens = shlex.split(raw)
        assert verdict in VERDICTS and tokens[0].startswith("--"), raw
        lines.append((verdict, tokens))
    return world, lines


def _paths(tmp_path: Path) -> Dict[str, str]:
    """The placeholders' values: files and folders the validation looks for."""
    for name in ("data.bin", "data.idx", "vocab.json", "merges.txt"):
        (tmp_path / name).write_text("")
    (tmp_path / "tokenizer").mkdir()
    return {"$DATA": str(tmp_path / "data"), "$VOCAB": str(tmp_path / "vocab.json"),
            "$MERGE": str(tmp_path / "merges.txt"), "$TOKENIZER": str(tmp_path / "tokenizer"),
            "$CKPT": str(tmp_path / "ckpt"), "$TB": str(tmp_path / "tb"),
            "$CACHE": str(tmp_path / "cache")}


def _argv(lines, verdicts, paths: Dict[str, str]) -> List[str]:
    return [paths.get(t, t) for verdict, tokens in lines if verdict in verdicts for t in tokens]


def _refusal(argv: List[str], capsys) -> str:
    """The parser's error line for ``argv`` (which must be refused)."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1]


@pytest.fixture
def script_env(monkeypatch):
    def setup(world: int) -> None:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", "0")   # errors print at once (other ranks wait first)
    return setup


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_is_known_and_noops_are_documented(script: str) -> None:
    actions = build_parser()._option_string_actions
    _, lines = _load(script)
    for verdict, tokens in lines:
        flag = tokens[0]
        assert flag in actions, f"{script}: {flag} is not a flag of this trainer"
        is_noop = NOOP in (actions[flag].help or "")
        assert is_noop == (verdict == "noop"), f"{script}: {flag} ({verdict}) help: " \
                                               f"{actions[flag].help!r}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_validates_and_refusals_say_why(script: str, tmp_path: Path, capsys,
                                               script_env) -> None:
    world, lines = _load(script)
    script_env(world)
    paths = _paths(tmp_path)
    cuda = torch.cuda.is_available()
    ok = ("act", "noop") + (("act-cuda",) if cuda else ())
    base = _argv(lines, ok, paths)
    args = parse_args(base)
    assert args.world_size == world and args.train_iters > 0

    refused = [(v, tokens) for v, tokens in lines if v == "refuse" or (v == "act-cuda" and not cuda)]
    for verdict, tokens in refused:
        line = _refusal(base + [paths.get(t, t) for t in tokens], capsys)
        assert "error:" in line, line
        if verdict == "refuse":
            assert tokens[0].split("=")[0] in line or "--fp8-" in line, (tokens, line)
        else:   # CUDA-only: says it needs CUDA (or what stands in for it)
            assert "cuda" in line.lower() or "CPU" in line, (tokens, line)


def test_fp8_refusal_names_transformer_engine(tmp_path: Path, capsys, script_env) -> None:
    script_env(1)
    line = _refusal(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                     "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "2",
                     "--lr", "1e-3", "--mock-data", "--device", "cpu", "--fp8-format", "hybrid"],
                    capsys)
    assert "--fp8-format" in line and "Transformer Engine" in line


def test_counts_per_script() -> None:
    """The fixtures hold what the report counts: every script has acting flags, and the counts
    add up to the flags listed."""
    for script in SCRIPTS:
        _, lines = _load(script)
        counts = {v: sum(1 for verdict, _ in lines if verdict == v) for v in VERDICTS}
        assert sum(counts.values()) == len(lines) and counts["act"] > 20, (script, counts)


def test_llama3_8b_script_flags_act(tmp_path: Path, script_env) -> None:
    """What the Llama 3 8B script's acting flags set: the sample-based schedule, per-token loss,
    the decoupled learning rate, fp32 softmax, no memory-mapped data files."""
    from megatron.training.model.config_builders import (build_optimizer_config,
                                                         build_transformer_config)

    world, lines = _load("train_llama3_8b_h100_fp8.txt")
    script_env(world)
    args = parse_args(_argv(lines, ("act", "noop"), _paths(tmp_path)) + ["--device", "cpu"])
    assert args.train_iters == 1953125000 // 128
    assert (args.lr_decay_steps, args.lr_warmup_steps) == (1949218748, 3906252)
    assert args.mmap_bin_files is False and args.data_parallel_size == 8
    assert build_transformer_config(args).calculate_per_token_loss
    oc = build_optimizer_config(args)
    assert (oc.decoupled_lr, oc.decoupled_min_lr) == (5.0e-4, 4.5e-5)


def test_old_attention_spellings(script_env, capsys) -> None:
    script_env(1)
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
            "--mock-data", "--device", "cpu", "--attention-dropout", "0"]
    assert parse_args(base + ["--use-flash-attn"]).attention_backend == "flash"
    a = parse_args(base + ["--transformer-impl", "local", "--attention-softmax-in-fp32"])
    assert a.attention_backend == "local" and a.attention_impl == "local"
    from megatron.training.model.config_builders import build_transformer_config

    assert build_transformer_config(a).attention_softmax_in_fp32
    # megatron-core's default (fp32 softmax) holds without the flag too: the baseline unchanged
    assert build_transformer_config(parse_args(base)).attention_softmax_in_fp32
    line = _refusal(base + ["--use-flash-attn", "--attention-backend", "unfused"], capsys)
    assert "--use-flash-attn means --attention-backend flash, not unfused" in line


def test_wandb_entity_reaches_wandb(monkeypatch, tmp_path: Path, script_env) -> None:
    import sys
    import types

    from megatron.training.logging_utils import MetricsLogger

    script_env(1)
    seen = {}
    import importlib.machinery

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)   # "installed"
    fake.init = lambda **kw: seen.update(kw) or types.SimpleNamespace(log=None, finish=None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                       "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "2",
                       "--lr", "1e-3", "--mock-data", "--device", "cpu", "--wandb-project", "p",
                       "--wandb-entity", "my-team", "--wandb-save-dir", str(tmp_path)])
    MetricsLogger(args, active=True)
    assert (seen["project"], seen["entity"]) == ("p", "my-team")
