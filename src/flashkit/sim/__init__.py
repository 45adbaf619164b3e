"""flashkit.sim: the machines FlashAttention was designed for, executable and counted.

* :mod:`~flashkit.sim.machine`, :mod:`~flashkit.sim.programs` -- the toy register machine of
  the essay and its programs (matmul by inner and outer product, safe and online softmax, online
  attention): cycles, DRAM reads and writes, the register table after every step.
* :mod:`~flashkit.sim.loop_orders` -- attention with queries outside (FlashAttention-2) or keys
  and values outside (FlashAttention-1), against a memory that counts HBM loads and stores.
* :mod:`~flashkit.sim.systolic` -- weight-stationary (TPU MXU) and output-stationary systolic
  arrays, ticked cycle by cycle (the TPU post).
* :mod:`~flashkit.sim.tpu` -- a TPU core's MXU and VPU running flash and standard attention,
  counting cycles and MXU utilisation (the TPU post).
* :mod:`~flashkit.sim.hbm` -- HBM traffic of standard attention, FlashAttention (the paper's
  Algorithm 1 and Theorem 2) and a Triton FlashAttention-2 forward's tile config.

Every part prints its tables through ``flashkit simulate ...`` (see :mod:`flashkit.sim.cli`).

The sources, and the short names the docstrings use for them, are listed in
:mod:`flashkit.algorithms`.
"""

from flashkit.sim.hbm import (
    IOCount,
    flash_attention_io,
    flash_attention_v1,
    flash_attention_v2,
    standard_attention_io,
    triton_forward_bytes,
    triton_forward_io,
)
from flashkit.sim.loop_orders import (
    HBMTraffic,
    inner_product_attention,
    outer_product_attention,
)
from flashkit.sim.machine import (
    Instruction,
    MachineError,
    Program,
    RegisterMachine,
    Run,
    assemble,
    op,
    run,
)
from flashkit.sim.programs import (
    dot_product_c00,
    example_program,
    matmul_inner_product,
    matmul_outer_product,
    online_attention,
    online_softmax,
    safe_softmax,
)
from flashkit.sim.systolic import (
    OutputStationaryArray,
    WeightStationaryArray,
    systolic_matmul,
)
from flashkit.sim.tpu import TPUCycleSimulator, compare_attention

__all__ = [
    "IOCount", "flash_attention_io", "flash_attention_v1", "flash_attention_v2",
    "standard_attention_io", "triton_forward_bytes", "triton_forward_io",
    "HBMTraffic", "inner_product_attention", "outer_product_attention",
    "Instruction", "MachineError", "Program", "RegisterMachine", "Run", "assemble", "op", "run",
    "dot_product_c00", "example_program", "matmul_inner_product", "matmul_outer_product",
    "online_attention", "online_softmax", "safe_softmax",
    "OutputStationaryArray", "WeightStationaryArray", "systolic_matmul",
    "TPUCycleSimulator", "compare_attention",
]
