"""Contract tests of megatron/distributed/mcore_compat/: one per megatron-core touch point.

Why: everything we take from megatron-core's private names (or its undocumented behaviour) goes
through mcore_compat. Each test below pins one thing we rely on, and is named after it, so a
megatron-core upgrade fails here -- in one named test -- instead of somewhere in training. These
tests touch megatron-core privates on purpose (that is what they check); nothing else should.

Fast and single-process: where a process group is needed it is a gloo world of one, inside the
scoped CPU mode (megatron/training/cpu_mode.py), both torn down at the end of the module.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import types
from typing import Any, Iterator, List, Tuple

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dist_harness import model_parallel_world_of_one
from megatron.distributed import mcore_compat as mc
from megatron.distributed.mcore_compat import data as mc_data
from megatron.distributed.mcore_compat import ddp_buckets as mc_buckets
from megatron.distributed.mcore_compat import ops as mc_ops
from megatron.distributed.mcore_compat import optimizer as mc_optimizer
from megatron.distributed.mcore_compat import process_globals as mc_globals
from megatron.training import cpu_mode

PAD = 384  # lcm(P=1, 384) = 384; megatron-core alone pads this model's buckets to 128 and 256


# ------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def world1() -> Iterator[None]:
    """A gloo world of one with megatron-core's model-parallel groups, in scoped CPU mode."""
    with model_parallel_world_of_one():
        yield


def _build(pad: int = 0, optimizer: bool = True) -> Tuple[Any, Any]:
    """(DistributedDataParallel over two Linear layers, its optimizer or None); several buckets,
    overlapped grad reduce and param gather (the paths whose handles we store)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                            use_cpu_initialization=True)

    class Tiny(MegatronModule):
        def __init__(self) -> None:
            super().__init__(cfg)
            self.a = torch.nn.Linear(10, 10)
            self.b = torch.nn.Linear(10, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    ddpc = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                         overlap_param_gather=True, bucket_size=40,
                                         grad_reduce_in_fp32=True)
    if pad:
        with mc_buckets.ddp_buffer_class(pad):
            ddp = DistributedDataParallel(cfg, ddpc, Tiny())
    else:
        ddp = DistributedDataParallel(cfg, ddpc, Tiny())
    opt = None
    if optimizer:
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True,
                            overlap_param_gather=True), [ddp])
    return ddp, opt


class _Handle:
    """Stands in for a collective handle: counts ``wait()`` calls."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


def _statements(source: str) -> List[str]:
    """Code lines of ``source`` without comments, whitespace-collapsed (for preamble checks)."""
    out = []
    for line in source.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(re.sub(r"\s+", " ", line))
    return out


def _names(func: Any) -> set:
    """Global/attribute names a function's code (nested closures included) looks up."""
    out: set = set()
    stack = [inspect.unwrap(func).__code__]
    while stack:
        code = stack.pop()
        out.update(code.co_names)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return out


def _contains_in_order(haystack: List[str], needles: List[str]) -> bool:
    joined = " ".join(haystack)
    return " ".join(needles) in joined


# ------------------------------------------------------------------------------------- version
def test_version_check_rejects_other_megatron_core_versions(monkeypatch) -> None:
    for ok in ("0.16.1", "0.16.0", "0.16.2rc0"):
        mc.check_version(ok)
    for bad in ("0.17.0", "0.15.3", "1.16.1", "garbage"):
        with pytest.raises(ImportError, match=re.escape(bad)) as exc:
            mc.check_version(bad)
        assert mc.SUPPORTED_SPEC in str(exc.value)
    # The import itself runs the check: load the package's __init__ afresh under a fake version.
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    spec = importlib.util.spec_from_file_location("_mcore_compat_probe", mc.__file__)
    probe = importlib.util.module_from_spec(spec)
    with pytest.raises(ImportError, match=r"megatron-core 0\.17\.0 is installed.*0\.16\.x"):
        spec.loader.exec_module(probe)


