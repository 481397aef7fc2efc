"""Run megatron-core 0.16.1 on CPU ranks (gloo) without touching megatron-core's source.

Why: megatron-core assumes CUDA everywhere (buffers on ``torch.cuda.current_device()``, helper
tensors made with ``device='cuda'``, CUDA streams, ``Tensor.type()`` compared with
``'torch.cuda.*Tensor'``, CUDA RNG states), none of it needed for correctness on CPU. Those touch
points are redirected to the CPU **inside megatron-core only**: a ``torch`` proxy per
megatron-core module, CPU versions of the RNG tracker's state functions, ``Tensor.type()`` /
``cuda()`` answered as on CUDA for megatron-core callers only, the JIT fuser off, one log filter.
``with cpu_mode():`` applies them and restores every original on exit (scopes nest);
:func:`enable_cpu_mode` enters for the rest of the process. Enter before building models and
optimizers. See [Note: CPU mode patches] in docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import types
from typing import Any, Callable, Dict, List, Optional

import torch

__all__ = ["cpu_mode", "CpuMode", "enable_cpu_mode", "disable_cpu_mode", "refresh_cpu_mode",
           "is_cpu_mode", "cpu_mode_requested", "proxied_modules"]

_REAL_TORCH = torch
_ORIG_TENSOR_TYPE = torch.Tensor.type
_ORIG_TENSOR_CUDA = torch.Tensor.cuda

# Modules imported eagerly by enable_cpu_mode so that their ``torch`` global is proxied before
# anyone calls into them (every megatron-core module on the GPTModel/DDP/optimizer/schedule path).
_PRELOAD_MODULES = (
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.module",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.mlp",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.common.embeddings.language_model_embedding",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.distributed",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.timers",
    "megatron.core.rerun_state_machine",
)

# Lazily compiled code resolves its globals at first call; a proxy object there would confuse
# TorchScript / dynamo, and these modules hold no CUDA touch points on the CPU path.
_SKIP_MODULE_PREFIXES = (
    "megatron.core.fusions",
    "megatron.core.jit",
    "megatron.core.extensions",
    "megatron.core.distributed.fsdp",
)


def _is_cuda_device(device: Any) -> bool:
    """True for every spelling of a CUDA device: 'cuda', 'cuda:0', torch.device('cuda'), 0."""
    if device is None:
        return False
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # torch treats a bare int as a CUDA ordinal
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, _REAL_TORCH.device):
        return device.type == "cuda"
    return False


def _map_device(device: Any) -> Any:
    return _REAL_TORCH.device("cpu") if _is_cuda_device(device) else device


def _wrap_factory(fn: Callable) -> Callable:
    """Wrap a torch factory so a CUDA ``device=`` becomes CPU; ``pin_memory`` is dropped too
    (pinning needs a CUDA runtime)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "factory")
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    return wrapper


_FACTORY_NAMES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "randperm", "zeros_like", "ones_like", "empty_like", "full_like", "linspace", "eye",
    "empty_strided", "tril_indices", "triu_indices",
)


class _DeviceMeta(type):
    """``torch.device`` replacement: constructing maps CUDA to CPU, ``isinstance`` still works."""

    def __call__(cls, *args: Any, **kwargs: Any) -> torch.device:  # type: ignore[override]
        if args and isinstance(args[0], str) and args[0].startswith("cuda"):
            return _REAL_TORCH.device("cpu")
        if args and isinstance(args[0], _REAL_TORCH.device) and args[0].type == "cuda":
            return _REAL_TORCH.device("cpu")
        return _REAL_TORCH.device(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _REAL_TORCH.device)


class _CpuDevice(metaclass=_DeviceMeta):
    """Stand-in for ``torch.device`` inside megatron-core modules (see :class:`_DeviceMeta`)."""


class _NullStream:
    """No-op ``torch.cuda.Stream``: CPU ops and gloo collectives are host-ordered already."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = _REAL_TORCH.device("cpu")

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NullEvent":
        return event if event is not None else _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullEvent:
    """No-op ``torch.cuda.Event`` (timing falls back to host clocks in our trainer)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


