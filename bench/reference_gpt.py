#!/usr/bin/env python3
"""A plain-PyTorch GPT of the SDP4Bit recipes' shapes: the reference ``bench/gpu_throughput.py``
holds the trainer against (issue 23, item 5).

What a plain PyTorch trainer would run, and nothing more:

* **Model** (the recipes' architecture, ``examples/sdp4bit/run_{125m,350m,1.3b}.sh``): GPT-2 style
  pre-LayerNorm decoder, learned position embeddings, word embeddings tied to the output layer
  (the recipes do not pass ``--untie-embeddings-and-output-weights``), biases on every linear
  layer, LayerNorm eps 1e-5, GELU MLP of 4h, dropout 0.1 on the embeddings, attention
  probabilities and both residual branches (megatron-core's defaults, which the recipes keep),
  vocabulary padded to a multiple of 128 (Megatron's ``--make-vocab-size-divisible-by``).
  Parameter for parameter the same count as megatron-core's ``GPTModel`` of the same shape
  (``tests/test_gpu_throughput.py`` checks it). Attention is
  ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` (flash / memory-efficient
  / cuDNN on a GPU, whichever torch picks).
* **Precision**: fp32 parameters, gradients and AdamW state, forward and backward under
  ``torch.autocast(dtype=torch.bfloat16)`` (``--precision bf16``, the default; how nanoGPT-style
  trainers run) -- the same 16 bytes of model state per parameter as Megatron's bf16 parameters
  + fp32 gradients + fp32 master + Adam moments (18). ``--precision fp32`` turns autocast off.
* **Optimizer**: ``torch.optim.AdamW(fused=True)`` on CUDA (foreach on CPU), betas 0.9/0.95,
  eps 1e-8, weight decay 0.1 on matrices only (Megatron's no-decay rule for biases and norms),
  gradient clipping at 1.0, the recipes' settings. No activation recomputation.
* **Step**: ``global_batch_size / micro_batch_size`` micro-batches of random tokens (a pool of
  pre-drawn batches, copied host-to-device each micro-batch as a data loader would), loss / n
  backward each, clip, step, ``zero_grad(set_to_none=True)``, the loss read back (one sync per
  step, as a trainer that logs every step). ``--compile`` wraps the model in ``torch.compile``.

Prints ms/iteration (median over the iterations after ``--warmup``), TFLOP/s by Megatron-LM's
model-FLOPs formula (``megatron/training/model/flops.py``, imported: one definition for ours and
the reference) and the peak memory: ``torch.cuda.max_memory_allocated`` on CUDA, the process's
peak RSS on CPU. ``--json PATH`` writes the same as one JSON object.

    python bench/reference_gpt.py --shape 1.3b --iters 20 --json out.json
    python bench/reference_gpt.py --shape toy --device cpu --iters 3
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron.training.model.flops import tflops_per_gpu, training_flops_per_iteration  # noqa: E402

# The recipes' shapes (examples/sdp4bit/run_*.sh) and micro-batch sizes; global batch 16 is what
# issue 23 measured on one H100. "toy" is for CPU tests.
SHAPES: Dict[str, Dict[str, int]] = {
    "toy": dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                vocab_size=1000, micro_batch_size=2, global_batch_size=4),
    "125m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=2048,
                 vocab_size=50257, micro_batch_size=8, global_batch_size=16),
    "350m": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=2048,
                 vocab_size=50257, micro_batch_size=8, global_batch_size=16),
    "1.3b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                 vocab_size=50257, micro_batch_size=4, global_batch_size=16),
}
VOCAB_MULTIPLE = 128  # Megatron's --make-vocab-size-divisible-by default (TP = 1)


def padded_vocab(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-vocab_size // multiple) * multiple


def flops_args(shape: Dict[str, int], global_batch_size: int) -> argparse.Namespace:
    """The fields of the trainer's args that megatron/training/model/flops.py reads."""
    return argparse.Namespace(
        num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"], seq_length=shape["seq_length"],
        ffn_hidden_size=None, swiglu=False, padded_vocab_size=padded_vocab(shape["vocab_size"]),
        global_batch_size=global_batch_size, world_size=1)


def parameter_count(shape: Dict[str, int], tied: bool = True) -> int:
    """Closed form: embeddings + L x (2 LayerNorms, QKV, projection, MLP) + final LayerNorm."""
    h, s, layers, v = (shape["hidden_size"], shape["seq_length"], shape["num_layers"],
                       padded_vocab(shape["vocab_size"]))
    return v * h + s * h + layers * (12 * h * h + 13 * h) + 2 * h + (0 if tied else v * h)


# ----------------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, h: int, heads: int, dropout: float, eps: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(h, eps=eps), nn.LayerNorm(h, eps=eps)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, s, h)), p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), p, self.training)


