"""flash-attn's own test suite (test_flash_attn.py, copied unmodified from flash-attn 2.8.4)
run against flashkit's drop-in: `import flash_attn` resolves to flashkit.flash_attn.

It needs a CUDA GPU (the file queries the device when imported) and einops, so the default test
run does not collect it; run it with run_upstream.py, which samples every test function.

Options:
  --sample N   keep every Nth parametrization of each test function (its first always kept)
Tests that exercise flash-attn's compiled extension module itself are marked not applicable.
"""

import pytest
import torch

# flash-attn's tests that call its compiled CUDA extension's raw entry points (flash_attn_gpu),
# which the drop-in does not reproduce
NOT_APPLICABLE = {
    "test_flash_attn_generator_arg_must_be_none":
        "calls flash-attn's compiled extension module (flash_attn_gpu) directly",
}


def pytest_ignore_collect(collection_path, config):
    if collection_path.name != "test_flash_attn.py":
        return None
    if not torch.cuda.is_available():
        return True  # CUDA only: the module queries the device at import
    import importlib.util

    if importlib.util.find_spec("einops") is None:
        return True
    import flashkit.flash_attn

    flashkit.flash_attn.install_alias()
    return None


def pytest_addoption(parser):
    parser.addoption("--sample", type=int, default=1,
                     help="keep every Nth parametrization of each test function")


def pytest_collection_modifyitems(config, items):
    step = config.getoption("--sample")
    seen = {}
    kept = []
    for item in items:
        if item.path.name != "test_flash_attn.py":  # this hook sees the whole session
            kept.append(item)
            continue
        name = item.originalname or item.name
        index = seen.get(name, 0)
        seen[name] = index + 1
        if name in NOT_APPLICABLE:
            item.add_marker(pytest.mark.skip(reason="not applicable: " + NOT_APPLICABLE[name]))
        if index % step == 0:
            kept.append(item)
    items[:] = kept
