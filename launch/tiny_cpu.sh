#!/usr/bin/env bash
# The CPU main job: a tiny random-init Qwen3-style model and its word tokenizer, built locally,
# learn the synthetic echo task with PPO (GAE + critic) on 4 gloo processes via torchrun, the
# actor and critic at TP2 x PP2, one vLLM engine per process. The mean score goes from ~0.03 to
# >0.95 in about 50 steps (~6 minutes on 2 cores); validation every 10 steps, checkpoints at
# steps 30 and 60 under $OUT/run (a rerun resumes from the latest one; delete it to start over).
#   bash launch/tiny_cpu.sh [key=value ...]      (extra overrides go to megappo.train)
# Environment: OUT (outputs/tiny_cpu), NPROC (4), TP (2), PP (2), PYTHON (.venv/bin/python).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="${OUT:-outputs/tiny_cpu}"
NPROC="${NPROC:-4}"
TP="${TP:-2}"
PP="${PP:-2}"
"$PY" -c "from megappo.data.tiny import make_tiny_setup; make_tiny_setup('$OUT')"
# The job's settings are the main_cpu preset (src/megappo/presets/main_cpu.yaml); only what
# depends on where it runs is set here.
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m megappo.train \
  --config tiny_cpu --config main_cpu \
  trainer.n_gpus_per_node="$NPROC" \
  actor_rollout_ref.actor.megatron.tensor_model_parallel_size="$TP" \
  actor_rollout_ref.actor.megatron.pipeline_model_parallel_size="$PP" \
  actor_rollout_ref.model.path="$OUT/model" data.train_files="[$OUT/data/train.parquet]" \
  data.val_files="[$OUT/data/test.parquet]" trainer.default_local_dir="$OUT/run" "$@"
