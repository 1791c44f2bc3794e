#!/usr/bin/env bash
# GPU checks of the Megatron backend on one GPU (meant to take < 8 minutes on an H200; NOT run
# yet: no GPU machine was lent when it was written): log-probs vs transformers, PPO steps, and
# the weight broadcast to a receiver process (NCCL with a second GPU, else gloo). Needs torch,
# transformers and safetensors there; megatron-core, mbridge (+ einops), and aiohttp + orjson for
# the broadcast's HTTP side, are installed from carried wheels when missing: put them (with their
# dependencies) in .gpu-wheels/ (`pip download megatron-core==0.16.1 mbridge==0.15.1 einops
# aiohttp orjson -d .gpu-wheels` for the machine's Python; ignored by git, so name it in the
# device run's `carry`), then from the repo root:
#   bash tests/gpu/run_checks.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
for pkg in megatron.core:megatron-core einops:einops mbridge:mbridge aiohttp:aiohttp \
           orjson:orjson; do
  if ! $PY -c "import ${pkg%%:*}" 2>/dev/null; then
    $PY -m pip install -q --no-index --find-links .gpu-wheels "${pkg##*:}" || true  # reported below
  fi
done
$PY - <<'PY'
import importlib
missing = [m for m in ("torch", "transformers", "safetensors", "megatron.core", "mbridge", "einops",
                       "aiohttp", "orjson") if importlib.util.find_spec(m) is None]
if missing:
    raise SystemExit(f"missing on this machine: {missing} (carry their wheels in .gpu-wheels/)")
PY
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export PYTHONPATH="services/trainer/src:services/common/src:.${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec timeout 450 $PY tests/gpu/checks.py