# ------------------------------------------------------------------------------------- CPU mode
def test_tp_random_rng_state_functions_have_the_signatures_we_replace() -> None:
    import megatron.core.tensor_parallel.random as tp_random

    get_params = list(inspect.signature(tp_random._get_cuda_rng_state).parameters)
    set_params = list(inspect.signature(tp_random._set_cuda_rng_state).parameters)
    assert get_params == ["device", "clone", "graph_safe"]
    assert set_params == ["new_state", "device", "graph_safe"]
    # Our CPU replacements accept the same calls.
    assert list(inspect.signature(cpu_mode._cpu_get_rng_state).parameters) == get_params
    assert list(inspect.signature(cpu_mode._cpu_set_rng_state).parameters) == set_params
    # The tracker reaches them as module globals (so replacing the globals redirects it).
    tracker = tp_random.CudaRNGStatesTracker
    for method in (tracker.fork, tracker.add):
        assert {"_get_cuda_rng_state", "_set_cuda_rng_state"} <= _names(method), method
    orig = (tp_random._get_cuda_rng_state, tp_random._set_cuda_rng_state)
    undo = mc_globals.patch_tp_rng_state(cpu_mode._cpu_get_rng_state, cpu_mode._cpu_set_rng_state)
    assert tp_random._get_cuda_rng_state is cpu_mode._cpu_get_rng_state
    assert tp_random._set_cuda_rng_state is cpu_mode._cpu_set_rng_state
    undo()
    assert (tp_random._get_cuda_rng_state, tp_random._set_cuda_rng_state) == orig


def test_tp_random_cpu_state_warning_text_and_logger() -> None:
    import megatron.core.tensor_parallel.random as tp_random

    assert tp_random.__name__ == mc_globals.TP_RNG_LOGGER
    source = inspect.getsource(tp_random)
    assert f"'{mc_globals.TP_RNG_CPU_STATE_WARNING}'" in source or \
        f'"{mc_globals.TP_RNG_CPU_STATE_WARNING}"' in source
    assert "logging.getLogger(__name__).warning" in source


def test_jit_fuser_is_a_module_global_read_at_decoration() -> None:
    import megatron.core.jit as mcore_jit

    before = mcore_jit.jit_fuser
    undo = mc_globals.suspend_jit_fuser()

    def f(x: Any) -> Any:
        return x

    assert mcore_jit.jit_fuser(f) is f  # no-op decorator
    undo()
    assert mcore_jit.jit_fuser is before


# ------------------------------------------------------------------------------------- datasets
def _write_index(tmp_path: Any, docs: List[List[int]]) -> str:
    from megatron.core.datasets.indexed_dataset import (IndexedDatasetBuilder, get_bin_path,
                                                        get_idx_path)

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    for doc in docs:
        builder.add_document(np.array(doc, dtype=np.int64), [len(doc)])
    builder.finalize(get_idx_path(prefix))
    return prefix


