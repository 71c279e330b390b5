#!/usr/bin/env bash
# Qwen3-30B-A3B (Mixture-of-Experts: 128 experts, 8 per token) with GRPO on GSM8K/MATH-style data,
# 2 nodes x 8 GPUs (80 GB): experts over 8 GPUs (EP8), dense parts TP1 PP1 (DP16), vLLM TP4;
# the settings live in parallel_configs/qwen3_30b_a3b.yaml, so `python -m megappo.plan --config`
# plans this job (60.6 of 77 GiB at the update; one node of 80 GB GPUs does not fit, one of H200s does:
# NNODES=1 GPU_MEMORY_GB=141). Router: fp32 logits, no load-balancing loss (RL fine-tuning keeps the
# pretrained router; add +actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=1e-3
# to train with one). actor/moe_expert_load_max in the metrics shows the balance either way.
#   bash launch/qwen3_30b_a3b.sh [key=value ...]     DRY_RUN=1 bash launch/qwen3_30b_a3b.sh
: "${MODEL_PATH:=Qwen/Qwen3-30B-A3B}"
: "${TRAIN_FILES:=$HOME/data/gsm8k/train.parquet}" "${VAL_FILES:=$HOME/data/gsm8k/test.parquet}"
: "${PARALLEL_CONFIG:=$(dirname "${BASH_SOURCE[0]}")/../parallel_configs/qwen3_30b_a3b.yaml}"
: "${TRAIN_BATCH_SIZE:=256}" "${PPO_MINI_BATCH_SIZE:=64}" "${ROLLOUT_N:=8}" "${ADV_ESTIMATOR:=grpo}"
: "${MAX_PROMPT_LENGTH:=1024}" "${MAX_RESPONSE_LENGTH:=4096}" "${PPO_MAX_TOKEN_LEN_PER_GPU:=10240}"
: "${ACTOR_LR:=1e-6}" "${CRITIC_LR:=1e-5}" "${ROLLOUT_TP:=4}" "${TOTAL_EPOCHS:=15}" "${SAVE_FREQ:=20}" "${TEST_FREQ:=5}"
: "${ACTOR_TP:=1}" "${ACTOR_PP:=1}" "${ACTOR_EP:=8}" "${NNODES:=2}" "${NGPUS_PER_NODE:=8}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
megappo_launch trainer.project_name=megappo trainer.experiment_name=qwen3_30b_a3b_grpo \
  trainer.logger="[console,tensorboard,file]" \
  actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.kl_loss_type=low_var_kl algorithm.use_kl_in_reward=False "$@"
