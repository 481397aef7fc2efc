"""PaRO engine memory on GPUs, the parts a CPU can check (issue 25, defect 9).

Why these tests: the engine's memory is what its strategies promise (paro.cost), yet some of its
bookkeeping scaled with the *model* on every rank, or made device copies of whole states:

* the grad norm made two fp64 copies of the gradient shard every step (16 B per element);
* the optimizer built a model-sized host bool mask and int64 indices per shard element to find
  its weight-decay mask (18 B per model element at os = N at its peak: ~126 GB per rank for 7B);
* the optimizer's checkpoint state and the save path's weights were cloned on the device.

A CPU cannot see device memory, so allocations are observed at the dispatcher
(:class:`FreshAllocations`: every tensor an aten op allocates, not views or in-place results).
Multi-rank layouts run on torch's "fake" process group (one process plays rank 3 of 8 with
collectives that do nothing), which builds the real engine layout for m = 4, g = 2 at no cost;
where values must be real (the save path), the engine's all-gather is replaced by a deterministic
stand-in, identical for the old and the new path.
"""

from __future__ import annotations

import contextlib
import math
import types
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.distributed.quant.paro.strategy import VALID_STRATEGIES, Level, PaRoStrategy

GRAD_NORM_RTOL = 1e-6
"""Grad norm vs the fp64 reference. Each chunk is an fp32 reduction (as megatron-core's
``get_grad_norm_fp32``: fp32 per-tensor norms), chunks summed in fp64; measured below ~1e-7."""


# ------------------------------------------------------------------------------------ helpers
class FreshAllocations(TorchDispatchMode):
    """Every tensor an aten op allocates while active: (op, dtype, numel, nbytes, device).

    An output is fresh when the op's schema gives it no alias (views and in-place results have
    one)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: List[Tuple[str, torch.dtype, int, int, str]] = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        rets = func._schema.returns
        for i, o in enumerate(outs):
            ret = rets[min(i, len(rets) - 1)]
            if ret.alias_info is not None:
                continue
            for t in (o if isinstance(o, (tuple, list)) else (o,)):
                if not torch.is_tensor(t):
                    continue
                self.rows.append((str(func), t.dtype, t.numel(), t.untyped_storage().nbytes(),
                                  str(t.device)))
        return out

    def bytes(self) -> int:
        return sum(r[3] for r in self.rows)


@contextlib.contextmanager
def fake_world(world: int, rank: int) -> Iterator[None]:
    """This process as ``rank`` of ``world`` on torch's fake backend (collectives do nothing)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Block(torch.nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(h, 3 * h - 1)
        self.norm = torch.nn.LayerNorm(3 * h - 1)
        self.fc2 = torch.nn.Linear(3 * h - 1, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.norm(self.fc1(x)).relu())


class Toy(torch.nn.Module):
    """An embedding, a ModuleList of blocks, a final norm: one bucket per unit, odd sizes (so
    buckets are padded and decayed / undecayed parameters straddle shard boundaries)."""

    def __init__(self, h: int = 13, layers: int = 3, vocab: int = 37) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, h)
        self.layers = torch.nn.ModuleList(Block(h) for _ in range(layers))
        self.final_norm = torch.nn.LayerNorm(h)
        self.register_buffer("position_scale", torch.linspace(0.5, 1.5, h))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) * self.position_scale
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x)


def _engine(strategy: str, group_size: int, module: Optional[torch.nn.Module] = None,
            bucket_numel: Optional[int] = None, overlap_param_gather: bool = False):
    from megatron.distributed.quant.paro.comm import build_paro_groups
    from megatron.distributed.quant.paro.engine import ParoDataParallel

    torch.manual_seed(0)
    module = Toy() if module is None else module
    groups = build_paro_groups(group_size)
    param_groups = build_paro_groups(group_size) if overlap_param_gather else None
    return ParoDataParallel(types.SimpleNamespace(), module, PaRoStrategy.from_string(strategy),
                            groups, bucket_numel=bucket_numel, param_groups=param_groups)


def _opt_config(optimizer: str = "adam") -> Any:
    return types.SimpleNamespace(fp16=False, optimizer=optimizer, lr=1e-3, weight_decay=0.1,
                                 adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, sgd_momentum=0.9)


