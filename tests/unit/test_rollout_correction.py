"""Rollout correction (algorithm.rollout_correction): truncated importance weights
pi_old / pi_rollout per token or per sequence, against a loop over tokens; their effect on every
policy loss; the engine's log-probs perturbed on purpose."""
import math

import pytest
import torch

from megappo import algo

DT = torch.float64


def _data(seed=0, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=DT) * 2
    rollout = old + torch.randn(B, T, generator=g, dtype=DT) * 0.5      # the engine's, perturbed on purpose
    mask = (torch.rand(B, T, generator=g) > 0.2).to(DT)
    mask[3] = 0
    mask[0, 0] = 1
    return old, rollout, mask


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
def test_weights_equal_a_loop(level, normalize):
    old, rollout, mask = _data()
    C = 1.5
    w, metrics = algo.rollout_is_weights(old, rollout, mask, level=level, threshold=C, batch_normalize=normalize)
    B, T = mask.shape
    raw = [[0.0] * T for _ in range(B)]
    units = []
    for i in range(B):
        ts = [t for t in range(T) if mask[i, t] > 0]
        if level == "sequence" and ts:
            ws = math.exp(sum(float(old[i, t] - rollout[i, t]) for t in ts))
            units.append(ws)
            for t in ts:
                raw[i][t] = ws
        for t in ts:
            if level == "token":
                raw[i][t] = math.exp(float(old[i, t] - rollout[i, t]))
                units.append(raw[i][t])
    trunc = [[min(x, C) for x in row] for row in raw]
    kept = [min(u, C) for u in units]
    factor = sum(kept) / len(kept) if normalize else 1.0
    want = torch.tensor([[x / factor for x in row] for row in trunc], dtype=DT) * mask
    torch.testing.assert_close(w, want, atol=1e-12, rtol=1e-12)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(sum(units) / len(units), rel=1e-12)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(max(units), rel=1e-12)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(
        sum(u > C for u in units) / len(units), abs=1e-12)
    normed = [k / (sum(kept) / len(kept)) for k in kept]
    assert metrics["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(
        1 / (sum(x * x for x in normed) / len(normed)), rel=1e-9)
    if normalize:
        assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(factor, rel=1e-12)
    assert not w.requires_grad


def test_same_engine_and_trainer_give_weight_one():
    old, _, mask = _data(1)
    for level in ("token", "sequence"):
        w, m = algo.rollout_is_weights(old, old.clone(), mask, level=level)
        torch.testing.assert_close(w, mask)
        assert m["rollout_corr/rollout_is_mean"] == 1.0


def test_bad_level_and_threshold_are_named():
    old, rollout, mask = _data()
    with pytest.raises(ValueError, match="rollout_is must be one of token, sequence, got 'seq'"):
        algo.rollout_is_weights(old, rollout, mask, level="seq")
    with pytest.raises(ValueError, match="rollout_is_threshold must be > 0, got 0"):
        algo.rollout_is_weights(old, rollout, mask, threshold=0)


@pytest.mark.parametrize("mode", algo.list_policy_losses())
def test_every_policy_loss_takes_the_weights(mode):
    """Weights of 1 change nothing; a constant weight scales the loss and its gradient; weights
    from a perturbed engine change the loss (so switching the correction off is visible)."""
    g = torch.Generator().manual_seed(5)
    old, rollout, mask = _data(2)
    lp = (old + torch.randn(old.shape, generator=g, dtype=DT) * 0.1).requires_grad_(True)
    adv = torch.randn(old.shape, generator=g, dtype=DT)
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
    base, _ = algo.compute_policy_loss(mode, old, lp, adv, mask, **kw)
    ones, _ = algo.compute_policy_loss(mode, old, lp, adv, mask, rollout_is_weights=torch.ones_like(mask), **kw)
    assert torch.equal(base, ones)
    two, _ = algo.compute_policy_loss(mode, old, lp, adv, mask, rollout_is_weights=2 * torch.ones_like(mask), **kw)
    torch.testing.assert_close(two, 2 * base, atol=1e-9, rtol=1e-9)
    w, _ = algo.rollout_is_weights(old, rollout, mask)
    corrected, _ = algo.compute_policy_loss(mode, old, lp, adv, mask, rollout_is_weights=w, **kw)
    assert abs(float(corrected - base)) > 1e-6


def test_vanilla_with_weights_equals_a_loop():
    old, rollout, mask = _data(3)
    g = torch.Generator().manual_seed(6)
    lp = old + torch.randn(old.shape, generator=g, dtype=DT) * 0.3
    adv = torch.randn(old.shape, generator=g, dtype=DT)
    w, _ = algo.rollout_is_weights(old, rollout, mask, level="token", threshold=2.0)
    loss, _ = algo.compute_policy_loss("vanilla", old, lp, adv, mask, rollout_is_weights=w)
    total, n = 0.0, 0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t] > 0:
                r = math.exp(float(lp[i, t] - old[i, t]))
                a = float(adv[i, t])
                l1 = max(-a * r, -a * min(max(r, 0.8), 1.2))
                l = min(l1, -a * 3.0) if a < 0 else l1
                total += l * min(math.exp(float(old[i, t] - rollout[i, t])), 2.0)
                n += 1
    assert float(loss) == pytest.approx(total / n, rel=1e-12)


def test_overlong_penalty_by_hand():
    """DAPO: max length 10, buffer 4: lengths <= 6 are free, 8 pays 0.5 x factor, 10 pays factor;
    the penalty lands on the last response token."""
    mask = torch.zeros(4, 10, dtype=DT)
    for i, n in enumerate([3, 6, 8, 10]):
        mask[i, :n] = 1
    scores = torch.zeros(4, 10, dtype=DT)
    scores[0, 2] = 1.0
    out, m = algo.overlong_penalty(scores, mask, max_response_length=10, buffer_len=4, penalty_factor=2.0)
    assert out[0, 2] == 1.0 and out[1].abs().sum() == 0
    assert out[2, 7] == pytest.approx(-1.0) and out[3, 9] == pytest.approx(-2.0)
    assert out.sum() == pytest.approx(1.0 - 3.0)
    assert m == {"reward/overlong_penalty_mean": pytest.approx(-0.75), "reward/overlong_fraction": 0.5}
    with pytest.raises(ValueError, match="buffer_len must be in \\(0, max_response_length=10\\], got 11"):
        algo.overlong_penalty(scores, mask, max_response_length=10, buffer_len=11, penalty_factor=1.0)
