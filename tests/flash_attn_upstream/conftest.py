"""flash-attn's own test suite (test_flash_attn.py, copied unmodified from flash-attn 2.8.4)
run against flashkit's drop-in: `import flash_attn` resolves to flashkit.flash_attn.

The file is collected only when a run asks for it with --fa-cases (run_upstream.py does), so a
plain `pytest tests` neither imports it nor pays for its 508,777 cases. It needs a CUDA GPU (the
file queries the device when imported) and einops.

Options:
  --fa-cases N|all     N cases in all, drawn at parametrize time (upstream_sampling.py): every
                       selected function gets an equal share, capped at its own size; `all`
                       runs every case
  --fa-seed S          which cases are drawn (default 0)
  --fa-functions A,B   only these test functions
  --fa-max-seqlen L    leave out cases with a sequence length above L (before drawing)
  --fa-deadline T      cases that start after the Unix time T are skipped as "not run"; the
                       functions' cases are interleaved so that every function loses the same
                       fraction of its cases
  --fa-plan-out PATH   write the plan as JSON: every function's cases in the file ("sizes"),
                       within --fa-max-seqlen ("in_range") and drawn ("drawn")
  --fa-cpu-collect     with --collect-only on a machine without CUDA: report the device as an
                       sm_90 GPU while the file is imported, to count and list the cases
  --fa-lost-context P  a case after which the CUDA context is broken (an illegal address is
                       sticky: every later case of the process would fail with it) ends its
                       process after writing its id to P (JSON lines); with -n, xdist starts a
                       fresh worker for the cases left
Tests that exercise flash-attn's compiled extension module itself are marked not applicable.
"""

import importlib.util
import inspect
import json
import os
import pathlib
import time

import pytest
import torch
import upstream_sampling
from upstream_summary import DEADLINE_REASON, UPSTREAM_FILE

# flash-attn's tests that call its compiled CUDA extension's raw entry points (flash_attn_gpu),
# which the drop-in does not reproduce
NOT_APPLICABLE = {
    "test_flash_attn_generator_arg_must_be_none":
        "calls flash-attn's compiled extension module (flash_attn_gpu) directly",
}


def pytest_addoption(parser):
    group = parser.getgroup("flash-attn upstream suite")
    group.addoption("--fa-cases", default=None,
                    help="collect flash-attn's test file: N sampled cases in all, or 'all'")
    group.addoption("--fa-seed", type=int, default=0, help="seed of the drawn cases")
    group.addoption("--fa-functions", default=None,
                    help="comma-separated test function names (default: every one)")
    group.addoption("--fa-max-seqlen", type=int, default=None,
                    help="leave out cases with a sequence length above this")
    group.addoption("--fa-deadline", type=float, default=None,
                    help="skip cases that would start after this Unix time")
    group.addoption("--fa-plan-out", default=None, help="write the drawn counts as JSON here")
    group.addoption("--fa-cpu-collect", action="store_true",
                    help="list the cases without CUDA (--collect-only only)")
    group.addoption("--fa-lost-context", default=None,
                    help="end the process after a case that breaks the CUDA context, "
                         "writing its id here")


def _option(config, name):
    # a plain `pytest tests` loads this conftest after parsing the command line: no options
    return config.getoption(name, default=None)


def pytest_configure(config):
    if not _option(config, "--fa-cpu-collect") or torch.cuda.is_available():
        return
    if not config.getoption("collectonly"):
        raise pytest.UsageError("--fa-cpu-collect lists cases; it needs --collect-only")
    # the module reads the capability at import to pick dtypes and head dims: claim an H100/H200
    torch.cuda.get_device_capability = lambda device=None: (9, 0)


def _why_not(config) -> str | None:
    """Why this run cannot collect the vendored file, or None."""
    if _option(config, "--fa-cases") is None:
        return "is collected only with --fa-cases N|all (run_upstream.py passes it)"
    if not (torch.cuda.is_available() or _option(config, "--fa-cpu-collect")):
        return "needs a CUDA device: it queries the device when imported"
    if importlib.util.find_spec("einops") is None:
        return "needs einops"
    return None


def pytest_ignore_collect(collection_path, config):
    if collection_path.name == UPSTREAM_FILE and _why_not(config) is not None:
        return True  # a directory run (`pytest tests`) passes over it quietly
    return None