def _fake_all_gather(engine) -> None:
    """Deterministic stand-in for the engine's all-gather on the fake backend (whose collectives
    leave the output untouched): every rank's piece is this rank's shard."""

    def ag(out: torch.Tensor, inp: torch.Tensor, scope: str, groups: Any = None) -> None:
        for piece in out.split(inp.numel()):  # views and in-place copies: no allocation
            piece.copy_(inp)

    engine.collectives._gather_hop = ag


# ------------------------------------------------------------------------ 1. grad norm in fp32
@pytest.mark.parametrize("numel,chunk", [(3_000_017, 1 << 18), (1_000, 1 << 24),
                                         (1 << 18, 1 << 16), (1, 7), (0, 5)])
def test_sum_of_squares_matches_fp64_reference(numel, chunk):
    from megatron.distributed.quant.paro.optimizer import sum_of_squares

    g = torch.Generator().manual_seed(numel)
    # Wide dynamic range: magnitudes from 1e-4 to 1e4, as real gradient shards have.
    scale = torch.pow(10.0, torch.empty(numel).uniform_(-4, 4, generator=g))
    x = torch.randn(numel, generator=g) * scale
    ref = torch.sum(x.double() ** 2).item()
    got = sum_of_squares(x, chunk)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert abs(got.item() - ref) <= GRAD_NORM_RTOL * ref, (got.item(), ref)
    # Same answer whatever the chunking (single chunk = one fp32 reduction).
    whole = sum_of_squares(x, max(numel, 1)).item()
    assert abs(whole - ref) <= GRAD_NORM_RTOL * ref


def test_sum_of_squares_keeps_non_finite_and_refuses_bad_chunks():
    from megatron.distributed.quant.paro.optimizer import sum_of_squares

    x = torch.ones(100)
    x[57] = float("nan")
    assert math.isnan(sum_of_squares(x, 8).item())
    x[57] = float("inf")
    assert math.isinf(sum_of_squares(x, 8).item())
    with pytest.raises(ValueError, match="chunk_numel must be positive"):
        sum_of_squares(x, 0)


@pytest.mark.parametrize("strategy", ["NNN", "NII", "NIG", "GGG"])
def test_grad_norm_makes_no_fp64_copy_of_the_shard(strategy, monkeypatch):
    """Rank 3 of 8 (m = 4): the norm of its main_grad shard (the fake all-reduce adds nothing)
    equals the fp64 reference within GRAD_NORM_RTOL, and no fp64 tensor bigger than one scalar
    per chunk -- nor any tensor of the shard's size -- is allocated."""
    from megatron.distributed.quant.paro import optimizer as paro_optimizer
    from megatron.distributed.quant.paro.optimizer import ParoOptimizer

    # Several chunks (raising=False: the measurement below also runs on the code before the fix).
    monkeypatch.setattr(paro_optimizer, "GRAD_NORM_CHUNK_NUMEL", 64, raising=False)
    with fake_world(8, 3):
        engine = _engine(strategy, 4)
        opt = ParoOptimizer(engine, _opt_config())
        shard = engine.padded_numel // engine.level_ranks(engine.strategy.optim)
        g = torch.Generator().manual_seed(7)
        engine.main_grad = torch.randn(shard, generator=g) * 3.0
        ref = math.sqrt(torch.sum(engine.main_grad.double() ** 2).item())
        with FreshAllocations() as log:
            norm = opt.get_grad_norm()
    assert abs(norm - ref) <= GRAD_NORM_RTOL * ref, (norm, ref)
    chunks = -(-shard // 64)
    fp64 = [r for r in log.rows if r[1] == torch.float64 and r[2] > chunks]
    assert not fp64, f"fp64 temporaries in the grad norm: {fp64}"
    big = [r for r in log.rows if r[2] >= shard]
    assert not big, f"shard-sized temporaries in the grad norm: {big}"


# ------------------------------------------------------- 3. decay mask per shard, not per model
@pytest.mark.parametrize("strategy", VALID_STRATEGIES)
def test_decay_mask_per_shard_equals_the_indexed_model_mask(strategy):
    """The per-shard construction gives exactly the old ``mask[level_indices(os)]`` on every
    local / group position (ranks 0, 3, 6 of 8; m = 4)."""
    for rank in (0, 3, 6):
        with fake_world(8, rank):
            engine = _engine(strategy, 4, bucket_numel=300)  # blocks split: many buckets
            o = engine.strategy.optim
            ref = engine.weight_decay_mask(Level.N)[engine.level_indices(o)]
            got = engine.weight_decay_mask(o)
            assert got.dtype == torch.bool and torch.equal(got, ref), (strategy, rank)
            assert 0 < int(got.sum()) < got.numel()  # both kinds present in the shard


@pytest.mark.parametrize("strategy", ["NNN", "NNI", "NIG", "IIG", "GGG"])
def test_optimizer_setup_host_bytes_are_per_shard_element(strategy):
    """Bytes ParoOptimizer.__init__ allocates beyond its fp32 master and moments: at most the
    1-byte-per-shard-element decay mask. Measured before: a model-sized bool mask, int64 indices
    (per-bucket aranges, then their concatenation), the indexed mask and a second copy of the
    master -- 22 B per shard element beyond the state at os = N (= per model element), 25 at
    os = I and 29 at os = G on 8 ranks with m = 4."""
    from megatron.distributed.quant.paro.optimizer import ParoOptimizer

    with fake_world(8, 3):
        engine = _engine(strategy, 4)
        with FreshAllocations() as log:
            opt = ParoOptimizer(engine, _opt_config())
    shard = engine.padded_numel // engine.level_ranks(engine.strategy.optim)
    extra = log.bytes() - opt.state_bytes()
    assert opt.decay_mask.numel() == shard
    assert extra <= 1.0 * shard, (f"{extra / shard:.2f} B per shard element beyond the optimizer "
                                  f"state ({extra / engine.padded_numel:.2f} B per model element): "
                                  f"{sorted(log.rows, key=lambda r: -r[3])[:5]}")


# --------------------------------------------------------------------- 2. save without a clone
def _old_save_path(engine) -> Dict[str, Any]:
    """What megatron/training/checkpoint/save_load.py's _model_state_dicts did for an engine chunk."""
    with engine.full_params():
        sd = engine.module.state_dict()
        return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in sd.items()}


