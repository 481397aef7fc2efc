"""examples/sdp4bit, examples/loco, examples/moe recipes and examples/quickstart.sh.

* every script passes ``bash -n``;
* ECHO_ONLY=1 prints the launch command without running it: the flags are checked exactly
  (model card, variant -> quantization flags, multi-node launcher, pass-through args) and the
  whole argument list is validated with the trainer's own parser;
* DRY_RUN=1 runs ``pretrain_gpt.py --dry-run`` (plain python, no torchrun) and the printed
  JSON config must carry the expected quantization settings;
* the quickstart pipeline runs up to the training call with a stand-in TORCHRUN.
"""

import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SDP = {  # script -> (layers, hidden, heads, lr, min_lr, micro batch)
    "examples/sdp4bit/run_125m.sh": (12, 768, 12, "6e-4", "6e-5", 8),
    "examples/sdp4bit/run_350m.sh": (24, 1024, 16, "3e-4", "3e-5", 8),
    "examples/sdp4bit/run_1.3b.sh": (24, 2048, 16, "2e-4", "2e-5", 4),
    "examples/sdp4bit/run_6.7b.sh": (32, 4096, 32, "1.2e-4", "1.2e-5", 2),
}
LOCO = {  # script -> (layers, hidden, heads, ffn)
    "examples/loco/run_0.8b.sh": (24, 1536, 12, 4096),
    "examples/loco/run_8b.sh": (32, 4096, 32, 11008),
}
MOE = {  # script -> (layers, hidden, heads, query groups, ffn, lr, min lr, micro batch)
    "examples/moe/run_8x0.8b.sh": (24, 2048, 16, 8, 5632, "3e-4", "3e-5", 2),
}
ALL_SCRIPTS = list(SDP) + list(LOCO) + list(MOE) + [
    "examples/sdp4bit/common.sh", "examples/moe/common.sh", "examples/quickstart.sh",
    "examples/sdp4bit/sbatch_elastic.sh"]

QWD = ["--quantized-weights", "--weight-quantization-bits", "4", "--wq-group-size", "2048"]
TLQ = ["--quantized-gradients", "--gq-group-size-inter", "128", "--gradient-quantization-bits-inter", "4",
       "--gq-group-size-intra", "128", "--gradient-quantization-bits-intra", "8"]
VARIANTS = {
    "baseline": [],
    "qwd": QWD,
    "qw": ["--quantized-weights", "--weight-quantization-mode", "direct", "--weight-quantization-bits", "4",
           "--wq-group-size", "2048"],
    "tlq": TLQ,
    "tlq-hs": TLQ + ["--hadamard-transform"],
    "sdp4bit": QWD + TLQ + ["--hadamard-transform"],
    "qwd-tlq": QWD + TLQ,
}
QUANT_FLAGS = {"--quantized-weights", "--quantized-gradients", "--hadamard-transform", "--loco",
               "--weight-quantization-mode"}
LOCO_FLAGS = ["--quantized-gradients", "--gradient-quantization-bits-intra", "4",
              "--gradient-quantization-bits-inter", "4", "--loco", "--loco-error-beta", "0.8",
              "--loco-reset-interval", "1024"]


def _env(**kw):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "NNODES", "NODE_RANK", "GPUS_PER_NODE", "WORLD_SIZE",
                                "RANK", "LOCAL_", "VARIANT", "LOCO", "DATA_PATH", "RUN_DIR", "TORCHRUN",
                                "EP", "TOPK", "NUM_EXPERTS", "GROUPED_GEMM", "TP"))}
    env.update({k: str(v) for k, v in kw.items()})
    return env


