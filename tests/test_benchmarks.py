"""The benchmark suites load and answer --help on the CPU; the shared helpers compute what the
benchmark method says (FLOP counts, result files)."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import common  # noqa: E402
import run  # noqa: E402

SUITES = sorted(run.suites())
DIAGNOSTICS = sorted(p.name for p in (BENCH / "diagnostics").glob("*.py"))


def help_text(argv_main) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = argv_main()
    assert code in (0, None), out.getvalue()
    return out.getvalue()


def test_the_named_suites_exist():
    assert {"speed", "decode", "features", "jax", "ring"} <= set(SUITES)


@pytest.mark.parametrize("suite", SUITES)
def test_suite_help_through_run_py(suite):
    text = help_text(lambda: run.main([suite, "--help"]))
    assert "usage:" in text and "--out" in text, text


@pytest.mark.parametrize("name", DIAGNOSTICS)
def test_diagnostic_help(name, monkeypatch):
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH / "diagnostics" / name), run_name="__main__")
    assert done.value.code == 0 and "usage:" in out.getvalue()


def test_run_py_lists_suites_and_rejects_unknown(capsys):
    assert run.main([]) == 0
    listing = capsys.readouterr().out
    assert all(f"  {name}" in listing for name in SUITES)
    assert run.main(["no_such_suite"]) == 2


def test_flops_follow_the_method():
    # forward 4 b h s^2 d, causal half; backward 2.5x, step 3.5x
    assert common.flops(2, 16, 1024, 128, False) == 4 * 2 * 16 * 1024 * 1024 * 128
    assert common.flops(2, 16, 1024, 128, True) == 2 * 2 * 16 * 1024 * 1024 * 128
    fwd = common.flops(1, 8, 512, 64, True)
    assert common.flops(1, 8, 512, 64, True, "bwd") == 2.5 * fwd
    assert common.flops(1, 8, 512, 64, True, "step") == 3.5 * fwd
    assert common.tflops(1e12, 1000.0) == 1.0


def test_result_files(tmp_path):
    result = common.Result("speed", str(tmp_path), tag="t", config={"grid": "quick"})
    result.save("rows", [{"a": 1.5}])
    result.markdown(common.table([{"a": 1.5, "b": None}], ["a", "b"]))
    data = json.loads(result.path.read_text())
    assert data["suite"] == "speed" and data["rows"] == [{"a": 1.5}]
    assert {"date", "device", "torch", "triton"} <= set(data["env"])
    assert result.path.name.endswith("_t.json")
    assert result.path.with_suffix(".md").read_text().splitlines()[2] == "| 1.5 | - |"



def test_readme_shows_each_declared_part_from_the_newest_run_that_measured_it(tmp_path,
                                                                            monkeypatch):
    """A suite that declares PARTS runs them one at a time: the README shows the newest file,
    then each part it lacks from the newest file of the same configuration that has it, with
    that file's name; an undeclared part, another configuration's file and a suite without
    PARTS add nothing."""
    import make_readme
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "parted.py").write_text('"""parted: a test suite."""\n'
                                                   'PARTS = ("fast", "slow")\n')
    (tmp_path / "suites" / "plain.py").write_text('"""plain: a test suite."""\n')

    def write(suite, name, config, **parts):
        folder = tmp_path / "results" / suite
        folder.mkdir(parents=True, exist_ok=True)
        data = dict(suite=suite, env=dict(date=name, device="dev"), config=config, **parts)
        (folder / f"{name}_dev.json").write_text(json.dumps(data))
        (folder / f"{name}_dev.md").write_text("\n".join(
            f"## {part}\n\n| x |\n|---|\n| {rows[0]['x']} |\n" for part, rows in parts.items()))

    write("parted", "20260101_0100", {"n": 1}, slow=[{"x": "old slow"}], other=[{"x": "other"}])
    write("parted", "20260101_0200", {"n": 1}, slow=[{"x": "new slow"}])
    write("parted", "20260101_0300", {"n": 2}, slow=[{"x": "other config"}])
    write("parted", "20260101_0400", {"n": 1}, fast=[{"x": "newest fast"}])
    write("plain", "20260101_0100", {}, old=[{"x": "plain old"}])
    write("plain", "20260101_0200", {}, new=[{"x": "plain new"}])
    monkeypatch.setattr(make_readme, "HERE", tmp_path)
    monkeypatch.setattr(make_readme, "RESULTS", tmp_path / "results")
    text = make_readme.render()
    parted = text[text.index("## parted"):text.index("## plain")]
    assert "newest fast" in parted and "### fast" in parted
    assert "new slow" in parted and "20260101_0200_dev.json" in parted
    for absent in ("old slow", "other config", "other"):
        assert f"| {absent} |" not in parted
    assert "plain new" in text and "plain old" not in text


def test_speed_summary_gives_flashkit_as_a_share_of_the_matmul_ceiling():
    """Each flashkit cell's TFLOP/s as a percentage of the same run's matmul rate in its dtype;
    a cell flashkit did not run stays empty."""
    sys.path.insert(0, str(BENCH / "suites"))
    import speed

    rows = [dict(dtype="float16", head_dim=256, seqlen=1024, causal=True,
                 tflops={"flashkit": {"fwd": 600.0}, "cudnn": {"fwd": 500.0}},
                 ratio_to_cudnn={"flashkit": {"fwd": 1.2}}),
            dict(dtype="bfloat16", head_dim=64, seqlen=4096, causal=False,
                 tflops={"cudnn": {"fwd": 400.0}}, ratio_to_cudnn={})]
    text = speed.summary(rows, ["fwd"], {"float16": 800.0, "bfloat16": 700.0})
    assert "ceiling (8192^3 torch.matmul, same run): float16 800, bfloat16 700 TFLOP/s" in text
    lines = [line for line in text.splitlines() if line.startswith("| float16")
             or line.startswith("| bfloat16")]
    assert lines[0].endswith("| 1.2 | 75 |")  # 600 of 800
    assert lines[1].endswith("| - | - |")

def _differential():
    sys.path.insert(0, str(BENCH / "suites"))
    import differential
    return differential


def test_differential_gives_few_element_outputs_the_rounding_term():
    """docs/design.md section 5: an output of at most TINY elements (dsink: one per head) adds
    the rounding term, since its baseline can be exact by luck; a larger one does not."""
    import torch

    differential = _differential()
    truth = torch.tensor([8.0005, -4.0005], dtype=torch.float64)  # near float16 values
    lucky = truth.to(torch.float16)  # the baseline: 5e-4 off
    off_by_one = lucky + torch.tensor([2 ** -7, 0], dtype=torch.float16)  # one step (7.8e-3) up
    failures = []
    differential.compare("dsink", off_by_one, truth, lucky, 3, torch.float16, failures)
    assert failures == []
    many = truth.repeat(64)
    differential.compare("dq", off_by_one.repeat(64), many, lucky.repeat(64), 3, torch.float16,
                         failures)
    assert len(failures) == 1 and failures[0].startswith("dq: max error")


def test_differential_draws_from_the_named_buckets(tmp_path, capsys):
    differential = _differential()
    with pytest.raises(SystemExit):
        differential.main(["--buckets", "b99", "--out", str(tmp_path)])
    assert "--buckets: unknown ['b99']" in capsys.readouterr().err
    assert differential.main(["--buckets", "b06,b10", "--cases", "4", "--budget", "120",
                              "--out", str(tmp_path)]) == 0
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert saved["summary"]["cases_run"] == 4 and saved["summary"]["failed"] == 0
    assert {row["bucket"] for row in saved["per_bucket"]} == {"b06", "b10"}
