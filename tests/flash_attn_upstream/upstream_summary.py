"""Counting a run of flash-attn's test file: outcomes per test function, failures grouped by
their cause, skips by their reason.

    tally = Tally(source_lines)        # the vendored file's lines, to quote the failing line
    tally.add(report)                  # every pytest TestReport (xdist forwards workers' ones)
    tally.as_dict(), markdown(summary) # the JSON summary and its markdown rendering

A failure's cause is the line of test_flash_attn.py it failed on plus the first line of its
error message with the numbers blanked out, so "3 * 0.0021" and "3 * 0.0019" count as one cause.
A skip without a reason (`pytest.skip()` after an `if`) is named by the condition it follows.
"""

from __future__ import annotations

import collections
import re

UPSTREAM_FILE = "test_flash_attn.py"
DEADLINE_REASON = "not run: time budget spent"
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "not_run")
EXAMPLES = 3  # node ids kept per failure cause
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?")


def normalise(message: str) -> str:
    """The first line of an error message with every number replaced by '#'."""
    first = next((line for line in message.splitlines() if line.strip()), "")
    return _NUMBER.sub("#", first.strip())[:300]


class Tally:
    def __init__(self, source_lines: list[str]):
        self.lines = source_lines
        self.outcomes = collections.defaultdict(collections.Counter)  # function -> outcome -> n
        self.seconds = collections.defaultdict(float)
        self.failures = {}  # (where, message) -> {"cases", "functions", "example", "ids"}
        self.skips = {}  # reason -> {"cases", "functions"}

    def add(self, report) -> None:
        function = report.nodeid.split("::")[-1].split("[")[0]
        self.seconds[function] += report.duration
        outcome = self._outcome(report)
        if outcome is None:
            return
        self.outcomes[function][outcome] += 1
        if outcome in ("failed", "error"):
            self._add_failure(function, report)
        elif outcome == "skipped":
            entry = self.skips.setdefault(self._skip_reason(report.longrepr),
                                          {"cases": 0, "functions": collections.Counter()})
            entry["cases"] += 1
            entry["functions"][function] += 1

    @staticmethod
    def _outcome(report) -> str | None:
        """One outcome per case: the call's, or the setup's when the call did not run; a failed
        teardown counts as an error on top of it."""
        xfail = hasattr(report, "wasxfail")
        if report.when == "call":
            if report.passed:
                return "xpassed" if xfail else "passed"
            if report.skipped:
                return "xfailed" if xfail else _skip_outcome(report.longrepr)
            return "failed"
        if report.passed:
            return None
        if report.skipped:
            return _skip_outcome(report.longrepr)
        return "error"

    def _add_failure(self, function, report) -> None:
        longrepr = report.longrepr
        crash = getattr(longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(longrepr).strip()
        if crash is None and message:
            message = message.splitlines()[-1]
        where = self._where(longrepr)
        key = (where, normalise(message))
        entry = self.failures.setdefault(key, {"cases": 0, "functions": collections.Counter(),
                                               "example": message.strip()[:500], "ids": []})
        entry["cases"] += 1
        entry["functions"][function] += 1
        if len(entry["ids"]) < EXAMPLES:
            entry["ids"].append(report.nodeid.split("::")[-1])

    def _where(self, longrepr) -> str:
        """The last line of the test file in the traceback, quoted: `test_flash_attn.py:1070
        assert (dq - dq_ref)...`; else the crash location."""
        entries = getattr(getattr(longrepr, "reprtraceback", None), "reprentries", [])
        for entry in reversed(entries):
            location = getattr(entry, "reprfileloc", None)
            if location is not None and str(location.path).endswith(UPSTREAM_FILE):
                return f"{UPSTREAM_FILE}:{location.lineno} {self._line(location.lineno)}"
        crash = getattr(longrepr, "reprcrash", None)
        return f"{crash.path}:{crash.lineno}" if crash is not None else "?"

    def _line(self, lineno: int) -> str:
        return self.lines[lineno - 1].strip() if 0 < lineno <= len(self.lines) else ""

    def _skip_reason(self, longrepr) -> str:
        path, lineno, reason = _skip_parts(longrepr)
        reason = reason.removeprefix("Skipped").removeprefix(":").strip()
        if reason:
            return reason
        if not str(path).endswith(UPSTREAM_FILE):
            return f"no reason given ({path}:{lineno})"
        return f"{UPSTREAM_FILE}:{lineno} {self._condition(lineno)}"

    def _condition(self, lineno: int) -> str:
        """The `if ...:` a bare `pytest.skip()` on line lineno sits under, on one line, and the
        skip line's own comment (flash-attn writes "# Reference implementation OOM" there)."""
        skip_line = self._line(lineno)
        start = lineno - 1
        while start > 1 and not self._line(start).startswith("if"):
            start -= 1
        condition = " ".join(self._line(n) for n in range(start, lineno))
        comment = skip_line.partition("#")[2].strip()
        return " ".join(condition.split()) + (f"  ({comment})" if comment else "")

    def as_dict(self) -> dict:
        functions = sorted(set(self.outcomes) | set(self.seconds))
        per_function = {
            name: {**{o: self.outcomes[name][o] for o in OUTCOMES if self.outcomes[name][o]},
                   "seconds": round(self.seconds[name], 1)}
            for name in functions}
        totals = collections.Counter()
        for counts in self.outcomes.values():
            totals.update(counts)
        failures = [{"cases": e["cases"], "where": where, "error": message,
                     "example": e["example"], "functions": dict(e["functions"]), "ids": e["ids"]}
                    for (where, message), e in self.failures.items()]
        skips = [{"cases": e["cases"], "reason": reason, "functions": dict(e["functions"])}
                 for reason, e in self.skips.items()]
        return {"totals": {o: totals[o] for o in OUTCOMES if totals[o]},
                "per_function": per_function,
                "failures_by_cause": sorted(failures, key=lambda f: -f["cases"]),
                "skips_by_reason": sorted(skips, key=lambda s: -s["cases"])}


def _skip_outcome(longrepr) -> str:
    return "not_run" if _skip_parts(longrepr)[2].endswith(DEADLINE_REASON) else "skipped"


def _skip_parts(longrepr) -> tuple:
    """(path, lineno, reason) of a skip; xdist sends the tuple as a list."""
    if isinstance(longrepr, tuple | list) and len(longrepr) == 3:
        return tuple(longrepr)
    return ("?", 0, str(longrepr or ""))


def markdown(summary: dict) -> str:
    """The summary as a page: header, the per-function table, failures by cause, skips."""
    plan = summary.get("plan", {})
    lines = [f"# {summary['suite']}", "",
             f"{summary['device']}, {summary['date']}; "
             + ", ".join(f"{k} {v}" for k, v in summary["versions"].items()), "",
             f"{summary['selection']}; {summary['seconds']} s with {summary['workers']} workers,"
             f" {summary.get('kernels_compiled', '?')} kernels compiled"
             f" (pytest exit code {summary['pytest_exit_code']}).", ""]
    header = ["test function", "cases in file", "drawn", *OUTCOMES, "seconds"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    names = sorted(set(summary["per_function"]) | set(plan.get("drawn", {})))
    for name in names:
        counts = summary["per_function"].get(name, {})
        row = [name, plan.get("sizes", {}).get(name, ""), plan.get("drawn", {}).get(name, ""),
               *(counts.get(o, 0) for o in OUTCOMES), counts.get("seconds", 0)]
        lines.append("| " + " | ".join(str(v) for v in row) + " |")
    totals = summary["totals"]
    total_row = ["total", sum(plan.get("sizes", {}).values()),
                 sum(plan.get("drawn", {}).values()), *(totals.get(o, 0) for o in OUTCOMES), ""]
    lines.append("| " + " | ".join(f"**{v}**" if v != "" else "" for v in total_row) + " |")
    lines += ["", "## Failures by cause", ""]
    if summary["failures_by_cause"]:
        lines += ["| cases | where | first error line | functions | e.g. |",
                  "|---|---|---|---|---|"]
        for f in summary["failures_by_cause"]:
            functions = ", ".join(f"{n} ({c})" for n, c in f["functions"].items())
            lines.append(f"| {f['cases']} | `{_cell(f['where'])}` | `{_cell(f['example'])}` | "
                         f"{functions} | {_cell(f['ids'][0])} |")
    else:
        lines.append("None.")
    lines += ["", "## Cases that broke the CUDA context", "",
              "Each ended its worker process (a fresh one ran the cases left), so the cases "
              "after it did not fail for it.", ""]
    lost = summary.get("lost_context", [])
    lines += [f"- `{_cell(case['id'])}`: {_cell(case['error'])}" for case in lost] or ["None."]
    lines += ["", "## Skips by reason", "",
              "Reasons starting with \"not applicable\" are where flashkit's drop-in deliberately "
              "differs from flash-attn (docs/dropin.md); the others are flash-attn's own skips.",
              ""]
    if summary["skips_by_reason"]:
        lines += ["| cases | reason | functions |", "|---|---|---|"]
        for s in summary["skips_by_reason"]:
            functions = ", ".join(f"{n} ({c})" for n, c in s["functions"].items())
            lines.append(f"| {s['cases']} | {_cell(s['reason'])} | {functions} |")
    else:
        lines.append("None.")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell (one line, no pipes)."""
    return " ".join(str(text).split()).replace("|", "\\|")[:300]