def _run(script, *args, timeout=120, **env):
    return subprocess.run(["bash", script, *args], cwd=REPO, env=_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def _echo(script, *args, **env):
    r = _run(script, *args, ECHO_ONLY=1, **env)
    assert r.returncode == 0, r.stderr
    return shlex.split(r.stdout.strip().splitlines()[-1])


def _opt(cmd, flag):
    assert cmd.count(flag) == 1, f"{flag} appears {cmd.count(flag)} times in {cmd}"
    return cmd[cmd.index(flag) + 1]


def _quant_part(cmd):
    """The quantization flags of a command, in order (everything from the first quant flag on,
    minus pass-through / --dry-run)."""
    starts = [i for i, a in enumerate(cmd) if a in QUANT_FLAGS]
    if not starts:
        return []
    return [a for a in cmd[starts[0]:] if a not in ("--dry-run", "--extra-flag-for-test")]


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_bash_syntax(script):
    r = subprocess.run(["bash", "-n", script], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", list(SDP))
def test_sdp4bit_commands(script):
    layers, hidden, heads, lr, min_lr, mbs = SDP[script]
    for variant, flags in VARIANTS.items():
        cmd = _echo(script, "--extra-flag-for-test", VARIANT=variant, DRY_RUN=1, DATA_PATH="mock")
        assert cmd[:2] == ["python", "pretrain_gpt.py"] and cmd[-1] == "--dry-run"
        assert _quant_part(cmd) == flags, variant
        assert cmd[-2] == "--extra-flag-for-test"  # "$@" passed through (last, so it can override)
        assert [_opt(cmd, f) for f in ("--num-layers", "--hidden-size", "--num-attention-heads")] == \
            [str(layers), str(hidden), str(heads)]
        assert (_opt(cmd, "--lr"), _opt(cmd, "--min-lr"), _opt(cmd, "--micro-batch-size")) == (lr, min_lr, str(mbs))
        for flag, value in (("--seq-length", "2048"), ("--global-batch-size", "256"), ("--train-iters", "80000"),
                            ("--lr-decay-iters", "70000"), ("--lr-decay-style", "cosine"),
                            ("--lr-warmup-fraction", "0.01"), ("--adam-beta1", "0.9"), ("--adam-beta2", "0.95"),
                            ("--adam-eps", "1e-8"), ("--weight-decay", "0.1"), ("--clip-grad", "1.0"),
                            ("--recompute-granularity", "selective")):
            assert _opt(cmd, flag) == value, (variant, flag)
        for flag in ("--bf16", "--use-distributed-optimizer", "--recompute-activations",
                     "--no-async-tensor-model-parallel-allreduce", "--mock-data"):
            assert flag in cmd
        assert "--data-path" not in cmd
        assert ("--overlap-grad-reduce" in cmd) == (mbs in (4, 2))  # 1.3B / 6.7B reference scripts
    bad = _run(script, ECHO_ONLY=1, VARIANT="fp4")
    assert bad.returncode != 0 and "unknown VARIANT" in bad.stderr


@pytest.mark.parametrize("script", list(LOCO))
def test_loco_commands(script):
    layers, hidden, heads, ffn = LOCO[script]
    on = _echo(script, DRY_RUN=1, DATA_PATH="mock")  # LOCO=1 is the default
    assert _quant_part(on) == LOCO_FLAGS
    off = _echo(script, LOCO=0, DRY_RUN=1, DATA_PATH="mock")
    assert _quant_part(off) == []
    q4 = _echo(script, LOCO=0, QUANTIZED_GRADIENTS=1, DRY_RUN=1, DATA_PATH="mock")
    assert _quant_part(q4) == LOCO_FLAGS[:5]
    for cmd in (on, off, q4):
        assert [_opt(cmd, f) for f in ("--num-layers", "--hidden-size", "--num-attention-heads",
                                        "--ffn-hidden-size", "--seq-length")] == \
            [str(layers), str(hidden), str(heads), str(ffn), "2048"]
        assert _opt(cmd, "--normalization") == "RMSNorm" and _opt(cmd, "--position-embedding-type") == "rope"
        for flag in ("--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                     "--bf16", "--use-distributed-optimizer"):
            assert flag in cmd
    assert _run(script, ECHO_ONLY=1, LOCO=2).returncode != 0


def test_launcher_multinode_and_data(tmp_path):
    # SLURM: node count/rank from SLURM_*, master = first host of the node list via scontrol.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'gpu-a17\\ngpu-a18\\n'\n")
    (fake / "scontrol").chmod(0o755)
    path = f"{fake}:{os.environ['PATH']}"
    cmd = _echo("examples/sdp4bit/run_1.3b.sh", VARIANT="sdp4bit", PATH=path, SLURM_NNODES=2, SLURM_NODEID=1,
                SLURM_JOB_NODELIST="gpu-a[17-18]", SLURM_GPUS_ON_NODE=4, DATA_PATH="/data/pile_text_document",
                VOCAB_FILE="/v.json", MERGE_FILE="/m.txt")
    assert cmd[0] == "torchrun"
    assert [_opt(cmd, f) for f in ("--nproc-per-node", "--nnodes", "--node-rank", "--master-addr")] == \
        ["4", "2", "1", "gpu-a17"]
    assert _opt(cmd, "--data-path") == "/data/pile_text_document"
    assert (_opt(cmd, "--vocab-file"), _opt(cmd, "--merge-file")) == ("/v.json", "/m.txt")
    assert _opt(cmd, "--tokenizer-type") == "GPT2BPETokenizer"
    assert _opt(cmd, "--save") == "runs/sdp4bit/gpt-1.3b-sdp4bit/checkpoints"
    # explicit variables win over SLURM
    cmd = _echo("examples/loco/run_8b.sh", NNODES=4, NODE_RANK=3, MASTER_ADDR="10.0.0.1", MASTER_PORT=29501,
                GPUS_PER_NODE=8, SLURM_NNODES=2, DATA_PATH="mock", TP=2)
    assert [_opt(cmd, f) for f in ("--nproc-per-node", "--nnodes", "--node-rank", "--master-addr",
                                    "--master-port", "--tensor-model-parallel-size")] == \
        ["8", "4", "3", "10.0.0.1", "29501", "2"]
    # a real run with a missing dataset fails early with a clear message
    r = _run("examples/sdp4bit/run_125m.sh", DATA_PATH=str(tmp_path / "nope"), GPUS_PER_NODE=1)
    assert r.returncode != 0 and "nope.bin not found" in r.stderr


def test_recipe_args_pass_trainer_validation():
    """Every recipe's argument list parses and validates with megatron/training/arguments.py."""
    from megatron.training.arguments import parse_args

    cases = [(s, {"VARIANT": v}) for s in SDP for v in ("baseline", "sdp4bit", "qw")]
    cases += [(s, {"LOCO": l}) for s in LOCO for l in (0, 1)]
    for script, env in cases:
        cmd = _echo(script, DRY_RUN=1, DATA_PATH="mock", **env)
        args = parse_args(cmd[cmd.index("pretrain_gpt.py") + 1:])
        q = args.quant_config
        assert args.num_layers == int(_opt(cmd, "--num-layers"))
        if env.get("VARIANT") == "sdp4bit":
            assert (q.quantized_weights, q.quantized_gradients, q.hadamard_transform) == (True, True, True)
            assert (q.gradient_quantization_bits_intra, q.gradient_quantization_bits_inter) == (8, 4)
            assert (q.gq_group_size_intra, q.gq_group_size_inter, q.wq_group_size) == (128, 128, 2048)
            assert q.weight_quantization_mode == "diff"
        elif env.get("VARIANT") == "qw":
            assert q.quantized_weights and q.weight_quantization_mode == "direct" and not q.quantized_gradients
        elif env.get("LOCO") == 1:
            assert q.loco and q.quantized_gradients and (q.loco_error_beta, q.loco_reset_interval) == (0.8, 1024)
            assert (q.gradient_quantization_bits_intra, q.gradient_quantization_bits_inter) == (4, 4)
        else:
            assert not q.enabled and not q.loco


MOE_ARGS = ["--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "8",
            "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
            "--moe-token-dispatcher-type", "alltoall"]


@pytest.mark.parametrize("script", list(MOE))
def test_moe_commands(script):
    """The Mixtral-style MoE recipe: its model card, the MoE flags, and VARIANT's quantization
    flags exactly as the dense recipes'."""
    layers, hidden, heads, groups, ffn, lr, min_lr, mbs = MOE[script]
    for variant, flags in VARIANTS.items():
        cmd = _echo(script, "--extra-flag-for-test", VARIANT=variant, DRY_RUN=1, DATA_PATH="mock")
        assert cmd[:2] == ["python", "pretrain_gpt.py"] and cmd[-1] == "--dry-run"
        assert _quant_part(cmd) == flags, variant
        assert cmd[-2] == "--extra-flag-for-test"
        i = cmd.index("--num-experts")
        assert cmd[i:i + len(MOE_ARGS)] == MOE_ARGS
        assert [_opt(cmd, f) for f in ("--num-layers", "--hidden-size", "--num-attention-heads",
                                        "--num-query-groups", "--ffn-hidden-size", "--seq-length")] == \
            [str(layers), str(hidden), str(heads), str(groups), str(ffn), "2048"]
        assert (_opt(cmd, "--lr"), _opt(cmd, "--min-lr"), _opt(cmd, "--micro-batch-size")) == (lr, min_lr, str(mbs))
        assert (_opt(cmd, "--normalization"), _opt(cmd, "--position-embedding-type"),
                _opt(cmd, "--rotary-base")) == ("RMSNorm", "rope", "1000000")
        for flag in ("--swiglu", "--group-query-attention", "--untie-embeddings-and-output-weights",
                     "--disable-bias-linear", "--bf16", "--use-distributed-optimizer",
                     "--overlap-grad-reduce", "--mock-data"):
            assert flag in cmd, flag
        for flag in ("--moe-grouped-gemm", "--sequence-parallel", "--data-path"):
            assert flag not in cmd, flag
        assert _opt(cmd, "--save") == f"runs/moe/mixtral-8x0.8b-{variant}/checkpoints"
    # the knobs: EP, top-k, grouped GEMM where installed, TP (with sequence parallelism)
    cmd = _echo(script, EP=4, TOPK=1, GROUPED_GEMM=1, TP=2, DATA_PATH="mock", NNODES=2, GPUS_PER_NODE=8)
    assert cmd[0] == "torchrun" and _opt(cmd, "--nnodes") == "2"
    assert (_opt(cmd, "--expert-model-parallel-size"), _opt(cmd, "--moe-router-topk"),
            _opt(cmd, "--tensor-model-parallel-size")) == ("4", "1", "2")
    assert "--moe-grouped-gemm" in cmd and "--sequence-parallel" in cmd
    for bad, why in (({"VARIANT": "fp4"}, "unknown VARIANT"), ({"GROUPED_GEMM": "yes"}, "GROUPED_GEMM")):
        r = _run(script, ECHO_ONLY=1, DATA_PATH="mock", **bad)
        assert r.returncode != 0 and why in r.stderr, r.stderr


def test_moe_recipe_args_pass_trainer_validation(monkeypatch, capsys):
    """The MoE recipe's argument list parses and validates with the trainer's parser for the
    launch's world: one node of 8 (EP 8, expert-data-parallel 1) and 16 nodes; on fewer ranks
    than EP the trainer refuses it naming the flag."""
    from megatron.training.arguments import parse_args

    for nodes in (1, 16):
        monkeypatch.setenv("WORLD_SIZE", str(8 * nodes))
        for variant in ("baseline", "sdp4bit"):
            cmd = _echo("examples/moe/run_8x0.8b.sh", DRY_RUN=1, DATA_PATH="mock", VARIANT=variant,
                        NNODES=nodes, GPUS_PER_NODE=8)
            args = parse_args(cmd[cmd.index("pretrain_gpt.py") + 1:])
            assert (args.num_experts, args.expert_model_parallel_size, args.moe_router_topk) == (8, 8, 2)
            assert (args.moe_token_dispatcher_type, args.moe_ffn_hidden_size) == ("alltoall", 5632)
            assert args.moe_router_load_balancing_type == "aux_loss" and args.moe_aux_loss_coeff == 0.01
            assert args.quant_config.quantized_gradients == (variant == "sdp4bit")
    monkeypatch.setenv("WORLD_SIZE", "4")
    cmd = _echo("examples/moe/run_8x0.8b.sh", DRY_RUN=1, DATA_PATH="mock")
    with pytest.raises(SystemExit):
        parse_args(cmd[cmd.index("pretrain_gpt.py") + 1:])
    assert "--expert-model-parallel-size 8 does not divide the data-parallel size 4" in \
        capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# DRY_RUN=1: the real pretrain_gpt.py --dry-run
# ------------------------------------------------------------------------------------------------


def _flatten(obj, out):
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, (dict, list)):
                _flatten(v, out)
            else:
                out.setdefault(k, []).append(v)
    elif isinstance(obj, list):
        for v in obj:
            _flatten(v, out)
    return out


def _dry_run_config(output):
    """All key -> [values] found in the JSON objects printed by --dry-run (e.g. lines
    'DRY_RUN_QUANT {...}'); nested configs are flattened."""
    found = {}
    for line in output.splitlines():
        i = line.find("{")
        if i < 0:
            continue
        try:
            obj = json.loads(line[i:])
        except json.JSONDecodeError:
            continue
        _flatten(obj, found)
    return found


DRY_RUN_CASES = [
    ("examples/sdp4bit/run_125m.sh", {"VARIANT": "sdp4bit"},
     {"quantized_weights": True, "quantized_gradients": True, "hadamard_transform": True,
      "weight_quantization_bits": 4, "wq_group_size": 2048, "gradient_quantization_bits_intra": 8,
      "gradient_quantization_bits_inter": 4, "gq_group_size_intra": 128, "num_layers": 12, "hidden_size": 768}),
    ("examples/sdp4bit/run_350m.sh", {"VARIANT": "tlq"},
     {"quantized_gradients": True, "hadamard_transform": False, "quantized_weights": False,
      "gq_group_size_inter": 128, "num_layers": 24, "hidden_size": 1024}),
    ("examples/sdp4bit/run_1.3b.sh", {"VARIANT": "qw"},
     {"quantized_weights": True, "weight_quantization_mode": "direct", "quantized_gradients": False,
      "hidden_size": 2048}),
    ("examples/sdp4bit/run_6.7b.sh", {"VARIANT": "baseline"},
     {"quantized_weights": False, "quantized_gradients": False, "num_layers": 32, "hidden_size": 4096}),
    ("examples/loco/run_0.8b.sh", {"LOCO": "1"},
     {"loco": True, "quantized_gradients": True, "loco_error_beta": 0.8, "loco_reset_interval": 1024,
      "gradient_quantization_bits_intra": 4, "gradient_quantization_bits_inter": 4, "ffn_hidden_size": 4096}),
    ("examples/loco/run_8b.sh", {"LOCO": "0"},
     {"loco": False, "quantized_gradients": False, "ffn_hidden_size": 11008, "num_layers": 32}),
    # the launch's world, not one rank: TP=4 on 2 nodes x 4 GPUs (before: "world size 1 is not
    # divisible by --tensor-model-parallel-size 4")
    ("examples/sdp4bit/run_6.7b.sh", {"VARIANT": "sdp4bit", "TP": "4", "NNODES": "2",
                                      "GPUS_PER_NODE": "4"},
     {"world_size": 8, "data_parallel_size": 2, "tensor_model_parallel_size": 4,
      "quantized_gradients": True}),
    # the MoE recipe on its node of 8: EP 8, expert-data-parallel 1; quantized dense and expert
    # buffers
    ("examples/moe/run_8x0.8b.sh", {"VARIANT": "sdp4bit"},
     {"world_size": 8, "num_moe_experts": 8, "expert_model_parallel_size": 8, "moe_router_topk": 2,
      "moe_token_dispatcher_type": "alltoall", "moe_ffn_hidden_size": 5632,
      "quantized_gradients": True, "quantized_weights": True, "hadamard_transform": True}),
]


def test_dry_run_prints_expected_config():
    def one(case):
        script, env, _ = case
        return _run(script, DRY_RUN=1, DATA_PATH="mock", timeout=300, **env)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, DRY_RUN_CASES))
    for (script, env, expected), r in zip(DRY_RUN_CASES, results):
        assert r.returncode == 0, f"{script} {env}: exit {r.returncode}\n{r.stderr[-3000:]}"
        found = _dry_run_config(r.stdout + "\n" + r.stderr)
        assert found, f"{script}: no JSON config in the dry-run output:\n{r.stdout[-2000:]}"
        for key, value in expected.items():
            assert key in found, f"{script} {env}: {key!r} missing from the dry-run config"
            assert value in found[key], f"{script} {env}: {key}={found[key]}, expected {value!r}"


