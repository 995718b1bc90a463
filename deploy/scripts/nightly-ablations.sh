#!/usr/bin/env bash
# Nightly ablations with regression gates judged on their 95% intervals: run each sweep spec as
# a fresh sweep, then gate it against its own baseline arm with
# `gemctl compare SWEEP_ID --max-ne-regression ...`. Both steps are read from their JSON output
# (`--json`), never from their text: the sweep id from `gemctl sweep --json`, the verdicts and
# exit code from `gemctl compare --json`.
# Runs every spec before exiting, so one bad night still records every ablation. Exit status:
#   0  every sweep finished and every gate passed
#   1  a sweep failed, or a gate failed (an interval lies wholly beyond its limit)
#   3  no failure, but a gate is inconclusive (its interval straddles the limit; the seeds
#      that would settle it are printed)
#
#   deploy/scripts/nightly-ablations.sh recipes/ablations/attention.yaml ...
#   MAX_NE_REGRESSION=0.1% (default) sets the gate of every spec without a
#   gates.max_ne_regression of its own (a control's expected verdicts hold at its own).
set -uo pipefail

MAX_NE_REGRESSION="${MAX_NE_REGRESSION:-0.1%}"

# json_field FILE KEY: the top-level KEY of the JSON document in FILE; empty when the file is
# not JSON or the key is missing or null.
json_field() {
  python3 - "$1" "$2" <<'PY'
import json
import sys

try:
    with open(sys.argv[1]) as f:
        body = json.load(f)
except (OSError, ValueError):
    body = {}
value = body.get(sys.argv[2]) if isinstance(body, dict) else None
print("" if value is None else value)
PY
}

# expect_args SPEC: the spec's control expectations (gates.expect: arm -> metric -> pass|fail)
# as `gemctl compare` arguments, one per line: --expect ARM:METRIC=VERDICT. A positive
# control's expected FAIL then counts as a pass, and a night where it passes fails.
expect_args() {
  python3 - "$1" <<'PY'
import sys

import yaml

try:
    with open(sys.argv[1]) as f:
        spec = yaml.safe_load(f) or {}
except (OSError, yaml.YAMLError):
    sys.exit(0)
expect = ((spec.get("gates") or {}).get("expect") or {}) if isinstance(spec, dict) else {}
for arm, metrics in expect.items():
    for metric, verdict in (metrics or {}).items():
        print(f"--expect\n{arm}:{metric}={verdict}")
PY
}

# spec_gate SPEC DEFAULT: the spec's own gates.max_ne_regression, else DEFAULT.
spec_gate() {
  python3 - "$1" "$2" <<'PY'
import sys

import yaml

try:
    with open(sys.argv[1]) as f:
        spec = yaml.safe_load(f) or {}
except (OSError, yaml.YAMLError):
    spec = {}
gates = (spec.get("gates") or {}) if isinstance(spec, dict) else {}
print(gates.get("max_ne_regression") or sys.argv[2])
PY
}

# verdicts FILE: one line per gate of a `gemctl compare --json` document:
# "ARM METRIC VERDICT" (+ "needs ~N seeds" when inconclusive and the spread says how many;
# + "(expected X)" for a control's verdict), then a warning per arm trained past one epoch.
verdicts() {
  python3 - "$1" <<'PY'
import json
import sys

try:
    with open(sys.argv[1]) as f:
        body = json.load(f)
except (OSError, ValueError):
    sys.exit(0)
for v in body.get("verdicts") or []:
    line = f"{v['arm']} {v['metric']} {v['verdict'].upper()}"
    if v["verdict"] == "inconclusive" and v.get("seeds_needed"):
        line += f" needs ~{v['seeds_needed']} seeds"
        if v.get("seeds_needed_closer"):
            line += f" (~{v['seeds_needed_closer']} if the mean moves 1 SE closer)"
    if v.get("expected"):
        line += f" (expected {v['expected'].upper()})"
    print(line)
for arm, epochs in (body.get("past_one_epoch") or {}).items():
    print(f"warning: {arm} trained {epochs:.1f} epochs of its training split: its NE can "
          "measure memorization")
PY
}

# worse STATUS CODE: the combined status (1 beats 3 beats 0).
worse() {
  if [ "$1" -eq 1 ] || [ "$2" -eq 1 ]; then echo 1
  elif [ "$1" -eq 3 ] || [ "$2" -eq 3 ]; then echo 3
  else echo 0
  fi
}

main() {
  if [ "$#" -eq 0 ]; then
    echo "usage: $0 SWEEP_SPEC..." >&2
    return 2
  fi
  local status=0 spec sweep_json cmp_json id code rc gate
  local -a expect
  for spec in "$@"; do
    mapfile -t expect < <(expect_args "${spec}")
    gate="$(spec_gate "${spec}" "${MAX_NE_REGRESSION}")"
    sweep_json="$(mktemp)"
    cmp_json="$(mktemp)"
    echo "== gemctl sweep --new ${spec} --json"
    gemctl sweep --new "${spec}" --json > "${sweep_json}" || status=1
    id="$(json_field "${sweep_json}" sweep_id)"
    if [ -z "${id}" ]; then
      echo "error: gemctl sweep ${spec} reported no sweep id" >&2
      status=1
      rm -f "${sweep_json}" "${cmp_json}"
      continue
    fi
    echo "sweep ${id}: $(json_field "${sweep_json}" status)"
    echo "== gemctl compare ${id} --max-ne-regression ${gate} ${expect[*]} --json"
    gemctl compare "${id}" --max-ne-regression "${gate}" "${expect[@]}" \
      --no-plot --json > "${cmp_json}"
    rc=$?
    verdicts "${cmp_json}"
    # the document's own exit_code; without a document (bad input, a crash) the run failed
    code="$(json_field "${cmp_json}" exit_code)"
    if [ -z "${code}" ]; then code=$(( rc == 0 ? 0 : 1 )); fi
    status="$(worse "${status}" "${code}")"
    rm -f "${sweep_json}" "${cmp_json}"
  done
  return "${status}"
}

# Sourced (by the tests), only define the functions.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
