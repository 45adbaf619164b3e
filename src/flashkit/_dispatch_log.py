"""The dispatch log that every front door writes (flashkit.ops.triton.dispatch for the Triton
backend, flashkit.jax.dispatch for the JAX port): which implementation ran a call and why the
others declined, under the logger "flashkit.dispatch".

FLASHKIT_LOG_DISPATCH=1 (any value but "" and "0") in the environment sets that logger to DEBUG
with a handler on stderr when flashkit is imported; or configure the logger yourself.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("flashkit.dispatch")
if os.environ.get("FLASHKIT_LOG_DISPATCH", "") not in ("", "0"):
    logger.setLevel(logging.DEBUG)
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler())


def log_choice(op: str, ran: str, declined) -> None:
    """Log "<op> ran <ran>; declined: <name>: <why>; ..." when the logger takes DEBUG;
    declined: (name, reason) pairs."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s ran %s; declined: %s", op, ran,
                     "; ".join(f"{name}: {why}" for name, why in declined) or "nothing")