README_DRY_RUN = "DRY_RUN=1 bash examples/sdp4bit/run_6.7b.sh"
DRY_RUN_MOCK_NOTE = "[recipe] note: DRY_RUN=1 without DATA_PATH: using DATA_PATH=mock"


@pytest.mark.parametrize("script", list(SDP) + list(LOCO) + list(MOE))
def test_dry_run_without_data_path_uses_mock_data(script):
    """DRY_RUN=1 needs no corpus or tokenizer files: with DATA_PATH unset it means mock data."""
    r = _run(script, DRY_RUN=1, ECHO_ONLY=1)  # _env() drops DATA_PATH from the environment
    assert r.returncode == 0, r.stderr
    assert r.stderr.count(DRY_RUN_MOCK_NOTE) == 1, r.stderr
    cmd = shlex.split(r.stdout.strip().splitlines()[-1])
    assert "--mock-data" in cmd and "--data-path" not in cmd
    # an explicit DATA_PATH is kept, and without DRY_RUN nothing changes
    explicit = _run(script, DRY_RUN=1, ECHO_ONLY=1, DATA_PATH="/data/corpus_text_document")
    assert explicit.returncode == 0 and DRY_RUN_MOCK_NOTE not in explicit.stderr
    assert _opt(shlex.split(explicit.stdout.strip().splitlines()[-1]), "--data-path") == "/data/corpus_text_document"
    real = _run(script, ECHO_ONLY=1)
    assert real.returncode == 0 and DRY_RUN_MOCK_NOTE not in real.stderr
    assert "--data-path" in shlex.split(real.stdout.strip().splitlines()[-1])


