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
# torchvision, optional: transformers' Qwen2VLProcessor (the tokenizer of Kandinsky 5's released
# checkpoints) loads a video processor that needs it; raydit's tiny models and tests need none.
# With a CPU torch, try the matching CPU build (torch 2.N pairs with torchvision 0.(N+15)); keep
# it only if it imports (with transformers), else remove it: a broken torchvision breaks
# transformers' imports. Never fails the set-up.
if ! "$VPY" -c "import torchvision" >/dev/null 2>&1; then
  TV=$("$VPY" -c "import torch; m = int(torch.__version__.split('.')[1]); print('' if torch.version.cuda else f'0.{m + 15}.*')" 2>/dev/null || true)
  if [ -n "$TV" ]; then
    if "$VPY" -m pip install -q --no-deps "torchvision==$TV" --index-url https://download.pytorch.org/whl/cpu >/dev/null 2>&1 \
        && "$VPY" -c "import torchvision, transformers.models.qwen2_vl" >/dev/null 2>&1; then
      echo "torchvision $("$VPY" -c 'import torchvision; print(torchvision.__version__)') (CPU build) installed"
    else
      "$VPY" -m pip uninstall -q -y torchvision >/dev/null 2>&1 || true
      echo "torchvision: no working CPU build for this torch here; continuing without it (only real Kandinsky 5 checkpoints' Qwen2VLProcessor needs it)"
    fi
  fi
fi
# torchao for the CPU tests of quantize fp8 (tests/models/fp8_cpu.py), kept apart in
# .venv/fp8-site rather than among the venv's packages: transformers and diffusers import it in
# every process once it is installed, and under a CPU torch its CUDA extensions fail to load
# with warnings on each process's stderr (which the one-line error tests read). Users of
# quantize fp8 install it as usual (pip install 'raydit[fp8]'). Never fails the set-up.
if [ ! -d .venv/fp8-site/torchao ]; then
  "$VPY" -m pip install -q --no-deps --target .venv/fp8-site "torchao>=0.14" >/dev/null 2>&1 \
    || echo "torchao: could not install into .venv/fp8-site; the CPU tests of quantize fp8 will skip and say so"
fi
"$VPY" -c "import raydit, torch, ray, diffusers; print('raydit', raydit.__version__, '| torch', torch.__version__, '| ray', ray.__version__, '| diffusers', diffusers.__version__)"
