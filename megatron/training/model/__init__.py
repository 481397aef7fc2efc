"""The GPT model the trainer builds: megatron-core configs from the flags, the layer spec,
SDPA attention, the fused kernels in use and the model FLOPs count."""
