"""The tiled pure-PyTorch backend: FlashAttention's algorithm on any device torch runs on."""

from flashkit.ops.tiled.backward import backward
from flashkit.ops.tiled.forward import forward
from flashkit.ops.tiled.kvcache import kvcache_attention
from flashkit.ops.tiled.probs import attention_probs

__all__ = ["forward", "backward", "kvcache_attention", "attention_probs"]
