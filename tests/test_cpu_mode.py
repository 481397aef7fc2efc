"""CPU mode: megatron-core GPTModel + DDP + DistributedOptimizer train on 2 gloo CPU ranks.

Why: every other CPU test (and the DDP/quantization engineers' tests) relies on CPU mode
(``with cpu_mode():``, or the entered-forever ``enable_cpu_mode()``) making megatron-core 0.16.1
run without CUDA. The training test exercises all the touch points at once: bf16 Float16Module,
DDP with overlapped grad reduce-scatter and param all-gather, the distributed optimizer with fp32
main grads and grad clipping, the no-pipelining schedule and the RNG tracker (dropout on).
The scope tests pin that CPU mode is scoped: leaving it restores every object it replaced (a
process, e.g. this test session, is not left patched), and it can be entered again.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.training import cpu_mode
from dist_harness import free_port, init_process_group, shutdown_process_group


def _train_worker(rank: int, world: int, port: int, out_dir: str, steps: int) -> None:
    """One rank: build the tiny model stack, train `steps` steps on a repeated batch."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    init_process_group(rank, world, port)
    with cpu_mode.cpu_mode():
        _train(rank, world, out_dir, steps)
    shutdown_process_group()  # final barrier: rank 0 hosts the store, it must not leave first


def _train(rank: int, world: int, out_dir: str, steps: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        hidden_dropout=0.1, attention_dropout=0.1, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, use_cpu_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)
    vocab, seq, mbs = 128, 32, 2
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope")
    model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, overlap_param_gather=True,
        use_distributed_optimizer=True, bucket_size=20000)  # several buckets
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.0, bf16=True,
                        params_dtype=torch.bfloat16, use_distributed_optimizer=True,
                        overlap_param_gather=True, clip_grad=1.0),
        [ddp])
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss

    gen = torch.Generator().manual_seed(99 + rank)  # ranks see different data
    tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=gen)
    batch = {
        "tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(seq).unsqueeze(0).expand(mbs, -1).contiguous(),
        "loss_mask": torch.ones(mbs, seq),
    }

    def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
        loss = (output.float().view(-1) * loss_mask.view(-1)).sum() / loss_mask.sum()
        # clone: the schedule divides the returned loss in place by num_microbatches
        return loss, {"lm loss": loss.detach().clone()}

    def forward_step(data_iterator, model_):
        b = next(data_iterator)
        out = model_(b["tokens"], b["position_ids"], None, labels=b["labels"])
        return out, partial(loss_func, b["loss_mask"])

    fwd_bwd = get_forward_backward_func()
    losses: List[float] = []
    grad_norms: List[float] = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = fwd_bwd(forward_step_func=forward_step, data_iterator=iter([batch, batch]),
                      model=[ddp], num_microbatches=2, seq_length=seq, micro_batch_size=mbs,
                      decoder_seq_length=seq, forward_only=False)
        ok, grad_norm, _ = opt.step()
        assert ok
        losses.append(float(torch.stack([o["lm loss"] for o in out]).mean()))
        grad_norms.append(float(grad_norm))
    # Finish the pending (overlapped) param all-gather before comparing parameters.
    ddp.start_param_sync(force_sync=True)
    flat = torch.cat([p.detach().float().view(-1) for p in ddp.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(gathered[0], g) for g in gathered)
    main_dtypes = sorted({str(p.dtype) for g in opt.optimizer.param_groups for p in g["params"]})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "losses": losses, "grad_norms": grad_norms, "params_identical": same,
        "param_dtypes": sorted({str(p.dtype) for p in ddp.parameters()}),
        "main_param_dtypes": main_dtypes,
        "num_buckets": len(ddp.bucket_groups),
        "proxied": len(cpu_mode.proxied_modules()),
    }))


def test_cpu_mode_ddp_distributed_optimizer_trains(tmp_path: Path) -> None:
    steps = 6
    mp.spawn(_train_worker, args=(2, free_port(), str(tmp_path), steps), nprocs=2, join=True)
    r = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for res in r:
        assert all(math.isfinite(x) for x in res["losses"]), res["losses"]
        assert all(math.isfinite(x) and x > 0 for x in res["grad_norms"]), res["grad_norms"]
        # Same batch every step: the loss must fall clearly.
        assert res["losses"][-1] < res["losses"][0] - 0.3, res["losses"]
        assert res["params_identical"]
        assert res["param_dtypes"] == ["torch.bfloat16"]
        assert res["main_param_dtypes"] == ["torch.float32"]  # fp32 main params in the optimizer
        assert res["num_buckets"] > 1
        assert res["proxied"] > 10
    # The grad norm is global (computed over the whole distributed optimizer state).
    assert r[0]["grad_norms"] == pytest.approx(r[1]["grad_norms"], rel=1e-6)
    # Ranks saw different data, so the local losses differ.
    assert r[0]["losses"] != r[1]["losses"]


