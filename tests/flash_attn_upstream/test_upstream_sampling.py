"""The runner of flash-attn's test file: drawing cases at parametrize time (the plan, the drawn
rows and their pytest ids) and counting a run's reports (outcomes, failure causes, skips)."""

import itertools
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import upstream_sampling
import upstream_summary

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def test_plan_gives_equal_shares_capped_at_each_size():
    sizes = {"tiny": 1, "small": 30, "big": 1000, "huge": 5000}
    plan = upstream_sampling.plan_module(sizes, 300)
    assert sum(plan.values()) == 300
    assert plan["tiny"] == 1 and plan["small"] == 30
    assert sorted((plan["big"], plan["huge"])) == [134, 135]
    assert plan["huge"] == 135  # the remainder goes to the largest first
    assert upstream_sampling.plan_module(sizes, None) == sizes
    assert upstream_sampling.plan_module(sizes, 10**6) == sizes
    with pytest.raises(ValueError, match="at least one"):
        upstream_sampling.plan_module(sizes, 3)


def test_draw_is_seeded_per_function():
    first = upstream_sampling.draw("test_a", 10_000, 50, seed=0)
    assert first == upstream_sampling.draw("test_a", 10_000, 50, seed=0)
    assert first == sorted(set(first)) and len(first) == 50
    assert first != upstream_sampling.draw("test_a", 10_000, 50, seed=1)
    assert first != upstream_sampling.draw("test_b", 10_000, 50, seed=0)


def _stacked():
    @pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
    @pytest.mark.skipif(False, reason="kept")
    @pytest.mark.parametrize("d", [32, 59, 128])
    @pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 239), (113, 203), (2048, 2048)])
    @pytest.mark.parametrize("new_kv,seqlen_new_eq_seqlen_q", [(False, True), (True, False)])
    @pytest.mark.parametrize("flag", [object(), object()])
    def test_f(flag, new_kv, seqlen_new_eq_seqlen_q, seqlen_q, seqlen_k, d, dtype):
        pass

    return test_f


def test_sample_function_draws_rows_of_the_product_with_pytests_ids():
    func = _stacked()
    # pytest expands the decorator nearest the function first: it varies slowest
    lists = [[(0,), (1,)], [(False, True), (True, False)], [(1, 239), (113, 203), (2048, 2048)],
             [(32,), (59,), (128,)], [("float16",), ("bfloat16",)]]
    flags = [mark.args[1] for mark in func.pytestmark if mark.args[0] == "flag"][0]
    product = [sum(rows, ()) for rows in itertools.product(*lists)]
    assert upstream_sampling.product_size(func) == len(product) == 72
    upstream_sampling.sample_function(func, 10, seed=3)
    [mark] = [mark for mark in func.pytestmark if mark.name == "parametrize"]
    assert [m.name for m in func.pytestmark] == ["skipif", "parametrize"]
    argnames, rows = mark.args
    assert argnames == ["flag", "new_kv", "seqlen_new_eq_seqlen_q", "seqlen_q", "seqlen_k", "d",
                        "dtype"]
    expected = [product[i] for i in upstream_sampling.draw("test_f", 72, 10, seed=3)]
    assert [(flags.index(row[0]),) + row[1:] for row in rows] == expected
    for row, case_id in zip(rows, mark.kwargs["ids"], strict=True):
        flag_id = f"flag{flags.index(row[0])}"  # no id from the value: name and index
        assert case_id == "-".join([flag_id, *(str(v) for v in row[1:])])
    upstream_sampling.sample_function(func, 5, seed=3)  # a second call leaves it as it is
    assert len([m for m in func.pytestmark if m.name == "parametrize"][0].args[1]) == 10


def test_max_seqlen_filters_lengths_before_drawing():
    func = _stacked()
    # (2048, 2048) goes; the boolean seqlen_new_eq_seqlen_q is not a length
    assert upstream_sampling.product_size(func, max_seqlen=1024) == 48
    upstream_sampling.sample_function(func, 48, seed=0, max_seqlen=1024)
    rows = [m for m in func.pytestmark if m.name == "parametrize"][0].args[1]
    assert len(rows) == 48 and max(row[3] for row in rows) == 113


def _collect(*options):
    """Node ids the vendored file yields for these options, collected without a GPU."""
    pytest.importorskip("einops")
    command = [sys.executable, "-m", "pytest", str(HERE), "--collect-only", "-q",
               "-p", "no:cacheprovider", "-o", "addopts=", "--fa-cpu-collect", *options]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    marker = upstream_summary.UPSTREAM_FILE + "::"
    return [line.split("::")[1] for line in done.stdout.splitlines() if marker in line]


