"""A drop-in for flash-attn 2.8's public interface, run by flashkit's kernels.

    from flashkit.flash_attn import flash_attn_func        # instead of: from flash_attn import ...

or, for code that imports flash_attn itself (including its submodules flash_attn_interface,
bert_padding and layers.rotary):

    import flashkit.flash_attn
    flashkit.flash_attn.install_alias()                     # then `import flash_attn` works

Signatures, return values and semantics follow flash-attn 2.8.4; docs/dropin.md lists where
they differ from flashkit's native API.
"""

from flashkit.flash_attn.alias import install_alias
from flashkit.flash_attn.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

# the flash-attn release whose interface this package reproduces
__version__ = "2.8.4"

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "install_alias",
]
