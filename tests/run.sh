#!/usr/bin/env bash
# The test command of the README: builds the CPU environment from nothing (examples/cpu/setup_env.sh,
# idempotent) and runs the whole suite: the pure core, the OpenRLHF integration, the examples and the
# end-to-end runs of the real Ray pipeline, after the linter (ruff.toml). Extra arguments go to pytest (e.g.
# `-m "not e2e"`). On a GPU machine (no Ray or vLLM needed), `pytest -m cuda tests/core tests/cuda` runs the CUDA
# tests, which this CPU suite collects and skips. It ends with its wall time (environment, linter and pytest) and
# the suite's counts: CI stops it at 90 minutes, and it is kept within 40 on the 2-core VM (a slow day takes half
# again).
#
# Without arguments the suite runs as two pytest processes: the end-to-end runs (-m e2e) in front, and the rest
# beside them at the lowest CPU priority (nice 19, below the runs' Ray workers), on the fifth of the cores the
# runs leave idle while their processes start; its output follows theirs. Each lists its 20 slowest tests; the
# script closes with the seconds per folder of tests/ and one line of counts.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash examples/cpu/setup_env.sh
PY="${D3S_VENV:-$ROOT/.venv}/bin/python"
# the environment's bin first on PATH, as an activated environment has it, for every process of the suite: DeepSpeed
# JIT-builds its CPU ops with the first `ninja` on PATH, and the system's and the wheel's (the launch-script clusters
# put the environment's first) hash the compile command differently, so every switch between them rebuilt both ops
# (~100 s of the 2 cores each time)
export PATH="$(dirname "$PY"):$PATH"
LINTED=(setup.py d3s_openrlhf tests benchmarks)  # every tracked .py; ruff format fixes what --check finds
"$PY" -m ruff check "${LINTED[@]}"
"$PY" -m ruff format --check "${LINTED[@]}"

pytest_start=$SECONDS
elapsed() { echo "$(($1 / 60)) min $(($1 % 60)) s"; }
rc=0
if (($#)); then
    "$PY" -m pytest -ra "$@" || rc=$?
    echo "[tests/run.sh] wall time $(elapsed "$SECONDS") (pytest $(elapsed $((SECONDS - pytest_start)))), exit $rc"
    exit "$rc"
fi

logs="$(mktemp -d)"
# each pytest in a process group of its own, waited for (a signal to the script ends the wait): the script's exit,
# however it comes, stops both
set -m
nice -n 19 "$PY" -m pytest -ra --durations=20 --junitxml="$logs/rest.xml" -m "not e2e" >"$logs/rest.log" 2>&1 &
rest=$!
("$PY" -m pytest -ra --durations=20 --junitxml="$logs/e2e.xml" -m e2e 2>&1 | tee "$logs/e2e.log"; exit "${PIPESTATUS[0]}") &
e2e=$!
set +m
trap 'kill -TERM -- "-$rest" "-$e2e" 2>/dev/null || true; rm -rf "$logs"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
wait "$e2e" || rc=$?
e2e_s=$((SECONDS - pytest_start))
rest_rc=0
wait "$rest" || rest_rc=$?
echo
echo "[tests/run.sh] the tests other than e2e, run beside them (exit $rest_rc):"
cat "$logs/rest.log"
((rc)) || rc=$rest_rc
echo "[tests/run.sh] wall time $(elapsed "$SECONDS") (pytest $(elapsed $((SECONDS - pytest_start))), the e2e runs $(elapsed "$e2e_s")), exit $rc"
# the seconds each folder of tests/ took (both processes, from their JUnit reports), then their counts as one
# closing line
"$PY" - "$logs/e2e.xml" "$logs/rest.xml" <<'EOF' || true
import collections
import sys
import xml.etree.ElementTree as ET

seconds, tests = collections.Counter(), collections.Counter()
counts = dict(tests=0, failures=0, errors=0, skipped=0)
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as error:
        print(f"[tests/run.sh] no report from {path}: {error}")
        continue
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    for case in root.iter("testcase"):
        parts = case.get("classname", "").split(".")
        parts = parts[1:] if parts[:1] == ["tests"] else parts
        folder = parts[0] if len(parts) > 1 else "(top level)"
        seconds[folder] += float(case.get("time", 0))
        tests[folder] += 1
print("[tests/run.sh] seconds per folder of tests/ (setup, call and teardown; the two processes overlap):")
for folder, total in seconds.most_common():
    print(f"{total:9.1f}  {tests[folder]:5d} tests  {folder}")
failed = counts["failures"] + counts["errors"]
passed = counts["tests"] - failed - counts["skipped"]
print(f"{passed} passed, {failed} failed, {counts['skipped']} skipped")
EOF
exit "$rc"
