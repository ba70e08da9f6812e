#!/usr/bin/env bash
# Download, on a machine with PyPI, the wheels the lent GPU image lacks (Python 3.12, x86-64, no network there):
# tyro and its pure-Python deps, webdataset + braceexpand, flash-linear-attention (fla: Python + Triton, its own
# Triton causal conv, so no compiled causal-conv1d). No torch, triton, transformers, numpy, pyyaml, einops or
# typing-extensions: the image has them (its torch 2.11 + triton 3.6 are what fla runs on).
#
#   bash benchmarks/gpu_wheels.sh .whl          # then carry .whl; gpu_check.sh installs it with --target
#
# Versions are pinned to what the project's venv tests (pyproject.toml), so the GPU run imports the same code.
set -euo pipefail
DIR=${1:?usage: gpu_wheels.sh DIR}
PY=${PYTHON:-python3}
if [[ -x "$(dirname "$0")/../.venv/bin/python" && -z "${PYTHON:-}" ]]; then PY="$(dirname "$0")/../.venv/bin/python"; fi
mkdir -p "$DIR"
WHEELS=(
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
  webdataset==1.0.2 braceexpand==0.1.7
  flash-linear-attention==0.6.0 fla-core==0.6.0
)
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DIR" "${WHEELS[@]}" 2> >(grep -v '^WARNING: Location' >&2)
# one version of each: two of a name would stop the offline install
dupes=$(ls "$DIR"/*.whl | xargs -n1 basename | sed 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [[ -n "$dupes" ]]; then echo "gpu_wheels: more than one wheel of: $dupes (empty $DIR first)" >&2; exit 1; fi
total=$(du -sk "$DIR" | cut -f1)
if (( total > 60 * 1024 )); then echo "gpu_wheels: $DIR holds ${total} KiB, over the 60 MiB share of the 64 MiB tree" >&2; exit 1; fi
echo "gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels, ${total} KiB in $DIR"
