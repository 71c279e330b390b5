"""Actor and Critic workers over megatron-core models and pipeline schedules."""
from .megatron_worker import Actor, Critic, MegatronWorker, RewardModel

__all__ = ["Actor", "Critic", "MegatronWorker", "RewardModel"]
