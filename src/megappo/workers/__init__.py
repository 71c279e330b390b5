"""Actor and Critic workers over megatron-core models and pipeline schedules, and how a step's
batch is dealt to DP ranks and cut into micro-batches (batching)."""
from .batching import PassBatching, deal_to_dp
from .megatron_worker import Actor, AdaptersOff, Critic, MegatronWorker, RewardModel

__all__ = ["Actor", "AdaptersOff", "Critic", "MegatronWorker", "RewardModel", "PassBatching", "deal_to_dp"]
