"""Quantized communication layer (SDP4Bit, LoCo, ZeRO++ qW, PaRO) on top of megatron-core."""