class GPT(nn.Module):
    def __init__(self, num_layers: int, hidden_size: int, num_attention_heads: int,
                 seq_length: int, vocab_size: int, dropout: float = 0.1, eps: float = 1e-5,
                 tied: bool = True, std: float = 0.02, **_: Any) -> None:
        super().__init__()
        v = padded_vocab(vocab_size)
        self.wte, self.wpe = nn.Embedding(v, hidden_size), nn.Embedding(seq_length, hidden_size)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(hidden_size, num_attention_heads, dropout, eps)
                                    for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(hidden_size, eps=eps)
        self.lm_head = None if tied else nn.Linear(hidden_size, v, bias=False)
        # Megatron's init: normal(0, std), output projections std / sqrt(2 L), biases zero.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                scaled = name.endswith(("proj.weight", "fc2.weight"))
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * num_layers) if scaled else std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight if self.lm_head is None else self.lm_head.weight)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.reshape(-1))


# ----------------------------------------------------------------------------------- training
def peak_memory(device: torch.device) -> Dict[str, Any]:
    if device.type == "cuda":
        return {"peak_memory_bytes": int(torch.cuda.max_memory_allocated(device)),
                "peak_memory_kind": "torch.cuda.max_memory_allocated"}
    # Linux reports ru_maxrss in KiB.
    return {"peak_memory_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
            "peak_memory_kind": "peak RSS of the process (CPU)"}


def run(shape_name: str, *, device: str = "cuda", iters: int = 20, warmup: int = 5,
        micro_batch_size: Optional[int] = None, global_batch_size: Optional[int] = None,
        precision: str = "bf16", compile: bool = False, dropout: float = 0.1, tied: bool = True,
        lr: float = 2e-4, seed: int = 1234) -> Dict[str, Any]:
    shape = dict(SHAPES[shape_name])
    mbs = micro_batch_size or shape["micro_batch_size"]
    gbs = global_batch_size or shape["global_batch_size"]
    if gbs % mbs:
        raise SystemExit(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mbs}")
    n_micro, s, vocab = gbs // mbs, shape["seq_length"], shape["vocab_size"]
    dev = torch.device(device)
    torch.manual_seed(seed)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    model = GPT(**shape, dropout=dropout, tied=tied).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8,
                            **({"fused": True} if dev.type == "cuda" else {}))
    fwd = torch.compile(model) if compile else model
    model.train()
    # A pool of random batches (tokens + shifted labels) on the host, pinned on CUDA.
    gen = torch.Generator().manual_seed(seed)
    pool = [torch.randint(0, vocab, (mbs, s + 1), generator=gen) for _ in range(4)]
    if dev.type == "cuda":
        pool = [b.pin_memory() for b in pool]
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    times: List[float] = []
    losses: List[float] = []
    for it in range(warmup + iters):
        sync()
        t0 = time.perf_counter()
        total = torch.zeros((), device=dev)
        for m in range(n_micro):
            batch = pool[(it * n_micro + m) % len(pool)].to(dev, non_blocking=True)
            with autocast:
                loss = fwd(batch[:, :-1], batch[:, 1:]) / n_micro
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))  # one host sync per step, as a trainer logging the loss
        sync()
        times.append(time.perf_counter() - t0)
    measured = times[warmup:] or times
    ms = 1000.0 * statistics.median(measured)
    fargs = flops_args(shape, gbs)
    return {"run": "reference" + ("-compile" if compile else ""), "shape": shape_name,
            "device": str(dev), "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "torch": torch.__version__, "precision": precision, "compile": compile,
            "micro_batch_size": mbs, "global_batch_size": gbs, "seq_length": s,
            "padded_vocab_size": fargs.padded_vocab_size, "parameters": n_params,
            "iterations": iters, "warmup": warmup, "ms_per_iteration": ms,
            "ms_per_iteration_all": [1000.0 * t for t in times],
            "flops_per_iteration": training_flops_per_iteration(fargs),
            "tflops_per_gpu": tflops_per_gpu(fargs, ms / 1000.0),
            "losses": losses, **peak_memory(dev)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="125m")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=20, help="measured iterations (after --warmup)")
    p.add_argument("--warmup", type=int, default=5, help="iterations before the measured ones")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the recipe's")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="default 16 (toy: 4); micro-batches are accumulated")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: fp32 parameters and optimizer, bf16 autocast (default)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--dropout", type=float, default=0.1, help="megatron-core's default 0.1")
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None, help="write the result as one JSON object here")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    r = run(a.shape, device=a.device, iters=a.iters, warmup=a.warmup,
            micro_batch_size=a.micro_batch_size, global_batch_size=a.global_batch_size,
            precision=a.precision, compile=a.compile, dropout=a.dropout,
            tied=not a.untie_embeddings_and_output_weights, seed=a.seed)
    print(f"reference_gpt {r['run']} shape {r['shape']} on {r['gpu'] or r['device']}: "
          f"{r['parameters']:,} parameters, micro-batch {r['micro_batch_size']}, global batch "
          f"{r['global_batch_size']}, seq {r['seq_length']}, {r['precision']} | "
          f"ms/iteration {r['ms_per_iteration']:.1f} (median of {r['iterations']} after "
          f"{r['warmup']} warm-up) | TFLOP/s {r['tflops_per_gpu']:.2f} | peak memory "
          f"{r['peak_memory_bytes'] / 2**30:.2f} GiB ({r['peak_memory_kind']}) | "
          f"last loss {r['losses'][-1]:.4f}", flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
