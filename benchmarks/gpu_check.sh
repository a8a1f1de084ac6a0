#!/usr/bin/env bash
# Every GPU test, then the dynamic-lengths arms, in one call on one CUDA machine (about 6 minutes on an H200; the
# parts' limits add up to 560 s, inside a 600 s call). The tests' limit is the largest: on one H100 the `gpu`-marked
# tests took 127 s, on another 39 of them had not finished in 170 s; the unmarked tests took 15 s and the arms 23-47 s.
#
#   OUT=/some/folder bash benchmarks/gpu_check.sh
#
# (PYTHON names the interpreter, ``python`` by default.)
# Writes under $OUT: gpu-tests.log, gpu-unmarked-tests.log, dyn-auto-<arm>.{json,log}, dyn-cap-<arm>.{json,log} and
# summary.txt (one line per part: its exit status and seconds). Each part has its own time limit, so one that hangs
# leaves the others their time; the exit status is non-zero where any part failed.
#
# What runs:
#   - the tests marked `gpu` (streams, events, pinned memory, the callback on CUDA, the memory picture, tracing);
#   - the test files that use CUDA where it exists without being marked (checkpointing, recompute, planned blocks,
#     device memory);
#   - dynamic lengths under the default budget, where the model fits (`none` against `input_changed`: the callback's
#     cost there should stay within 1.05x);
#   - dynamic lengths under a hard 6 GiB cap, five bucketed lengths (`input_changed` against `fixed`).
set -u
: "${OUT:?set OUT to the folder the results go to}"
export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}" PYTHONUNBUFFERED=1
python=${PYTHON:-python}
status=0
summary="${OUT}/summary.txt"
: >"${summary}"
logs=${OUT}
# shellcheck source=benchmarks/parts.sh
source "$(dirname "${BASH_SOURCE[0]}")/parts.sh"

# tests/test_cli.py holds no GPU test and imports the optional CLI extra (jsonargparse), which a GPU machine may lack:
# collecting it there fails the whole part.
part gpu-tests 280 "${python}" -m pytest -q -m gpu -p no:cacheprovider tests --ignore=tests/test_cli.py
part gpu-unmarked-tests 40 "${python}" -m pytest -q -p no:cacheprovider tests/test_checkpointing.py \
    tests/test_recompute_policy.py tests/test_planned_blocks.py tests/test_device_memory.py
for arm in none input_changed; do
    BUDGET=auto part "dyn-auto-${arm}" 50 "${python}" -m benchmarks.dynamic_lengths "${OUT}/dyn-auto-${arm}.json" "${arm}" \
        64 8192 16384 512
done
for arm in fixed input_changed; do
    CAP=1 part "dyn-cap-${arm}" 70 "${python}" -m benchmarks.dynamic_lengths "${OUT}/dyn-cap-${arm}.json" "${arm}" \
        128 8192 16384 2048
done
cat "${summary}"
exit "${status}"
