"""Every command in README.md's ```bash blocks runs as written (smaller or dry where needed).

Why: the README is the first thing a user runs; a command that drifted from the code (a renamed
flag, a recipe that needs an unset variable) is a broken promise nobody notices.  Each README
command has an entry in :data:`RUNNERS` saying how it is exercised here, and a README command
without one fails :func:`test_every_readme_command_has_a_runner`.  Commands run in a scratch
directory with the repository's scripts, ``python`` meaning this interpreter; what is made
smaller or dry is said next to each runner.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SMALL_QUICKSTART = {"TRAIN_ITERS": "4", "LOG_INTERVAL": "2", "CORPUS_BYTES": "400000", "VOCAB_SIZE": "1000"}


def readme_commands() -> List[str]:
    """The README's shell commands: ```bash blocks, continuations joined, comments dropped."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(re.sub(r"\s+", " ", line))
    return commands


def _env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHON=sys.executable)
    env.pop("DATA_PATH", None)
    env.update(extra)
    return env


def _run(command: str, cwd: Path, env: Dict[str, str], timeout: int = 600) -> str:
    """Run ``command`` as the README writes it, from ``cwd`` (repo paths made absolute)."""
    argv = shlex.split(command)
    assignments = {}
    while argv and re.match(r"^[A-Z_]+=", argv[0]):
        key, value = argv.pop(0).split("=", 1)
        assignments[key] = value
    argv = [sys.executable if a == "python" else a for a in argv]
    argv = [str(REPO / a) if (REPO / a).is_file() and not (cwd / a).exists() else a for a in argv]
    res = subprocess.run(argv, cwd=cwd, env={**env, **assignments}, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, f"{command}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout + res.stderr


# ----------------------------------------------------------------------------- the runners
def quickstart(command: str, work: Path) -> None:
    """The real script end to end on a smaller corpus and 4 iterations (about a minute)."""
    env = _env(DATA_DIR=str(work / "data"), RUNS_ROOT=str(work / "runs"), **SMALL_QUICKSTART)
    out = _run(command, work, env)
    if command.strip() == "bash examples/quickstart.sh":  # baseline then SDP4Bit, side by side
        assert "| baseline |" in out and "| sdp4bit |" in out and "4.25 |" in out, out[-3000:]
        assert (work / "runs" / "loss.png").stat().st_size > 0
    else:  # one run with the given flags, named after them
        (summary,) = [json.loads(line) for run in (work / "runs").iterdir() if run.is_dir()
                      and run.name.startswith("quantized-weights")
                      for line in (run / "metrics.jsonl").read_text().splitlines()
                      if '"summary"' in line]
        assert summary["quantization"] is True and summary["iterations"] == 4


def planner(command: str, work: Path) -> None:
    """As written: the planner needs no GPU and takes seconds; it must print every variant and a
    recommendation."""
    out = _run(command, work, _env())
    for variant in ("baseline", "SDP4Bit", "TLq-HS", "qWD"):
        assert f"| {variant} |" in out, out[-3000:]
    assert "recommended: " in out


def ci_calls_the_test_command(command: str, work: Path) -> None:
    """Not run from inside the tests it runs: CI's entry point must call exactly this command."""
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(rf"^{re.escape(command)}\s*$", ci, re.M), ci


def recipe_dry_run(command: str, work: Path) -> None:
    """Multi-node recipes: DRY_RUN=1 (parse the recipe, build its config, exit) without data."""
    out = _run(command if command.startswith("DRY_RUN=1") else f"DRY_RUN=1 {command}", work,
               _env())
    assert "DRY_RUN_CONFIGS" in out, out[-2000:]
    if "VARIANT=sdp4bit" in command:   # the variant reaches the trainer's quantization config
        quant = json.loads(out.split("DRY_RUN_QUANT ", 1)[1].splitlines()[0])
        assert quant["quantized_weights"] and quant["quantized_gradients"], quant
        assert quant["hadamard_transform"] and quant["gradient_quantization_bits_inter"] == 4, quant


def preprocess(command: str, work: Path) -> None:
    """The real command on a small corpus and a BPE trained for it, in its relative paths."""
    from tools import train_tokenizer

    (work / "data").mkdir(exist_ok=True)
    texts = [f"document {i}: the quick brown fox jumps over the lazy dog {i * 7}" for i in range(50)]
    with open(work / "corpus.jsonl", "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    vocab, merges, _ = train_tokenizer.train(str(work / "corpus.jsonl"), str(work / "tok"),
                                             vocab_size=300, min_frequency=1)
    os.replace(vocab, work / "vocab.json")
    os.replace(merges, work / "merges.txt")
    _run(command, work, _env())
    assert (work / "data" / "my_text_document.bin").stat().st_size > 0
    assert (work / "data" / "my_text_document.idx").stat().st_size > 0


def _train_tiny(save: Path, extra: List[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--standalone",
           str(REPO / "pretrain_gpt.py"), "--num-layers", "2", "--hidden-size", "64",
           "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
           "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
           "--lr", "1e-3", "--mock-data", "--vocab-size", "128", "--device", "cpu",
           "--eval-iters", "0", "--split", "100,0,0", "--save", str(save), *extra]
    res = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def convert_to_hf(command: str, work: Path) -> None:
    """The GPT command for real on a tiny checkpoint at its path; the Llama one (a 32000-token
    tokenizer directory) parsed by the tool, which tests/test_convert_to_hf.py runs in full."""
    argv = shlex.split(command)[2:]
    if "--tokenizer-dir" in argv:
        from tools.checkpoint import convert_to_hf as tool

        args = tool.build_parser().parse_args(argv)
        assert (args.vocab_size, args.tokenizer_dir) == (32000, "data/llama2-tokenizer")
        return
    load = argv[argv.index("--load") + 1]
    _train_tiny(work / load, [])
    _run(command, work, _env())
    assert (work / argv[argv.index("--output") + 1] / "config.json").is_file()


def continue_pretraining(command: str, work: Path) -> None:
    """examples/continue_pretraining/run.sh as written, 2 iterations: tiny HF Llama -> import ->
    SDP4Bit + LoCo on 2 CPU ranks -> an export that transformers loads."""
    from dist_harness import free_port

    env = _env(WORK=str(work / "work"), TRAIN_ITERS="2", MASTER_PORT=str(free_port()))
    out = _run(command, work, env)
    w = work / "work"
    assert "--mask-padded-vocab-logits" in (w / "imported" / "model_args.txt").read_text()
    assert "iteration        2/       2" in out and "quantization: True" in out, out[-3000:]
    config = json.loads((w / "hf-continued" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "exported LlamaForCausalLM (vocab " in out
    assert config["vocab_size"] == json.loads(
        (w / "hf-tiny-llama" / "config.json").read_text())["vocab_size"]


def plot_logs(command: str, work: Path) -> None:
    """The real command on a JSON-lines log and a tensorboard directory at its paths."""
    from torch.utils.tensorboard import SummaryWriter

    (work / "runs" / "a").mkdir(parents=True)
    with open(work / "runs" / "a" / "metrics.jsonl", "w") as f:
        for it, loss in ((10, 5.0), (20, 4.0)):
            f.write(json.dumps({"type": "train", "iteration": it, "lm_loss": loss}) + "\n")
    writer = SummaryWriter(str(work / "runs" / "b" / "tensorboard"))
    for it, loss in ((10, 5.1), (20, 4.2)):
        writer.add_scalar("lm loss", loss, it)
    writer.close()
    out = _run(command, work, _env())
    assert "| sdp4bit | 20 | 4.2000 |" in out and (work / "loss.png").is_file()


def pip_install_dry(command: str, work: Path) -> None:
    """Dry: pip resolves and builds the project's metadata (``--dry-run --no-deps``), offline."""
    argv = shlex.split(command)
    target = argv[-1]  # "." or ".[gpu]"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
                          "--no-build-isolation", "-e", str(REPO) + target[1:]],
                         cwd=work, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "Would install" in res.stdout, res.stdout + res.stderr


def gpu_selfcheck_without_gpu(command: str, work: Path) -> None:
    """The command as written, on a machine without a GPU: it says so at its first step and
    stops (tests/test_gpu_selfcheck.py runs its --dry-run, which checks every step's command)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the command would run every step")
    res = subprocess.run(command.split(), cwd=REPO, env=_env(SELFCHECK_DIR=str(work / "run")),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "env: FAIL (torch sees no CUDA device" in res.stdout, res.stdout[-3000:]
    assert "stopping: every later step needs a GPU" in res.stdout


RUNNERS: Dict[str, Callable[[str, Path], None]] = {
    "bash examples/quickstart.sh": quickstart,
    "bash scripts/run_tests.sh": ci_calls_the_test_command,
    "bash examples/quickstart.sh --quantized-weights --quantized-gradients --hadamard-transform "
    "--loco": quickstart,
    "bash examples/sdp4bit/run_1.3b.sh": recipe_dry_run,
    "MICRO_BATCH_SIZE=2 python tools/planner.py --recipe examples/sdp4bit/run_1.3b.sh --nodes 16 "
    "--gpus-per-node 8 --inter-gbit 100": planner,
    "VARIANT=sdp4bit bash examples/sdp4bit/run_1.3b.sh": recipe_dry_run,
    "bash examples/loco/run_8b.sh": recipe_dry_run,
    "DRY_RUN=1 bash examples/sdp4bit/run_6.7b.sh": recipe_dry_run,
    "python tools/preprocess_data.py --input corpus.jsonl --json-keys text --output-prefix "
    "data/my --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt "
    "--append-eod --workers 8": preprocess,
    "python tools/checkpoint/convert_to_hf.py --load runs/sdp4bit/gpt-125m-baseline/checkpoints "
    "--output hf/gpt-125m": convert_to_hf,
    "python tools/checkpoint/convert_to_hf.py --load runs/loco/llama-0.8b-loco/checkpoints "
    "--output hf/llama-0.8b --tokenizer-dir data/llama2-tokenizer --vocab-size 32000":
        convert_to_hf,
    "bash examples/continue_pretraining/run.sh": continue_pretraining,
    "python tools/plot_logs.py baseline=runs/a/metrics.jsonl sdp4bit=runs/b/tensorboard "
    "--output loss.png": plot_logs,
    "pip install -e .": pip_install_dry,
    "pip install -e .[gpu]": pip_install_dry,
    "bash scripts/gpu_selfcheck.sh": gpu_selfcheck_without_gpu,
}


def test_every_readme_command_has_a_runner() -> None:
    assert sorted(readme_commands()) == sorted(RUNNERS), (
        "README.md's commands changed: give each new one a runner in RUNNERS")


@pytest.fixture(scope="module")
def quickstart_dir(tmp_path_factory) -> Path:
    """One scratch directory for both quickstart commands, so the corpus, tokenizer and
    .bin/.idx files are built once (the script skips steps whose output exists)."""
    return tmp_path_factory.mktemp("quickstart")


@pytest.mark.parametrize("command", list(RUNNERS))
def test_readme_command_runs(command: str, tmp_path: Path, quickstart_dir: Path) -> None:
    runner = RUNNERS[command]
    runner(command, quickstart_dir if runner is quickstart else tmp_path)
