#!/usr/bin/env bash
# GPU checks of the Megatron backend on one GPU (meant to take < 8 minutes on an H200; NOT run
# yet: no GPU machine was lent when it was written). Needs torch, transformers and safetensors
# there; megatron-core is installed from a carried wheel: put it (and any other missing wheel)
# in .gpu-wheels/ (`pip download megatron-core==0.16.1 --no-deps -d .gpu-wheels`; ignored by
# git, so name it in the device run's `carry`), then from the repo root:
#   bash tests/gpu/run_checks.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if ! $PY -c "import megatron.core" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --find-links .gpu-wheels megatron-core
fi
$PY - <<'PY'
import importlib
missing = [m for m in ("torch", "transformers", "safetensors", "megatron.core")
           if importlib.util.find_spec(m) is None]
if missing:
    raise SystemExit(f"missing on this machine: {missing} (carry their wheels in .gpu-wheels/)")
PY
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export PYTHONPATH="services/trainer/src:services/common/src:.${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec timeout 450 $PY tests/gpu/checks.py
