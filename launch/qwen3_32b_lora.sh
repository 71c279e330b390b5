#!/usr/bin/env bash
# Qwen3-32B with LoRA on ONE node of 8 x 80 GiB GPUs: the qwen3_8b recipe's data and token budgets
# with adapters of rank 64 (verl's common setting), lora_alpha 128, on every linear of the decoder
# layers; actor TP8 x PP1, vLLM TP4. GRPO (5 samples per prompt) instead of the 8b recipe's GAE, so
# no critic is needed (a critic would be a second 32B model on the node); the KL loss's reference is
# the actor's base with the adapters off (no memory of its own). The actor's lr is 1e-5: LoRA wants
# about 10x full fine-tuning's. parallel_configs/qwen3_32b_lora.yaml holds the same settings, so
# `python -m megappo.plan --config parallel_configs/qwen3_32b_lora.yaml trainer.gpu_memory_gb=80`
# plans this job (it fits without offload; full fine-tuning of this layout does not).
#   bash launch/qwen3_32b_lora.sh [key=value ...]      DRY_RUN=1 bash launch/qwen3_32b_lora.sh
: "${MODEL_PATH:=Qwen/Qwen3-32B}" "${PARALLEL_CONFIG:=$(dirname "${BASH_SOURCE[0]}")/../parallel_configs/qwen3_32b_lora.yaml}"
: "${ACTOR_TP:=8}" "${ACTOR_PP:=1}" "${CRITIC_TP:=8}" "${CRITIC_PP:=1}" "${ROLLOUT_TP:=4}" "${NNODES:=1}"
: "${TRAIN_BATCH_SIZE:=256}" "${PPO_MINI_BATCH_SIZE:=64}" "${ROLLOUT_N:=5}" "${ADV_ESTIMATOR:=grpo}"
: "${PPO_MAX_TOKEN_LEN_PER_GPU:=12288}" "${ACTOR_LR:=1e-5}"
: "${LORA_RANK:=64}" "${LORA_ALPHA:=128}" "${TARGET_MODULES:=all-linear}"
export MODEL_PATH PARALLEL_CONFIG ACTOR_TP ACTOR_PP CRITIC_TP CRITIC_PP ROLLOUT_TP NNODES TRAIN_BATCH_SIZE \
  PPO_MINI_BATCH_SIZE ROLLOUT_N ADV_ESTIMATOR PPO_MAX_TOKEN_LEN_PER_GPU ACTOR_LR
exec bash "$(dirname "${BASH_SOURCE[0]}")/qwen3_8b.sh" trainer.experiment_name=qwen3_32b_lora_grpo \
  actor_rollout_ref.model.lora_rank="$LORA_RANK" actor_rollout_ref.model.lora_alpha="$LORA_ALPHA" \
  actor_rollout_ref.model.target_modules="$TARGET_MODULES" \
  actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.kl_loss_type=low_var_kl "$@"