def test_collection_draws_what_was_asked_with_the_full_files_ids(tmp_path):
    plan_file = tmp_path / "plan.json"
    ids = _collect("--fa-cases", "3000", "--fa-plan-out", str(plan_file))
    plan = json.loads(plan_file.read_text())
    assert len(ids) == 3000 == sum(plan["drawn"].values())
    assert sum(plan["sizes"].values()) == 508_777  # flash-attn 2.8.4's file on an sm_90 GPU
    counts = {name: 0 for name in plan["sizes"]}
    for case_id in ids:
        counts[case_id.split("[")[0]] += 1
    assert counts == plan["drawn"]  # every function runs; small ones whole
    assert counts["test_flash_attn_bwd_overflow"] == plan["sizes"]["test_flash_attn_bwd_overflow"]
    # the drawn cases of one function are cases of the whole file, in the file's order
    name = "test_flash_attn_causal"
    whole = _collect("--fa-cases", "all", "--fa-functions", name)
    assert len(whole) == plan["sizes"][name] == 960
    drawn = [case_id for case_id in ids if case_id.startswith(name + "[")]
    positions = [whole.index(case_id) for case_id in drawn]
    assert positions == sorted(positions) and len(drawn) == plan["drawn"][name]


FAKE_SUITE = '''
import pytest

def test_pass():
    pass

@pytest.mark.parametrize("tol", [0.001, 0.002, 0.003])
def test_close(tol):
    assert 0.5 <= 2 * tol

def test_raises():
    raise NotImplementedError("triton backend: 7 things")

@pytest.mark.parametrize("big", [1, 2])
def test_skips(big):
    if big:
        pytest.skip()  # Reference implementation OOM

@pytest.mark.skip(reason="not applicable: calls the compiled module")
def test_not_applicable():
    pass

def test_late():
    pytest.skip("%s")
'''


def test_tally_counts_outcomes_causes_and_skip_reasons(tmp_path):
    source = textwrap.dedent(FAKE_SUITE % upstream_summary.DEADLINE_REASON)
    (tmp_path / upstream_summary.UPSTREAM_FILE).write_text(source)
    script = textwrap.dedent(f"""
        import json, sys
        import pytest
        sys.path.insert(0, {str(HERE)!r})
        import upstream_summary
        tally = upstream_summary.Tally({source.splitlines()!r})
        class Plugin:
            def pytest_runtest_logreport(self, report):
                tally.add(report)
        pytest.main([{str(tmp_path)!r}, "-q", "-p", "no:cacheprovider", "--tb=short"],
                     plugins=[Plugin()])
        print("SUMMARY" + json.dumps(tally.as_dict()))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    summary = json.loads(done.stdout.split("SUMMARY")[-1])
    assert summary["totals"] == {"passed": 1, "failed": 4, "skipped": 3, "not_run": 1}
    per = summary["per_function"]
    assert per["test_close"]["failed"] == 3 and per["test_late"]["not_run"] == 1
    causes = {f["error"]: f for f in summary["failures_by_cause"]}
    assert causes["assert # <= (# * #)"]["cases"] == 3
    assert causes["assert # <= (# * #)"]["where"].endswith("assert 0.5 <= 2 * tol")
    assert causes["NotImplementedError: triton backend: # things"]["cases"] == 1
    reasons = {s["reason"]: s["cases"] for s in summary["skips_by_reason"]}
    assert reasons == {"not applicable: calls the compiled module": 1,
                       "test_flash_attn.py:17 if big:  (Reference implementation OOM)": 2}
    summary.update(suite="s", device="cpu", date="today", versions={}, selection="all",
                   seconds=1, workers=0, pytest_exit_code=1)
    page = upstream_summary.markdown(summary)
    assert "| 3 | `test_flash_attn.py:9 assert 0.5 <= 2 * tol`" in page


def test_runner_counts_the_cases_it_would_run(tmp_path):
    pytest.importorskip("einops")
    command = [sys.executable, str(HERE / "run_upstream.py"), "--co", "--cpu-collect",
               "--cases", "40", "--max-seqlen", "512", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "test_flash_attn.py: 40" in done.stdout
    plan = json.loads((tmp_path / "flash_attn_upstream_plan.json").read_text())
    assert sum(plan["drawn"].values()) == 40
    # lengths above 512 are left out before drawing: 7 of test_flash_attn_causal's 10 length
    # pairs stay, with their 96 combinations of the other parameters each
    assert plan["in_range"]["test_flash_attn_causal"] == 7 * 96
    assert all(plan["in_range"][name] <= plan["sizes"][name] for name in plan["sizes"])


def test_a_case_that_breaks_the_cuda_context_ends_its_process(tmp_path, monkeypatch):
    """The teardown wait: a case after which synchronising fails is written to the
    --fa-lost-context file and its process ends; a case whose wait passes is not."""
    import importlib.util
    import types

    import torch

    # this directory's conftest, by path (other conftest modules share its module name)
    spec = importlib.util.spec_from_file_location(
        "upstream_conftest", pathlib.Path(__file__).with_name("conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)

    lost = tmp_path / "lost.jsonl"
    item = types.SimpleNamespace(
        nodeid="test_flash_attn.py::test_x[1]", path=pathlib.Path(upstream_summary.UPSTREAM_FILE),
        config=types.SimpleNamespace(getoption=lambda name, default=None: str(lost)
                                     if name == "--fa-lost-context" else default))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    conftest.pytest_runtest_teardown(item, None)
    assert not lost.exists()

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    monkeypatch.setattr(os, "_exit", exit_)
    with pytest.raises(SystemExit, match="3"):
        conftest.pytest_runtest_teardown(item, None)
    assert json.loads(lost.read_text()) == {
        "id": item.nodeid, "error": "CUDA error: an illegal memory access was encountered"}
