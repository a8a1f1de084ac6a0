#!/usr/bin/env bash
# The memory-budget planner on one CUDA machine, in one call: the benchmark workloads under the planner's budgets, the
# same beside another tree's planner (the one before a change) on the same machine, and parts of the model zoo.
#
#   OUT=/some/folder [BASELINE=/path/to/other/tree] [WORKLOADS=a,b] [ZOO="1/3 2/3"] bash benchmarks/planner_check.sh
#
# BASELINE names a folder holding another version's `lightning_offload/` and `benchmarks/` (from `git archive <commit>
# lightning_offload benchmarks pyproject.toml`); its workloads run in it, after this tree's. WORKLOADS set but empty
# runs none (a call for zoo parts alone). ZOO lists zoo parts (`--part i/n`), run in order; empty: none. WORKLOADS_S
# and ZOO_S bound each workloads run and each zoo part, in seconds (defaults 280 and 270: one tree's four workloads
# take about 4 minutes on an H100, a third of the zoo 3-5; a zoo part cut at its limit keeps the rows it ran, not their
# traces). MODES replaces this tree's workload modes (the default adds the defaults and checkpointing to the baseline's
# none and budgets). PYTHON names the interpreter, `python` by default.
#
# Writes two files under $OUT (a device call brings back few): summary.txt, one line per part with its exit status and
# seconds, and planner-check.tgz, packed again after every part (a call cut short keeps what ran): workloads-<tree>.json
# and .log for this tree ("head") and the baseline ("baseline"), zoo-<i>.json, zoo-<i>-traces.json and zoo-<i>.log per
# part. The Markdown and plots are made from the JSON later (`benchmarks.report`, `python -m benchmarks.zoo --merge`).
# The exit status is non-zero where any part failed.
set -u
: "${OUT:?set OUT to the folder the results go to}"
export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}" PYTHONUNBUFFERED=1
python=${PYTHON:-python}
workloads=${WORKLOADS-llama1b-s4k,llama1b-s16k,llama8b-lora-s8k,small-h512}  # set but empty: no workloads
work=$(mktemp -d)
trap 'rm -rf "${work}"' EXIT
results="${work}/results"
mkdir -p "${results}"
status=0
summary="${OUT}/summary.txt"
: >"${summary}"
logs=${results}
# shellcheck source=benchmarks/parts.sh
source "$(dirname "${BASH_SOURCE[0]}")/parts.sh"

keep() { # keep FROM NAME: a result the run wrote, into the pack
    if [ -f "$1" ]; then cp "$1" "${results}/$2"; fi
    tar czf "${OUT}/planner-check.tgz" -C "${results}" .
}

# The planner's budgets beside the plain step, the defaults and checkpointing; the baseline runs the planner's rows.
if [ -n "${workloads}" ]; then
    part workloads-head "${WORKLOADS_S:-280}" "${python}" -m benchmarks --workloads "${workloads}" \
        --modes "${MODES:-none,ours-default,ac,ours-budget-0.9x,ours-budget-0.7x}" --out "${work}/head" --device-name head \
        --deadline "$((${WORKLOADS_S:-280} - 10))"
    keep "${work}/head/head.json" workloads-head.json
    if [ -n "${BASELINE:-}" ]; then
        baseline=$(cd "${BASELINE}" && pwd)
        # In the baseline's tree, with it alone on the path.
        part workloads-baseline "${WORKLOADS_S:-280}" env -C "${baseline}" PYTHONPATH="${baseline}" "${python}" \
            -m benchmarks --workloads "${workloads}" --modes none,ours-budget-0.9x,ours-budget-0.7x \
            --out "${work}/baseline" --device-name baseline
        keep "${work}/baseline/baseline.json" workloads-baseline.json
    fi
fi
for slice in ${ZOO:-}; do
    index=${slice%%/*}
    part "zoo-${index}" "${ZOO_S:-270}" "${python}" -m benchmarks.zoo --part "${slice}" \
        --out "${work}/zoo-${index}.json"
    keep "${work}/zoo-${index}.json" "zoo-${index}.json"
    keep "${work}/zoo-${index}-traces.json" "zoo-${index}-traces.json"
done
tar czf "${OUT}/planner-check.tgz" -C "${results}" .
cat "${summary}"
exit "${status}"