def pytest_collect_file(file_path, parent):
    if file_path.name != UPSTREAM_FILE:
        return None
    why_not = _why_not(parent.config)
    if why_not is not None:  # the file was named on the command line
        raise pytest.UsageError(f"{UPSTREAM_FILE} {why_not}")
    import flashkit.flash_attn

    flashkit.flash_attn.install_alias()
    return None  # pytest's python plugin collects it


def _plan(module, config):
    """{test function name: cases to draw}, computed once per module from all its functions."""
    plan = getattr(module, "_flashkit_plan", None)
    if plan is not None:
        return plan
    wanted = _option(config, "--fa-functions")
    wanted = None if wanted is None else {name.strip() for name in wanted.split(",")}
    functions = {name: obj for name, obj in vars(module).items()
                 if name.startswith("test") and inspect.isfunction(obj)}
    unknown = sorted((wanted or set()) - set(functions))
    if unknown:
        raise pytest.UsageError(f"--fa-functions: no test function named {unknown}")
    max_seqlen = _option(config, "--fa-max-seqlen")
    selected = {name: obj for name, obj in functions.items() if wanted is None or name in wanted}
    in_range = {name: upstream_sampling.product_size(obj, max_seqlen)
                for name, obj in selected.items()}
    cases = _option(config, "--fa-cases")
    total = None if cases == "all" else int(cases)
    plan = upstream_sampling.plan_module({n: s for n, s in in_range.items() if s > 0}, total)
    module._flashkit_plan = plan
    path = _option(config, "--fa-plan-out")
    if path is not None:
        sizes = {name: upstream_sampling.product_size(obj) for name, obj in selected.items()}
        record = {"sizes": sizes, "drawn": plan}
        if max_seqlen is not None:
            record["in_range"] = in_range
        # xdist workers all write the same plan: replace the file in one step
        temporary = pathlib.Path(f"{path}.{os.getpid()}")
        temporary.write_text(json.dumps(record, indent=1))
        os.replace(temporary, path)
    return plan


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    if collector.path.name != UPSTREAM_FILE or not inspect.isfunction(obj):
        return None
    if not name.startswith("test"):
        return None
    config = collector.config
    n = _plan(collector.obj, config).get(name, 0)
    if n == 0:
        return []  # not selected, or every case longer than --fa-max-seqlen
    if name in NOT_APPLICABLE and not getattr(obj, upstream_sampling.SAMPLED, False):
        obj.pytestmark = [*getattr(obj, "pytestmark", []),
                          pytest.mark.skip(reason="not applicable: " + NOT_APPLICABLE[name]).mark]
    max_seqlen = _option(config, "--fa-max-seqlen")
    if _option(config, "--fa-cases") != "all" or max_seqlen is not None:
        upstream_sampling.sample_function(obj, n, _option(config, "--fa-seed") or 0, max_seqlen)
    return None  # pytest's own collection expands the parametrize marks, rewritten or not


def pytest_collection_modifyitems(config, items):
    """Interleave the test functions in proportion to their drawn counts, so that at any moment
    every function has run the same fraction of its cases (and a run cut short by --fa-deadline
    leaves every function's cases equally likely not run)."""
    if _option(config, "--fa-cases") is None:
        return
    upstream = [item for item in items if item.path.name == UPSTREAM_FILE]
    functions = {}
    for item in upstream:
        functions.setdefault(item.originalname, []).append(item)
    order = {name: rank for rank, name in enumerate(functions)}
    fraction = {}
    for name, cases in functions.items():
        for index, item in enumerate(cases):
            fraction[item.nodeid] = ((index + 0.5) / len(cases), order[name])
    items[:] = ([item for item in items if item.path.name != UPSTREAM_FILE]
                + sorted(upstream, key=lambda item: fraction[item.nodeid]))


def pytest_runtest_setup(item):
    deadline = _option(item.config, "--fa-deadline")
    if deadline is not None and item.path.name == UPSTREAM_FILE and time.time() > deadline:
        pytest.skip(DEADLINE_REASON)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After each case, wait for its kernels: a broken context shows here at the latest, so the
    case that broke it is this one (the previous case's wait passed). See --fa-lost-context."""
    path = _option(item.config, "--fa-lost-context")
    if path is None or item.path.name != UPSTREAM_FILE:
        return
    try:
        torch.cuda.synchronize()
    except Exception as error:  # torch.AcceleratorError: the context is gone for this process
        with open(path, "a") as f:
            f.write(json.dumps({"id": item.nodeid, "error": str(error).splitlines()[0]}) + "\n")
        os._exit(3)
