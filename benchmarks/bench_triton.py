"""The shared benchmark helpers under their former module name; import `common` instead."""

from common import (  # noqa: F401
    TOKENS,
    WIDTH,
    anchor,
    anchor_flex_compiled,
    bench,
    environment,
    flops,
    inputs,
    peak_memory,
)
