#!/usr/bin/env bash
# On a lent GPU machine: a learning run of `make run`'s stack (the trainer on the GPU, which
# `[train] device = "auto"` picks; the CPU engine on the machine's 16 cores), then its CSV,
# plot and log in $OUT. The parts that scripts/gpu/pack.py made (.gpu/part.NN) must all be
# there: carry them over the calls that README.md beside this file lists. Arguments go to
# tests/bench/bench_learning.py, with a --label that starts with gpu- (what comes back), e.g.
#   bash scripts/gpu/learn.sh --method combine --remarks varied --minutes 7 --label gpu-combine
# `--prepare` only joins, installs and prepares the model (the first call that has every part).
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=.gpu/work
OUT=${OUT:-$PWD/.gpu/out}
mkdir -p "$WORK" "$OUT"

if [ ! -f "$WORK/ready" ]; then
  parts=(.gpu/part.*)
  [ -e "${parts[0]}" ] || { echo "no .gpu/part.NN here: carry them (scripts/gpu/README.md)"; exit 2; }
  cat "${parts[@]}" | tar -x -C "$WORK" || {
    echo "the parts do not make a whole bundle (${#parts[@]} here): carry the missing ones"; exit 2; }
  python3 -m venv --system-site-packages "$WORK/venv"  # the image's CUDA torch stays visible
  "$WORK/venv/bin/pip" install -q --no-index --find-links "$WORK/bundle/wheels" \
    -r "$WORK/bundle/pins.txt"
  for svc in common rollout-engine gateway judge trainer simulator; do
    "$WORK/venv/bin/pip" install -q --no-index --no-deps --no-build-isolation -e "services/$svc"
  done
  mkdir -p "$WORK/bin"  # redis-server with its own libraries, nothing else sees them
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$PWD/$WORK/bundle/redis" \
    "$PWD/$WORK/bundle/redis/redis-server" > "$WORK/bin/redis-server"
  chmod +x "$WORK/bin/redis-server" "$WORK/bundle/redis/redis-server"
  touch "$WORK/ready"
fi
export PATH="$PWD/$WORK/bin:$PATH"
"$WORK/venv/bin/clawrl-prepare-model" SmolLM2-135M-Instruct
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$WORK/venv/bin/python" -c "import torch; print('trainer device:', 'cuda' if torch.cuda.is_available() else 'cpu (no GPU seen)')"
[ "${1:-}" = "--prepare" ] && exit 0

"$WORK/venv/bin/python" tests/bench/bench_learning.py --docs "$@" \
  2>&1 | tee "$OUT/learn.log"
cp docs/learning-gpu-* "$OUT/"
