"""When the engine acts during a micro-step: the forward / backward hooks that drive it.

:class:`MicroStepHooks` decides the moments; :mod:`.gather` and :mod:`.grad_reduce` act at them.
For p = I / G a bucket is gathered before its owner's forward and again before its backward, and
released after the last owner's forward and once all its gradients arrived (a tied bucket stays
gathered between its owners). A callback at the end of each backward finishes leftover buckets in
bucket order, so every rank issues the same collectives.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from .gather import ParamGathers
from .grad_reduce import GradReduction
from .layout import Bucket, FlatLayout, output_tensors
from .strategy import Level

__all__ = ["MicroStepHooks"]


class MicroStepHooks:
    """The hooks of one engine and the backward-pass state they share (module docstring).

    ``layout``: the engine's parameters, their slots and buckets; ``param_level``: the
    strategy's parameter level p; ``param_gathers`` / ``grad_reduction``: what acts at the
    moments the hooks decide.
    """

    def __init__(self, layout: FlatLayout, param_level: Level, param_gathers: ParamGathers,
                 grad_reduction: GradReduction) -> None:
        self.layout = layout
        self.buckets = layout.buckets
        self.param_level = param_level
        self.param_gathers = param_gathers
        self.grad_reduction = grad_reduction
        self.in_backward = False
        """Between the first gradient (or output gradient) of a backward and its end callback."""
        self.pre_backward_done = False
        """The model output's gradient hook of this forward has run."""
        self.deferred: List[Bucket] = []
        """Buckets whose release waits for the next owner's forward (a returned parameter)."""
        self.handles: List[Any] = []
        """Handles of the module forward (pre-)hooks."""

    def register(self) -> None:
        """A post-accumulate-grad hook on every parameter; for p = I / G a forward pre-hook and
        a forward hook on every module owning a bucket."""
        for i, p in enumerate(self.layout.params):
            p.register_post_accumulate_grad_hook(self._make_grad_hook(i))
        if self.param_level == Level.N:
            return
        owned: Dict[int, Tuple[torch.nn.Module, List[Bucket]]] = {}
        for b in self.buckets:
            for mod in b.owners:
                owned.setdefault(id(mod), (mod, []))[1].append(b)
        for mod, bs in owned.values():
            self.handles.append(mod.register_forward_pre_hook(self._make_pre_hook(bs)))
            self.handles.append(mod.register_forward_hook(self._make_post_hook(mod, bs)))

    def after_forward(self, out: Any) -> None:
        """The chunk's forward returned ``out``: release what waited for a next owner, and hook
        the output so its gradient marks the start of this chunk's backward."""
        self.release_deferred()
        if torch.is_grad_enabled():
            self.pre_backward_done = False
            for t in output_tensors(out):
                if t.requires_grad:
                    t.register_hook(self._pre_backward_hook)

    def release_deferred(self, keep: Sequence[Bucket] = ()) -> None:
        """Release the deferred buckets, except those in ``keep``."""
        still = []
        for b in self.deferred:
            if any(b is k for k in keep):
                still.append(b)
            else:
                self.param_gathers.release(b)
        self.deferred = still

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        """Gradient of the model output arrived: the backward of this chunk starts now."""
        if not self.pre_backward_done:
            self.pre_backward_done = True
            self.begin_backward()

    def begin_backward(self) -> None:
        """First call of a backward pass: every bucket waits for all its gradients again, and
        :meth:`end_backward` is queued to run when the autograd engine is done."""
        if self.in_backward:
            return
        self.in_backward = True
        for b in self.buckets:
            b.pending, b.reduced = len(b.params), False
        torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    @torch.no_grad()
    def end_backward(self) -> None:
        """End of one micro-step's backward (safety net): every bucket not finished yet is reduced
        and released, in bucket order, so every rank issues the same collectives."""
        for b in self.buckets:
            self.grad_reduction.finish_bucket(b)
        self.grad_reduction.finish_all()
        self.param_gathers.release_all()
        self.in_backward = False

    def _make_grad_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        slot = self.layout.slots[index]
        b = self.buckets[self.layout.bucket_of[index]]

        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            self.begin_backward()
            self.grad_reduction.add(slot, b, param)
            param.grad = None
            b.pending -= 1
            if b.pending == 0:  # the bucket's backward is over
                self.grad_reduction.finish_bucket(b)

        return hook

    def _make_pre_hook(self, buckets: List[Bucket]) -> Callable[[torch.nn.Module, Any], None]:
        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            gathers = self.param_gathers
            self.release_deferred(keep=buckets)
            for b in buckets:
                gathers.gather(b)
            # the next bucket's gather travels while this module computes
            gathers.prefetch(max(b.index for b in buckets) + 1, self.in_backward)
        return pre_hook

    def _make_post_hook(self, module: torch.nn.Module,
                        buckets: List[Bucket]) -> Callable[[torch.nn.Module, Any, Any], None]:
        def post_hook(mod: torch.nn.Module, args: Any, output: Any) -> None:
            outs = list(output_tensors(output))
            if torch.is_grad_enabled():  # regather right before this module's backward
                tensors = [t for t in outs if t.requires_grad and t.grad_fn is not None]
                if not tensors:  # no handle on its backward: keep its buckets until then
                    return
                hook = self._make_output_grad_hook(buckets)
                for t in tensors:
                    t.register_hook(hook)
            if self.in_backward:  # re-run forward (activation recomputation) inside backward
                return
            # A parameter returned for the caller to apply (megatron's skip_bias_add: linear_proj /
            # linear_fc2 return their bias): release at the next owner's forward instead.
            returned = {t.untyped_storage().data_ptr() for t in outs}
            for b in buckets:
                if b.owners[-1] is module:
                    if b.full.untyped_storage().data_ptr() in returned:
                        self.deferred.append(b)
                    else:
                        self.param_gathers.release(b)
        return post_hook

    def _make_output_grad_hook(self, buckets: List[Bucket]) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            gathers = self.param_gathers
            self.begin_backward()
            for b in buckets:
                if not b.reduced:
                    gathers.gather(b)
            # the next backward's bucket (the previous one in module order)
            gathers.prefetch(min(b.index for b in buckets) - 1, self.in_backward)
        return hook
