"""Rewards: rule scorers keyed by data_source (GSM8K, MATH, synthetic tasks) and users' own functions."""
from . import gsm8k, synthetic
from .hendrycks_math import last_boxed
from .registry import (RewardFunctionError, get_reward_fn, list_rewards, load_custom_reward, register_reward,
                       score_batch)

__all__ = ["RewardFunctionError", "get_reward_fn", "list_rewards", "load_custom_reward", "register_reward",
           "score_batch", "last_boxed", "gsm8k", "synthetic"]
