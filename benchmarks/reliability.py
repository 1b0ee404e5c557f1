"""docs/reliability.md from what the fault and fuzz tests recorded (`make reliability`).

    python -m benchmarks.reliability LOG [OUT]

LOG holds one JSON line per record, written by the tests' `reliability` fixture
(tests/conftest.py) when AUTOPAR_RELIABILITY_LOG names it: the test, what it tried, its
fuzzing profile, a count per outcome, what was lost and what it measured. Records of the same
test and trial are summed, their figures given as ranges.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections import Counter
from importlib.metadata import version

HEADER = """# Reliability: what was tried, how often, and what was lost

Made by `make reliability` from the records the tests themselves write
(`AUTOPAR_RELIABILITY_LOG`, tests/conftest.py's `reliability`); no figure here is typed by hand.
Every row is a passing test: a fault whose outcome broke the test's assertions would have failed
the run instead. "runs" counts the test's runs, "cases" what they tried in all; "refused" counts
inputs answered with an `AutoparError` naming the problem and
a fix; "taken" counts inputs accepted, and a step run under them computed what one device does.
How a fault is handled, and why: docs/decisions.md, "Faults".

{machine}

| what was tried | test | fuzzing profile | runs | cases | outcomes | measured | lost |
|---|---|---|---|---|---|---|---|
"""


def rows(lines: list[str]) -> list[str]:
    """One table row per test and trial: outcomes summed over its runs, figures as ranges."""
    merged: dict[tuple[str, str, str], dict] = {}
    for line in lines:
        r = json.loads(line)
        row = merged.setdefault((r["what"], r["test"], r["profile"]),
                                {"runs": 0, "counts": Counter(), "lost": set(), "measured": {}})
        row["runs"] += 1
        row["counts"] += Counter(r["outcomes"])
        row["lost"].add(r["lost"])
        for name, value in r["measured"].items():
            row["measured"].setdefault(name, []).append(value)
    out = []
    for (what, test, profile), row in merged.items():
        counts = row["counts"]
        outcomes = "; ".join(f"{k} {v}" for k, v in counts.most_common())
        figures = "; ".join(f"{name} {min(v):.3g}-{max(v):.3g}" if len(v) > 1 else
                            f"{name} {v[0]:.3g}" for name, v in row["measured"].items())
        out.append(f"| {what} | `{test}` | {profile or '-'} | {row['runs']} | "
                   f"{sum(counts.values())} | {outcomes} | {figures or '-'} | "
                   f"{'; '.join(sorted(row['lost']))} |")
    return out


def main(argv: list[str]) -> int:
    log, out = argv[0], argv[1] if len(argv) > 1 else os.path.join("docs", "reliability.md")
    with open(log) as f:
        lines = [line for line in f if line.strip()]
    machine = (f"Run on {datetime.date.today()}: {platform.machine()} with {os.cpu_count()} "
               f"CPU cores, Python {platform.python_version()}, jax {version('jax')}, "
               f"orbax-checkpoint {version('orbax-checkpoint')}, hypothesis "
               f"{version('hypothesis')}.")
    with open(out, "w") as f:
        f.write(HEADER.format(machine=machine) + "\n".join(rows(lines)) + "\n")
    print(f"{len(lines)} records -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
