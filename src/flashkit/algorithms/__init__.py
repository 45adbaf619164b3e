"""The algorithms behind FlashAttention at teaching scale, each small, readable and tested.

    softmax           native, safe and online softmax as scalar streaming loops
    merge             the (m, l, o) state of attention rows and the merge of two partial states
    online_attention  2-pass and 1-pass online attention for one query
    tiled             tiled forward in FA1 (KV outer) and FA2 (Q outer) loop order, HBM counted
    welford           Welford's online mean/variance and Chan's parallel merge
    lessons           worked examples, printed by `flashkit learn <topic>`

The sources, and the short names the docstrings use for them:
    "the chapter"     Under the Hood, chapter 8: Flash Attention and tiled kernels
    "the derivation"  a step-by-step derivation of FlashAttention from the online softmax
    "the essay"       "Flash attention", the register-machine walkthrough of FlashAttention
    "the TPU post"    "Forcing Flash Attention onto a TPU and Learning the Hard Way" (Archer
                      Zhang), the JAX/TPU write-up
    "the paper"       FlashAttention (Dao et al. 2022), with notes and a Triton implementation
"""

from flashkit.algorithms.merge import State, block_state, empty_state, finalize, fold, merge
from flashkit.algorithms.online_attention import one_pass_attention, two_pass_attention
from flashkit.algorithms.softmax import (
    native_softmax,
    online_normalizer,
    online_softmax,
    online_steps,
    safe_softmax,
)
from flashkit.algorithms.tiled import HBM, Forward, flash1_forward, flash2_forward
from flashkit.algorithms.welford import (
    Moments,
    merge_moments,
    textbook_variance,
    variance,
    welford,
    welford_update,
)

__all__ = [
    "native_softmax", "safe_softmax", "online_softmax", "online_steps", "online_normalizer",
    "State", "empty_state", "block_state", "merge", "fold", "finalize",
    "two_pass_attention", "one_pass_attention",
    "Forward", "HBM", "flash1_forward", "flash2_forward",
    "Moments", "welford_update", "welford", "merge_moments", "variance", "textbook_variance",
]
