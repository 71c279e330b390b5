#!/usr/bin/env bash
# DAPO (arXiv 2503.14476) with its published algorithm settings on Qwen3-8B, one node of 8 GPUs:
# GRPO advantages (no critic), clip-higher (0.2 / 0.28, dual clip 10), token-mean loss, no KL,
# dynamic sampling (rounds of 3 x 512 prompts until 512 prompts with varied scores are kept, at most
# 10 rounds), 16 samples per prompt, 20k-token responses whose last 4k pay the overlong penalty.
# Layout as launch/qwen3_8b.sh (TP2 x PP2, vLLM TP2); the settings live in
# parallel_configs/dapo_qwen3_8b.yaml too, so `python -m megappo.plan --config` plans this job.
#   bash launch/dapo_qwen3_8b.sh [key=value ...]      DRY_RUN=1 bash launch/dapo_qwen3_8b.sh
# The filter metric is `score`: the built-in GSM8K/MATH rewards are 0/1, so a group is dropped
# exactly when all its answers are right or all wrong (DAPO's `acc`). A reward function that
# returns {"score": ..., "acc": ...} (DAPO's math_dapo does) can use FILTER_METRIC=acc instead.
# Data: python -m megappo.data.preprocess math --out ~/data/math (or --input <raw>; or DAPO-Math-17k
# with a reward function for its data_source via custom_reward_function.path).
: "${MODEL_PATH:=Qwen/Qwen3-8B}"
: "${TRAIN_FILES:=$HOME/data/math/train.parquet}" "${VAL_FILES:=$HOME/data/math/test.parquet}"
: "${PARALLEL_CONFIG:=$(dirname "${BASH_SOURCE[0]}")/../parallel_configs/dapo_qwen3_8b.yaml}"
: "${TRAIN_BATCH_SIZE:=512}" "${GEN_BATCH_SIZE:=1536}" "${PPO_MINI_BATCH_SIZE:=32}" "${ROLLOUT_N:=16}"
: "${MAX_PROMPT_LENGTH:=2048}" "${MAX_RESPONSE_LENGTH:=20480}" "${OVERLONG_BUFFER_LEN:=4096}"
: "${PPO_MAX_TOKEN_LEN_PER_GPU:=24576}" "${ACTOR_LR:=1e-6}" "${CRITIC_LR:=1e-5}" "${ADV_ESTIMATOR:=grpo}"
: "${FILTER_METRIC:=score}" "${MAX_NUM_GEN_BATCHES:=10}"
: "${ROLLOUT_TP:=2}" "${TOTAL_EPOCHS:=1}" "${SAVE_FREQ:=20}" "${TEST_FREQ:=5}"
: "${ACTOR_TP:=2}" "${ACTOR_PP:=2}" "${NNODES:=1}" "${NGPUS_PER_NODE:=8}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
megappo_launch trainer.project_name=megappo trainer.experiment_name=dapo_qwen3_8b \
  trainer.logger="[console,tensorboard,file]" \
  data.gen_batch_size="$GEN_BATCH_SIZE" algorithm.filter_groups.enable=True \
  algorithm.filter_groups.metric="$FILTER_METRIC" algorithm.filter_groups.max_num_gen_batches="$MAX_NUM_GEN_BATCHES" \
  actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 \
  actor_rollout_ref.actor.clip_ratio_c=10.0 actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.actor.use_kl_loss=False algorithm.use_kl_in_reward=False actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.optim.lr_warmup_steps=10 actor_rollout_ref.actor.optim.weight_decay=0.1 \
  actor_rollout_ref.actor.optim.clip_grad=1.0 \
  reward_model.reward_manager=dapo reward_model.overlong_buffer.enable=True \
  reward_model.overlong_buffer.len="$OVERLONG_BUFFER_LEN" reward_model.overlong_buffer.penalty_factor=1.0 \
  actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1 \
  actor_rollout_ref.rollout.val_kwargs.temperature=1.0 actor_rollout_ref.rollout.val_kwargs.top_p=0.7 \
  actor_rollout_ref.rollout.val_kwargs.do_sample=True "$@"