def test_index_reader_reads_an_index_written_by_megatron_core(tmp_path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    prefix = _write_index(tmp_path, docs)
    s = mc_data.read_index_summary(prefix + ".idx")
    assert (s.sequence_count, s.first_document, s.last_document) == (4, 0, 4)
    assert s.dtype is np.uint16 and s.dtype_size == 2
    assert s.data_bytes == os.path.getsize(prefix + ".bin") == 2 * sum(map(len, docs))
    ds = IndexedDataset(prefix)  # .index is the same private reader, with byte-offset pointers
    assert mc_data.index_token_count(ds, np.arange(1, 3)) == 2 + 4  # contiguous: two pointers
    assert mc_data.index_token_count(ds, np.array([0, 3])) == 3 + 1  # otherwise summed
    assert mc_data.index_token_count(ds, np.array([], dtype=np.int64)) == 0


def test_build_megatron_dataset_splits_hands_each_split_its_document_range(tmp_path) -> None:
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    prefix = _write_index(tmp_path, [[i + 1, i + 2] for i in range(100)])
    config = GPTDatasetConfig(random_seed=1, sequence_length=4, blend=([prefix], None),
                              split="80,15,5", tokenizer=types.SimpleNamespace(vocab_size=300),
                              reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False,
                              path_to_cache=str(tmp_path / "cache"), mmap_bin_files=True)
    parts = mc_data.dataset_split_parts(prefix, config)
    assert [(int(p.indices[0]), int(p.indices[-1]) + 1) for p in parts] == \
        [(0, 80), (80, 95), (95, 100)]
    assert all(len(p.dataset) == 100 for p in parts)  # the file's IndexedDataset
    config.split_matrix = [config.split_matrix[0], None, None]  # a None bookend: not built
    parts = mc_data.dataset_split_parts(prefix, config)
    assert parts[1] is None and parts[2] is None and len(parts[0].indices) == 80


def test_gpt_dataset_get_num_epochs_never_ends_on_an_empty_split() -> None:
    """Why data.py checks every used split first. If this fails, megatron-core fixed the hang:
    the check may stay (it names the fix), but its docstring should be updated."""
    from megatron.core.datasets.gpt_dataset import GPTDataset

    class StillLooping(Exception):
        pass

    class Counting(int):
        calls = 0

        def __add__(self, other: Any) -> "Counting":
            Counting.calls += 1
            if Counting.calls > 10_000:
                raise StillLooping
            return Counting(int(self) + int(other))

    fake = types.SimpleNamespace(num_samples=0, config=types.SimpleNamespace(
        sequence_length=32, add_extra_token_to_sequence=True))
    with pytest.raises(StillLooping):  # 0 samples still ask for 1 token; 0 tokens per epoch
        GPTDataset._get_num_epochs(fake, Counting(0))


# ------------------------------------------------------------------------------------- init / ckpt
def test_num_microbatches_calculator_init_asserts_and_destroy_is_safe() -> None:
    from megatron.core import num_microbatches_calculator as nmc

    kw = dict(rank=1, rampup_batch_size=None, global_batch_size=8, micro_batch_size=2,
              data_parallel_size=1)
    nmc.destroy_num_microbatches_calculator()
    nmc.destroy_num_microbatches_calculator()  # safe when none exists
    nmc.init_num_microbatches_calculator(**kw)
    try:
        with pytest.raises(AssertionError):  # why reinit destroys first
            nmc.init_num_microbatches_calculator(**kw)
        mc_globals.reinit_num_microbatches_calculator(**dict(kw, global_batch_size=16))
        assert nmc.get_num_microbatches() == 8
    finally:
        nmc.destroy_num_microbatches_calculator()


def test_distributed_optimizer_init_optimizer_states_with_dummy_values(world1) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    assert callable(getattr(DistributedOptimizer, "_init_optimizer_states_with_dummy_values"))
    _, opt = _build()
    (leaf,) = mc_optimizer.leaf_optimizers(opt)
    assert len(leaf.optimizer.state) == 0
    mc_optimizer.init_optimizer_states_with_dummy_values(leaf)
    states = list(leaf.optimizer.state.values())
    assert states and all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for s in states)


# ------------------------------------------------------------------------------------- DDP buffers
def test_ddp_looks_up_param_and_grad_buffer_as_a_module_global(world1) -> None:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed import distributed_data_parallel as ddp_module

    assert mc_buckets.ParamAndGradBuffer is ddp_module._ParamAndGradBuffer
    assert "_ParamAndGradBuffer" in _names(DistributedDataParallel.__init__)
    ddp, _ = _build(PAD, optimizer=False)
    assert ddp.buffers and all(isinstance(b, mc_buckets.PaddedParamAndGradBuffer)
                               for b in ddp.buffers)
    # restored after __init__
    assert ddp_module._ParamAndGradBuffer is mc_buckets.ParamAndGradBuffer
    with pytest.raises(ZeroDivisionError):
        with mc_buckets.ddp_buffer_class(PAD):
            raise ZeroDivisionError
    assert ddp_module._ParamAndGradBuffer is mc_buckets.ParamAndGradBuffer  # restored on error too


