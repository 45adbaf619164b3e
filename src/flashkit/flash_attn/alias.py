"""Make `import flash_attn` resolve to flashkit's drop-in, so code written for flash-attn runs
unchanged. Explicit only: nothing happens until install_alias() is called, it logs what it did,
and it refuses when a real flash-attn is installed (which would otherwise be shadowed)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

__all__ = ["install_alias"]

logger = logging.getLogger("flashkit")

# flash-attn's module path -> the drop-in module that stands in for it
MODULES = {
    "flash_attn": "flashkit.flash_attn",
    "flash_attn.flash_attn_interface": "flashkit.flash_attn.flash_attn_interface",
    "flash_attn.bert_padding": "flashkit.flash_attn.bert_padding",
    "flash_attn.layers": "flashkit.flash_attn.layers",
    "flash_attn.layers.rotary": "flashkit.flash_attn.layers.rotary",
}


def install_alias() -> None:
    """Register the drop-in as `flash_attn` (and its submodules flash_attn_interface,
    bert_padding, layers.rotary) in sys.modules.

    Raises RuntimeError if a real flash-attn is importable or already imported. Calling it
    again after it succeeded does nothing.
    """
    current = sys.modules.get("flash_attn")
    if current is not None and current.__name__ == MODULES["flash_attn"]:
        return
    spec = None if current is not None else importlib.util.find_spec("flash_attn")
    if current is not None or spec is not None:
        where = getattr(current, "__file__", None) or getattr(spec, "origin", None)
        raise RuntimeError(f"install_alias: a real flash-attn is installed ({where}); flashkit "
                           "will not shadow it. Import flashkit.flash_attn directly instead, or "
                           "uninstall flash-attn")
    for name, target in MODULES.items():
        sys.modules[name] = importlib.import_module(target)
    logger.warning("flashkit: `import flash_attn` now resolves to flashkit.flash_attn (the "
                   "flash-attn 2.8 drop-in)")
