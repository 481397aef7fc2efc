"""Training layer (arguments, initialization, CPU mode, training loop, checkpointing).

Kept import-light on purpose: ``import megatron.training.cpu_mode`` must not pull in the
whole trainer (the DDP engineers import it from their tests).
"""