def test_bucket_padding_closure_reads_data_parallel_world_size(world1) -> None:
    plain, _ = _build(optimizer=False)
    assert any(b.grad_data.numel() % PAD for buf in plain.buffers for b in buf.buckets)
    ddp, _ = _build(PAD, optimizer=False)
    numels = [b.grad_data.numel() for buf in ddp.buffers for b in buf.buckets]
    assert len(numels) > 1 and all(n % PAD == 0 for n in numels), numels
    assert all(buf.data_parallel_world_size == 1 for buf in ddp.buffers)  # real P afterwards


# ---------------------------------------------------------------------------------- bucket groups
def test_bucket_group_class_swap_keeps_megatron_cores_objects(world1) -> None:
    class Mine(mc_buckets.ParamAndGradBucketGroup):
        pass

    ddp, _ = _build(optimizer=False)
    group = ddp.bucket_groups[0]
    assert mc_buckets.adopt_bucket_group(group, Mine) is group and type(group) is Mine
    assert any(g is group for g in ddp.param_to_bucket_group.values())
    with pytest.raises(TypeError):
        mc_buckets.adopt_bucket_group(object(), Mine)
    with pytest.raises(TypeError):
        mc_buckets.adopt_bucket_group(ddp.bucket_groups[-1], object)


def test_start_grad_sync_preamble_is_megatron_cores(world1) -> None:
    source = _statements(inspect.getsource(mc_buckets.ParamAndGradBucketGroup.start_grad_sync))
    assert _contains_in_order(source, [
        "if self.is_first_batch and self.grad_reduce_handle is not None:", "return",
        "assert (", "self.grad_reduce_handle is None",
        '), "Should not have multiple communication calls outstanding at once"',
        "if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:",
        "self.check_grads(", "check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,",
        "check_for_large=self.ddp_config.check_for_large_grads,", ")",
        "for bucket in self.buckets:", "if bucket.gradient_scaling_factor != 1.0:",
        "bucket.grad_data *= bucket.gradient_scaling_factor",
        "reduce_op = torch.distributed.ReduceOp.SUM"]), "megatron-core's preamble changed"
    ddp, _ = _build(optimizer=False)
    group = ddp.bucket_groups[0]
    group.is_first_batch, group.grad_reduce_handle = True, _Handle()
    assert mc_buckets.grad_sync_is_noop(group) and not mc_buckets.grad_sync_preamble(group)
    group.grad_reduce_handle = None
    bucket = group.buckets[0]
    bucket.grad_data.fill_(2.0)
    bucket.gradient_scaling_factor = 0.25
    assert mc_buckets.grad_sync_preamble(group)
    assert torch.all(bucket.grad_data == 0.5)
    group.is_first_batch, group.grad_reduce_handle = False, _Handle()
    with pytest.raises(AssertionError, match="outstanding"):
        mc_buckets.grad_sync_preamble(group)


def test_start_param_sync_preamble_is_megatron_cores(world1) -> None:
    source = _statements(inspect.getsource(mc_buckets.ParamAndGradBucketGroup.start_param_sync))
    assert _contains_in_order(source, [
        "assert self.ddp_config.use_distributed_optimizer", "if force_sync:",
        "if self.param_gather_handle is not None:", "self.param_gather_handle.wait()",
        "self.param_gather_handle = None", "return", "else:",
        "assert self.param_gather_handle is None"]), "megatron-core's preamble changed"
    ddp, _ = _build(optimizer=False)
    group = ddp.bucket_groups[0]
    handle = _Handle()
    group.param_gather_handle = handle
    assert mc_buckets.param_sync_is_wait_only(group, True)
    assert not mc_buckets.param_sync_preamble(group, force_sync=True)
    assert handle.waits == 1 and group.param_gather_handle is None
    assert mc_buckets.param_sync_preamble(group, force_sync=True)
    assert mc_buckets.param_sync_preamble(group, force_sync=False)
    group.param_gather_handle = _Handle()
    with pytest.raises(AssertionError):
        mc_buckets.param_sync_preamble(group, force_sync=False)


def test_finish_grad_sync_waits_on_grad_reduce_handle(world1) -> None:
    ddp, _ = _build(optimizer=False)
    group = ddp.bucket_groups[0]
    handle = _Handle()
    for first_batch in (True, False):  # first batch: start_grad_sync is a no-op with a handle
        handle.waits = 0
        group.is_first_batch = first_batch
        mc_buckets.set_grad_reduce_handle(group, handle)
        group.finish_grad_sync()
        assert handle.waits == 1 and group.grad_reduce_handle is None