class _CudaShim(types.ModuleType):
    """What megatron-core sees as ``torch.cuda`` in CPU mode."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self.current_device = lambda: _REAL_TORCH.device("cpu")
        self.is_available = lambda: False
        self.device_count = lambda: 0
        self.Stream = _NullStream
        self.Event = _NullEvent
        self.stream = lambda stream=None: contextlib.nullcontext()
        self.current_stream = lambda device=None: _NullStream()
        self.default_stream = lambda device=None: _NullStream()
        self.synchronize = _noop
        self.empty_cache = _noop
        self.set_device = _noop
        self.device = lambda device=None: contextlib.nullcontext()
        self.memory_allocated = _zero
        self.max_memory_allocated = _zero
        self.memory_reserved = _zero
        self.max_memory_reserved = _zero
        self.reset_peak_memory_stats = _noop
        self.get_rng_state = lambda device="cuda": _REAL_TORCH.get_rng_state()
        self.set_rng_state = lambda new_state, device="cuda": _REAL_TORCH.set_rng_state(new_state)
        self.manual_seed = lambda seed: _REAL_TORCH.manual_seed(seed)
        self.manual_seed_all = lambda seed: _REAL_TORCH.manual_seed(seed)
        self.is_current_stream_capturing = lambda: False
        self.nvtx = types.SimpleNamespace(range_push=_noop, range_pop=_noop, mark=_noop,
                                          range=lambda *a, **k: contextlib.nullcontext())

    def __getattr__(self, name: str) -> Any:
        return getattr(_REAL_TORCH.cuda, name)


_CUDA_SHIM = _CudaShim()


class _TorchProxy(types.ModuleType):
    """What a megatron-core module sees as ``torch`` in CPU mode (see module docstring)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CUDA_SHIM
        self.device = _CpuDevice
        for name in _FACTORY_NAMES:
            if hasattr(_REAL_TORCH, name):
                setattr(self, name, _wrap_factory(getattr(_REAL_TORCH, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(_REAL_TORCH, name)


_TORCH_PROXY = _TorchProxy()
_PROXIED: Dict[str, types.ModuleType] = {}


def _called_from_megatron_core(depth: int = 2) -> bool:
    frame = sys._getframe(depth)
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name.startswith("megatron.core")


def _tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.type`` that reports CUDA type strings to megatron-core for CPU tensors."""
    result = _ORIG_TENSOR_TYPE(self, *args, **kwargs)
    if (not args and not kwargs and isinstance(result, str) and self.device.type == "cpu"
            and not result.startswith("torch.cuda.") and _called_from_megatron_core()):
        return "torch.cuda." + result[len("torch."):]
    return result


def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.cuda`` that is the identity for megatron-core callers in CPU mode."""
    if _called_from_megatron_core():
        return self
    return _ORIG_TENSOR_CUDA(self, *args, **kwargs)


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False,
                       graph_safe: bool = False) -> torch.Tensor:
    """CPU replacement of ``tensor_parallel.random._get_cuda_rng_state``."""
    return _REAL_TORCH.get_rng_state()  # already a copy


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1,
                       graph_safe: bool = False) -> None:
    """CPU replacement of ``tensor_parallel.random._set_cuda_rng_state``."""
    _REAL_TORCH.set_rng_state(new_state)


class _DropCpuRngWarning(logging.Filter):
    """Drops the RNG-tracker warning that is expected in CPU mode (patch 5)."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self._message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return self._message not in record.getMessage()


# ------------------------------------------------------------------------------------ the scope
Undo = Callable[[], None]

_DEPTH = 0
"""Open entries (scopes plus the entered-forever one); the patches are on while > 0."""
_UNDO: List[Undo] = []
"""How to undo the patches of the outermost entry, in application order."""
_FOREVER: Optional["CpuMode"] = None
"""The entry :func:`enable_cpu_mode` made (never left unless :func:`disable_cpu_mode`)."""


def _proxy_loaded_modules() -> int:
    """Give every loaded megatron-core module not yet proxied the torch proxy (patch 1)."""
    count = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("megatron.core") or name in _PROXIED:
            continue
        if name.startswith(_SKIP_MODULE_PREFIXES):
            continue
        if getattr(mod, "torch", None) is _REAL_TORCH:
            mod.torch = _TORCH_PROXY
            _PROXIED[name] = mod
            count += 1
    return count


def _unproxy_modules() -> None:
    """Give every proxied module its real ``torch`` back (undo of patch 1)."""
    for mod in _PROXIED.values():
        if getattr(mod, "torch", None) is _TORCH_PROXY:
            mod.torch = _REAL_TORCH
    _PROXIED.clear()


def _patch_tensor_method(name: str, fn: Callable) -> Undo:
    """Set ``torch.Tensor.<name>``; the undo restores exactly what was there (deleting our
    attribute when the method came from torch's C base class)."""
    had_own = name in torch.Tensor.__dict__
    old = torch.Tensor.__dict__.get(name)
    setattr(torch.Tensor, name, fn)

    def undo() -> None:
        if had_own:
            setattr(torch.Tensor, name, old)
        elif name in torch.Tensor.__dict__:
            delattr(torch.Tensor, name)

    return undo


def _apply_patches() -> List[Undo]:
    """Apply patches 1-5 (the proxying itself is :func:`_proxy_loaded_modules`); returns the
    undos in application order. On a failure part-way, what was applied is undone first."""
    from megatron.distributed.mcore_compat import process_globals as mcore_globals

    undo: List[Undo] = []
    try:
        undo.append(_unproxy_modules)
        undo.append(mcore_globals.suspend_jit_fuser())
        for name in _PRELOAD_MODULES:
            try:
                importlib.import_module(name)
            except ImportError:  # optional pieces of megatron-core
                pass
        undo.append(mcore_globals.patch_tp_rng_state(_cpu_get_rng_state, _cpu_set_rng_state))
        logger = logging.getLogger(mcore_globals.TP_RNG_LOGGER)
        log_filter = _DropCpuRngWarning(mcore_globals.TP_RNG_CPU_STATE_WARNING)
        logger.addFilter(log_filter)
        undo.append(lambda: logger.removeFilter(log_filter))
        undo.append(_patch_tensor_method("type", _tensor_type))
        undo.append(_patch_tensor_method("cuda", _tensor_cuda))
    except BaseException:
        for fn in reversed(undo):
            fn()
        raise
    return undo


class CpuMode:
    """CPU mode as a scope: ``with CpuMode(): ...`` (or ``with cpu_mode(): ...``).

    Entry applies every patch of the module docstring (the outermost entry only; nested entries
    just count) and proxies the megatron-core modules loaded so far; exit of the outermost entry
    restores every original object. ``enabled=False`` makes the scope do nothing, so a caller
    can write ``with cpu_mode(args.device == "cpu"):``. An instance may be entered again after it
    was left.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = bool(enabled)
        self.proxied = 0
        """Modules newly proxied by the last entry."""
        self._open = 0

    def __enter__(self) -> "CpuMode":
        global _DEPTH
        if not self.enabled:
            return self
        if _DEPTH == 0:
            _UNDO[:] = _apply_patches()
        _DEPTH += 1
        self._open += 1
        self.proxied = _proxy_loaded_modules()
        return self

    def __exit__(self, *exc: Any) -> None:
        global _DEPTH
        if not self.enabled:
            return
        if self._open <= 0:
            raise RuntimeError("CpuMode left more often than it was entered")
        self._open -= 1
        _DEPTH -= 1
        if _DEPTH == 0:
            undo, _UNDO[:] = list(_UNDO), []
            for fn in reversed(undo):
                fn()

    def refresh(self) -> int:
        """Proxy megatron-core modules imported since the entry (see :func:`refresh_cpu_mode`)."""
        return refresh_cpu_mode()


def cpu_mode(enabled: bool = True) -> CpuMode:
    """``with cpu_mode(): ...``: CPU mode for the block only (see :class:`CpuMode`)."""
    return CpuMode(enabled)


def cpu_mode_requested(device: Optional[str] = None) -> bool:
    """CPU mode when asked for (``--device cpu``) or when no CUDA device exists."""
    if device is not None:
        return device == "cpu"
    return not _REAL_TORCH.cuda.is_available()


def is_cpu_mode() -> bool:
    """Whether CPU mode is on (in a :func:`cpu_mode` scope, or after :func:`enable_cpu_mode`)."""
    return _DEPTH > 0


def refresh_cpu_mode() -> int:
    """Proxy megatron-core modules imported since CPU mode was entered (e.g. dist_checkpointing's
    strategies, imported at the first save); returns how many. 0 when CPU mode is off."""
    return _proxy_loaded_modules() if _DEPTH > 0 else 0


def enable_cpu_mode() -> int:
    """CPU mode for the rest of the process (the entered-forever form of :func:`cpu_mode`).

    Idempotent; returns the number of newly proxied modules (a repeated call proxies only modules
    imported since). Prefer the scope; :func:`disable_cpu_mode` leaves this entry."""
    global _FOREVER
    if _FOREVER is None:
        _FOREVER = CpuMode()
        _FOREVER.__enter__()
        return _FOREVER.proxied
    return _proxy_loaded_modules()


def disable_cpu_mode() -> None:
    """Leave the entry :func:`enable_cpu_mode` made (no-op without one); the patches are undone
    unless a :func:`cpu_mode` scope is still open."""
    global _FOREVER
    if _FOREVER is not None:
        forever, _FOREVER = _FOREVER, None
        forever.__exit__(None, None, None)


def proxied_modules() -> list:
    """Names of megatron-core modules currently seeing the CPU torch proxy (for diagnostics)."""
    return sorted(_PROXIED)
