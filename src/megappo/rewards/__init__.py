"""Rewards: rule scorers keyed by data_source (GSM8K, MATH, synthetic tasks) and users' own functions."""
from . import gsm8k, synthetic
from .hendrycks_math import last_boxed
from .registry import (RewardFunctionError, call_rewards, finish_scores, get_reward_fn, list_rewards,
                       load_custom_reward, register_reward, score_batch)
from .pool import PoolOutcome, RewardPool, default_workers
from .spread import spread_scores

__all__ = ["RewardFunctionError", "get_reward_fn", "list_rewards", "load_custom_reward", "register_reward",
           "score_batch", "call_rewards", "finish_scores", "spread_scores", "RewardPool", "PoolOutcome",
           "default_workers", "last_boxed", "gsm8k", "synthetic"]
