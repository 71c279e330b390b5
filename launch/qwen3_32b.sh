#!/usr/bin/env bash
# Qwen3-32B: the qwen3_8b recipe on 4 nodes x 8 GPUs at TP8 x PP2 with 2 virtual stages (DP2), vLLM TP8.
: "${MODEL_PATH:=Qwen/Qwen3-32B}" "${PARALLEL_CONFIG:=$(dirname "${BASH_SOURCE[0]}")/../parallel_configs/qwen3_32b.yaml}"
: "${ACTOR_TP:=8}" "${ACTOR_PP:=2}" "${CRITIC_TP:=8}" "${CRITIC_PP:=2}" "${ROLLOUT_TP:=8}" "${NNODES:=4}"
: "${PPO_MAX_TOKEN_LEN_PER_GPU:=12288}"
export MODEL_PATH PARALLEL_CONFIG ACTOR_TP ACTOR_PP CRITIC_TP CRITIC_PP ROLLOUT_TP NNODES PPO_MAX_TOKEN_LEN_PER_GPU
exec bash "$(dirname "${BASH_SOURCE[0]}")/qwen3_8b.sh" trainer.experiment_name=qwen3_32b_ppo "$@"
