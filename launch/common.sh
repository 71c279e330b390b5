# Shared logic of the GPU recipes (launch/qwen3_8b.sh, launch/qwen2_5_0_5b_gsm8k.sh, ...).
# A recipe sets its defaults with ': "${VAR:=value}"', then sources this file and calls
# `megappo_launch "$@"`. Every knob is an environment variable mapped to a config override;
# extra key=value arguments are passed through last (they win).
#
#   MODEL_PATH CRITIC_MODEL_PATH TRAIN_FILES VAL_FILES (comma-separated)  PARALLEL_CONFIG
#   TRAIN_BATCH_SIZE PPO_MINI_BATCH_SIZE MAX_PROMPT_LENGTH MAX_RESPONSE_LENGTH
#   PPO_MAX_TOKEN_LEN_PER_GPU (actor, critic, reference, old-log-prob and vLLM token budgets)
#   ACTOR_LR CRITIC_LR ROLLOUT_TP ROLLOUT_N ADV_ESTIMATOR TOTAL_EPOCHS SAVE_FREQ TEST_FREQ
#   ACTOR_TP ACTOR_PP CRITIC_TP CRITIC_PP ACTOR_EP (Mixture-of-Experts: expert parallelism, all roles)
#   ACTOR_CP (context parallelism, all roles: each sequence split over that many ranks)   NNODES NGPUS_PER_NODE NODE_RANK MASTER_ADDR MASTER_PORT
#   RDZV_ENDPOINT (host:port, replaces MASTER_ADDR/PORT)  LAUNCHER (torchrun | ray | slurm)
#   ROLLOUT_GPUS (split placement: that many GPUs of every node run vLLM, the rest train; with
#   ROLLOUT_NNODES=m the rollout gets m nodes of its own instead)  ASYNC_MODE (sync | one_step_off)
#   DRY_RUN=1 (print the resolved config, rank layout and memory plan; start nothing; DRY_RUN=2: also
#   simulate each pipeline stage's step at full size on fake tensors, minutes on a CPU)
#   GPU_MEMORY_GB (the plan's GPU size; default trainer.gpu_memory_gb, else the device's, else 80)  PYTHON
set -euo pipefail

MEGAPPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$MEGAPPO_ROOT/.venv/bin/python" ]]; then PYTHON="$MEGAPPO_ROOT/.venv/bin/python"; else PYTHON=python; fi
fi
: "${NNODES:=1}" "${NGPUS_PER_NODE:=8}" "${NODE_RANK:=0}" "${MASTER_ADDR:=127.0.0.1}" "${MASTER_PORT:=29500}"
: "${LAUNCHER:=torchrun}" "${DRY_RUN:=0}" "${ROLLOUT_N:=1}" "${ADV_ESTIMATOR:=gae}" "${ACTOR_EP:=1}" "${ACTOR_CP:=1}"
: "${ROLLOUT_GPUS:=0}" "${ROLLOUT_NNODES:=0}" "${ASYNC_MODE:=sync}"
# The split placement (ROLLOUT_GPUS / ROLLOUT_NNODES): one launcher starts every rank; the config
# says which train (trainer.*) and which roll out (rollout.*). Colocated: all ranks do both.
if (( ROLLOUT_NNODES > 0 )); then
  TRAIN_NNODES=$NNODES TRAIN_GPUS_PER_NODE=$NGPUS_PER_NODE JOB_NNODES=$((NNODES + ROLLOUT_NNODES))
  ROLLOUT_GPUS=$NGPUS_PER_NODE
elif (( ROLLOUT_GPUS > 0 )); then
  TRAIN_NNODES=$NNODES TRAIN_GPUS_PER_NODE=$((NGPUS_PER_NODE - ROLLOUT_GPUS)) JOB_NNODES=$NNODES ROLLOUT_NNODES=$NNODES
else
  TRAIN_NNODES=$NNODES TRAIN_GPUS_PER_NODE=$NGPUS_PER_NODE JOB_NNODES=$NNODES
fi
: "${CRITIC_TP:=$ACTOR_TP}" "${CRITIC_PP:=$ACTOR_PP}" "${CRITIC_MODEL_PATH:=$MODEL_PATH}"
# megatron overlaps TP communication with compute only when kernels are issued in order.
export CUDA_DEVICE_MAX_CONNECTIONS=1
# Expandable segments: micro-batches of varying length do not fragment the trainer's memory next
# to vLLM's pool (vLLM's sleep-mode allocator turns them off around that pool). A user's own
# setting wins; megappo.launch.ray gives Ray ranks the same (ALLOC_CONF).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

megappo_fail() { echo "megappo launch: $*" >&2; exit 2; }

