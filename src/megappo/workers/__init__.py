"""Actor and Critic workers over megatron-core models and pipeline schedules."""
from .megatron_worker import Actor, Critic, MegatronWorker

__all__ = ["Actor", "Critic", "MegatronWorker"]
