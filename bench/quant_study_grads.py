"""Real per-rank gradients for the quantization error study: the quickstart GPT on its corpus.

Why real gradients: the quantization error of a sum depends on the data -- heavy-tailed groups,
sparse embedding rows, how much the ranks' gradients cancel -- which Gaussian inputs do not show.

What: megatron-core's ``GPTModel`` in the quickstart's shape (examples/quickstart.sh: 2 layers,
hidden 128, 4 heads, sequence 128, the corpus' byte-level BPE vocabulary of 8192), built by the
trainer's own pieces (``parse_args`` / ``initialize_megatron`` / ``build_transformer_config`` /
``model_provider``, ``--device cpu``, a gloo world of one process), in fp32. Every virtual rank's
micro-batch is ``mbs`` windows of ``seq + 1`` tokens at random offsets of the train part (first
94.9 %, the quickstart's ``--split 949,50,1``) of the tokenized corpus, drawn from a generator
seeded by (seed, step, rank), so ranks see different data and a rerun sees the same. The model
moves along the *exact* trajectory: AdamW (quickstart's lr 1e-3, betas 0.9/0.95, weight decay
0.1, clip 1.0) on the exact mean gradient. The study therefore measures the communication error
at each step of an unperturbed run (item 3 of issue 15, multi-seed training, measures what the
error does to the loss).

A gradient is flattened as megatron-core's buffer lays a bucket out (parameters in reverse
order; one bucket: the model has 1.5 M parameters, below megatron-core's bucket size) and
zero-padded by the caller to the multiple the quantized collectives need.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "data" / "quickstart"
DATA_PREFIX = DATA_DIR / "stdlib_text_document"


def ensure_quickstart_data(data_dir: Path = DATA_DIR) -> Path:
    """Steps 1-3 of examples/quickstart.sh (corpus, tokenizer, .bin/.idx), the same commands,
    when their outputs are missing (~1 min on 2 cores; no internet needed)."""
    prefix = data_dir / "stdlib_text_document"
    corpus, tok = data_dir / "corpus.jsonl", data_dir / "tokenizer"
    steps = []
    if not corpus.exists():
        steps.append(["tools/make_quickstart_corpus.py", "--output", str(corpus),
                      "--max-bytes", "4000000"])
    if not (tok / "vocab.json").exists():
        steps.append(["tools/train_tokenizer.py", "--input", str(corpus), "--output-dir", str(tok),
                      "--vocab-size", "8192"])
    if not Path(str(prefix) + ".idx").exists():
        steps.append(["tools/preprocess_data.py", "--input", str(corpus), "--json-keys", "text",
                      "--output-prefix", str(data_dir / "stdlib"), "--tokenizer-type",
                      "GPT2BPETokenizer", "--vocab-file", str(tok / "vocab.json"), "--merge-file",
                      str(tok / "merges.txt"), "--append-eod", "--workers", "1"])
    for step in steps:
        print("[quant_error_study] preparing the quickstart corpus:", " ".join(step), flush=True)
        subprocess.run([sys.executable] + step, cwd=ROOT, check=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return prefix


class GptGradients:
    """The quickstart GPT, its corpus, per-rank micro-batch gradients, exact AdamW steps."""

    def __init__(self, *, seed: int = 1234, micro_batch_size: int = 4, seq_length: int = 128,
                 num_layers: int = 2, hidden_size: int = 128, heads: int = 4,
                 lr: float = 1e-3, warmup_steps: int = 10) -> None:
        from megatron.training import cpu_mode
        from megatron.training.arguments.parser import padded_vocab_size
        from megatron.training.arguments import parse_args
        from megatron.training.initialize import initialize_megatron
        from megatron.training.data.tokenizer import build_tokenizer
        from megatron.training.model.config_builders import build_transformer_config
        from megatron.training.components import model_provider
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        prefix = ensure_quickstart_data()
        tok = DATA_DIR / "tokenizer"
        argv = ["--device", "cpu", "--distributed-backend", "gloo",
                "--num-layers", str(num_layers), "--hidden-size", str(hidden_size),
                "--num-attention-heads", str(heads), "--seq-length", str(seq_length),
                "--max-position-embeddings", str(seq_length),
                "--micro-batch-size", str(micro_batch_size),
                "--global-batch-size", str(micro_batch_size), "--train-iters", "1",
                "--lr", str(lr), "--seed", str(seed), "--data-path", str(prefix),
                "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "vocab.json"),
                "--merge-file", str(tok / "merges.txt")]
        self._cpu = cpu_mode.cpu_mode()   # the trainer's CPU scope, left by close()
        self._cpu.__enter__()
        args = parse_args(argv)
        initialize_megatron(args)
        vocab = padded_vocab_size(build_tokenizer(args).vocab_size, args)
        self.model = model_provider(args, build_transformer_config(args), vocab, True, True)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.seed, self.mbs, self.seq = seed, micro_batch_size, seq_length
        ds = IndexedDataset(str(prefix))
        train_docs = int(len(ds) * 949 / 1000)
        self.tokens = torch.cat([torch.from_numpy(ds[i].astype("int64"))
                                 for i in range(train_docs)])
        self.position_ids = torch.arange(seq_length).unsqueeze(0).expand(micro_batch_size, -1)
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)))
        self.last_loss = self.step_loss = float("nan")

    def close(self) -> None:
        self._cpu.__exit__(None, None, None)

    # -- buckets -------------------------------------------------------------------------------
    def flat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """One fp32 bucket, megatron-core's order (parameters reversed)."""
        return torch.cat([t.detach().reshape(-1).float() for t in reversed(list(tensors))])

    def weights(self) -> torch.Tensor:
        """The exact (fp32 master) weights as one bucket."""
        return self.flat(self.params)

    # -- gradients -----------------------------------------------------------------------------
    def micro_batch_gradient(self, step: int, rank: int) -> torch.Tensor:
        """Gradient of the token-mean LM loss of rank ``rank``'s micro-batch at ``step``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 10_007 + rank)
        starts = torch.randint(0, self.tokens.numel() - self.seq - 1, (self.mbs,), generator=gen)
        win = torch.stack([self.tokens[s:s + self.seq + 1] for s in starts.tolist()])
        for p in self.params:
            p.grad = None
        torch.manual_seed(self.seed + 7 * step + 13 * rank)   # dropout
        losses = self.model(win[:, :-1].contiguous(), self.position_ids, None,
                            labels=win[:, 1:].contiguous())
        loss = losses.float().mean()
        loss.backward()
        self.last_loss = float(loss.detach())
        return self.flat([p.grad for p in self.params])

    def gradients(self, step: int, ranks: int) -> List[torch.Tensor]:
        """Ranks 0..ranks-1's gradients at ``step``; :attr:`step_loss` = their mean loss."""
        out, losses = [], []
        for r in range(ranks):
            out.append(self.micro_batch_gradient(step, r))
            losses.append(self.last_loss)
        self.step_loss = sum(losses) / len(losses)
        return out

    def apply(self, mean_gradient: torch.Tensor) -> None:
        """One exact AdamW step on ``mean_gradient`` (a bucket, unpadded), clipped to norm 1."""
        g = mean_gradient.float()
        off = g.numel()
        for p in self.params:       # the bucket is reversed: walk it from the end
            p.grad = g[off - p.numel():off].view_as(p).clone()
            off -= p.numel()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.sched.step()
