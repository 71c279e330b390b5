#!/usr/bin/env bash
# Multi-turn GRPO with a tool on Qwen3-8B, one node of 8 GPUs: GSM8K where the model may call
# megappo's calculator (examples/tools/calculator.yaml) between its turns, at most 5 assistant
# turns, 8 samples per prompt, the GSM8K rule reward on the whole conversation. verl's multi-turn
# GSM8K example's algorithm settings (GRPO, low-variance KL loss 0.001, no KL in the reward).
# Layout and memory settings as launch/qwen3_8b.sh (TP2 x PP2, vLLM TP2, offload between phases).
#   bash launch/qwen3_8b_gsm8k_tool.sh [key=value ...]      DRY_RUN=1 bash launch/qwen3_8b_gsm8k_tool.sh
# Prepare data: python -m megappo.data.preprocess gsm8k_tool --out ~/data/gsm8k_tool  (hub openai/gsm8k; --input <raw> for local files)
: "${MODEL_PATH:=Qwen/Qwen3-8B}"
: "${TRAIN_FILES:=$HOME/data/gsm8k_tool/train.parquet}" "${VAL_FILES:=$HOME/data/gsm8k_tool/test.parquet}"
: "${PARALLEL_CONFIG:=$(dirname "${BASH_SOURCE[0]}")/../parallel_configs/qwen3_8b.yaml}"
: "${TOOL_CONFIG:=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/examples/tools/calculator.yaml}"
: "${TRAIN_BATCH_SIZE:=256}" "${PPO_MINI_BATCH_SIZE:=64}" "${ROLLOUT_N:=8}" "${ADV_ESTIMATOR:=grpo}"
: "${MAX_PROMPT_LENGTH:=1024}" "${MAX_RESPONSE_LENGTH:=2048}" "${MAX_ASSISTANT_TURNS:=5}"
: "${PPO_MAX_TOKEN_LEN_PER_GPU:=24576}" "${ACTOR_LR:=1e-6}" "${CRITIC_LR:=1e-5}"
: "${ROLLOUT_TP:=2}" "${TOTAL_EPOCHS:=15}" "${SAVE_FREQ:=20}" "${TEST_FREQ:=10}"
: "${ACTOR_TP:=2}" "${ACTOR_PP:=2}" "${NNODES:=1}" "${NGPUS_PER_NODE:=8}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
megappo_launch trainer.project_name=megappo trainer.experiment_name=qwen3_8b_gsm8k_tool \
  trainer.logger="[console,tensorboard,file]" \
  actor_rollout_ref.rollout.multi_turn.enable=True \
  actor_rollout_ref.rollout.multi_turn.max_assistant_turns="$MAX_ASSISTANT_TURNS" \
  actor_rollout_ref.rollout.multi_turn.tool_config_path="$TOOL_CONFIG" \
  actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0 \
  algorithm.use_kl_in_reward=False "$@"
