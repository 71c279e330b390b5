#!/usr/bin/env bash
# The canonical recipe: PPO (GAE + critic) on Qwen3-8B with GSM8K + MATH, actor/critic at
# TP2 x PP2, vLLM TP2, token-budget micro-batches and balanced DP batches.
#   ACTOR_TP=2 ACTOR_PP=2 bash launch/qwen3_8b.sh [key=value ...]
#   DRY_RUN=1 bash launch/qwen3_8b.sh          # resolved config + rank layout, nothing started
#   NNODES=2 NODE_RANK=0|1 MASTER_ADDR=<node0> bash launch/qwen3_8b.sh   # torchrun, on each node
#   sbatch --nodes 2 launch/slurm.sbatch launch/qwen3_8b.sh              # SLURM
#   LAUNCHER=ray bash launch/qwen3_8b.sh       # on a running Ray cluster (RAY_ADDRESS)
# Prepare data: python -m megappo.data.preprocess gsm8k|math --out ~/data/<name>  (hub data sets; --input <raw> for local files)
: "${MODEL_PATH:=Qwen/Qwen3-8B}"
: "${GSM8K_TRAIN_FILE:=$HOME/data/gsm8k/train.parquet}" "${GSM8K_TEST_FILE:=$HOME/data/gsm8k/test.parquet}"
: "${MATH_TRAIN_FILE:=$HOME/data/math/train.parquet}" "${MATH_TEST_FILE:=$HOME/data/math/test.parquet}"
: "${TRAIN_FILES:=$GSM8K_TRAIN_FILE,$MATH_TRAIN_FILE}" "${VAL_FILES:=$GSM8K_TEST_FILE,$MATH_TEST_FILE}"
: "${PARALLEL_CONFIG:=$(dirname "${BASH_SOURCE[0]}")/../parallel_configs/qwen3_8b.yaml}"
: "${TRAIN_BATCH_SIZE:=1024}" "${PPO_MINI_BATCH_SIZE:=256}" "${MAX_PROMPT_LENGTH:=1024}" "${MAX_RESPONSE_LENGTH:=2048}"
: "${PPO_MAX_TOKEN_LEN_PER_GPU:=24576}" "${ACTOR_LR:=1e-6}" "${CRITIC_LR:=1e-5}"
: "${ROLLOUT_TP:=2}" "${ROLLOUT_N:=1}" "${TOTAL_EPOCHS:=15}" "${SAVE_FREQ:=20}" "${TEST_FREQ:=5}"
: "${ACTOR_TP:=2}" "${ACTOR_PP:=2}" "${CRITIC_TP:=2}" "${CRITIC_PP:=2}" "${NNODES:=1}" "${NGPUS_PER_NODE:=8}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
megappo_launch trainer.project_name=megappo trainer.experiment_name=qwen3_8b_ppo \
  trainer.logger="[console,tensorboard,file]" "$@"
