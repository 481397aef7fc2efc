"""Measure every PaRO strategy on a tiny GPT: memory, link bytes, losses against ZeRO-1.

Usage (CPU, 4 gloo ranks on 127.0.0.1 laid out as 2 groups x 2, about a minute)::

    python tools/paro_strategy_table.py [--steps 3] [--bf16] [--quantized] [--bucket-numel N]

Prints a Markdown table (docs/paro.md, "Measured"): per rank, the persistent model-state bytes
measured from the storages of the engine's resident tensors next to
``paro.cost.model_state_memory``, the number of buckets (units of gather / release and of the gradient
reduce-scatter; ``--bucket-numel`` caps their size, default one per transformer layer / top-level
module) and the peak parameter + gradient bytes during a step, the intra / inter bytes counted in
one step next to
``paro.cost.communication_volume``, and the largest relative loss difference to megatron-core's
DDP + DistributedOptimizer (NNG) over the steps. Same setup as tests/test_paro_training.py.
``--quantized`` adds ``--quantized-gradients --quantized-weights`` (SDP4Bit's TLq / qWD inside the
PaRO groups) for the strategies that support them (os = G); the reference stays unquantized.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from functools import partial
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD, GROUP, MICRO, MBS, SEQ, VOCAB = 4, 2, 2, 2, 32, 128
ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size",
        str(MBS), "--global-batch-size", str(MBS * WORLD * MICRO), "--train-iters", "10",
        "--lr", "3e-3", "--mock-data", "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by",
        "8", "--device", "cpu", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--paro-group-size", str(GROUP), "--weight-decay", "0.1", "--paro-strategy", "NNG",
        "--use-distributed-optimizer"]


def synthetic_batches(rank: int, first_step: int, steps: int, *, micro: int = MICRO,
                      mbs: int = MBS, seq: int = SEQ, vocab: int = VOCAB):
    """Deterministic synthetic micro-batches of this DP rank (same for every strategy; also used
    by tests/test_paro_training.py). Learnable: each sequence counts up by a per-sequence stride
    from a random start."""
    for step in range(first_step, first_step + steps):
        for m in range(micro):
            g = torch.Generator().manual_seed(100_000 + 1000 * step + 10 * m + rank)
            start = torch.randint(0, vocab, (mbs, 1), generator=g)
            stride = torch.randint(1, 4, (mbs, 1), generator=g)
            tokens = (start + stride * torch.arange(seq + 1)) % vocab
            yield {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                   "loss_mask": torch.ones(mbs, seq),
                   "position_ids": torch.arange(seq).unsqueeze(0).expand(mbs, seq).contiguous()}


QUANT = ["--quantized-gradients", "--quantized-weights"]


def _worker(rank: int, port: int, steps: int, bf16: bool, quantized: bool, bucket_numel,
            out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    from megatron.core.transformer.module import Float16Module
    from megatron.distributed.quant.paro.optimizer import model_state_bytes
    from megatron.distributed.quant import integration
    from megatron.training.arguments import parse_args
    from megatron.training.model.config_builders import build_ddp_config, build_transformer_config
    from megatron.training.initialize import initialize_megatron, set_random_seed
    from megatron.training.components import (configure_schedule, get_model,
                                                       get_optimizer_and_scheduler,
                                                       model_provider)
    from megatron.training.step import forward_step, train_step

    plain = parse_args(ARGS + (["--bf16"] if bf16 else []))
    initialize_megatron(plain)
    quant = parse_args(ARGS + (["--bf16"] if bf16 else []) + QUANT)
    results: Dict[str, Any] = {}
    for label in ["core"] + _strategies(quantized):
        args = quant if (quantized and label != "core") else plain
        set_random_seed(args.seed, "cpu")
        args.paro_strategy = "NNG" if label == "core" else label
        args.use_distributed_optimizer = label == "core"
        config = build_transformer_config(args)
        if label == "core":
            model = get_model(args, config, VOCAB)
        else:
            chunk = model_provider(args, config, VOCAB, True, True)
            chunk = Float16Module(config, chunk) if bf16 else chunk
            args.ddp_bucket_size = bucket_numel  # the engine's bucket-size cap (None: per layer)
            model = integration.wrap_model(config, build_ddp_config(args), [chunk],
                                           args.quant_config, strategy=label,
                                           group_size=args.paro_group_size, engine=True)
        opt, sched = get_optimizer_and_scheduler(args, model)
        configure_schedule(args, config, model, opt)
        it, losses, row = synthetic_batches(rank, 0, steps), [], {}
        for _ in range(steps):
            if label != "core":
                model[0].counter.reset()
            losses.append(train_step(args, partial(forward_step, args), it, model, opt, sched,
                                     torch.device("cpu"))[0])
        row["losses"] = losses
        if label != "core":
            row.update(memory=model_state_bytes(model[0], opt), bytes=dict(model[0].counter.bytes),
                       padded=model[0].padded_numel, peak=model[0].peak_bytes,
                       buckets=len(model[0].buckets))
        results[label] = row
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.destroy_process_group()


def _strategies(quantized: bool) -> List[str]:
    from megatron.distributed.quant.paro.strategy import VALID_STRATEGIES

    return [s for s in VALID_STRATEGIES if not quantized or s[2] == "G"]


def _table(results: Dict[str, Any], bf16: bool, quantized: bool) -> str:
    from megatron.distributed.quant.paro import cost as paro_cost
    from megatron.distributed.quant.config import QuantizationConfig

    ref = results["core"]["losses"]
    sb = paro_cost.StateBytes(param=2 if bf16 else 4, grad=4, optim=12)
    qc = QuantizationConfig(quantized_gradients=True, quantized_weights=True) if quantized else None
    lines = ["| strategy | params B | grads B | optim B | total B (model) | buckets | peak p+g B "
             "| intra B/step (model) | inter B/step (model) | max rel. loss diff vs ZeRO-1 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in _strategies(quantized):
        r = results[s]
        mem = paro_cost.model_state_memory(s, r["padded"], WORLD, GROUP, state_bytes=sb)
        vol = paro_cost.communication_volume(s, r["padded"], WORLD, GROUP, micro_steps=MICRO,
                                        state_bytes=sb, quant_config=qc)
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
        m = r["memory"]
        lines.append(f"| {s} | {m['params']:,} | {m['grads']:,} | {m['optimizer_states']:,} | "
                     f"{m['total']:,} ({mem.total:,.0f}) | {r['buckets']} | {r['peak']:,} | {r['bytes']['intra']:,.0f} "
                     f"({vol.intra:,.0f}) | {r['bytes']['inter']:,.0f} ({vol.inter:,.0f}) | "
                     f"{diff:.1e} |")
    lines.append(f"\nZeRO-1 (megatron-core) losses: {', '.join(f'{x:.6f}' for x in ref)}; "
                 f"padded parameter count S = {results['NNG']['padded']:,}")
    return "\n".join(lines)


def main(argv: List[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--quantized", action="store_true")
    p.add_argument("--bucket-numel", type=int, default=None,
                   help="bucket-size cap in elements (default: one bucket per module unit)")
    a = p.parse_args(argv)
    sys.path.insert(0, REPO)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(port, a.steps, a.bf16, a.quantized, a.bucket_numel, out), nprocs=WORLD, join=True)
        results = torch.load(os.path.join(out, "results.pt"), weights_only=False)
    print(_table(results, a.bf16, a.quantized))


if __name__ == "__main__":
    main(sys.argv[1:])
