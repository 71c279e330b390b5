#!/usr/bin/env bash
# verl's reference PPO recipe (its quick start): Qwen2.5-0.5B-Instruct on GSM8K, GAE with a
# critic from the same model, one node, pure data parallel. Prepare the data first:
#   python -m megappo.data.preprocess gsm8k --out ~/data/gsm8k   (the hub's openai/gsm8k; --input <raw> for local files)
# Every knob below is an environment variable (see launch/common.sh); extra key=value args pass through.
: "${MODEL_PATH:=Qwen/Qwen2.5-0.5B-Instruct}"
: "${TRAIN_FILES:=$HOME/data/gsm8k/train.parquet}" "${VAL_FILES:=$HOME/data/gsm8k/test.parquet}"
: "${PARALLEL_CONFIG:=$(dirname "${BASH_SOURCE[0]}")/../parallel_configs/qwen2.5_0.5b.yaml}"
: "${TRAIN_BATCH_SIZE:=256}" "${PPO_MINI_BATCH_SIZE:=64}" "${MAX_PROMPT_LENGTH:=512}" "${MAX_RESPONSE_LENGTH:=512}"
: "${PPO_MAX_TOKEN_LEN_PER_GPU:=16384}" "${ACTOR_LR:=1e-6}" "${CRITIC_LR:=1e-5}"
: "${ROLLOUT_TP:=1}" "${ROLLOUT_N:=1}" "${TOTAL_EPOCHS:=15}" "${SAVE_FREQ:=10}" "${TEST_FREQ:=10}"
: "${ACTOR_TP:=1}" "${ACTOR_PP:=1}" "${NNODES:=1}" "${NGPUS_PER_NODE:=8}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
megappo_launch algorithm.kl_ctrl.kl_coef=0.001 actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
  trainer.val_before_train=False trainer.logger="[console,tensorboard,file]" \
  trainer.project_name=megappo_examples trainer.experiment_name=qwen2.5_0.5b_gsm8k_ppo "$@"