def _assert_identical(got: Dict[str, Any], want: Dict[str, Any]) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        g = got[k]
        if not torch.is_tensor(v):
            assert g == v, k
            continue
        assert g.device.type == "cpu", k
        assert g.dtype == v.dtype and g.shape == v.shape, k
        assert torch.equal(g.view(torch.uint8) if g.dtype.is_floating_point else g,
                           v.view(torch.uint8) if v.dtype.is_floating_point else v), k


def _device_allocations(log: FreshAllocations, min_numel: int) -> List[Tuple]:
    """Fresh tensors of at least ``min_numel`` elements not made by an explicit copy to the host
    (on a GPU these would be device memory: clones, gathered buffers)."""
    return [r for r in log.rows if r[2] >= min_numel and r[0] != "aten._to_copy.default"]


@pytest.mark.parametrize("strategy", ["GGG", "IIG", "ING", "NIG", "NNN"])
def test_host_state_dict_is_the_old_save_bucket_by_bucket(strategy):
    """Rank 3 of 8 (m = 4): ``host_state_dict`` returns bit for bit what the old save path kept,
    on the host; at most one bucket is gathered at a time, none stays gathered; the only big
    allocations are host copies (the old path cloned every parameter where it lived)."""
    with fake_world(8, 3):
        engine = _engine(strategy, 4)
        _fake_all_gather(engine)
        released = [b.gathered for b in engine.buckets]
        want = _old_save_path(engine)
        gathered_at_once = []
        inner = engine.param_gathers.gather

        def gather(b):
            inner(b)
            gathered_at_once.append(sum(x.gathered for x in engine.buckets))

        engine.param_gathers.gather = gather
        with FreshAllocations() as log:
            got = engine.host_state_dict()
        assert [b.gathered for b in engine.buckets] == released
        _assert_identical(got, want)
        if engine.strategy.params != Level.N:
            assert max(gathered_at_once) == 1 and len(gathered_at_once) == len(engine.buckets)
        # Besides the host copies only the gathers' own scratch (p = G: the I slice of
        # exact_gather, per bucket) -- less in all than one copy of the parameters, which is what
        # the old path's clones alone took.
        assert not [r for r in log.rows if r[0] == "aten.clone.default"]
        scratch = sum(r[3] for r in _device_allocations(log, 1))
        assert scratch < engine.num_params * 4, log.rows
        # Ranks that do not store the weights still take part in every gather.
        gathered_at_once.clear()
        assert engine.host_state_dict(keep=False) is None
        if engine.strategy.params != Level.N:
            assert len(gathered_at_once) == len(engine.buckets)
        # The copies do not alias the live parameters.
        key = next(k for k in got if k.endswith("fc1.weight"))
        before = got[key].clone()
        with engine.full_params(writeback=True):
            for p in engine.module.parameters():
                p.data.add_(1.0)
        assert torch.equal(got[key], before)


