"""KL estimators, KL coefficient controllers and the KL-in-reward penalty.

``logprob``/``ref_logprob`` are (B, T) per-token log-probabilities of the sampled tokens under the
policy and the reference. With d = logprob - ref_logprob:
    kl | k1        d
    abs            |d|
    mse | k2       0.5 d^2
    low_var_kl|k3  x = clamp(-d, -20, 20); clamp(exp(x) - x - 1, -10, 10)   (Schulman's k3)
    full           needs the full distributions: NotImplementedError
A '+' suffix (``k1+``, ``k3+``, ``low_var_kl+``, ...) returns the named estimator's value with the
gradient of k2 (straight-through): the unbiased-gradient trick of "On a few pitfalls in KL".
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .stats import masked_mean

__all__ = ["kl_penalty", "list_kl_kinds", "FixedKLController", "AdaptiveKLController",
           "make_kl_controller", "apply_kl_in_reward"]

_BASE = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")


def list_kl_kinds() -> list[str]:
    """Every accepted ``kind`` (each base kind but 'full' also with a '+' suffix)."""
    return list(_BASE) + [k + "+" for k in _BASE if k != "full"]


def _forward(logprob, ref_logprob, kind: str) -> torch.Tensor:
    d = logprob - ref_logprob
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("mse", "k2"):
        return 0.5 * d.square()
    if kind in ("low_var_kl", "k3"):
        x = torch.clamp(-d, min=-20, max=20)
        return torch.clamp(torch.exp(x) - x - 1, min=-10, max=10)
    if kind == "full":
        raise NotImplementedError("kl kind 'full' needs the full vocabulary distributions of both models, "
                                  "which the trainer does not materialise; use k1, k2 or low_var_kl")
    raise ValueError(f"unknown KL estimator {kind!r}; supported: {', '.join(list_kl_kinds())}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate (B, T) of the policy from the reference; see the module docstring."""
    if kind.endswith("+"):
        base = kind[:-1]
        if base == "full" or base not in _BASE:
            raise ValueError(f"unknown KL estimator {kind!r}; supported: {', '.join(list_kl_kinds())}")
        value = _forward(logprob, ref_logprob, base)
        grad_path = _forward(logprob, ref_logprob, "k2")
        return grad_path - grad_path.detach() + value.detach()
    return _forward(logprob, ref_logprob, kind)


class FixedKLController:
    """A constant coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al.'s controller: e = clip(current_kl / target - 1, -0.2, 0.2);
    value *= 1 + e * n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        super().__init__(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(kl_ctrl_cfg):
    """From an object with ``type``, ``kl_coef``, ``target_kl``, ``horizon`` (or a dict of them)."""
    get = (lambda k: kl_ctrl_cfg[k]) if isinstance(kl_ctrl_cfg, dict) else (lambda k: getattr(kl_ctrl_cfg, k))
    kind = get("type")
    if kind == "fixed":
        return FixedKLController(get("kl_coef"))
    if kind == "adaptive":
        return AdaptiveKLController(get("kl_coef"), get("target_kl"), get("horizon"))
    raise ValueError(f"unknown kl_ctrl.type {kind!r}; supported: fixed, adaptive")


def apply_kl_in_reward(token_level_scores, old_log_prob, ref_log_prob, response_mask, kl_ctrl, kind: str = "kl",
                       dp_group=None):
    """rewards = scores - beta * KL(t) on response tokens, beta = the controller's current value.

    The batch KL is the mean over samples of each sample's token-mean KL (over the DP-global
    batch with ``dp_group``); the controller is then updated with it and the number of samples.
    Returns ``(token_level_rewards (B, T), metrics)``.
    """
    m = response_mask.to(token_level_scores.dtype)
    kld = kl_penalty(old_log_prob, ref_log_prob, kind).detach() * m
    beta = kl_ctrl.value
    rewards = token_level_scores - beta * kld
    per_seq = masked_mean(kld, response_mask, dim=-1).double()
    acc = torch.stack([per_seq.sum(), torch.tensor(float(per_seq.numel()), dtype=torch.float64, device=per_seq.device)])
    if dp_group is not None:
        dist.all_reduce(acc, group=dp_group)
    current_kl = (acc[0] / acc[1].clamp(min=1)).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=int(acc[1].item()))
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
