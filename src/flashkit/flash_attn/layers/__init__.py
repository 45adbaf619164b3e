"""Layers of flash-attn's `flash_attn.layers` that code written for it imports."""