def _patchable_state() -> Dict[str, Any]:
    """Every object CPU mode replaces, as it is now (identity matters, not equality)."""
    import megatron.core.jit as mcore_jit
    import megatron.core.tensor_parallel.random as tp_random

    return {
        "module_torch": {name: mod.torch for name, mod in list(sys.modules.items())
                         if name.startswith("megatron.core") and mod is not None
                         and hasattr(mod, "torch")},
        "tensor_type": torch.Tensor.type, "tensor_cuda": torch.Tensor.cuda,
        "tensor_own": {n for n in ("type", "cuda") if n in torch.Tensor.__dict__},
        "rng_get": tp_random._get_cuda_rng_state, "rng_set": tp_random._set_cuda_rng_state,
        "jit_fuser": mcore_jit.jit_fuser,
        "log_filters": list(logging.getLogger(tp_random.__name__).filters),
    }


def _assert_same(before: Dict[str, Any], after: Dict[str, Any]) -> None:
    for key in before:
        if key == "module_torch":
            changed = [n for n, t in before[key].items() if after[key].get(n) is not t]
            assert not changed, f"modules whose torch was not restored: {changed[:5]}"
        elif isinstance(before[key], (list, set)):
            assert before[key] == after[key], key
        else:
            assert after[key] is before[key], key


@pytest.fixture
def cpu_mode_off() -> None:
    if cpu_mode.is_cpu_mode():
        pytest.skip("CPU mode was entered for this whole process by an earlier test")


def _assert_patched() -> None:
    import megatron.core.jit as mcore_jit
    import megatron.core.optimizer.optimizer as mopt
    import megatron.core.tensor_parallel.random as tp_random

    assert cpu_mode.is_cpu_mode()
    assert mopt.torch is not torch
    assert tp_random._get_cuda_rng_state is cpu_mode._cpu_get_rng_state
    assert torch.Tensor.type is cpu_mode._tensor_type
    assert torch.Tensor.cuda is cpu_mode._tensor_cuda
    assert mcore_jit.jit_fuser is mcore_jit.noop_decorator
    assert any(isinstance(f, cpu_mode._DropCpuRngWarning)
               for f in logging.getLogger(tp_random.__name__).filters)


def test_cpu_mode_scope_restores_every_original_object(cpu_mode_off) -> None:
    import megatron.core  # noqa: F401 -- so that "before" covers megatron-core's modules

    before = _patchable_state()
    scope = cpu_mode.cpu_mode()
    for _ in range(2):  # re-entering the same scope object works
        with scope as entered:
            assert entered is scope and entered.proxied > 10
            _assert_patched()
            with cpu_mode.cpu_mode():  # nested: only the outermost exit restores
                _assert_patched()
            _assert_patched()
        assert not cpu_mode.is_cpu_mode() and cpu_mode.proxied_modules() == []
        _assert_same(before, _patchable_state())
        assert not [n for n, m in list(sys.modules.items()) if n.startswith("megatron.core")
                    and getattr(m, "torch", None) is cpu_mode._TORCH_PROXY]
    with pytest.raises(RuntimeError):
        scope.__exit__(None, None, None)  # left more often than entered
    with cpu_mode.cpu_mode(enabled=False):
        assert not cpu_mode.is_cpu_mode()


def test_cpu_mode_scope_restores_on_error(cpu_mode_off) -> None:
    before = _patchable_state()
    with pytest.raises(ValueError):
        with cpu_mode.cpu_mode():
            raise ValueError("boom")
    assert not cpu_mode.is_cpu_mode()
    _assert_same(before, _patchable_state())


def test_enable_cpu_mode_is_entered_forever_until_disabled(cpu_mode_off) -> None:
    before = _patchable_state()
    try:
        cpu_mode.enable_cpu_mode()
        assert cpu_mode.enable_cpu_mode() == 0  # nothing new to proxy: idempotent
        with cpu_mode.cpu_mode():
            pass
        _assert_patched()  # a scope's exit does not end the entered-forever mode
    finally:
        cpu_mode.disable_cpu_mode()
    assert not cpu_mode.is_cpu_mode()
    _assert_same(before, _patchable_state())


def test_cpu_mode_is_targeted() -> None:
    """Only megatron-core sees the CPU redirect; global torch still refuses CUDA on CPU hosts."""
    with cpu_mode.cpu_mode() as scope:
        assert scope.refresh() == 0  # nothing new to proxy
        import megatron.core.optimizer.optimizer as mopt
        import megatron.core.transformer.utils as tutils

        assert mopt.torch is not torch
        assert mopt.torch.tensor([1.0], device="cuda").device.type == "cpu"
        assert mopt.torch.cuda.current_device() == torch.device("cpu")
        assert tutils.get_default_causal_mask(4).device.type == "cpu"
        assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.BFloat16Tensor"
        if not torch.cuda.is_available():
            with pytest.raises((RuntimeError, AssertionError)):
                torch.zeros(1, device="cuda")
