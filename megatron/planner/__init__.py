"""The speed planner: how long one training iteration takes on a given cluster, per variant.

Why: before the first launch a user asks "on my nodes and my network, how much faster is SDP4Bit
(or TLq-HS, LoCo, a PaRO strategy), and does it fit?". The planner answers from the run's own
flags, measured device rates and the links' latency and bandwidth, following the run bucket by
bucket (``tools/planner.py`` is the command; docs/planner.md the model and its checks). It sits
above both layers: it reads the trainer's parser and FLOPs count (``megatron.training``) and the
communication layer's accounting, config and kernels (``megatron.distributed.quant``); neither
imports it.

* :mod:`.cluster` -- the links and the latency-bandwidth cost of each collective algorithm;
* :mod:`.calibration` -- device rates (model compute, kernels, memory copy), measured, with their
  source;
* :mod:`.workload` -- the model and parallel layout a flag list describes: parameters, FLOPs,
  buckets, the data-parallel grid;
* :mod:`.timeline` -- one variant's iteration, per bucket, with its overlap;
* :mod:`.variants` -- which variants apply to a run, with the recipe's own flags;
* :mod:`.report` -- the table and the recommendation;
* :mod:`.measure` -- ``--measure``: the rates and links of a real launch, timed.
"""
