"""Quantized data-parallel collectives: two-level gradient reduce-scatter and weight all-gather.

Both are independent of megatron-core: they take flat buffers and process groups
(:class:`~megatron.distributed.quant.topology.TwoLevelGroups`) and can be wired into any bucketed
DDP. See ../shared/research/sdp4bit.md §3/§4 and zeropp.md (qgZ) for the algorithms.

One module per path, plus what both share; import a name from the module that defines it:

* :mod:`.gradients` -- :func:`~.gradients.two_level_reduce_scatter` (TLq / TLq-HS, qgZ, LoCo),
  its slot order (:func:`~.gradients.swizzle_order`) and pipeline chunks
  (:func:`~.gradients.pipeline_bounds`).
* :mod:`.weights` -- :func:`~.weights.quantized_all_gather` (qWD / qW, one group or PaRO's hops)
  and :func:`~.weights.gather_layout`.
* :mod:`.common` -- the bucket padding both paths need
  (:func:`~.common.required_padding_multiple`), the packed wire format, the NaN/Inf agreement,
  :class:`~.common.PendingCollective` and where asynchronous jobs run, and torch's flat
  collectives under their current names (also used by the PaRO engine).

Non-finite inputs, two contracts (both paths):

* ``check_finite=True`` (default, standalone use): every rank tests its own input, the verdict is
  agreed with a one-element all-reduce over the DP group, and then *all* ranks raise
  :class:`~..kernels.NonFiniteError` before any payload moves. Raising on one rank only would leave
  the others blocked inside the all-to-all. It costs an all-reduce and a host sync per call.
* ``nonfinite_flag=<int32 device tensor>`` (the trainer's path): no agreement and no host sync
  here; the first quantization adds the number of NaN/Inf inputs into the flag on the device (in
  the same pass on CUDA: the Triton kernel's fused count) and the payload moves anyway (a
  poisoned group dequantizes to NaN, never to finite values). The caller agrees on the flag once
  per training step and skips the step -- one host sync per step instead of one per bucket and
  hop, which would stall the CUDA stream and serialize the overlap.

Stochastic rounding uses the ``generator`` passed in (reproducible). Give each rank a different
seed (e.g. ``seed + global_rank``): identical draws on all ranks correlate the rounding errors
and stop them from averaging out.
"""
