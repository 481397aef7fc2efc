"""Training data: the ``--data-path`` blend, startup checks and megatron-core's datasets, the
resumable sampler and the tokenizers."""
