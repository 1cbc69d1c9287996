#!/usr/bin/env bash
# Type check of the qdqgraph package (settings: mypy.ini) against a baseline that may only shrink:
# .ci/mypy-baseline.txt holds the number of errors accepted today. More errors fail (exit 1, the
# errors listed, those in files changed or added since HEAD first); fewer pass and say the baseline can go
# down to the new count. PYTHON picks the interpreter that has mypy (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
BASELINE_FILE=.ci/mypy-baseline.txt
baseline=$(tr -d '[:space:]' < "$BASELINE_FILE")
if ! [[ $baseline =~ ^[0-9]+$ ]]; then
    echo "mypy: $BASELINE_FILE must hold one integer, found '$baseline'" >&2
    exit 2
fi

# no cache: every run checks from scratch (a few seconds), so a stale cache never hides an error
out=$(mktemp)
trap 'rm -f "$out"' EXIT
rc=0
"$PY" -m mypy --config-file mypy.ini --cache-dir=/dev/null > "$out" 2>&1 || rc=$?
if [ "$rc" -gt 1 ]; then                # 1: type errors found; anything else: mypy itself failed
    cat "$out" >&2
    echo "mypy: did not run to the end (exit $rc)" >&2
    exit 2
fi

# the last line is mypy's summary: "Found N errors in M files (...)" or "Success: no issues found ..."
summary=$(tail -n 1 "$out")
if [[ $summary =~ ^Found\ ([0-9]+)\ errors?\ in ]]; then
    count=${BASH_REMATCH[1]}
elif [[ $summary =~ ^Success: ]]; then
    count=0
else
    cat "$out" >&2
    echo "mypy: no summary line from $PY -m mypy (is mypy installed there? set PYTHON)" >&2
    exit 2
fi
if [ "$count" -gt "$baseline" ]; then
    changed=$( (git diff --name-only HEAD -- qdqgraph; git ls-files --others --exclude-standard qdqgraph) 2>/dev/null || true)
    echo "mypy: $count errors (baseline $baseline): $((count - baseline)) more than the baseline allows."
    if [ -n "$changed" ]; then
        echo "-- in files changed or added since HEAD:"
        grep ': error:' "$out" | grep -F -f <(printf '%s:\n' $changed) || echo "   (none)"
        echo "-- everywhere:"
    fi
    grep ': error:' "$out"
    echo "mypy: fix the new errors (mypy.ini holds the settings); the baseline only goes down."
    exit 1
fi
echo "mypy: $count errors (baseline $baseline)"
if [ "$count" -lt "$baseline" ]; then
    echo "mypy: the baseline can be lowered: echo $count > $BASELINE_FILE"
fi
