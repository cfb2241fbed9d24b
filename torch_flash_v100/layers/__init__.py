"""Layers of FlashAttention-2's ``flash_attn.layers`` (``rotary``), under the same names."""