def test_finish_param_sync_waits_on_param_gather_handle(world1) -> None:
    ddp, _ = _build(optimizer=False)
    group = ddp.bucket_groups[0]
    handle = _Handle()
    mc_buckets.set_param_gather_handle(group, handle)
    assert group.param_gather_dispatched
    group.finish_param_sync(skip_next_bucket_dispatch=True)
    assert handle.waits == 1 and group.param_gather_handle is None


def test_bucket_shards_are_megatron_cores_cached_views(world1) -> None:
    ddp, _ = _build(optimizer=False)
    group = ddp.bucket_groups[0]
    assert mc_buckets.dp_instance_size(group) == 1 and mc_buckets.dp_instance_rank(group) == 0
    assert dist.get_process_group_ranks(mc_buckets.dp_instance_group(group)) == [0]
    grad = mc_buckets.bucket_grad_shard(group, 0)
    assert grad is group.cached_grad_buffer_shard_list[0][0]
    assert grad.data_ptr() == group.buckets[0].grad_data.data_ptr()
    assert mc_buckets.bucket_grad_shard(group, 0) is grad
    param = mc_buckets.bucket_param_shard(group, 0)
    assert param is group.cached_param_buffer_shard_list[0][0]
    assert param.data_ptr() == group.buckets[0].param_data.data_ptr()
    assert mc_buckets.shard_buffer is mc_buckets._mcore_pgb_module.shard_buffer


def test_bucket_collectives_are_param_and_grad_buffer_module_globals() -> None:
    pgb = mc_buckets._mcore_pgb_module
    grad_names = _names(mc_buckets.ParamAndGradBucketGroup.start_grad_sync)
    param_names = _names(mc_buckets.ParamAndGradBucketGroup.start_param_sync)
    assert {"dist_reduce_scatter_func", "_coalescing_manager"} <= grad_names
    assert "_coalescing_manager" in param_names
    before = (pgb.dist_reduce_scatter_func, pgb._coalescing_manager)
    rs, cm = (lambda *a, **k: None), (lambda *a, **k: None)
    undo = mc_buckets.patch_bucket_collectives(reduce_scatter=rs, coalescing_manager=cm)
    assert (pgb.dist_reduce_scatter_func, pgb._coalescing_manager) == (rs, cm)
    undo()
    assert (pgb.dist_reduce_scatter_func, pgb._coalescing_manager) == before


# ------------------------------------------------------------------------------------- optimizer
def test_distributed_optimizer_step_calls_copy_main_params_to_model_params(world1) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    assert callable(getattr(DistributedOptimizer, "_copy_main_params_to_model_params"))
    assert "_copy_main_params_to_model_params" in \
        _names(MixedPrecisionOptimizer.step_with_ready_grads)
    ddp, opt = _build()
    leaves = mc_optimizer.leaf_optimizers(opt)
    assert leaves and all(isinstance(leaf, DistributedOptimizer) for leaf in leaves)
    calls: List[int] = []
    for leaf in leaves:
        assert mc_optimizer.wrap_copy_main_params_to_model_params(leaf, lambda: calls.append(1))
        assert mc_optimizer.wrap_copy_main_params_to_model_params(
            leaf, lambda: calls.append(2))  # no-op
    assert not mc_optimizer.wrap_copy_main_params_to_model_params(object(), lambda: None)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp(torch.ones(2, 10)).sum().backward()
    ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok and calls == [1] * len(leaves)


def test_optimizer_step_looks_up_prepare_grads_on_the_instance(world1) -> None:
    ddp, opt = _build()
    calls: List[str] = []
    opt.prepare_grads = lambda: calls.append("orig") or True  # the original finds inf ...
    mc_optimizer.wrap_prepare_grads(opt, lambda: calls.append("extra") or False)
    mc_optimizer.wrap_prepare_grads(opt, lambda: calls.append("twice") or False)  # idempotent
    assert opt.step() == (False, None, None)
    assert calls == ["orig", "extra"]  # ... and extra still runs (it may hold a collective)
    calls.clear()
    opt.prepare_grads = lambda: calls.append("orig") or False
    mc_optimizer.wrap_prepare_grads(opt, lambda: calls.append("extra") or True)
    assert opt.step() == (False, None, None) and calls == ["orig", "extra"]


