#!/usr/bin/env bash
# Real SGLang on CPU, in its own venv, for the conformance suite (tests/sglang, make test-sglang).
# Pinned and idempotent: a stamp file keyed by the pins skips a venv already made from them.
# SGLang's declared dependencies are CUDA kernels PyPI cannot run here, so it is installed with
# --no-deps and only what its HTTP server imports is added. vllm (--no-deps) serves one import in
# SGLang's rotary embedding; it logs that vllm._C is missing, which is harmless.
# Prints the venv's path last (for scripts: `$(bash scripts/setup-sglang.sh | tail -1)`).
set -euo pipefail

PYTHON=${PYTHON:-python3}
SGLANG=sglang==0.5.23
VLLM=vllm==0.33.0
# torch from PyPI is the CUDA build; it runs on CPU, and SGLang imports torchvision, which has
# no release matching the CPU torch 2.13 the project's own venv uses.
TORCH=(torch==2.14.1 torchvision==0.29.1)
# What SGLang's server imports, pinned where SGLang pins it.
LIGHT=(
  numpy pillow requests tqdm packaging psutil setproctitle 'setuptools>=77'
  aiohttp fastapi uvicorn uvloop orjson pybase64 pydantic python-multipart pyzmq msgspec
  prometheus-client transformers==5.19.0 tokenizers==0.23.2 safetensors huggingface_hub
  sentencepiece==0.2.1 tiktoken openai==2.8.0 einops xxhash interegular partial_json_parser
  regex ipython dill apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 gguf soundfile==0.13.1
  jsonschema xgrammar==0.2.7
)
KEY="$SGLANG $VLLM ${TORCH[*]} ${LIGHT[*]}"

VENV=${CLAWRL_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/clawrl/sglang-venv}
STAMP=$VENV/.clawrl-sglang-stamp

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ]; then
  echo "==> SGLang venv up to date ($SGLANG, $(du -sh "$VENV" | cut -f1)): $VENV" >&2
  echo "$VENV"
  exit 0
fi

echo "==> installing $SGLANG for CPU into $VENV (about 7 GB: torch's CUDA build is most of it)" >&2
# An existing venv is updated in place (pip keeps what already matches the pins).
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"

# Noise: pip's local-index notes, and its resolver listing what sglang and vllm declare but
# are deliberately installed without.
quiet() { grep -v -E "is ignored: it is neither|dependency resolver does not|^(sglang|vllm) .* requires " >&2 || true; }

# Downloads of several GB fail now and then: retry each step before giving up.
pip_install() {
  local attempt
  for attempt in 1 2 3; do
    if "$VENV/bin/python" -m pip install -q --disable-pip-version-check --retries 5 \
      --timeout 60 "$@" 2> >(quiet); then
      return 0
    fi
    echo "==> pip install $* failed (attempt $attempt of 3)" >&2
    sleep $((attempt * 10))
  done
  echo "setup-sglang: could not install $*; check the network or pip's index, then rerun" >&2
  exit 1
}

echo "==> [1/3] ${TORCH[*]}" >&2
pip_install "${TORCH[@]}"
echo "==> [2/3] $SGLANG $VLLM (--no-deps)" >&2
pip_install --no-deps "$SGLANG" "$VLLM"
echo "==> [3/3] SGLang's server dependencies (${#LIGHT[@]} packages)" >&2
# Torch pinned so that no dependency moves it.
pip_install "${LIGHT[@]}" "${TORCH[@]}"

if ! "$VENV/bin/python" -c 'import sglang.launch_server, sglang.srt.entrypoints.http_server' \
  2>"$VENV/import-check.log"; then
  tail -5 "$VENV/import-check.log" >&2
  echo "setup-sglang: SGLang's server does not import (log: $VENV/import-check.log)" >&2
  exit 1
fi
echo "$KEY" >"$STAMP"
echo "==> SGLang ready ($(du -sh "$VENV" | cut -f1)): $VENV" >&2
echo "$VENV"
