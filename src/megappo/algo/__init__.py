"""Pure RL math: tensors in, tensors out (torch only, no config objects).

Shapes follow the trainer's batch: ``(B, T)`` per response token, ``(B,)`` per sample.
"""
from .advantages import (CRITIC_TARGETS, GAE_ADV_NORMS, SHIFT_FREE_ADV_NORMS, CvMemory, EstimatorSpec,
                         compute_advantages, critic_cv_beta, discounted_returns, discounted_returns_reference,
                         equal_score_share, gae, gae_per_sample_lam, gae_reference, get_estimator, group_normalised_gae,
                         group_relative_rewards, group_stats, length_adaptive_lam, list_estimators, register_estimator)
from .kl import (AdaptiveKLController, FixedKLController, apply_kl_in_reward, kl_penalty, list_kl_kinds,
                 make_kl_controller)
from .losses import (LOSS_AGG_MODES, PolicyLossSpec, ValueLossSpec, agg_loss, entropy_from_logits, list_loss_agg_modes,
                     policy_loss, value_loss)
from .policy_losses import COV_LOSSES, POLICY_LOSSES, compute_policy_loss, list_policy_losses, register_policy_loss
from .cov_selection import clip_cov_selection, kl_cov_selection, token_cov, token_keys
from .shaping import informative_groups, overlong_penalty
from .rollout_correction import (ROLLOUT_IS_LEVELS, ROLLOUT_RS_OPTIONS, RolloutRSError, parse_rollout_rs, rollout_is_weights,
                                 rollout_rejection_mask, truncated_is_weights)
from .stats import (global_count, global_seq_count, masked_mean, masked_sum, masked_var, masked_whiten,
                    rollout_probs_diff)

__all__ = [
    "RolloutRSError",
    "masked_sum", "masked_mean", "masked_var", "masked_whiten", "global_count", "global_seq_count", "rollout_probs_diff",
    "gae", "gae_reference", "GAE_ADV_NORMS", "group_normalised_gae", "equal_score_share", "critic_cv_beta", "CvMemory", "length_adaptive_lam", "gae_per_sample_lam",
    "SHIFT_FREE_ADV_NORMS", "CRITIC_TARGETS", "group_relative_rewards",
    "discounted_returns", "discounted_returns_reference", "group_stats",
    "EstimatorSpec", "register_estimator", "get_estimator", "list_estimators", "compute_advantages",
    "kl_penalty", "list_kl_kinds", "FixedKLController", "AdaptiveKLController", "make_kl_controller",
    "apply_kl_in_reward",
    "LOSS_AGG_MODES", "list_loss_agg_modes", "agg_loss", "policy_loss", "value_loss", "entropy_from_logits",
    "PolicyLossSpec", "ValueLossSpec",
    "POLICY_LOSSES", "COV_LOSSES", "clip_cov_selection", "kl_cov_selection", "token_cov", "token_keys",
    "register_policy_loss", "list_policy_losses", "compute_policy_loss",
    "ROLLOUT_IS_LEVELS", "rollout_is_weights", "ROLLOUT_RS_OPTIONS", "parse_rollout_rs", "rollout_rejection_mask",
    "truncated_is_weights", "overlong_penalty", "informative_groups",
]