@pytest.mark.parametrize("strategy", ["GGG", "IIG", "ING", "NIG", "NNN"])
def test_load_writes_the_shard_without_gathering_the_model(strategy):
    """Rank 3 of 8 (m = 4): ``load_host_state_dict`` leaves the shard (and the buffers) bit for
    bit as the old load path did (``load_state_dict`` inside ``full_params(writeback=True)``),
    without gathering anything: the old path held every bucket's full parameters at once."""
    with fake_world(8, 3):
        old, new = _engine(strategy, 4), _engine(strategy, 4)
        for engine in (old, new):
            _fake_all_gather(engine)
        gen = torch.Generator().manual_seed(5)
        sd = {k: torch.randn(v.shape, generator=gen).to(v.dtype) if torch.is_tensor(v) else v
              for k, v in old.host_state_dict().items()}
        with old.full_params(writeback=True):
            old.module.load_state_dict(sd, strict=True)
        gathers = []
        inner = new.param_gathers.gather
        new.param_gathers.gather = lambda b: (gathers.append(b.index), inner(b))
        with FreshAllocations() as log:
            new.load_host_state_dict(sd)
        assert torch.equal(new.param_level_storage(), old.param_level_storage())
        assert torch.equal(new.module.position_scale, sd["position_scale"])
        if new.strategy.params != Level.N:
            assert gathers == [] and not any(b.gathered for b in new.buckets)
            assert not _device_allocations(log, 64), log.rows
        # strict, as load_state_dict(strict=True)
        with pytest.raises(RuntimeError, match="[Mm]issing key"):
            new.load_host_state_dict({k: v for k, v in sd.items() if k != "layers.1.fc2.bias"})
        key = "layers.0.fc1.weight"
        with pytest.raises(RuntimeError, match=f"size mismatch for {key}"):
            new.load_host_state_dict(dict(sd, **{key: sd[key][:-1]}))


@pytest.mark.parametrize("strategy", ["GGG", "IIG"])
def test_overlapped_gathers_run_one_bucket_ahead(strategy):
    """--overlap-param-gather (p = I / G): each forward pre-hook starts the next bucket's gather
    (on the weights stage) before its own module computes, each backward hook the previous
    bucket's; never more than PARAM_GATHERS_AHEAD in flight, nothing left gathered or in flight
    after the backward. The inline engine starts each gather only when its module is called."""
    from megatron.distributed.quant.paro.gather import PARAM_GATHERS_AHEAD

    def events_of(overlap: bool) -> List[Tuple[str, int]]:
        with fake_world(8, 3):
            engine = _engine(strategy, 4, overlap_param_gather=overlap)
            events: List[Tuple[str, int]] = []
            start = engine.param_gathers.start

            def logged_start(b):
                events.append(("gather", b.index))
                handle = start(b)
                assert len(engine.param_gathers.in_flight) <= PARAM_GATHERS_AHEAD
                return handle

            engine.param_gathers.start = logged_start
            for b in engine.buckets:
                if len(b.owners) == 1:
                    b.owners[0].register_forward_hook(
                        lambda m, i, o, index=b.index: events.append(("computed", index)))
            tokens = torch.randint(0, 37, (2, 5))
            engine(tokens).float().sum().backward()
            assert engine.param_gathers.in_flight == {}
            assert not any(b.gathered for b in engine.buckets)
            if overlap:
                assert engine.param_gathers.stages.kind == "thread"
            return events

    overlapped, inline = events_of(True), events_of(False)
    forward = [i for kind, i in overlapped if kind == "computed"]
    assert forward == sorted(forward) and len(forward) >= 3
    for a, b in zip(forward, forward[1:]):   # b's gather started before a computed
        assert overlapped.index(("gather", b)) < overlapped.index(("computed", a)), overlapped
        assert inline.index(("gather", b)) > inline.index(("computed", a)), inline
    # the backward regathers every bucket, the earlier ones ahead of their turn
    assert sorted(i for kind, i in overlapped if kind == "gather") == \
        sorted(i for kind, i in inline if kind == "gather")


