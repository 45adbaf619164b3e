"""The demo's report: one Markdown page with tables and the PNGs beside it.

Sections are added as the demo produces them; `write()` renders whatever is there, so a demo
that stops half-way still leaves a readable page. What a step left out (a backend this machine
cannot run, a size skipped) is collected with `skip()` and listed in a last section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from flashkit.experiments import results


@dataclass
class Report:
    title: str
    environment: dict
    sections: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def add(self, heading: str, text: str, image: Path | None = None) -> None:
        """A section: heading, Markdown text, and optionally a PNG in the report folder."""
        body = f"## {heading}\n\n{text.strip()}\n"
        if image is not None:
            body += f"\n![{heading}]({image.name})\n"
        self.sections.append(body)

    def skip(self, what: str, why: str) -> None:
        """Note something a step did not run, and why."""
        self.skipped.append(f"- {what}: {why}")

    def write(self, path: Path) -> Path:
        env = self.environment
        triton = env["triton"] or "not installed"
        lines = [f"# {self.title}", "",
                 f"{env['date']} on {env['device_name']} ({env['device']}); Python "
                 f"{env['python']}, torch {env['torch']}, triton {triton}, "
                 f"flashkit {env['flashkit']}.", ""]
        skipped = ["## Skipped", "", *(self.skipped or ["Nothing: every step ran in full."]), ""]
        busy = results.busy_cpu_note(env)
        if busy and not env["device"].startswith("cuda"):
            lines += [f"**Note:** {busy}.", ""]
        path.write_text("\n".join(lines + self.sections + skipped))
        return path
