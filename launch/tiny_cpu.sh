#!/usr/bin/env bash
# The CPU main job: a tiny random-init Qwen3-style model and its word tokenizer, built locally,
# learn the synthetic echo task with PPO on 2 gloo processes (DP2) via torchrun.
#   bash launch/tiny_cpu.sh [key=value ...]      (extra overrides go to megappo.train)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="${OUT:-outputs/tiny_cpu}"
NPROC="${NPROC:-2}"
"$PY" -c "from megappo.data.tiny import make_tiny_setup; make_tiny_setup('$OUT')"
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m megappo.train \
  trainer.n_gpus_per_node="$NPROC" \
  actor_rollout_ref.model.path="$OUT/model" data.train_files="[$OUT/data/train.parquet]" \
  data.val_files="[$OUT/data/test.parquet]" trainer.default_local_dir="$OUT/run" "$@"
