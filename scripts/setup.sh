#!/usr/bin/env bash
# Set up raydit in ./.venv. Safe to run again: it installs only what is missing.
#
# torch: on a machine with an NVIDIA GPU the venv sees the system's torch (the venv uses
# --system-site-packages) or installs the default CUDA build; without a GPU it installs
# torch 2.13.0 and never a multi-gigabyte CUDA build by accident. Set
# RAYDIT_TORCH_INDEX to a CPU wheel index (see README) where your pip would otherwise
# choose a CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip
if ! "$VPY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VPY" -m pip install -q torch
  else
    "$VPY" -m pip install -q "torch==2.13.0" ${RAYDIT_TORCH_INDEX:+--index-url "$RAYDIT_TORCH_INDEX"}
  fi
fi
"$VPY" -m pip install -q -e ".[test]"
"$VPY" -c "import raydit, torch, ray, diffusers; print('raydit', raydit.__version__, '| torch', torch.__version__, '| ray', ray.__version__, '| diffusers', diffusers.__version__)"