def test_old_save_path_cloned_every_parameter():
    """The measurement the test above relies on: the old path's big allocations were clones."""
    with fake_world(8, 3):
        engine = _engine("GGG", 4)
        _fake_all_gather(engine)
        with FreshAllocations() as log:
            _old_save_path(engine)
    clones = [r for r in log.rows if r[0] == "aten.clone.default"]
    assert sum(r[2] for r in clones) >= engine.num_params


def test_optimizer_state_dict_is_a_host_copy():
    """The optimizer's checkpoint state: equal to its state, not aliasing it, made by copies to
    the host (before: ``.clone()`` where the state lives -- 12 B per shard element on the GPU)."""
    from megatron.distributed.quant.paro.optimizer import ParoOptimizer

    with fake_world(8, 3):
        engine = _engine("NIG", 4)
        opt = ParoOptimizer(engine, _opt_config())
        opt.exp_avg.normal_()
        opt.exp_avg_sq.uniform_()
        with FreshAllocations() as log:
            sd = opt.state_dict()
    for name in ("master", "exp_avg", "exp_avg_sq"):
        live = opt.master.data if name == "master" else getattr(opt, name)
        assert sd[name].device.type == "cpu" and torch.equal(sd[name], live)
        assert sd[name].untyped_storage().data_ptr() != live.untyped_storage().data_ptr()
    assert not _device_allocations(log, opt.master.numel()), log.rows
    saved = sd["exp_avg"].clone()
    opt.exp_avg.add_(1.0)
    assert torch.equal(sd["exp_avg"], saved)
    opt.load_state_dict(sd)
    assert torch.equal(opt.exp_avg, saved)
    # Another group size, same DP size and padded size: each rank's slice would hold another
    # rank's state (m follows LOCAL_WORLD_SIZE: a requeue on another node shape changes it).
    with pytest.raises(RuntimeError, match="groups of 2 ranks, this run's are 4"):
        opt.load_state_dict(dict(sd, group_size=2))


def test_resume_layout_check_names_another_paro_group_size():
    """The torch format's layout check: the engine's shards depend on --paro-group-size too."""
    import argparse

    from megatron.training.checkpoint import torch_format as checkpoint_torch_format
    from megatron.training.errors import StartupError

    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              data_parallel_size=16, use_distributed_optimizer=False,
                              paro_strategy="NGG", paro_group_size=4)
    saved = argparse.Namespace(**{**vars(args), "paro_group_size": 8})
    with pytest.raises(StartupError, match="--paro-group-size 8 -> 4"):
        checkpoint_torch_format._check_same_layout("ckpt", saved, args)
    checkpoint_torch_format._check_same_layout("ckpt", argparse.Namespace(**vars(args)), args)
    for core in ("NNG", None):   # megatron-core's layouts do not depend on it
        checkpoint_torch_format._check_same_layout(
            "ckpt", argparse.Namespace(**{**vars(saved), "paro_strategy": core}),
            argparse.Namespace(**{**vars(args), "paro_strategy": core}))


@pytest.fixture
def world1() -> Iterator[None]:
    from dist_harness import model_parallel_world_of_one

    with model_parallel_world_of_one(seed=0):
        yield


