"""Policy losses by name (actor.policy_loss.loss_mode): each against a float64 loop over tokens
written from its paper's formula (value and gradient), each adding up over micro-batches and
data-parallel ranks with the mini-batch's global counts."""
import math

import pytest
import torch

from megappo import algo

EPS_LO, EPS_HI, C = 0.2, 0.28, 3.0
TAU_POS, TAU_NEG = 1.0, 1.05


def _data(seed=0, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv[1] = adv[1, 0]                      # one sequence-level advantage
    mask = (torch.rand(B, T, generator=g) > 0.25).to(torch.float64)
    mask[2] = 0                             # an empty row (DP padding): counts for nothing
    mask[0, 0] = 1
    return old, lp, adv, mask


def _tokens(mask):
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t] > 0]


def _rows(mask):
    return [i for i in range(mask.shape[0]) if mask[i].sum() > 0]


def ref_vanilla(old, lp, adv, mask):
    total = 0.0
    for i, t in _tokens(mask):
        r = torch.exp(torch.clamp(lp[i, t] - old[i, t], -20, 20))
        l1 = torch.maximum(-adv[i, t] * r, -adv[i, t] * torch.clamp(r, 1 - EPS_LO, 1 + EPS_HI))
        total = total + (torch.minimum(l1, -adv[i, t] * C) if adv[i, t] < 0 else l1)
    return total / len(_tokens(mask))


def ref_gspo(old, lp, adv, mask):
    total = 0.0
    for i in _rows(mask):
        ts = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        log_si = sum(lp[i, t] - old[i, t] for t in ts) / len(ts)
        row = 0.0
        for t in ts:
            s = torch.exp(torch.clamp(log_si.detach() + lp[i, t] - lp[i, t].detach(), max=10.0))
            row = row + torch.maximum(-adv[i, t] * s, -adv[i, t] * torch.clamp(s, 1 - EPS_LO, 1 + EPS_HI))
        total = total + row / len(ts)
    return total / len(_rows(mask))


def ref_sapo(old, lp, adv, mask):
    total = 0.0
    for i in _rows(mask):
        ts = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        row = 0.0
        for t in ts:
            r = torch.exp(torch.clamp(lp[i, t] - old[i, t], -20, 20))
            tau = TAU_POS if adv[i, t] > 0 else TAU_NEG
            row = row - adv[i, t] * torch.sigmoid(tau * (r - 1)) * 4 / tau
        total = total + row / len(ts)
    return total / len(_rows(mask))


def ref_gpg(old, lp, adv, mask):
    return sum(-adv[i, t] * lp[i, t] for i, t in _tokens(mask)) / len(_tokens(mask))


def ref_cispo(old, lp, adv, mask):
    total = 0.0
    for i, t in _tokens(mask):
        w = min(max(math.exp(float((lp[i, t] - old[i, t]).detach())), 1 - EPS_LO), 1 + EPS_HI)   # a number: no gradient
        total = total - w * adv[i, t] * lp[i, t]
    return total / len(_tokens(mask))


def ref_geo_mean(old, lp, adv, mask):
    total = 0.0
    for i in _rows(mask):
        ts = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        ds = []
        for t in ts:
            d = lp[i, t] - old[i, t]
            lo_hi = torch.clamp(d, -EPS_LO, EPS_HI)
            # clip only where it lowers the objective: a positive advantage caps the increase,
            # a negative one caps the decrease
            ds.append(torch.minimum(d, lo_hi) if adv[i, t] > 0 else torch.maximum(d, lo_hi) if adv[i, t] < 0 else d * 0)
        ratio = torch.exp(sum(ds) / len(ts))
        total = total - sum(adv[i, t] for t in ts) / len(ts) * ratio
    return total / len(_rows(mask))


REFS = {"vanilla": ref_vanilla, "gspo": ref_gspo, "sapo": ref_sapo, "gpg": ref_gpg, "cispo": ref_cispo,
        "geo_mean": ref_geo_mean}
KW = dict(clip_ratio_low=EPS_LO, clip_ratio_high=EPS_HI, clip_ratio_c=C, loss_agg_mode="token-mean",
          tau_pos=TAU_POS, tau_neg=TAU_NEG)


