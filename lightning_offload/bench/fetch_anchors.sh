#!/usr/bin/env bash
# Download the benchmark's anchors (torchtune 0.6.1, TRL 1.16) as wheels into .whl/ (git-ignored), for a GPU
# machine that has no network. Nothing of theirs is committed; the benchmark imports them only if present.
#
# Besides the two anchors, the set holds the packages they import at import time that the GPU image lacks, all
# pure Python except torchao (whose C++ extensions are never loaded: TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1):
#   torchtune.training -> torchtune/__init__ imports torchao (0.15: the last with the int4_weight_only torchtune
#   0.6.1 imports) and its data modules import datasets (-> dill, multiprocess) and omegaconf.
#   trl.models.activation_offloading needs only accelerate, transformers and psutil, which the image has.
# torchao 0.15 is older than peft accepts, so the worker hides it from sys.path until torchtune is loaded.
#
# On the GPU machine (Python 3.12, no index):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site python3 -m lightning_offload.bench --device-name h200 --deadline 570
#
# Usage: bash lightning_offload/bench/fetch_anchors.sh [DEST]   (DEST defaults to .whl at the repository root)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dest="${1:-$root/.whl}"
mkdir -p "$dest"

python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" \
    torchtune==0.6.1 \
    trl==1.16.0 \
    torchao==0.15.0 \
    datasets==4.8.0 \
    dill==0.4.1 \
    multiprocess==0.70.19 \
    omegaconf==2.4.0

ls -l "$dest"
total=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
echo "total: $((total / 1024 / 1024)) MiB in $(ls "$dest"/*.whl | wc -l) wheels"
if [ "$total" -gt $((40 * 1024 * 1024)) ]; then
    echo "warning: more than 40 MiB of wheels" >&2
fi
