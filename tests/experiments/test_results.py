"""Result files and the progress bar: what every experiment writes and shows."""

import csv
import json

from flashkit.experiments import progress, results


def test_environment_names_the_machine_and_versions():
    env = results.environment("cpu")
    assert env["device"] == "cpu" and "cores" in env["device_name"]
    assert env["torch"] and env["flashkit"] and env["date"].endswith("+00:00")


def test_json_and_csv_round_trip(tmp_path):
    rows = [{"a": 1, "b": 2.5}, {"a": 3, "c": "x"}]
    results.write_csv(tmp_path / "r.csv", rows)
    assert list(csv.DictReader((tmp_path / "r.csv").open())) == [
        {"a": "1", "b": "2.5", "c": ""}, {"a": "3", "b": "", "c": "x"}]
    results.write_json(tmp_path / "r.json", {"rows": rows})
    assert json.loads((tmp_path / "r.json").read_text()) == {"rows": rows}


def test_tables_line_up():
    assert results.markdown_table(["n", "x"], [[1, "a"]]) == "| n | x |\n|---|---|\n| 1 | a |"
    assert results.text_table(["n", "value"], [[10, "a"]]).splitlines() == [
        " n  value", "10      a"]


def test_progress_bar_goes_to_stderr_and_yields_everything(capsys):
    assert list(progress.track([1, 2, 3], "work")) == [1, 2, 3]
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "work [" in captured.err and "3/3  done" in captured.err


def test_a_busy_cpu_is_named_in_the_results():
    env = results.environment("cpu")
    assert env["cpu_cores"] >= 1 and "load_average" in env
    assert results.busy_cpu_note({"load_average": 0.5, "cpu_cores": 2}) is None
    note = results.busy_cpu_note({"load_average": 7.0, "cpu_cores": 2})
    assert "load average 7.0 on 2 cores" in note
