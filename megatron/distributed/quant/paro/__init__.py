"""PaRO (partial redundancy optimizer): partition strategies for parameters, gradients and
optimizer states, and the data-parallel engine that trains the ones megatron-core cannot.

:mod:`.strategy` (the strategy grammar and validity rule), :mod:`.args` (the ``--paro-*`` flags),
:mod:`.cost` (cost model, report, ``auto``), :mod:`.comm` (PaRO groups, collectives, byte
counter); the engine: :mod:`.engine` (the model-chunk wrapper), :mod:`.layout` (buckets and
shards), :mod:`.transitions` (collectives between partition levels), :mod:`.gather` (parameter
gathers), :mod:`.grad_reduce` (gradient reduction), :mod:`.hooks` (forward / backward hooks),
:mod:`.state` (host state dicts), :mod:`.optimizer` (its optimizer); and :mod:`.integration`
(what :mod:`..integration`, the trainer's only entry point, builds for a strategy). Nothing is
re-exported here: import from the module that defines a name.
"""
