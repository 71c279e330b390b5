#!/usr/bin/env bash
# Qwen3-14B: the qwen3_8b recipe on 2 nodes x 8 GPUs at TP4 x PP2 (DP2), vLLM TP4.
: "${MODEL_PATH:=Qwen/Qwen3-14B}" "${PARALLEL_CONFIG:=$(dirname "${BASH_SOURCE[0]}")/../parallel_configs/qwen3_14b.yaml}"
: "${ACTOR_TP:=4}" "${ACTOR_PP:=2}" "${CRITIC_TP:=4}" "${CRITIC_PP:=2}" "${ROLLOUT_TP:=4}" "${NNODES:=2}"
: "${PPO_MAX_TOKEN_LEN_PER_GPU:=16384}"
export MODEL_PATH PARALLEL_CONFIG ACTOR_TP ACTOR_PP CRITIC_TP CRITIC_PP ROLLOUT_TP NNODES PPO_MAX_TOKEN_LEN_PER_GPU
exec bash "$(dirname "${BASH_SOURCE[0]}")/qwen3_8b.sh" trainer.experiment_name=qwen3_14b_ppo "$@"