def test_step_looks_up_step_with_ready_grads_on_the_instance(world1) -> None:
    """``--overlap-param-gather-with-optimizer-step`` with one chunk: the dispatch runs after a
    successful step only, once however often the wrapper is installed."""
    ddp, opt = _build()
    calls: List[str] = []
    mc_optimizer.wrap_step_with_ready_grads(opt, lambda: calls.append("after"))
    mc_optimizer.wrap_step_with_ready_grads(opt, lambda: calls.append("twice"))  # idempotent
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp(torch.ones(2, 10)).sum().backward()
    ddp.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok and calls == ["after"]
    calls.clear()
    opt.prepare_grads = lambda: True  # found inf: no step, no dispatch
    assert opt.step() == (False, None, None) and calls == []


def test_bucket_groups_are_in_reverse_forward_order_and_pre_hook_skips_dispatch(world1) -> None:
    """What :func:`mc_buckets.dispatch_param_gathers_after_step` relies on: group i's
    ``next_param_gather_bucket_group`` is group i-1 (forward order = reversed list), and
    ``finish_param_sync`` chain-dispatches unless the chunk's
    ``overlap_param_gather_with_optimizer_step`` attribute is set."""
    ddp, _ = _build(optimizer=False)
    groups = ddp.bucket_groups
    assert len(groups) >= 2
    assert groups[0].next_param_gather_bucket_group is None
    for i in range(1, len(groups)):
        assert groups[i].next_param_gather_bucket_group is groups[i - 1]
    assert ddp.overlap_param_gather_with_optimizer_step is False
    assert "overlap_param_gather_with_optimizer_step" in _names(ddp._make_forward_pre_hook)
    order: List[int] = []
    for i, g in enumerate(groups):
        g.param_gather_dispatched = False
        g.start_param_sync = (lambda i=i, g=g: order.append(i)
                              or mc_buckets.set_param_gather_handle(g, _Handle()))
    mc_buckets.dispatch_param_gathers_after_step(ddp)
    assert order == list(reversed(range(len(groups))))
    assert ddp.overlap_param_gather_with_optimizer_step is True
    mc_buckets.dispatch_param_gathers_after_step(ddp)  # already dispatched: nothing more
    assert order == list(reversed(range(len(groups))))


def test_precision_aware_optimizer_flag_and_chained_optimizers(world1) -> None:
    from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig

    assert hasattr(OptimizerConfig(), "use_precision_aware_optimizer_no_fp8_or_ds_fp8")
    _, opt = _build()
    assert isinstance(opt, ChainedOptimizer) and hasattr(opt, "chained_optimizers")
    assert not any(mc_optimizer.writes_model_params_in_step(leaf)
                   for leaf in mc_optimizer.leaf_optimizers(opt))
    fake = types.SimpleNamespace(config=types.SimpleNamespace(
        use_precision_aware_optimizer_no_fp8_or_ds_fp8=True))
    assert mc_optimizer.writes_model_params_in_step(fake)
    assert not mc_optimizer.writes_model_params_in_step(object())


def test_distributed_optimizer_model_param_range_map(world1) -> None:
    ddp, opt = _build()
    (leaf,) = mc_optimizer.leaf_optimizers(opt)
    for param in ddp.module.parameters():
        ranges = mc_optimizer.model_param_range_map(leaf, param)
        assert {"param", "gbuf_world_in_bucket"} <= set(ranges)
        assert (ranges["param"].start, ranges["param"].end) == (0, param.numel())  # P = 1
        assert ranges["gbuf_world_in_bucket"].size == param.numel()


