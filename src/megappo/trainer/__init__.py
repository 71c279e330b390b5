"""The PPO trainer: the loop (:class:`PPOTrainer`), its phases (generation, scoring, per-rank
passes, validation, run state), process set-up, and the split placement's rollout service."""
from .ppo import PPOTrainer
from .remote import RemoteRollout, serve
from .setup import init_distributed, set_library_log_level

__all__ = ["PPOTrainer", "init_distributed", "set_library_log_level", "RemoteRollout", "serve"]