megappo_check_layout() {
  (( NNODES >= 1 && NGPUS_PER_NODE >= 1 )) || megappo_fail "NNODES=$NNODES and NGPUS_PER_NODE=$NGPUS_PER_NODE must be >= 1"
  (( TRAIN_GPUS_PER_NODE >= 1 )) || megappo_fail \
    "ROLLOUT_GPUS=$ROLLOUT_GPUS leaves no training GPU on a node of NGPUS_PER_NODE=$NGPUS_PER_NODE"
  local world=$((TRAIN_NNODES * TRAIN_GPUS_PER_NODE)) rollout_per_node=$NGPUS_PER_NODE
  local what="the world NNODES=$NNODES x NGPUS_PER_NODE=$NGPUS_PER_NODE = $world"
  if (( ROLLOUT_GPUS > 0 )); then
    rollout_per_node=$ROLLOUT_GPUS
    what="the training ranks $TRAIN_NNODES node(s) x $TRAIN_GPUS_PER_NODE = $world (NGPUS_PER_NODE=$NGPUS_PER_NODE, ROLLOUT_GPUS=$ROLLOUT_GPUS)"
  fi
  (( ACTOR_CP >= 1 )) || megappo_fail "ACTOR_CP=$ACTOR_CP must be >= 1"
  if (( ACTOR_CP == 1 )); then
    (( world % (ACTOR_TP * ACTOR_PP) == 0 )) || megappo_fail \
      "ACTOR_TP=$ACTOR_TP x ACTOR_PP=$ACTOR_PP = $((ACTOR_TP * ACTOR_PP)) does not divide $what"
  else
    (( world % (ACTOR_TP * ACTOR_CP * ACTOR_PP) == 0 )) || megappo_fail \
      "ACTOR_TP=$ACTOR_TP x ACTOR_CP=$ACTOR_CP x ACTOR_PP=$ACTOR_PP = $((ACTOR_TP * ACTOR_CP * ACTOR_PP)) does not divide $what"
  fi
  (( CRITIC_TP == ACTOR_TP && CRITIC_PP == ACTOR_PP )) || megappo_fail \
    "CRITIC_TP=$CRITIC_TP/CRITIC_PP=$CRITIC_PP must equal ACTOR_TP=$ACTOR_TP/ACTOR_PP=$ACTOR_PP (one megatron parallel state per process)"
  (( ACTOR_EP >= 1 && (world / ACTOR_PP) % ACTOR_EP == 0 )) || megappo_fail \
    "ACTOR_EP=$ACTOR_EP must divide the ranks of a pipeline stage: world $world / ACTOR_PP=$ACTOR_PP = $((world / ACTOR_PP))"
  (( rollout_per_node % ROLLOUT_TP == 0 )) || megappo_fail \
    "ROLLOUT_TP=$ROLLOUT_TP does not divide the rollout GPUs per node ($rollout_per_node): a vLLM replica stays inside one node"
}

megappo_list() { local IFS=,; local a=($1); local IFS=,; echo "[${a[*]}]"; }

megappo_args() {
  MEGAPPO_ARGS=(
    actor_rollout_ref.model.path="$MODEL_PATH" critic.model.path="$CRITIC_MODEL_PATH"
    data.train_files="$(megappo_list "$TRAIN_FILES")" data.val_files="$(megappo_list "$VAL_FILES")"
    data.train_batch_size="$TRAIN_BATCH_SIZE" actor_rollout_ref.actor.ppo_mini_batch_size="$PPO_MINI_BATCH_SIZE"
    data.max_prompt_length="$MAX_PROMPT_LENGTH" data.max_response_length="$MAX_RESPONSE_LENGTH"
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$PPO_MAX_TOKEN_LEN_PER_GPU"
    critic.ppo_max_token_len_per_gpu="$PPO_MAX_TOKEN_LEN_PER_GPU"
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="$PPO_MAX_TOKEN_LEN_PER_GPU"
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu="$PPO_MAX_TOKEN_LEN_PER_GPU"
    actor_rollout_ref.rollout.max_num_batched_tokens="$PPO_MAX_TOKEN_LEN_PER_GPU"
    trainer.balance_batch=True
    actor_rollout_ref.actor.optim.lr="$ACTOR_LR" critic.optim.lr="$CRITIC_LR"
    actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP" actor_rollout_ref.rollout.n="$ROLLOUT_N"
    algorithm.adv_estimator="$ADV_ESTIMATOR"
    trainer.total_epochs="$TOTAL_EPOCHS" trainer.save_freq="$SAVE_FREQ" trainer.test_freq="$TEST_FREQ"
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size="$ACTOR_TP"
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size="$ACTOR_PP"
    actor_rollout_ref.actor.megatron.expert_model_parallel_size="$ACTOR_EP"
    actor_rollout_ref.actor.megatron.context_parallel_size="$ACTOR_CP"
    critic.megatron.tensor_model_parallel_size="$CRITIC_TP" critic.megatron.pipeline_model_parallel_size="$CRITIC_PP"
    trainer.nnodes="$TRAIN_NNODES" trainer.n_gpus_per_node="$TRAIN_GPUS_PER_NODE" trainer.async_mode="$ASYNC_MODE"
  )
  if (( ROLLOUT_GPUS > 0 )); then
    MEGAPPO_ARGS+=(actor_rollout_ref.hybrid_engine=False rollout.nnodes="$ROLLOUT_NNODES" rollout.n_gpus_per_node="$ROLLOUT_GPUS")
  fi
}

