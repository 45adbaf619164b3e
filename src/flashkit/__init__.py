"""flashkit: exact, memory-efficient attention (FlashAttention) for Python."""

__version__ = "0.1.0"