def test_host_state_dict_of_a_megatron_gpt(world1):
    """A megatron-core GPTModel (local spec, tied embeddings) on a gloo world of one with its
    parameters partitioned (GGG: shards and per-bucket gathers, real collectives of one rank):
    the checkpoint weights are bit for bit the old save path's."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16,
                     share_embeddings_and_output_weights=True)
    engine = _engine("GGG", 1, module=model)
    want = _old_save_path(engine)
    got = engine.host_state_dict()
    _assert_identical(got, want)
    assert any(k.endswith("word_embeddings.weight") for k in got)
    assert all(not b.gathered for b in engine.buckets)


# ------------------------------------------------------------ 4. auto keeps room for activations
GPT_1B = dict(seq_length=2048, micro_batch_size=1, hidden_size=2048, num_layers=24,
              num_attention_heads=16, vocab_size=50304)


def test_activation_estimate_is_the_papers_formula():
    """Korthikanti et al. 2022: sbh(34 + 5as/h) per layer for 16-bit activations and f = 4h;
    selective recomputation drops the 5as/h term, full recomputation keeps the layer inputs."""
    from megatron.distributed.quant.paro.cost import activation_memory

    s, b, h, a, L, v = 2048, 2, 1024, 16, 4, 1000
    kw = dict(seq_length=s, micro_batch_size=b, hidden_size=h, num_layers=L,
              num_attention_heads=a, vocab_size=v)
    logits = (2 + 4) * s * b * v
    assert activation_memory(**kw) == L * s * b * h * (34 + 5 * a * s / h) + logits
    assert activation_memory(**kw, recompute="selective") == L * s * b * h * 34 + logits
    assert activation_memory(**kw, attention_scores=False) == L * s * b * h * 34 + logits
    assert activation_memory(**kw, recompute="full") == \
        L * 2 * s * b * h + s * b * h * (34 + 5 * a * s / h) + logits
    assert activation_memory(**kw, bytes_per_value=4) > activation_memory(**kw)
    assert activation_memory(**kw, gated_mlp=True, ffn_hidden_size=2816) > \
        activation_memory(**kw, ffn_hidden_size=2816)


def _auto_args(**kw: Any) -> Any:
    import argparse

    base = dict(paro_strategy="auto", data_parallel_size=16, paro_group_size=8,
                paro_gpu_memory_gb=None, paro_reserved_memory_gb=None,
                paro_intra_bandwidth_gbs=300.0, paro_inter_bandwidth_gbs=5.0, bf16=True,
                fp16=False, accumulate_allreduce_grads_in_fp32=True, device="cuda",
                ffn_hidden_size=None, swiglu=False, attention_impl="sdpa",
                recompute_granularity=None, recompute_num_layers=None,
                use_distributed_optimizer=False, padded_vocab_size=None, **GPT_1B)
    base.update(kw)
    return argparse.Namespace(**base)


def _reserved(args: Any, memory_bytes: float) -> Tuple[float, str]:
    """``reserved_bytes_for_auto`` for the run these flags describe."""
    from megatron.distributed.quant import integration
    from megatron.distributed.quant.paro import integration as paro_integration
    from megatron.training.components import activation_shape

    return paro_integration.reserved_bytes_for_auto(
        integration.build_quantization_config(args, frozenset()).paro, memory_bytes,
        integration.activation_bytes_estimate(**activation_shape(args)))


@pytest.fixture
def device_memory(monkeypatch):
    """``auto`` on a pretend 8 GB device, 4 micro-batches (no process group, no GPU needed)."""
    import megatron.core.num_microbatches_calculator as nmc
    from megatron.distributed.quant.paro import integration as paro_integration

    memory = {"bytes": 8e9}
    monkeypatch.setattr(paro_integration, "_memory_for_auto",
                        lambda paro: paro.gpu_memory_gb * 1e9
                        if paro.gpu_memory_gb is not None else memory["bytes"])
    monkeypatch.setattr(nmc, "get_num_microbatches", lambda: 4)
    return memory


def _choose(args: Any) -> Tuple[str, float]:
    from megatron.distributed.quant.paro import integration as paro_integration
    from megatron.distributed.quant.paro.cost import StateBytes, model_state_memory

    from megatron.distributed.quant import integration
    from megatron.training.components import activation_shape

    auto = paro_integration.resolve_auto_strategy(
        integration.build_quantization_config(args, frozenset()), 1.3e9,
        integration.activation_bytes_estimate(**activation_shape(args)))
    mem = model_state_memory(auto.config.paro.strategy, 1.3e9, 16, 8,
                             state_bytes=StateBytes(param=2.0, grad=4.0)).total
    return auto.note, mem


def test_auto_reserves_context_and_activations_by_default(device_memory):
    """No reserve flag, the device's own memory: a tenth of it plus one micro-batch's estimated
    activations stay free, and the chosen strategy's model states fit in the rest (before: 0
    reserved, so auto planned states that filled the GPU)."""
    from megatron.distributed.quant.paro import integration as paro_integration
    from megatron.distributed.quant.paro.cost import DEVICE_RESERVE_FRACTION, activation_memory

    args = _auto_args()
    reserved, why = _reserved(args, 8e9)
    act = activation_memory(**GPT_1B, attention_scores=False)
    assert act > 3e9  # the 1B model's activations at 2K tokens: ~4 GB
    assert reserved == pytest.approx(DEVICE_RESERVE_FRACTION * 8e9 + act)
    assert "estimated activations" in why
    note, mem = _choose(args)
    assert mem <= 8e9 - reserved
    assert f"Reserved {reserved / 1e9:.2f} GB" in note
    # The local attention kernel keeps the s x s scores: more reserved.
    more, _ = _reserved(_auto_args(attention_impl="local"), 8e9)
    assert more > reserved
    # So does Transformer Engine's unfused backend (asked for, or TE's fallback for fp32);
    # its flash / fused kernels do not.
    def te(**kw: Any) -> float:
        return _reserved(
            _auto_args(attention_impl="transformer_engine", **kw), 8e9)[0]

    assert te(attention_backend="unfused") == more
    assert te(attention_backend="flash") == te(attention_backend="auto") == reserved
    assert te(attention_backend="auto", bf16=False) > _reserved(
        _auto_args(bf16=False), 8e9)[0]


def test_auto_picks_leaner_strategies_as_the_reserve_grows(device_memory):
    """Explicit reserves 0..6.5 GB on the 8 GB device: the chosen strategy's model states never
    grow and shrink step by step (NIG 4.2 GB -> IIG 1.95 GB -> GGG 1.46 GB), and the default
    reserve picks a leaner one than 0."""
    mems = []
    for gb in (0.0, 2.0, 4.0, 6.0, 6.5):
        _, mem = _choose(_auto_args(paro_reserved_memory_gb=gb))
        assert mem <= (8.0 - gb) * 1e9
        mems.append(mem)
    assert all(x >= y for x, y in zip(mems, mems[1:])) and len(set(mems)) >= 3, mems
    _, default = _choose(_auto_args())
    assert default < mems[0]


def test_explicit_memory_budget_reserves_nothing_by_default(device_memory):
    """--paro-gpu-memory-gb says what model states may fill: no reserve is taken off it unless
    --paro-reserved-memory-gb says so (the smoke runs' tiny budgets keep working)."""
    from megatron.distributed.quant.paro import integration as paro_integration

    assert _reserved(_auto_args(paro_gpu_memory_gb=5.0), 5e9)[0] == 0
    assert _reserved(
        _auto_args(paro_gpu_memory_gb=5.0, paro_reserved_memory_gb=1.5), 5e9)[0] == 1.5e9
    assert _reserved(
        _auto_args(paro_reserved_memory_gb=0.0), 8e9)[0] == 0.0


def test_strategy_report_is_per_rank_with_model_parallelism(monkeypatch):
    """With TP / PP the startup report's per-rank memory and bytes come from this rank's share
    of the model (what its data-parallel group holds and moves, and what auto sizes); the whole
    model's count made them TP x PP times too large."""
    import argparse

    import megatron.core.num_microbatches_calculator as nmc
    from megatron.distributed.quant import integration
    from megatron.distributed.quant.paro import integration as paro_integration
    from megatron.distributed.quant.config import QuantizationConfig
    from megatron.distributed.quant.paro.cost import format_report, paro_report

    monkeypatch.setattr(nmc, "get_num_microbatches", lambda: 2)
    chunk = torch.nn.Linear(64, 32)   # 2080 parameters on this rank
    args = argparse.Namespace(paro_strategy="NNG", tensor_model_parallel_size=2,
                              pipeline_model_parallel_size=2, data_parallel_size=8,
                              paro_group_size=4, quant_config=QuantizationConfig(),
                              bf16=True, fp16=False, accumulate_allreduce_grads_in_fp32=True,
                              use_distributed_optimizer=True)
    quant = integration.build_quantization_config(args, frozenset())
    text = paro_integration.strategy_report(quant, [chunk], None)
    want = format_report(paro_report("NNG", 2080, 8, 4, micro_steps=2,
                                     quant_config=args.quant_config,
                                     state_bytes=paro_integration._state_bytes(quant.paro)))
    assert text.startswith(want) and "Ψ=2080 params" in text
    assert "this rank's share of the model (tensor x pipeline parallel = 4)" in text