def test_readme_dry_run_command_runs_without_data_path():
    """The README's command, verbatim, with no DATA_PATH in the environment: the real
    ``pretrain_gpt.py --dry-run`` must succeed (it failed on the missing GPT-2 vocab file)."""
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    assert README_DRY_RUN in readme
    env = _env()
    assert "DATA_PATH" not in env
    r = subprocess.run(["bash", "-c", README_DRY_RUN], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count(DRY_RUN_MOCK_NOTE) == 1
    found = _dry_run_config(r.stdout + "\n" + r.stderr)
    assert 32 in found.get("num_layers", []) and 4096 in found.get("hidden_size", []), r.stdout[-2000:]


# ------------------------------------------------------------------------------------------------
# quickstart.sh up to the training call
# ------------------------------------------------------------------------------------------------


def test_quickstart_pipeline_until_training(tmp_path):
    fake = tmp_path / "fake_torchrun.sh"
    fake.write_text('#!/bin/sh\necho "FAKE_TORCHRUN $*"\n')
    fake.chmod(0o755)
    env = dict(DATA_DIR=tmp_path / "data", RUN_DIR=tmp_path / "run", CORPUS_BYTES=300_000, VOCAB_SIZE=1024,
               TORCHRUN=str(fake), PYTHON=sys.executable)
    r = _run("examples/quickstart.sh", "--quantized-gradients", "--hadamard-transform", timeout=300, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("FAKE_TORCHRUN")][-1]
    cmd = shlex.split(line)[1:]
    assert cmd[:4] == ["--standalone", "--nproc-per-node", "2", "pretrain_gpt.py"]
    assert cmd[-2:] == ["--quantized-gradients", "--hadamard-transform"]
    data_path = _opt(cmd, "--data-path")
    assert data_path == f"{tmp_path}/data/stdlib_text_document"
    assert [_opt(cmd, f) for f in ("--device", "--distributed-backend", "--tokenizer-type", "--split")] == \
        ["cpu", "gloo", "GPT2BPETokenizer", "949,50,1"]
    for flag in ("--bf16", "--use-distributed-optimizer"):
        assert flag in cmd
    assert os.path.getsize(data_path + ".bin") > 100_000 and os.path.exists(data_path + ".idx")
    assert json.load(open(tmp_path / "data/tokenizer/vocab.json"))["<|endoftext|>"] == 0
    assert (tmp_path / "run/train.log").exists()
    # the trainer's tokenizer and the dataset agree on vocabulary / EOD
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.training.data.tokenizer import GPT2BPETokenizer

    tok = GPT2BPETokenizer(_opt(cmd, "--vocab-file"), _opt(cmd, "--merge-file"))
    ds = IndexedDataset(data_path)
    assert len(ds) > 50 and all(int(ds[i][-1]) == tok.eod for i in range(len(ds)))
    assert max(int(ds[i].max()) for i in range(len(ds))) < tok.vocab_size == 1024
    # rerun: every data step is skipped, outputs untouched
    mtime = os.path.getmtime(data_path + ".bin")
    r2 = _run("examples/quickstart.sh", "--quantized-gradients", timeout=120, **env)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert r2.stderr.count("(skipping)") == 3
    assert os.path.getmtime(data_path + ".bin") == mtime


# ------------------------------------------------------------------------------------------------
# ELASTIC=1 and the SLURM template (issue 46)
# ------------------------------------------------------------------------------------------------


def test_elastic_mode_and_sbatch_template(tmp_path):
    """ELASTIC=1: c10d rendezvous (no node rank or master port of a static world), --nnodes
    MIN:MAX, --max-restarts, torch_dist checkpoints (a restart on fewer nodes reshards). The sbatch
    template: --requeue, one ``srun`` task per node that survives a node's failure, running the
    recipe, whose torchrun line carries the job id as rendezvous id; its argument list validates
    with the trainer's parser."""
    from megatron.training.arguments import parse_args

    cmd = _echo("examples/sdp4bit/run_125m.sh", ELASTIC=1, NNODES=4, MIN_NNODES=2, GPUS_PER_NODE=8,
                MASTER_ADDR="10.0.0.1", MASTER_PORT=29400, MAX_RESTARTS=5, DATA_PATH="mock",
                VARIANT="sdp4bit")
    assert cmd[0] == "torchrun" and "--node-rank" not in cmd and "--master-port" not in cmd
    assert [_opt(cmd, f) for f in ("--nproc-per-node", "--nnodes", "--rdzv-backend",
                                    "--rdzv-endpoint", "--rdzv-id", "--max-restarts",
                                    "--ckpt-format")] == \
        ["8", "2:4", "c10d", "10.0.0.1:29400", "gpt-125m-sdp4bit", "5", "torch_dist"]
    r = _run("examples/sdp4bit/run_125m.sh", ECHO_ONLY=1, ELASTIC=1, DATA_PATH="mock")
    assert "[recipe] ELASTIC=1: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r.stderr
    static = _echo("examples/sdp4bit/run_125m.sh", NNODES=4, DATA_PATH="mock")
    assert "--rdzv-backend" not in static and "--ckpt-format" not in static
    for bad in ({"ELASTIC": "2"}, {"ELASTIC": "1", "NNODES": "2", "MIN_NNODES": "3"}):
        r = _run("examples/sdp4bit/run_125m.sh", ECHO_ONLY=1, DATA_PATH="mock", **bad)
        assert r.returncode == 2 and "[recipe] error:" in r.stderr, r.stderr

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && "
                                   "printf 'gpu-a17\\ngpu-a18\\n'\n")
    (fake / "scontrol").chmod(0o755)
    template = "examples/sdp4bit/sbatch_elastic.sh"
    assert "#SBATCH --requeue\n" in open(os.path.join(REPO, template)).read()
    r = _run(template, "--exit-signal-handler", ECHO_ONLY=1, PATH=f"{fake}:{os.environ['PATH']}",
             SLURM_JOB_ID=4242, SLURM_NNODES=4, SLURM_NODEID=2, SLURM_JOB_NODELIST="gpu-a[17-18]",
             SLURM_GPUS_ON_NODE=4, SLURM_SUBMIT_DIR=REPO, DATA_PATH="mock", VARIANT="sdp4bit",
             RECIPE="run_350m.sh")
    assert r.returncode == 0, r.stderr
    srun, torchrun = (shlex.split(line) for line in r.stdout.strip().splitlines()[-2:])
    assert srun[:4] == ["srun", "--ntasks-per-node=1", "--no-kill", "--kill-on-bad-exit=0"]
    assert srun[4:] == ["bash", os.path.join(REPO, "examples/sdp4bit/run_350m.sh"),
                        "--exit-signal-handler"]
    assert [_opt(torchrun, f) for f in ("--nproc-per-node", "--nnodes", "--rdzv-endpoint",
                                         "--rdzv-id", "--max-restarts", "--ckpt-format")] == \
        ["4", "2:4", "gpu-a17:29500", "4242", "3", "torch_dist"]
    assert torchrun[-1] == "--exit-signal-handler" and _opt(torchrun, "--num-layers") == "24"
    dry = _echo(template, DRY_RUN=1, SLURM_NNODES=2, GPUS_PER_NODE=2, SLURM_SUBMIT_DIR=REPO,
                DATA_PATH="mock", VARIANT="sdp4bit", GLOBAL_BATCH_SIZE=32)
    args = parse_args(dry[dry.index("pretrain_gpt.py") + 1:])
    assert args.ckpt_format == "torch_dist" and args.quant_config.quantized_gradients