def test_every_registered_loss_has_a_reference_here():
    assert sorted(REFS) == algo.list_policy_losses()


@pytest.mark.parametrize("mode", sorted(REFS))
@pytest.mark.parametrize("seed", [0, 1])
def test_value_and_gradient_equal_the_loop_reference(mode, seed):
    old, lp, adv, mask = _data(seed)
    a = lp.clone().requires_grad_(True)
    loss, metrics = algo.compute_policy_loss(mode, old, a, adv, mask, **KW)
    ga, = torch.autograd.grad(loss, a)
    b = lp.clone().requires_grad_(True)
    ref = REFS[mode](old, b, adv, mask)
    gb, = torch.autograd.grad(ref, b)
    torch.testing.assert_close(loss, ref.reshape(()), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ga, gb, atol=1e-12, rtol=1e-12)
    assert (ga[mask == 0] == 0).all()
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    assert metrics["ppo_kl"].item() == pytest.approx(float(((old - lp) * mask).sum() / mask.sum()), abs=1e-12)


@pytest.mark.parametrize("mode", sorted(REFS))
def test_losses_add_up_over_micro_batches_and_ranks(mode):
    """Three parts (micro-batches or DP ranks) with the mini-batch's global counts: the parts'
    losses add up to the whole batch's loss and so do their gradients."""
    old, lp, adv, mask = _data(3, B=9)
    whole = lp.clone().requires_grad_(True)
    loss, _ = algo.compute_policy_loss(mode, old, whole, adv, mask, **KW)
    g_whole, = torch.autograd.grad(loss, whole)
    norm = dict(global_tokens=mask.sum(), global_seqs=(mask.sum(-1) > 0).sum().to(mask.dtype))
    part = lp.clone().requires_grad_(True)
    total = sum(algo.compute_policy_loss(mode, old[rows], part[rows], adv[rows], mask[rows], **KW, **norm)[0]
                for rows in ([0, 4, 8], [1, 2, 3], [5, 6, 7]))
    g_parts, = torch.autograd.grad(total, part)
    torch.testing.assert_close(total, loss, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(g_parts, g_whole, atol=1e-12, rtol=1e-12)


def test_losses_differ_where_their_papers_say():
    """At r = 1 (on-policy) the ratio losses share PPO's gradient -A; CISPO and GPG differ from it
    by design only in what carries the gradient (logp directly), GSPO in the aggregation."""
    old, lp, adv, mask = _data(4)
    grads = {}
    for mode in REFS:
        x = old.clone().requires_grad_(True)   # on-policy: lp == old
        loss, m = algo.compute_policy_loss(mode, old, x, adv, mask, **KW)
        grads[mode], = torch.autograd.grad(loss, x)
        assert m["pg_clipfrac"].item() == 0 and m["ppo_kl"].item() == 0
    for mode in ("cispo", "gpg"):
        torch.testing.assert_close(grads[mode], grads["vanilla"], atol=1e-12, rtol=0)
    assert not torch.allclose(grads["gspo"], grads["vanilla"])   # seq-mean-token-mean vs token-mean


def test_unknown_loss_is_named():
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'; registered: cispo, geo_mean, gpg"):
        algo.compute_policy_loss("ppo2", *(_data()[0:4]))
    with pytest.raises(ValueError, match="already registered"):
        algo.register_policy_loss("vanilla")(lambda *a, **k: None)


def test_the_config_sets_the_spec():
    from megappo.builders import loss_specs
    from megappo.config import load_config

    cfg = load_config(["actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.tau_neg=2.0",
                       "actor_rollout_ref.actor.clip_ratio=0.1", "actor_rollout_ref.actor.clip_ratio_high=0.3"])
    policy, _ = loss_specs(cfg)
    assert (policy.loss_mode, policy.tau_pos, policy.tau_neg) == ("sapo", 1.0, 2.0)
    assert policy.loss_kwargs() == dict(clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=3.0,
                                        loss_agg_mode="token-mean", tau_pos=1.0, tau_neg=2.0)
