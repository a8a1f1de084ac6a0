#!/usr/bin/env bash
# The benchmark's anchors (torchtune 0.6.1, TRL 1.16), reference implementations installed from their own packages
# at benchmark time, never committed:
#   fetch    (default; needs network) download their wheels into .whl/ (git-ignored)
#   install  (no network needed) install .whl/*.whl into .refimpl/ (git-ignored); `python -m benchmarks` puts
#            .refimpl/pkgs and .refimpl/ao on its workers' PYTHONPATH when it exists, and the anchors' rows run.
#
# Besides the two anchors, the set holds the packages they import at import time that the GPU image lacks, all
# pure Python except torchao (whose C++ extensions are never loaded: TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1):
#   torchtune.training -> torchtune/__init__ imports torchao (0.15: the last with the int4_weight_only torchtune
#   0.6.1 imports) and its data modules import datasets (-> dill, multiprocess) and omegaconf.
#   trl.models.activation_offloading needs only accelerate, transformers and psutil, which the image has.
# torchao 0.15 is older than peft accepts, so the worker hides it from sys.path until torchtune is loaded.
#
# Usage, from anywhere:
#   bash benchmarks/fetch_anchors.sh [fetch] [DEST]      # on a machine with network access, once
#   bash benchmarks/fetch_anchors.sh install [SRC]       # on the GPU machine (carry .whl along)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
action="fetch"
if [ "${1:-}" = "fetch" ] || [ "${1:-}" = "install" ]; then
    action="$1"
    shift
fi
wheels="${1:-$root/.whl}"

if [ "$action" = "install" ]; then
    shopt -s nullglob
    found=("$wheels"/*.whl)
    if [ "${#found[@]}" -eq 0 ]; then
        echo "no wheels in $wheels: run 'bash benchmarks/fetch_anchors.sh fetch' where there is network" >&2
        exit 1
    fi
    rm -rf "$root/.refimpl"
    # torchao in a folder of its own: the worker hides it from peft (see above), and hiding it must not hide TRL.
    others=()
    for wheel in "${found[@]}"; do
        case "$(basename "$wheel")" in
            torchao-*) python3 -m pip install -q --no-index --no-deps --no-compile --target "$root/.refimpl/ao" "$wheel" ;;
            *) others+=("$wheel") ;;
        esac
    done
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$root/.refimpl/pkgs" "${others[@]}"
    echo "installed ${#found[@]} wheels into $root/.refimpl/{pkgs,ao}"
    exit 0
fi

mkdir -p "$wheels"
python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$wheels" \
    torchtune==0.6.1 \
    trl==1.16.0 \
    torchao==0.15.0 \
    datasets==4.8.0 \
    dill==0.4.1 \
    multiprocess==0.70.19 \
    omegaconf==2.4.0

ls -l "$wheels"
total=$(du -cb "$wheels"/*.whl | tail -1 | cut -f1)
echo "total: $((total / 1024 / 1024)) MiB in $(ls "$wheels"/*.whl | wc -l) wheels"
if [ "$total" -gt $((40 * 1024 * 1024)) ]; then
    echo "warning: more than 40 MiB of wheels" >&2
fi
