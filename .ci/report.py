"""The test budget at the end of CI: totals per phase, outcomes, and the 15 slowest tests of the whole run.

    python .ci/report.py NAME=RECORD.jsonl [NAME=RECORD.jsonl ...]

Each RECORD is what tests/conftest.py appends under RLHPC_TEST_RECORD: one JSON line per test with its id, outcome,
seconds (setup, call and teardown together), the CPU seconds of the processes it waited for, and the end of its
failure's report if it failed. docs/testing.md
explains the tiers these numbers belong to.
"""

import json
import sys
from collections import Counter
from pathlib import Path


def main(args):
    rows = []
    print("== test budget")
    for arg in args:
        name, _, path = arg.partition("=")
        phase = [json.loads(x) for x in Path(path).read_text().splitlines()] if Path(path).exists() else []
        outcomes = Counter(r["outcome"] for r in phase)
        seconds = sum(r["seconds"] for r in phase)
        counts = ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())) or "no test"
        print(f"{name:>12}: {seconds:7.0f} s of tests ({seconds / 60:4.1f} min), {counts}")
        rows += [dict(r, phase=name) for r in phase]
    total = sum(r["seconds"] for r in rows)
    print(f"{'total':>12}: {total:7.0f} s of tests ({total / 60:4.1f} min), {len(rows)} tests")
    # CPU: the seconds of CPU of the processes the test waited for; far below its seconds, the test mostly waited.
    print("the 15 slowest (seconds, CPU seconds):")
    for r in sorted(rows, key=lambda r: -r["seconds"])[:15]:
        cpu = r.get("cpu_seconds")
        cpu = f"{cpu:7.1f}" if cpu is not None else "      ?"
        print(f"  {r['seconds']:7.1f} s {cpu} cpu  {r['phase']:<8} {r['outcome']:<7} {r['id']}")
    for r in rows:  # the end of each failure's report: a run cut short by CI's time limit prints no pytest summary
        if r.get("failure"):
            print(f"== failed: {r['id']} ({r['phase']})")
            print("\n".join("    " + line for line in r["failure"].splitlines()[-25:]))


if __name__ == "__main__":
    main(sys.argv[1:])
