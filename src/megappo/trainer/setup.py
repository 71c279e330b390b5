"""The processes of a run: torch.distributed from the launcher's environment, megatron's
parallel state from the config, the split placement's groups; library log levels."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megappo.config import PPOConfig

__all__ = ["init_distributed", "set_library_log_level"]


def init_distributed(cfg: PPOConfig) -> torch.device:
    """torch.distributed from the launcher's environment (torchrun, srun, Ray); megatron's
    parallel state from the config. On CPU the megatron adaptation is installed first (with the
    device check when ``MEGAPPO_CHECK_DEVICES=1``). Returns this process's device."""
    import datetime

    from megappo.distributed import process_device

    if cfg.trainer.device == "cpu":
        from megappo import device_check, megatron_cpu

        megatron_cpu.install(check_devices=device_check.enabled_by_env())
    backend = "gloo" if cfg.trainer.device == "cpu" else "nccl"
    timeout = datetime.timedelta(seconds=cfg.trainer.dist_timeout_s)
    if not cfg.actor_rollout_ref.hybrid_engine:
        # split placement: each role gets its own default group (megatron sees the training ranks,
        # vLLM the rollout ranks) and the bridge between them; rollout ranks need no megatron
        from megappo.distributed import split
        from megappo.layout import train_ranks_of

        tr, ro = cfg.trainer, cfg.rollout
        groups = split.init_split(train_ranks_of(tr.nnodes, tr.n_gpus_per_node, ro.nnodes, ro.n_gpus_per_node),
                                  backend, timeout)
        split.set_current(groups)
        _start_watchdog(cfg, groups.global_rank, groups.global_world)
        if groups.role == "rollout":
            return process_device(cfg.trainer.device)
    else:
        if not dist.is_initialized():
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend, timeout=timeout)
        _start_watchdog(cfg, dist.get_rank(), dist.get_world_size())
    from megappo.models import initialize_parallel

    m = cfg.actor_rollout_ref.actor.megatron
    initialize_parallel(m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                        m.virtual_pipeline_model_parallel_size, seed=m.seed, ep=m.expert_model_parallel_size,
                        etp=m.expert_tensor_parallel_size or 1, cp=m.context_parallel_size)
    return process_device(cfg.trainer.device)


def _start_watchdog(cfg: PPOConfig, rank: int, world: int) -> None:
    from megappo import watchdog

    tr = cfg.trainer
    watchdog.start(rank, world, tr.watchdog_silence_s, tr.watchdog_slow_phase_s)


def set_library_log_level(level: str) -> None:
    """vLLM's and megatron-core's loggers at ``level`` (trainer.log_level). vLLM configures its
    logger from VLLM_LOGGING_LEVEL when first imported (a user's own setting wins); later
    changes go through the logger objects."""
    import logging

    os.environ.setdefault("VLLM_LOGGING_LEVEL", level.upper())
    for name in ("vllm", "megatron"):
        logging.getLogger(name).setLevel(level.upper())
