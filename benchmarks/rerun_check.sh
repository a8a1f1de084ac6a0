#!/usr/bin/env bash
# Steps that run out of memory run again: the GPU test that makes CUDA fail mid-backward, and the zoo rows that ran out
# of memory in a planned step before (row 31 in every run since 2026-12-06; rows 00 and 37 in earlier ones). One device
# call of about three minutes:
#
#   OUT=/some/folder bash benchmarks/rerun_check.sh
#
# ZOO replaces the rows' options (e.g. ZOO="--part 2/3", which holds rows 31 and 37, about 130 s) and ZOO_S their
# time limit in seconds (150).
#
# Writes rerun.tgz under $OUT (the zoo's JSON, Markdown, plots and traces; the test's log) and prints each row's line.
set -u
: "${OUT:?set OUT to the folder the results go to}"
export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}" PYTHONUNBUFFERED=1
work=$(mktemp -d)
timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py \
    -k "ran_out_of_memory_mid_backward" >"${work}/gpu-test.log" 2>&1
echo "gpu test: exit $?"
tail -n 3 "${work}/gpu-test.log"
# shellcheck disable=SC2086  # ZOO holds the zoo's row options, split on purpose (e.g. ZOO="--part 2/3")
timeout "${ZOO_S:-150}" python -m benchmarks.zoo ${ZOO:---only 0,31,37} --out "${work}/rows.json" 2>&1 | grep -v '^ \|^{\|^}'
python - "${work}" <<'PY'
import json
import sys

work = sys.argv[1]
for name in ("rows",):
    try:
        rows = json.load(open(f"{work}/{name}.json"))["rows"]
    except OSError:
        print(name, "missing")
        continue
    for r in rows:
        print(name, r["config"][:40], "floor_fits", r.get("fits_floor"), "oom", r.get("oom_planned"),
              "reruns", r.get("reruns"), "x_ac", r.get("ratio_ac"), "kinds", r.get("kinds"))
        if r.get("oom_fragments"):
            f = r["oom_fragments"]
            print("  fragments", {k: f[k] for k in ("request_mib", "reserved", "allocated", "free_beside_live",
                                                     "largest_free", "segments", "kinds")})
            for w in f["worst"][:6]:
                print("   ", w)
PY
tar czf "${OUT}/rerun.tgz" -C "${work}" .
