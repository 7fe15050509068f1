#!/bin/sh
# The test suite as `make test` runs it (bench/suite.py too), in two parts run side by side:
# - the multi-rank tests (marked ray) in one process, which starts one local Ray cluster and shares it
#   between them (tests/conftest.py);
# - the single-process tests (tests/tracer, tests/workloads, tests/orchestrator but those marked ray)
#   on up to 4 cores (pytest-xdist, a file per process at a time), their output printed when they end.
# The multi-rank tests alone leave ~17% of 2 cores idle (Ray's start, rank rendezvous, a hung job's
# timeout); the single-process ones fill part of it. On 2 cores, one after the other took 90 + 645 s,
# side by side 678 s (the same hour, the machine's load unchanged).
# Both always run; the exit code is the first failing one's. Arguments: pytest paths and options
# (default: tests).
PY="${PY:-.venv/bin/python}"
[ $# -gt 0 ] || set -- tests
n=$(nproc 2>/dev/null || echo 2)
[ "$n" -gt 4 ] && n=4
# ttrace's own bytecode, up to date before ~100 processes import it (Ray workers, fork servers, CLI
# runs): where PYTHONDONTWRITEBYTECODE is set, each of them compiled its 16,000 lines (0.25 s of CPU).
# A file that does not compile is printed here and fails the tests that import it.
"$PY" -m compileall -q -j "$n" tracer orchestrator workloads hydra_plugins
# And the tests' processes write what they import that setup did not compile (scripts/suite_imports.py
# lists what it does), once, instead of compiling it again in every process that imports it.
unset PYTHONDONTWRITEBYTECODE
fast_log=$(mktemp)
"$PY" -m pytest -q -n "$n" --dist loadfile -m "not ray" "$@" >"$fast_log" 2>&1 &
fast_pid=$!
trap 'kill "$fast_pid" 2>/dev/null; rm -f "$fast_log"; exit 130' INT TERM
"$PY" -m pytest -q --durations=12 -m ray "$@"; slow=$?
wait $fast_pid; fast=$?
echo "--- single-process tests (run beside the multi-rank ones) ---"
cat "$fast_log"
rm -f "$fast_log"
[ $fast -eq 5 ] && fast=0   # none collected there (only multi-rank tests asked for)
[ $slow -eq 5 ] && slow=0
[ $fast -ne 0 ] && exit $fast
exit $slow
