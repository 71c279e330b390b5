#!/usr/bin/env bash
# Multi-turn GRPO with a simulated teacher on Qwen3-8B, one node of 8 GPUs: GSM8K where, after each
# answer, the GSM8K interaction (examples/interactions/gsm8k.yaml) says whether it is right and,
# if not, asks the model to reconsider; at most 5 user turns, 8 samples per prompt, the GSM8K rule
# reward on the whole conversation (each turn's score in extra_info["turn_scores"]). verl's GSM8K
# interaction example's algorithm settings (GRPO, low-variance KL loss 0.001, no KL in the reward).
# Layout and memory settings as launch/qwen3_8b.sh (TP2 x PP2, vLLM TP2, offload between phases).
#   bash launch/qwen3_8b_gsm8k_interaction.sh [key=value ...]      DRY_RUN=1 bash launch/qwen3_8b_gsm8k_interaction.sh
# Prepare data: python -m megappo.data.preprocess gsm8k_interaction --out ~/data/gsm8k_interaction
: "${MODEL_PATH:=Qwen/Qwen3-8B}"
: "${TRAIN_FILES:=$HOME/data/gsm8k_interaction/train.parquet}" "${VAL_FILES:=$HOME/data/gsm8k_interaction/test.parquet}"
: "${PARALLEL_CONFIG:=$(dirname "${BASH_SOURCE[0]}")/../parallel_configs/qwen3_8b.yaml}"
: "${INTERACTION_CONFIG:=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/examples/interactions/gsm8k.yaml}"
: "${TRAIN_BATCH_SIZE:=256}" "${PPO_MINI_BATCH_SIZE:=64}" "${ROLLOUT_N:=8}" "${ADV_ESTIMATOR:=grpo}"
: "${MAX_PROMPT_LENGTH:=1024}" "${MAX_RESPONSE_LENGTH:=3072}" "${MAX_USER_TURNS:=5}"
: "${PPO_MAX_TOKEN_LEN_PER_GPU:=32768}" "${ACTOR_LR:=1e-6}" "${CRITIC_LR:=1e-5}"
: "${ROLLOUT_TP:=2}" "${TOTAL_EPOCHS:=15}" "${SAVE_FREQ:=20}" "${TEST_FREQ:=20}"
: "${ACTOR_TP:=2}" "${ACTOR_PP:=2}" "${NNODES:=1}" "${NGPUS_PER_NODE:=8}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
megappo_launch trainer.project_name=megappo trainer.experiment_name=qwen3_8b_gsm8k_interaction \
  trainer.logger="[console,tensorboard,file]" \
  actor_rollout_ref.rollout.multi_turn.enable=True \
  actor_rollout_ref.rollout.multi_turn.max_user_turns="$MAX_USER_TURNS" \
  actor_rollout_ref.rollout.multi_turn.interaction_config_path="$INTERACTION_CONFIG" \
  actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0 \
  algorithm.use_kl_in_reward=False "$@"
