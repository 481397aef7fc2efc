"""Quantized data-parallel collectives: two-level gradient reduce-scatter and weight all-gather.

Both are independent of megatron-core: they take flat buffers and process groups
(:class:`~megatron.distributed.quant.topology.TwoLevelGroups`) and can be wired into any bucketed
DDP. See ../shared/research/sdp4bit.md §3/§4 and zeropp.md (qgZ) for the algorithms.

One module per path, plus what both share; import a name from the module that defines it. Each
hop's encoding (bits, group size, rounding, Hadamard) is one :class:`~..config.HopSpec` argument:

* :mod:`.gradients` -- :func:`~.gradients.two_level_reduce_scatter` (TLq / TLq-HS, qgZ, LoCo),
  its slot order (:func:`~.gradients.swizzle_order`) and pipeline chunks
  (:func:`~.gradients.pipeline_bounds`).
* :mod:`.weights` -- :func:`~.weights.quantized_all_gather` (qWD / qW, one group or PaRO's hops)
  and :func:`~.weights.gather_layout`.
* :mod:`.common` -- the bucket padding both paths need
  (:func:`~.common.required_padding_multiple`), the packed wire format, the NaN/Inf agreement,
  :class:`~.common.PendingCollective` and where asynchronous jobs run, and torch's flat
  collectives under their current names (also used by the PaRO engine).

Non-finite inputs: ``check_finite=True`` (every rank raises together, one all-reduce and host
sync per call) or ``nonfinite_flag`` (counted on the device, agreed once per step by the caller).
Stochastic rounding draws from the ``generator`` passed in; seed each rank differently so rounding
errors average out.
"""
# See [Note: non-finite contracts] in docs/architecture.md