def test_torch_dist_results_queue_is_the_global_megatron_core_reads(monkeypatch) -> None:
    """writer_processes installs its own write-results queue (served by a process that dies with
    the rank): megatron-core must take the installed one instead of spawning its own manager."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    assert mc_globals.torch_dist_results_queue() is None
    installed = object()
    mc_globals.set_torch_dist_results_queue(installed)
    assert mc_globals.torch_dist_results_queue() is installed
    assert filesystem_async._get_write_results_queue() is installed


def test_foreach_multi_tensor_ops_replace_megatron_cores_fallback(monkeypatch) -> None:
    """The globals install_foreach_multi_tensor_ops replaces are the ones clip_grads and the
    optimizer read at call time, and a second install changes nothing."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    for module, name in ((clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_impl"),
                         (mcore_optimizer, "multi_tensor_scale_impl")):
        monkeypatch.setattr(module, name, getattr(module, name))
    before = clip_grads.l2_norm_impl
    undo = mc_ops.install_foreach_multi_tensor_ops()
    assert clip_grads.l2_norm_impl is mc_ops.foreach_multi_tensor_l2_norm
    assert mcore_optimizer.multi_tensor_scale_impl is mc_ops.foreach_multi_tensor_scale
    mc_ops.install_foreach_multi_tensor_ops()()          # already installed: its undo is a no-op
    assert clip_grads.l2_norm_impl is mc_ops.foreach_multi_tensor_l2_norm
    grads = [torch.full((3,), 2.0), torch.full((4,), 2.0)]
    norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, None, [grads], False)
    assert norm.item() == pytest.approx(2.0 * 7 ** 0.5)
    undo()
    assert clip_grads.l2_norm_impl is before


def test_moe_router_reads_te_general_gemm_that_only_te_defines() -> None:
    """megatron-core 0.16's router gating reads ``te_general_gemm`` unconditionally, a name its
    module defines only with Transformer Engine: without TE the router fails until
    :func:`install_moe_fixes` defines it as None (then the torch.mm branch runs)."""
    import inspect

    from megatron.core.transformer.moe import moe_utils
    from megatron.distributed.mcore_compat.moe import install_moe_fixes

    assert "te_general_gemm is not None" in inspect.getsource(moe_utils.RouterGatingLinearFunction)
    if getattr(moe_utils, "HAVE_TE", False):
        pytest.skip("Transformer Engine installed: megatron-core defines the name itself")
    had = "te_general_gemm" in vars(moe_utils)  # a model built in this process installed it
    undo = install_moe_fixes(cpu=False)
    try:
        x, w = torch.randn(3, 4), torch.randn(2, 4)
        out = moe_utils.router_gating_linear(x, w, None, torch.float32)
        assert torch.equal(out, x @ w.t())
    finally:
        undo()
    assert ("te_general_gemm" in vars(moe_utils)) == had


def test_alltoall_dispatcher_splits_are_host_numpy_only_for_cuda_tensors() -> None:
    """The alltoall token dispatcher hands ``maybe_move_tensor_to_cpu(..., as_numpy=True)``'s
    result to ``all_to_all_single`` as split sizes; megatron-core converts CUDA tensors only, so
    on CPU the wrapper of :func:`install_moe_fixes` returns numpy for host tensors too."""
    import inspect

    import numpy as np
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.distributed.mcore_compat.moe import install_moe_fixes

    assert "maybe_move_tensor_to_cpu(" in inspect.getsource(token_dispatcher)
    splits = torch.tensor([3, 5])
    current = token_dispatcher.maybe_move_tensor_to_cpu  # a model built here may have wrapped it
    original = getattr(current, "__wrapped__", current)
    assert torch.is_tensor(original(splits, as_numpy=True))  # megatron-core's: stays a tensor
    undo = install_moe_fixes(cpu=True)
    try:
        moved = token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)
        assert isinstance(moved, np.ndarray) and moved.tolist() == [3, 5]
        assert install_moe_fixes(cpu=True) is not None  # idempotent: wraps once
        assert not hasattr(token_dispatcher.maybe_move_tensor_to_cpu.__wrapped__, "__wrapped__")
    finally:
        undo()
    assert token_dispatcher.maybe_move_tensor_to_cpu is current
