#!/usr/bin/env bash
# Fill .whl/ with the wheels a lent GPU machine lacks, for scripts/gpu-runbooks.sh to install there (it has no network).
#
#   scripts/device-wheels.sh [--have FREEZE] [PACKAGE ...]
#
# Downloads PACKAGES (default: the project's base dependencies but torch, which the GPU machine brings with its own
# CUDA build) and their dependencies, at the exact versions of requirements/lock.txt, as wheels for the GPU machine's
# Python (DEVICE_PYTHON, default 3.12) on manylinux x86_64. With --have, every wheel of a project listed in FREEZE
# (the GPU machine's `python3 -m pip list --format=freeze`) is dropped: what is installed there stays as it is, so the
# records' environment does not change because of what was carried. Ends with the size, against the 64 MiB that a
# device call carries beside the working tree.
# Exit: 0 done, 2 bad arguments, 3 pip could not download.
set -euo pipefail
cd "$(dirname "$0")/.."
have=""
if [ "${1:-}" = "--have" ]; then
  [ -r "${2:-}" ] || { echo "usage: $0 [--have FREEZE] [PACKAGE ...]: no readable FREEZE file" >&2; exit 2; }
  have=$2
  shift 2
fi
py=${DEVICE_PYTHON:-3.12}
if [ "$#" -eq 0 ]; then
  set -- transformers safetensors tokenizers click pyyaml numpy tqdm matplotlib papermill jupytext ipykernel filelock
fi
mkdir -p .whl
pip download -q -d .whl --only-binary=:all: --python-version "$py" --implementation cp --abi "cp${py/./}" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -c requirements/lock.txt "$@" || { echo "pip download failed (see above)" >&2; exit 3; }
if [ -n "$have" ]; then
  # a wheel's project name: the file name up to the first '-', compared as pip normalises names
  norm() { tr '[:upper:]' '[:lower:]' | tr '_.' '--'; }
  cut -d= -f1 "$have" | norm | sort -u > /tmp/device-have.$$
  for w in .whl/*.whl; do
    name=$(basename "$w" | cut -d- -f1 | norm)
    if grep -qx "$name" /tmp/device-have.$$; then rm -f "$w"; fi
  done
  rm -f /tmp/device-have.$$
fi
echo "$(find .whl -name '*.whl' | wc -l) wheels, $(du -sm .whl | cut -f1) MiB in .whl/ (a device call carries 64 MiB)"