megappo_launch() {
  megappo_check_layout
  megappo_args
  local cfg=(--config "$PARALLEL_CONFIG")
  if [[ "$DRY_RUN" == 1 || "$DRY_RUN" == 2 ]]; then
    # the resolved config and layout, then the memory plan (per stage and phase, against
    # GPU_MEMORY_GB or trainer.gpu_memory_gb); a plan that does not fit is reported, not fatal
    "$PYTHON" -m megappo.train "${cfg[@]}" --dry-run "${MEGAPPO_ARGS[@]}" "$@"
    local rc=0 simulate=()
    [[ "$DRY_RUN" == 2 ]] && simulate=(--simulate)
    "$PYTHON" -m megappo.plan "${simulate[@]}" "${cfg[@]}" "${MEGAPPO_ARGS[@]}" ${GPU_MEMORY_GB:+trainer.gpu_memory_gb=$GPU_MEMORY_GB} "$@" || rc=$?
    (( rc <= 1 )) || exit "$rc"
    exit 0
  fi
  case "$LAUNCHER" in
    torchrun)
      local rdzv=(--master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --node_rank "$NODE_RANK")
      if [[ -n "${RDZV_ENDPOINT:-}" ]]; then
        rdzv=(--rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT" --rdzv_id "${RDZV_ID:-megappo}")
      fi
      exec "$PYTHON" -m torch.distributed.run --nnodes "$JOB_NNODES" --nproc_per_node "$NGPUS_PER_NODE" "${rdzv[@]}" \
        -m megappo.train "${cfg[@]}" "${MEGAPPO_ARGS[@]}" "$@" ;;
    ray)
      exec "$PYTHON" -m megappo.launch.ray --nnodes "$JOB_NNODES" --nproc-per-node "$NGPUS_PER_NODE" -- \
        "${cfg[@]}" "${MEGAPPO_ARGS[@]}" "$@" ;;
    slurm)
      [[ -n "${SLURM_JOB_ID:-}" ]] || megappo_fail "LAUNCHER=slurm runs inside an allocation: sbatch launch/slurm.sbatch <recipe>"
      # One torchrun per node; each learns its node rank from SLURM_NODEID at run time.
      # CONTAINER_IMAGE runs it in the image: pyxis/enroot (srun --container-image; an image
      # name or a .sqsh file) or Apptainer (a .sif file, or CONTAINER_RUNTIME=apptainer), with
      # the image's python (CONTAINER_PYTHON, default python) and this checkout mounted.
      local cmd container=() runtime=""
      if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
        runtime="${CONTAINER_RUNTIME:-$([[ "$CONTAINER_IMAGE" == *.sif ]] && echo apptainer || echo pyxis)}"
        PYTHON="${CONTAINER_PYTHON:-python}"
        case "$runtime" in
          pyxis) container=(--container-image "$CONTAINER_IMAGE" --container-workdir "$PWD"
                            --container-mounts "${CONTAINER_MOUNTS:-$MEGAPPO_ROOT:$MEGAPPO_ROOT,$PWD:$PWD}") ;;
          apptainer) ;;
          *) megappo_fail "CONTAINER_RUNTIME=$runtime: expected pyxis or apptainer" ;;
        esac
      fi
      cmd="$(printf '%q ' "$PYTHON" -m torch.distributed.run --nnodes "$JOB_NNODES" --nproc_per_node "$NGPUS_PER_NODE" \
        --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")"
      cmd+='--node_rank "$SLURM_NODEID" '
      cmd+="$(printf '%q ' -m megappo.train "${cfg[@]}" "${MEGAPPO_ARGS[@]}" "$@")"
      if [[ "$runtime" == apptainer ]]; then
        cmd="$(printf '%q ' apptainer exec --nv --bind "${CONTAINER_MOUNTS:-$MEGAPPO_ROOT,$PWD}" "$CONTAINER_IMAGE" bash -c "$cmd")"
      fi
      exec srun "${container[@]}" --nodes "$JOB_NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1 bash -c "$cmd" ;;
    *) megappo_fail "LAUNCHER=$LAUNCHER: expected torchrun, ray or slurm" ;;
  esac
}
