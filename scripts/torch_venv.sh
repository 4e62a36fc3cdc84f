#!/usr/bin/env bash
# The PyTorch every peer measures and checks against: the newest torch on PyPI (TORCH_VERSION
# below), in a venv outside the clone ($FLOTILLA_TORCH_VENV, default
# ~/.cache/flotilla-torch-venv), with numpy and safetensors. Makes it, or nothing when it
# already holds this version; prints its Python's path last. `.ci/run` calls it (the engine's
# PyTorch twin test), and the benchmark scripts and `flotilla bench step` take that Python by
# default (scripts/torch_python.py; `--python` names another).
#
# The Linux wheel is the CUDA build and runs on the CPU: 5.4 GB installed, most of it the
# nvidia-* packages, which `pip install --no-deps torch` cannot leave out (libtorch_cuda.so
# links cuBLAS, cuDNN, cuFFT, cuSPARSE, NCCL, NVSHMEM...: `import torch` fails without them).
# About 3 minutes at 45 MB/s; no bytecode compiled ahead (Python compiles what it imports).
set -euo pipefail
TORCH_VERSION=2.15.0
venv="${FLOTILLA_TORCH_VENV:-$HOME/.cache/flotilla-torch-venv}"
if ! "$venv/bin/python" -c "import sys, torch, numpy, safetensors
sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --no-compile --disable-pip-version-check \
    "torch==$TORCH_VERSION" numpy safetensors
fi
echo "$venv/bin/python"
