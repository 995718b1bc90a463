#!/usr/bin/env bash
# Nightly ablations with a regression gate: run each sweep spec as a fresh sweep, then gate it
# against its own baseline arm with `gemctl compare SWEEP_ID --max-ne-regression ...`.
# Exits non-zero when any sweep failed or any gate was exceeded, after running all of them,
# so one bad night still records every ablation.
#
#   deploy/scripts/nightly-ablations.sh recipes/ablations/attention.yaml ...
#   MAX_NE_REGRESSION=0.1% (default) sets the gate.
set -uo pipefail

MAX_NE_REGRESSION="${MAX_NE_REGRESSION:-0.1%}"

# The sweep id from `gemctl sweep` output: its closing line reads
# "sweep <id> <FINISHED|FAILED|KILLED>: ...".
sweep_id_from_log() {
  sed -n -E 's/^sweep ([A-Za-z0-9_.-]+) (FINISHED|FAILED|KILLED):.*/\1/p' "$1" | tail -n 1
}

main() {
  if [ "$#" -eq 0 ]; then
    echo "usage: $0 SWEEP_SPEC..." >&2
    return 2
  fi
  local status=0 spec log id
  for spec in "$@"; do
    log="$(mktemp)"
    echo "== gemctl sweep --new ${spec}"
    gemctl sweep --new "${spec}" 2>&1 | tee "${log}" || status=1
    id="$(sweep_id_from_log "${log}")"
    rm -f "${log}"
    if [ -z "${id}" ]; then
      echo "error: no sweep id in the output of gemctl sweep ${spec}" >&2
      status=1
      continue
    fi
    echo "== gemctl compare ${id} --max-ne-regression ${MAX_NE_REGRESSION}"
    gemctl compare "${id}" --max-ne-regression "${MAX_NE_REGRESSION}" --no-plot || status=1
  done
  return "${status}"
}

# Sourced (by the tests), only define the functions.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
