"""GAE options for PPO with a critic: group normalisation, decoupled and length-adaptive lambda."""
import pytest
import torch

from megappo import algo
from megappo.algo import gae_reference


def _batch(seed=0, groups=4, n=4, T=6):
    g = torch.Generator().manual_seed(seed)
    B = groups * n
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(B, T, dtype=torch.float64)
    rewards[torch.arange(B), lengths - 1] = torch.rand(B, generator=g, dtype=torch.float64).round(decimals=1)
    values = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 * mask
    index = torch.arange(groups).repeat_interleave(n)
    return rewards, values, mask, index


def _group_reference(rewards, values, mask, index, gamma, lam, eps=1e-6):
    """Per sample, by hand: (GAE + V(s_0) - group mean score) / group std; 0 for equal scores."""
    adv, _ = gae_reference(rewards, values, mask, gamma, lam)
    score = (rewards * mask).sum(-1)
    out = torch.zeros_like(adv)
    for i in range(len(score)):
        members = score[index == index[i]]
        mean, std = members.mean(), members.std()  # unbiased, as GRPO
        if std > eps:
            out[i] = (adv[i] + values[i, 0] - mean) / (std + eps) * mask[i]
    return out


@pytest.mark.parametrize("lam", [1.0, 0.95, 0.0])
def test_group_normalised_gae_matches_a_per_sample_loop(lam):
    rewards, values, mask, index = _batch()
    got, ret = algo.compute_advantages("gae", token_level_rewards=rewards, values=values, response_mask=mask,
                                       group_index=index, gamma=1.0, lam=lam, gae_adv_norm="group")
    want = _group_reference(rewards, values, mask, index, 1.0, lam)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    # returns (the critic's targets) do not depend on the normalisation
    torch.testing.assert_close(ret, gae_reference(rewards, values, mask, 1.0, lam)[1], rtol=1e-9, atol=1e-9)


def test_group_normalised_gae_with_a_flat_critic_is_grpo():
    """lambda = 1 and a constant value: the advantage is GRPO's, whatever the constant."""
    rewards, values, mask, index = _batch(seed=1)
    flat = torch.full_like(values, 0.37) * mask
    got, _ = algo.compute_advantages("gae", token_level_rewards=rewards, values=flat, response_mask=mask,
                                     group_index=index, gamma=1.0, lam=1.0, gae_adv_norm="group")
    grpo, _ = algo.compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, group_index=index)
    torch.testing.assert_close(got, grpo.to(got.dtype), rtol=1e-5, atol=1e-5)


def test_a_critic_that_knows_each_prompts_outcome_does_not_reward_always_wrong_prompts():
    """The collapse measured on pick-first: the policy is (nearly) deterministic per prompt, the
    critic predicts each prompt's score with a small error, and batch whitening scales that error
    to unit size: every response of the prompts the policy always gets wrong is pushed UP (the
    policy locks in its wrong answers). Group normalisation gives those groups exactly 0 and
    keeps the sign of real differences."""
    T, n = 4, 4
    mask = torch.ones(3 * n, T, dtype=torch.float64)
    rewards = torch.zeros(3 * n, T, dtype=torch.float64)
    index = torch.arange(3).repeat_interleave(n)
    rewards[:n, -1] = 1.0                  # prompt 0: always right
    rewards[n + 1:2 * n, -1] = 1.0         # prompt 1: one of four wrong (the informative group)
    values = torch.empty(3 * n, T, dtype=torch.float64)
    values[:n] = 1.03                      # overshoot on the right ones
    values[n:2 * n] = 0.75
    values[2 * n:] = -0.02                 # prompt 2: always wrong, predicted a little below 0
    batch, _ = algo.compute_advantages("gae", token_level_rewards=rewards, values=values, response_mask=mask,
                                       group_index=index, gamma=1.0, lam=0.95, gae_adv_norm="batch")
    group, _ = algo.compute_advantages("gae", token_level_rewards=rewards, values=values, response_mask=mask,
                                       group_index=index, gamma=1.0, lam=0.95, gae_adv_norm="group")
    wrong = slice(2 * n, 3 * n)
    assert batch[wrong].mean() > 0.05              # the defect: always-wrong answers reinforced
    assert batch[:n].mean() < 0                    # and always-right ones punished
    assert torch.count_nonzero(group[wrong]) == 0 and torch.count_nonzero(group[:n]) == 0
    assert group[n].mean() < 0 < group[n + 1:2 * n].mean()   # the wrong sample of the mixed group is pushed down


def test_decoupled_critic_lambda():
    rewards, values, mask, index = _batch(seed=2)
    adv, ret = algo.compute_advantages("gae", token_level_rewards=rewards, values=values, response_mask=mask,
                                       gamma=1.0, lam=0.9, critic_lam=1.0)
    a09, _ = gae_reference(rewards, values, mask, 1.0, 0.9)
    _, r1 = gae_reference(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, algo.masked_whiten(a09, mask), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ret, r1, rtol=1e-9, atol=1e-9)
    # lambda 1 returns are the Monte-Carlo returns-to-go (gamma 1): the critic target is unbiased
    mc = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1]) * mask
    torch.testing.assert_close(ret, mc, rtol=1e-9, atol=1e-9)


def test_length_adaptive_lambda():
    mask = torch.zeros(3, 200)
    for i, length in enumerate((10, 40, 200)):
        mask[i, :length] = 1
    lam = algo.length_adaptive_lam(mask, alpha=0.05)
    # 1 - 1/(0.05 l): l=10 -> -1 (clamped to 0), l=40 -> 0.5, l=200 -> 0.9
    torch.testing.assert_close(lam, torch.tensor([0.0, 0.5, 0.9], dtype=torch.float64))
    rewards, values, mask, index = _batch(seed=3, T=8)
    per = algo.length_adaptive_lam(mask, alpha=0.5)
    adv, ret = algo.gae_per_sample_lam(rewards, values, mask, 1.0, per)
    for i in range(len(per)):
        a, r = gae_reference(rewards[i:i + 1], values[i:i + 1], mask[i:i + 1], 1.0, float(per[i]))
        torch.testing.assert_close(adv[i:i + 1], a, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(ret[i:i + 1], r, rtol=1e-9, atol=1e-9)
    # through the estimator: the critic keeps algorithm.lam unless critic_lam says otherwise
    got, ret2 = algo.compute_advantages("gae", token_level_rewards=rewards, values=values, response_mask=mask,
                                        gamma=1.0, lam=0.95, lam_length_alpha=0.5)
    torch.testing.assert_close(got, algo.masked_whiten(adv, mask), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ret2, gae_reference(rewards, values, mask, 1.0, 0.95)[1], rtol=1e-9, atol=1e-9)


def test_gae_adv_norm_errors():
    rewards, values, mask, index = _batch()
    with pytest.raises(ValueError, match="gae_adv_norm must be one of"):
        algo.compute_advantages("gae", token_level_rewards=rewards, values=values, response_mask=mask,
                                gae_adv_norm="token")
    with pytest.raises(ValueError, match="needs group_index"):
        algo.compute_advantages("gae", token_level_rewards=rewards, values=values, response_mask=mask,
                                gae_adv_norm="group")


def test_config_validation_of_the_gae_options():
    from megappo.config import ConfigError, load_config, validate

    def error(*overrides):
        with pytest.raises(ConfigError) as ei:
            validate(load_config(list(overrides), ("tiny_cpu",)))
        return dict(ei.value.errors)

    e = error("algorithm.gae_adv_norm=group", "actor_rollout_ref.rollout.n=1")
    assert "rollout.n > 1" in e["algorithm.gae_adv_norm"]
    assert "auto, batch, group, group_shift, group_centred or group_cv" in error("algorithm.gae_adv_norm=token")["algorithm.gae_adv_norm"]
    assert "rollout.n > 1" in error("algorithm.gae_adv_norm=group_cv", "actor_rollout_ref.rollout.n=1")["algorithm.gae_adv_norm"]
    assert "rollout.n > 1" in error("algorithm.gae_adv_norm=group_shift", "actor_rollout_ref.rollout.n=1")["algorithm.gae_adv_norm"]
    assert "[0, 1]" in error("algorithm.critic_lam=1.5")["algorithm.critic_lam"]
    assert "> 0" in error("algorithm.lam_length_alpha=0")["algorithm.lam_length_alpha"]
    cfg = load_config(["algorithm.gae_adv_norm=group", "algorithm.critic_lam=1.0", "algorithm.lam_length_alpha=0.05"],
                      ("tiny_cpu",))
    validate(cfg)
    assert (cfg.algorithm.gae_adv_norm, cfg.algorithm.critic_lam, cfg.algorithm.lam_length_alpha) == ("group", 1.0, 0.05)


def test_gae_defaults_fill_only_the_keys_nobody_set(tmp_path):
    """adv_estimator=gae with several samples per prompt: group_cv and the critic's short Adam
    memory where the keys are unset; verl's meaning wherever a file or the command line set them.
    The critic's passes stay verl's (the actor's ppo_epochs): 8 passes cost ~3.5x GRPO's step."""
    from megappo.config import GAE_GROUP_DEFAULTS, load_config, source_of, validate

    def cfg_of(*overrides, files=("tiny_cpu",)):
        sources: dict = {}
        cfg = load_config(list(overrides), files, sources=sources)
        validate(cfg)
        al, cr = cfg.algorithm, cfg.critic
        return (al.gae_adv_norm, cr.ppo_epochs, list(cr.optim.betas)), sources

    verl = ("batch", 1, [0.9, 0.999])
    grouped = (GAE_GROUP_DEFAULTS["algorithm.gae_adv_norm"], 1, GAE_GROUP_DEFAULTS["critic.optim.betas"])
    got, sources = cfg_of("actor_rollout_ref.rollout.n=8")
    assert got == grouped and grouped[0] == "group_cv" and grouped[2] != verl[2]
    assert source_of(sources, "critic.optim.betas") == "the defaults of adv_estimator=gae with rollout.n > 1"
    assert source_of(sources, "critic.ppo_epochs") == "the defaults"          # verl's: the actor's passes
    assert cfg_of("actor_rollout_ref.rollout.n=1")[0] == verl                       # no groups
    assert cfg_of("actor_rollout_ref.rollout.n=8", "algorithm.adv_estimator=grpo")[0] == verl
    assert cfg_of("actor_rollout_ref.rollout.n=8", "algorithm.gae_adv_norm=batch")[0] == verl   # chosen: nothing filled
    assert cfg_of("actor_rollout_ref.rollout.n=8", "algorithm.lam_length_alpha=0.05")[0] == verl  # VAPO's lambda
    # each key set by the user keeps its value, the others are still filled
    assert cfg_of("actor_rollout_ref.rollout.n=8", "critic.ppo_epochs=2")[0] == (grouped[0], 2, grouped[2])
    assert cfg_of("actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_epochs=3")[0] == (grouped[0], 3, grouped[2])
    y = tmp_path / "mine.yaml"
    y.write_text("critic:\n  optim:\n    betas: [0.8, 0.99]\n")
    assert cfg_of("actor_rollout_ref.rollout.n=8", files=("tiny_cpu", str(y)))[0] == (grouped[0], 1, [0.8, 0.99])
    # the actor's betas are never touched
    assert list(load_config(["actor_rollout_ref.rollout.n=8"], ("tiny_cpu",)).actor_rollout_ref.actor.optim.betas) == [0.9, 0.999]


def test_equal_score_share():
    """The share of the advantage on groups whose samples all scored alike, against a loop."""
    rewards, values, mask, index = _batch(seed=4, groups=5, n=4)
    rewards[:4] = 0.0                      # group 0: all alike
    rewards[4:8, 0] = 0.5; rewards[4:8, 1:] = 0.0   # group 1: all alike (0.5 each)
    adv = torch.randn(rewards.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    got = algo.equal_score_share(adv, rewards, mask, index)
    a2 = (adv ** 2 * mask).sum(-1)
    assert got == pytest.approx(float(a2[:8].sum() / a2.sum()), rel=1e-12)
    grpo, _ = algo.compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, group_index=index)
    assert algo.equal_score_share(grpo, rewards, mask, index) == 0.0


def test_collapse_watch_names_the_failure_once():
    from megappo.metrics import CollapseWatch

    w = CollapseWatch()
    msgs = [w.update({"actor/entropy": 4.0 - 0.3 * i, "critic/score/mean": 0.02,
                      "critic/advantages/equal_score_share": 0.8}) for i in range(12)]
    fired = [i for i, m in enumerate(msgs) if m]
    assert fired == [9]   # entropy 1.3 < 2.0 after ten steps, score flat
    assert "sharpening without learning" in msgs[9] and "equal_score_share 0.80" in msgs[9]
    learning = CollapseWatch()   # entropy falls because the score rises: no warning
    assert not any(learning.update({"actor/entropy": 4.0 - 0.3 * i, "critic/score/mean": 0.02 + 0.1 * i})
                   for i in range(12))


def test_collapse_watch_and_a_run_that_starts_competent():
    """A warm start (copy_warm, seed 0 of GRPO's settings with a critic): 0.38 over the first five
    steps, 0.63 when the entropy fell under half (step 12), best samples 1.0: it learns, though
    its score cannot double. The same run with the score flat at its start is named."""
    from megappo.metrics import CollapseWatch

    scores = [0.42, 0.36, 0.34, 0.36, 0.43, 0.47, 0.55, 0.58, 0.60, 0.62, 0.66, 0.70, 0.72, 0.76]
    entropy = [2.57, 2.51, 2.55, 2.43, 2.31, 2.13, 1.85, 1.79, 1.64, 1.50, 1.36, 1.21, 1.09, 0.99]
    best = [0.88, 1.0, 0.88, 0.88, 0.88] + [1.0] * 9
    run = CollapseWatch()
    assert not any(run.update({"actor/entropy": e, "critic/score/mean": s, "critic/score/max": b})
                   for e, s, b in zip(entropy, scores, best))
    flat = CollapseWatch()
    msgs = [flat.update({"actor/entropy": e, "critic/score/mean": 0.38, "critic/score/max": b})
            for e, b in zip(entropy, best)]
    assert [i for i, m in enumerate(msgs) if m] == [11]   # the first step with entropy under 1.285
    # without critic/score/max the rule is the doubling one: this learning run would be named
    doubling = CollapseWatch()
    assert any(doubling.update({"actor/entropy": e, "critic/score/mean": s}) for e, s in zip(entropy, scores))
    # scores below zero: gaining less than the start's size, or a quarter of the headroom, is flat
    neg = CollapseWatch()
    msgs = [neg.update({"actor/entropy": 4.0 - 0.3 * i, "critic/score/mean": -0.5 + 0.01 * i, "critic/score/max": 1.0})
            for i in range(12)]
    assert [i for i, m in enumerate(msgs) if m] == [9]


def _group_shift_reference(rewards, values, mask, index, gamma, lam, eps=1e-6):
    """Per sample, by hand: GAE on values shifted so that V(s_0) = the group's mean score, over the
    group's std; 0 for equal scores."""
    score = (rewards * mask).sum(-1)
    out = torch.zeros_like(values)
    for i in range(len(score)):
        members = score[index == index[i]]
        mean, std = members.mean(), members.std()
        if std > eps:
            v = (values[i:i + 1] - values[i, 0] + mean) * mask[i:i + 1]
            adv, _ = gae_reference(rewards[i:i + 1], v, mask[i:i + 1], gamma, lam)
            out[i] = adv[0] / (std + eps)
    return out


@pytest.mark.parametrize("lam", [1.0, 0.8, 0.5, 0.0])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_group_shift_matches_a_per_sample_loop(lam, gamma):
    rewards, values, mask, index = _batch(seed=2)
    got, ret = algo.compute_advantages("gae", token_level_rewards=rewards, values=values, response_mask=mask,
                                       group_index=index, gamma=gamma, lam=lam, gae_adv_norm="group_shift")
    torch.testing.assert_close(got, _group_shift_reference(rewards, values, mask, index, gamma, lam), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ret, gae_reference(rewards, values, mask, gamma, lam)[1], rtol=1e-9, atol=1e-9)


def test_group_shift_is_group_at_lambda_1_and_the_td_residuals_at_lambda_0():
    rewards, values, mask, index = _batch(seed=3)
    kw = dict(token_level_rewards=rewards, values=values, response_mask=mask, group_index=index, gamma=1.0)
    shift, _ = algo.compute_advantages("gae", lam=1.0, gae_adv_norm="group_shift", **kw)
    group, _ = algo.compute_advantages("gae", lam=1.0, gae_adv_norm="group", **kw)
    torch.testing.assert_close(shift, group, rtol=1e-9, atol=1e-9)
    # lambda 0: every token but the last gets the critic's TD residual V_{t+1} - V_t on the group's scale
    td, _ = algo.compute_advantages("gae", lam=0.0, gae_adv_norm="group_shift", **kw)
    score = (rewards * mask).sum(-1)
    for i in range(len(score)):
        std = score[index == index[i]].std()
        n = int(mask[i].sum())
        if std > 1e-6 and n > 1:
            torch.testing.assert_close(td[i, :n - 1], (values[i, 1:n] - values[i, :n - 1]) / (std + 1e-6))


def test_group_shift_with_a_flat_critic_gives_grpo_times_lambda_powers():
    """A critic that knows nothing (a constant): lambda^(tokens after t) times GRPO's advantage,
    whatever the constant (group, at lambda < 1, would add (1 - lambda^k)(V - mean) instead)."""
    rewards, values, mask, index = _batch(seed=4)
    flat = torch.full_like(values, 0.37) * mask
    got, _ = algo.compute_advantages("gae", token_level_rewards=rewards, values=flat, response_mask=mask,
                                     group_index=index, gamma=1.0, lam=0.8, gae_adv_norm="group_shift")
    grpo, _ = algo.compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, group_index=index)
    after = mask.sum(-1, keepdim=True) - 1 - torch.arange(mask.shape[1])[None, :]
    torch.testing.assert_close(got, (grpo.double() * 0.8 ** after.clamp(min=0) * mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lam", [1.0, 0.5])
def test_group_centred_removes_the_group_common_part_of_the_critic_correction(lam):
    rewards, values, mask, index = _batch(seed=5)
    kw = dict(token_level_rewards=rewards, response_mask=mask, group_index=index, gamma=1.0, lam=lam)
    got, _ = algo.compute_advantages("gae", values=values, gae_adv_norm="group_centred", **kw)
    # by hand: the group_shift advantage (unscaled) minus the outcome's part (lambda^k (score - mean),
    # k: tokens after t) is the critic's correction; subtract its mean over the group's samples
    # present at each position
    score = (rewards * mask).sum(-1)
    shift = _group_shift_reference(rewards, values, mask, index, 1.0, lam, eps=0.0)
    want = torch.zeros_like(values)
    for i in range(len(score)):
        g = index == index[i]
        mean, std = score[g].mean(), score[g].std()
        if std > 1e-6:
            out = _outcome_by_hand(score[g] - mean, mask[g], lam)
            corr = (shift[g] * std - out) * mask[g]
            common = corr.sum(0) / mask[g].sum(0).clamp(min=1)
            want[i] = (shift[i] * std - common) * mask[i] / (std + 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    # a critic whose values depend only on the prompt and the position (shared by the group): GRPO
    # (at lambda 1; at lambda < 1 the outcome's lambda-decay is a per-sample term and stays)
    shared = torch.randn(4, values.shape[1], dtype=torch.float64)[index] * mask
    flat, _ = algo.compute_advantages("gae", values=shared, gae_adv_norm="group_centred", **kw)
    grpo, _ = algo.compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, group_index=index)
    if lam == 1.0:
        torch.testing.assert_close(flat, grpo.double(), rtol=1e-5, atol=1e-5)


def _outcome_by_hand(o, mask, lam):
    """(n, T) lambda^k o_i at each response token (k: the sample's tokens after t; the reward at its
    last token, gamma 1): GAE(lambda) of a critic that knows only the group's mean score."""
    k = mask.sum(-1, keepdim=True) - 1 - torch.arange(mask.shape[1])[None, :]
    return (lam ** k.clamp(min=0).to(torch.float64)) * o[:, None] * mask


def _cv_parts_by_hand(rewards, values, mask, index, lam):
    """The outcome's unscaled part o (GRPO's at lambda 1) and the critic's within-group
    correction d, per sample by hand (from the group_shift reference), and each sample's group std."""
    score = (rewards * mask).sum(-1)
    shift = _group_shift_reference(rewards, values, mask, index, 1.0, lam, eps=0.0)
    o, d, std = torch.zeros_like(values), torch.zeros_like(values), torch.zeros(len(score), dtype=torch.float64)
    for i in range(len(score)):
        g = index == index[i]
        mean, std[i] = score[g].mean(), score[g].std()
        if std[i] > 1e-6:
            out = _outcome_by_hand(score[g] - mean, mask[g], lam)
            corr = (shift[g] * std[i] - out) * mask[g]
            common = corr.sum(0) / mask[g].sum(0).clamp(min=1)
            o[i] = out[int((g.nonzero()[:, 0] == i).nonzero()[0, 0])]     # sample i's row within its group
            d[i] = (shift[i] * std[i] - o[i] - common) * mask[i]
    return o, d, std


@pytest.mark.parametrize("lam", [1.0, 0.7])
def test_group_cv_weights_the_critic_by_a_shrunk_least_squares_fit_of_the_outcome(lam):
    import numpy as np

    from megappo.algo.advantages import critic_cv_fit

    rewards, values, mask, index = _batch(seed=11, groups=6, n=4, T=7)
    kw = dict(token_level_rewards=rewards, response_mask=mask, group_index=index, gamma=1.0, lam=lam)
    # a critic with some per-token knowledge: values that partly track each sample's own outcome
    score = (rewards * mask).sum(-1)
    values = (values + 4.0 * score[:, None] * torch.linspace(0, 1, mask.shape[1])[None, :]) * mask
    got, _ = algo.compute_advantages("gae", values=values, gae_adv_norm="group_cv", **kw)
    o, d, std = _cv_parts_by_hand(rewards, values, mask, index, lam)
    # beta_hat by numpy's least squares: regress o/std on -d/std over the tokens of groups that differ
    live = (std > 1e-6)[:, None].expand_as(mask) & mask.bool()
    X, Y = -d / (std[:, None] + 1e-6), o / (std[:, None] + 1e-6)
    beta_hat = float(np.linalg.lstsq(X[live].numpy()[:, None], Y[live].numpy(), rcond=None)[0][0])
    # its standard error clustered by prompt group, by hand
    resid = (Y - beta_hat * X) * live
    groups = [(X[index == g] * resid[index == g]).sum() for g in index.unique()]
    se = float(torch.stack(groups).square().sum().sqrt() / X[live].square().sum())
    fit = critic_cv_fit(o, d, std, mask, index)
    assert fit == pytest.approx((beta_hat, se), rel=1e-6)
    beta = min(1.0, beta_hat * max(0.0, 1 - (se / beta_hat) ** 2))
    assert 0.05 < beta < beta_hat < 0.95, (beta, beta_hat, se)   # partial knowledge, shrunk a little
    want = torch.where((std > 1e-6)[:, None], (o + beta * d) / (std[:, None] + 1e-6), torch.zeros_like(o)) * mask
    # (the scores are summed in float32 inside: 1e-8 differences in o)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert abs(algo.critic_cv_beta(rewards, values, mask, index, 1.0, lam) - beta) < 1e-6


@pytest.mark.parametrize("lam", [0.95, 0.7])
def test_group_cv_at_lambda_below_1_sees_no_knowledge_in_a_critic_that_has_none(lam):
    """GAE(lambda) of a constant critic is lambda^k (score - mean_g): the outcome's part, not the
    critic's. Counted as the critic's correction, it made the fit 4.5 at lambda 0.95 for values
    that are all 0 (beta clamped to 1 and logged as a critic that knows everything). A critic that
    knows only the prompt gets beta 0 and the lambda-discounted outcome on the group's scale."""
    from megappo.algo.advantages import _centred_parts, critic_cv_fit

    def case(full):
        rewards, _, mask, index = _batch(seed=21, groups=8, n=4, T=6)
        if full:   # one length (a shared critic's future values then end at the same place for all)
            rewards = torch.zeros_like(rewards)
            rewards[:, -1] = torch.rand(len(index), generator=torch.Generator().manual_seed(4), dtype=torch.float64)
            mask = torch.ones_like(mask)
        return rewards, mask, index

    # values all 0 (responses of varied lengths), and values the group shares at each position
    g2 = torch.Generator().manual_seed(2)
    for full, values_of in ((False, lambda m, i: torch.zeros(m.shape, dtype=torch.float64)),
                            (True, lambda m, i: torch.randn(8, m.shape[1], dtype=torch.float64, generator=g2)[i] * m)):
        rewards, mask, index = case(full)
        values = values_of(mask, index)
        kw = dict(token_level_rewards=rewards, response_mask=mask, group_index=index, gamma=1.0, lam=lam)
        score = (rewards * mask).sum(-1)
        want = torch.zeros(mask.shape, dtype=torch.float64)
        for g in index.unique():
            rows = index == g
            mean, std = score[rows].mean(), score[rows].std()
            if std > 1e-6:
                want[rows] = _outcome_by_hand(score[rows] - mean, mask[rows], lam) / (std + 1e-6)
        o, d, std = _centred_parts(rewards, values, mask, index, 1.0, lam, None)
        assert critic_cv_fit(o, d, std, mask, index) == (0.0, float("inf"))
        memory = algo.CvMemory(0.0, beta_max=10.0)
        got, _ = algo.compute_advantages("gae", values=values, gae_adv_norm="group_cv", cv_memory=memory, **kw)
        assert memory.beta == 0.0
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # rewards on several tokens (a KL penalty in the reward), lambda 1, values 0: the outcome's part
    # is the reward to go minus the group's mean score (the rewards before t are known at t: they
    # are not the critic's to weigh)
    rewards, mask, index = case(True)
    rewards[:, 1] = -0.1 * torch.rand(len(index), generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    score = rewards.sum(-1)
    _, mean, std = algo.group_stats(score, index)
    to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    memory = algo.CvMemory(0.0)
    got, _ = algo.compute_advantages("gae", token_level_rewards=rewards, response_mask=mask, group_index=index,
                                     gamma=1.0, lam=1.0, values=torch.zeros_like(rewards), gae_adv_norm="group_cv",
                                     cv_memory=memory)
    assert memory.beta == 0.0
    torch.testing.assert_close(got, (to_go - mean[:, None]) / (std[:, None] + 1e-6), rtol=1e-6, atol=1e-6)
    # and one that knows a part of each outcome is still seen
    rewards, mask, index = case(True)
    score = rewards.sum(-1)
    know = torch.zeros(mask.shape, dtype=torch.float64)
    know[:, 1:] = score[:, None] / 2
    assert algo.critic_cv_beta(rewards, know * mask, mask, index, 1.0, lam) > 0.5


def test_group_cv_ignores_a_critic_whose_per_token_values_are_noise():
    """Values independent of the outcome: the unshrunk fit is positive on about half the batches
    (noise), the shrunk weight is 0 on most and small on the rest."""
    from megappo.algo.advantages import _centred_parts, critic_cv_fit

    raw, shrunk = [], []
    for seed in range(30):
        rewards, values, mask, index = _batch(seed=100 + seed, groups=8, n=8, T=8)
        o, d, std = _centred_parts(rewards, values, mask, index, 1.0, 1.0, None)
        raw.append(max(0.0, critic_cv_fit(o, d, std, mask, index)[0]))
        shrunk.append(algo.critic_cv_beta(rewards, values, mask, index, 1.0, 1.0))
    assert sum(b > 0 for b in raw) >= 8
    assert sum(b == 0 for b in shrunk) >= 20 and sum(shrunk) < 0.6 * sum(raw), (raw, shrunk)


def test_group_cv_is_grpo_for_a_critic_without_per_token_knowledge_and_clamps_beta():
    rewards, values, mask, index = _batch(seed=12, groups=5, n=4, T=6)
    kw = dict(token_level_rewards=rewards, response_mask=mask, group_index=index, gamma=1.0, lam=1.0)
    grpo, _ = algo.compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, group_index=index)
    # values shared by the group at each position: d = 0 (up to rounding), beta = 0, GRPO's advantage
    g = torch.Generator().manual_seed(3)
    shared = torch.randn(5, mask.shape[1], dtype=torch.float64, generator=g)[index] * mask
    got, _ = algo.compute_advantages("gae", values=shared, gae_adv_norm="group_cv", **kw)
    torch.testing.assert_close(got, grpo.double(), rtol=1e-5, atol=1e-5)
    assert algo.critic_cv_beta(rewards, shared, mask, index, 1.0, 1.0) == 0.0
    for seed in range(20):   # whatever the draw (the rounding of d differs with the values)
        g = torch.Generator().manual_seed(seed)
        other = torch.randn(5, mask.shape[1], dtype=torch.float64, generator=g)[index] * mask
        assert algo.critic_cv_beta(rewards, other, mask, index, 1.0, 1.0) == 0.0, seed
    # the clamp, on planted parts: d = -k o gives beta = 1/k, clamped to [0, 1]
    from megappo.algo.advantages import critic_cv_coefficient
    o = torch.randn(8, 5, dtype=torch.float64)
    std = torch.ones(8, dtype=torch.float64)
    m = torch.ones(8, 5)
    groups = torch.arange(4).repeat_interleave(2)
    # (an exact linear relation: no residual, no standard error, no shrinkage)
    assert abs(critic_cv_coefficient(o, -2.0 * o, std, m, groups) - 0.5) < 1e-12
    assert critic_cv_coefficient(o, -0.5 * o, std, m, groups) == 1.0     # over-confident critic: full weight only
    assert critic_cv_coefficient(o, 0.7 * o, std, m, groups) == 0.0      # anti-correlated critic: ignored
    # and a critic whose values are exactly each sample's outcome from its first token on is
    # trusted fully: its correction cancels the outcome (beta 1, advantages 0 after token 0)
    score = (rewards * mask).sum(-1)
    exact = (score[:, None] * torch.ones_like(mask, dtype=torch.float64)) * mask
    exact[:, 0] = 0.0
    assert abs(algo.critic_cv_beta(rewards, exact, mask, index, 1.0, 1.0) - 1.0) < 1e-9


def test_group_cv_beta_max_lets_the_fit_scale_up_an_under_scaled_critic():
    """A critic whose within-group correction points the right way at a third of its size
    (d = -o / 3: beta_hat 3): the default cap gives it weight 1, beta_max 4 the fitted 3, which
    cancels the outcome exactly; the fit before the clamp is kept for critic/advantages/cv_beta_fit."""
    from megappo.algo.advantages import critic_cv_coefficient

    o = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    std, m = torch.ones(8, dtype=torch.float64), torch.ones(8, 5)
    groups = torch.arange(4).repeat_interleave(2)
    capped, free = algo.CvMemory(0.0), algo.CvMemory(0.0, beta_max=4.0)
    assert critic_cv_coefficient(o, -o / 3, std, m, groups, memory=capped) == 1.0
    assert capped.beta_fit == pytest.approx(3.0, rel=1e-12)
    assert critic_cv_coefficient(o, -o / 3, std, m, groups, memory=free) == pytest.approx(3.0, rel=1e-12)
    assert (free.beta, free.beta_fit) == pytest.approx((3.0, 3.0), rel=1e-12)
    assert free.t == 1e9          # an exact fit: its t is logged large and finite (cv_t), not as 0
    assert critic_cv_coefficient(o, -o / 5, std, m, groups, memory=free) == 4.0       # clamped at beta_max
    assert free.share == pytest.approx(0.2, rel=1e-12)     # the share the correction carries: 1/5
    # through the estimator: group_cv at lambda 1 on values that know a third of each outcome
    # (every response the same length: the group-common part at each position is then its mean score)
    rewards, index = torch.zeros(20, 6, dtype=torch.float64), torch.arange(5).repeat_interleave(4)
    rewards[:, -1] = torch.rand(20, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    mask, score = torch.ones(20, 6), rewards[:, -1]
    values = torch.zeros(mask.shape, dtype=torch.float64)
    values[:, 1:] = score[:, None] / 3     # V(s_t) - V(s_0) = score / 3 after the first token
    values = values * mask
    kw = dict(token_level_rewards=rewards, response_mask=mask, group_index=index, gamma=1.0, lam=1.0,
              values=values, gae_adv_norm="group_cv")
    capped_adv, _ = algo.compute_advantages("gae", cv_memory=algo.CvMemory(0.0), **kw)
    free_adv, _ = algo.compute_advantages("gae", cv_memory=algo.CvMemory(0.0, beta_max=4.0), **kw)
    grpo, _ = algo.compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, group_index=index)
    later = mask.clone().bool()
    later[:, 0] = False
    # beta 3 removes the outcome from every token after the first; beta 1 two thirds of it remains
    assert free_adv[later].abs().max() < 1e-6
    torch.testing.assert_close(capped_adv[later], (2 / 3) * grpo.double()[later], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="beta_max must be > 0"):
        algo.CvMemory(0.9, beta_max=0.0)


def _cv_batch(seed, knowledge):
    """A batch whose critic knows ``knowledge`` of each sample's outcome per token (0: noise)."""
    from megappo.algo.advantages import _centred_parts

    rewards, values, mask, index = _batch(seed=seed, groups=6, n=4, T=7)
    score = (rewards * mask).sum(-1)
    values = (values + knowledge * score[:, None] * torch.linspace(0, 1, mask.shape[1])[None, :]) * mask
    return _centred_parts(rewards, values, mask, index, 1.0, 1.0, None), mask, index


def test_cv_memory_is_the_least_squares_fit_over_the_recent_batches_weighted_by_decay():
    from megappo.algo.advantages import critic_cv_fit

    decay = 0.7
    batches = [_cv_batch(40 + k, 2.0 + k) for k in range(3)]
    memory = algo.CvMemory(decay)
    for (o, d, std), mask, index in batches:
        beta, se = critic_cv_fit(o, d, std, mask, index, memory=memory)
    # the same fit on the three batches as one, batch k back scaled by decay^(k/2) (its squared
    # sums then weigh decay^k); group ids kept apart
    parts = [[t * decay ** ((2 - k) / 2) for t in (o, d)] + [std, mask, index + 100 * k]
             for k, ((o, d, std), mask, index) in enumerate(batches)]
    joint = [torch.cat([p[i] for p in parts]) for i in range(5)]
    want_beta, _ = critic_cv_fit(*joint)
    assert beta == pytest.approx(want_beta, rel=1e-9)
    # decay 0 is the batch alone
    (o, d, std), mask, index = batches[-1]
    assert critic_cv_fit(o, d, std, mask, index, memory=algo.CvMemory(0.0)) == critic_cv_fit(o, d, std, mask, index)
    # the same batch again and again: the same beta, its standard error down by
    # sqrt(sum decay^2k) / sum decay^k (the clustered variance decays with decay^2)
    one = critic_cv_fit(o, d, std, mask, index)
    memory = algo.CvMemory(decay)
    for k in range(1, 6):
        beta, se = critic_cv_fit(o, d, std, mask, index, memory=memory)
        ratio = sum(decay ** (2 * j) for j in range(k)) ** 0.5 / sum(decay ** j for j in range(k))
        assert (beta, se) == pytest.approx((one[0], one[1] * ratio), rel=1e-9), k


def test_group_cv_beta_with_memory_does_not_drop_to_0_on_a_batch_with_little_evidence():
    """The flip the memory removes: a critic with per-token knowledge, then a batch where only one
    prompt group has varied scores. Alone, that batch's fit is too noisy and beta drops to 0
    (GRPO's advantage on one step, the critic's on the next: measured on the CPU main job once its
    score passed 0.97); with the recent batches' sums it stays where they put it."""
    from megappo.algo.advantages import critic_cv_coefficient

    memory = algo.CvMemory(0.9)
    for k in range(6):
        (o, d, std), mask, index = _cv_batch(60 + k, 1.0)
        critic_cv_coefficient(o, d, std, mask, index, memory=memory)
    settled = memory.beta
    assert settled > 0.15
    (o, d, std), mask, index = _cv_batch(70, 1.0)
    one = index == index[0]                       # keep one group's samples varied, the rest equal
    std = torch.where(one, std, torch.zeros_like(std))
    o = o * one[:, None]
    alone = critic_cv_coefficient(o, d, std, mask, index)
    with_memory = critic_cv_coefficient(o, d, std, mask, index, memory=memory)
    assert alone == 0.0 and abs(with_memory - settled) < 0.1, (alone, with_memory, settled)
    # the advantages use the remembered weight, and the state round-trips
    state = memory.state_dict()
    again = algo.CvMemory(0.9)
    again.load_state_dict(state)
    assert again.state_dict() == state
    with pytest.raises(ValueError, match="decay must be in"):
        algo.CvMemory(1.0)


def _loo_mean_return(rewards, mask, index, gamma):
    """By hand: each sample's leave-one-out mean, over the other samples of its group, of their
    discounted return from the first response token."""
    g0 = []
    for i in range(len(rewards)):
        pos = mask[i].nonzero().flatten()
        g0.append(sum(gamma ** k * rewards[i, p] for k, p in enumerate(pos.tolist())))
    g0 = torch.tensor(g0, dtype=torch.float64)
    return torch.stack([g0[(index == index[i]) & (torch.arange(len(g0)) != i)].mean() for i in range(len(g0))])


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.9), (0.9, 0.8), (0.95, 0.0)])
def test_group_relative_targets_are_the_returns_minus_the_others_mean_return(gamma, lam):
    """critic_target=group_relative: with values level-shifted by each sample's leave-one-out
    mean return c_i, the targets are the return targets minus c_i at every token and lambda (the
    TD errors are equal), and the advantages do not change (the group normalisations read only
    V(s_t) - V(s_0)). Masked positions inside a response (tool tokens) are skipped."""
    rewards, values, mask, index = _batch(seed=3, groups=4, n=4, T=7)
    mask[::3, 1] = 0                    # a masked position inside some responses (multi-turn)
    mask[:, 0] = 1
    rewards = rewards * mask + 0.05 * mask   # a per-token part too (a KL penalty in the reward)
    values = values * mask
    c = _loo_mean_return(rewards, mask, index, gamma)
    kw = dict(token_level_rewards=rewards, response_mask=mask, group_index=index, gamma=gamma, lam=lam,
              gae_adv_norm="group_cv")
    adv, ret = algo.compute_advantages("gae", values=values, **kw)
    adv_rel, ret_rel = algo.compute_advantages("gae", values=values - c[:, None] * mask, critic_target="group_relative", **kw)
    torch.testing.assert_close(ret_rel, (ret - c[:, None]) * mask, rtol=0, atol=1e-12)
    torch.testing.assert_close(adv_rel, adv, rtol=0, atol=1e-12)
    # the critic's own values (not shifted): the targets differ from the returns' by c_i exactly where
    # lambda reaches the end of the response
    _, ret_same_v = algo.compute_advantages("gae", values=values, critic_target="group_relative", **kw)
    if lam == 1.0 and gamma == 1.0:
        torch.testing.assert_close(ret_same_v, (ret - c[:, None]) * mask, rtol=0, atol=1e-12)


def test_group_relative_targets_in_expectation_are_the_change_of_value_since_the_prompt():
    """Sampled responses of a two-token task with known values: averaged over many groups the
    targets at t are V(s_t) - V(s_0), not V(s_t)."""
    g = torch.Generator().manual_seed(0)
    groups, n = 4000, 4
    B = groups * n
    p = torch.rand(groups, generator=g, dtype=torch.float64).repeat_interleave(n)   # each prompt's hit rate
    hit = (torch.rand(B, 2, generator=g, dtype=torch.float64) < p[:, None]).double()
    rewards = torch.zeros(B, 2, dtype=torch.float64)
    rewards[:, 1] = hit.sum(1) / 2
    mask = torch.ones(B, 2)
    index = torch.arange(groups).repeat_interleave(n)
    _, ret = algo.compute_advantages("gae", token_level_rewards=rewards, values=torch.zeros(B, 2, dtype=torch.float64),
                                     response_mask=mask, group_index=index, gamma=1.0, lam=1.0,
                                     gae_adv_norm="group_cv", critic_target="group_relative")
    # V(s_0) = p, V(s_1) = (hit_0 + p) / 2: the target at token 1 is (hit_0 - p) / 2 + noise of mean 0
    assert abs(float(ret[:, 0].mean())) < 0.01
    slope = float(((ret[:, 1] - ret[:, 1].mean()) * (hit[:, 0] - p)).sum() / ((hit[:, 0] - p) ** 2).sum())
    assert abs(slope - 0.5) < 0.05
    assert abs(float((ret[:, 1] - (hit[:, 0] - p) / 2).mean())) < 0.01


def test_group_relative_targets_need_a_shift_free_normalisation():
    rewards, values, mask, index = _batch()
    kw = dict(token_level_rewards=rewards, values=values, response_mask=mask, group_index=index)
    for norm in ("batch", "group"):
        with pytest.raises(ValueError, match="critic_target='group_relative' needs gae_adv_norm in"):
            algo.compute_advantages("gae", gae_adv_norm=norm, critic_target="group_relative", **kw)
    with pytest.raises(ValueError, match="critic_target must be one of"):
        algo.compute_advantages("gae", gae_adv_norm="group_cv", critic_target="values", **kw)


def test_critic_target_config():
    """verl's targets unless asked; group_relative needs a normalisation that reads only
    V(s_t) - V(s_0) (n > 1 resolves gae_adv_norm=auto to group_cv), and is refused with one that
    reads V itself."""
    from megappo.config import ConfigError, load_config, validate

    def target(*overrides):
        cfg = load_config(list(overrides), ("tiny_cpu",))
        validate(cfg)
        return cfg.algorithm.critic_target

    assert target("actor_rollout_ref.rollout.n=8") == "return"
    assert target("actor_rollout_ref.rollout.n=8", "algorithm.critic_target=group_relative") == "group_relative"
    assert target("actor_rollout_ref.rollout.n=8", "algorithm.gae_adv_norm=group_centred",
                  "algorithm.critic_target=group_relative") == "group_relative"

    def error(*overrides):
        with pytest.raises(ConfigError) as ei:
            validate(load_config(list(overrides), ("tiny_cpu",)))
        return dict(ei.value.errors)["algorithm.critic_target"]

    assert "gae_adv_norm='batch'" in error("actor_rollout_ref.rollout.n=8", "algorithm.gae_adv_norm=batch",
                                           "algorithm.critic_target=group_relative")
    assert "gae_adv_norm='group'" in error("actor_rollout_ref.rollout.n=8", "algorithm.gae_adv_norm=group",
                                           "algorithm.critic_target=group_relative")
    assert "gae_adv_norm='batch'" in error("actor_rollout_ref.rollout.n=1", "algorithm.critic_target=group_relative")
    assert "return or group_relative" in error("algorithm.critic_target=mean")


def test_the_trainer_passes_the_critic_target_to_the_returns():
    """phases.rewards_and_advantages: with critic_target=group_relative the critic's targets are
    the returns minus each sample's leave-one-out group mean; the advantages are the default's."""
    from types import SimpleNamespace

    from megappo.config import load_config
    from megappo.trainer import phases

    rewards, values, mask, index = _batch(seed=5, groups=3, n=4, T=5)
    batch = SimpleNamespace(token_level_scores=rewards, response_mask=mask, values=values, prompt_index=index,
                            old_log_prob=None, ref_log_prob=None, sum_pi_squared=None, rollout_is_weights=None,
                            reward_components=None)
    out = {}
    for target in ("return", "group_relative"):
        cfg = load_config(["actor_rollout_ref.rollout.n=4", f"algorithm.critic_target={target}"], ("tiny_cpu",))
        out[target] = phases.rewards_and_advantages(batch, cfg, None, None)
    c = _loo_mean_return(rewards, mask, index, 1.0)
    torch.testing.assert_close(out["group_relative"][2], (out["return"][2] - c[:, None]) * mask, rtol=0, atol=1e-12)
    torch.testing.assert_close(out["group_relative"][1], out["return"][1], rtol=0, atol=0)


def _trainer_cv_step(rewards, mask, values, index, overrides):
    """(the CvMemory phases builds from the tiny_cpu config with ``overrides`` at n=4, the step's
    metrics from phases.rewards_and_advantages on that batch)."""
    from types import SimpleNamespace

    from megappo.config import load_config
    from megappo.trainer import phases

    batch = SimpleNamespace(token_level_scores=rewards, response_mask=mask, values=values, prompt_index=index,
                            old_log_prob=None, ref_log_prob=None, sum_pi_squared=None, rollout_is_weights=None,
                            reward_components=None)
    cfg = load_config(["actor_rollout_ref.rollout.n=4"] + overrides, ("tiny_cpu",))
    memory = phases.cv_memory(cfg)
    return memory, phases.rewards_and_advantages(batch, cfg, None, None, cv_memory=memory)[3]


def _weak_critic_batch():
    """_cv_batch(4, 0.5) as (rewards, values, mask, index): a critic whose fit is positive but weak."""
    rewards, values, mask, index = _batch(seed=4, groups=6, n=4, T=7)
    score = (rewards * mask).sum(-1)
    return rewards, (values + 0.5 * score[:, None] * torch.linspace(0, 1, mask.shape[1])[None, :]) * mask, mask, index


def test_the_trainer_builds_group_cvs_memory_from_the_config_and_logs_the_fit():
    """phases.cv_memory takes gae_cv_decay and gae_cv_beta_max from the config; the step's metrics
    carry the weight used (cv_beta) and the least-squares fit before its clamp (cv_beta_fit)."""
    rewards, index = torch.zeros(20, 6, dtype=torch.float64), torch.arange(5).repeat_interleave(4)
    rewards[:, -1] = torch.rand(20, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    mask = torch.ones(20, 6)
    values = torch.zeros(20, 6, dtype=torch.float64)
    values[:, 1:] = rewards[:, -1:] / 3          # a third of each outcome: the fit is 3
    got = {}
    for top in (1.0, 4.0):
        memory, got[top] = _trainer_cv_step(rewards, mask, values, index,
                                            ["algorithm.gae_cv_decay=0.5", f"algorithm.gae_cv_beta_max={top}"])
        assert (memory.decay, memory.beta_max) == (0.5, top)
    assert got[1.0]["critic/advantages/cv_beta"] == 1.0
    assert got[4.0]["critic/advantages/cv_beta"] == pytest.approx(3.0, rel=1e-9)
    assert got[1.0]["critic/advantages/cv_beta_fit"] == pytest.approx(3.0, rel=1e-9)
    # the share of the outcome the correction carries: a third of it on tokens 1-5, none on token 0
    assert got[1.0]["critic/advantages/cv_share"] == pytest.approx(5 / 18, rel=1e-9)


def test_cv_share_tells_a_critic_that_carries_the_outcome_from_one_that_only_points_its_way():
    """The fit (and so the weight) reads the same for a critic whose correction is the outcome and
    for one whose correction is a hundredth of it pointing the same way (clamped to 1 both); the
    share tells them apart: 1 and 0.01, and 0 for a critic that knows only the prompt. It is this
    batch's, not the memory's."""
    from megappo.algo.advantages import critic_cv_coefficient

    o = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    std, m = torch.full((8,), 0.5, dtype=torch.float64), torch.ones(8, 5)
    groups = torch.arange(4).repeat_interleave(2)
    full, tiny, none = algo.CvMemory(0.0), algo.CvMemory(0.0), algo.CvMemory(0.9)
    assert critic_cv_coefficient(o, -o, std, m, groups, memory=full) == pytest.approx(1.0, rel=1e-12)
    assert critic_cv_coefficient(o, -o / 100, std, m, groups, memory=tiny) == 1.0
    assert (full.share, tiny.share) == pytest.approx((1.0, 0.01), rel=1e-12)
    assert tiny.beta_fit == pytest.approx(100.0, rel=1e-9)
    critic_cv_coefficient(o, -o / 2, std, m, groups, memory=none)
    assert none.share == pytest.approx(0.5, rel=1e-12)
    assert critic_cv_coefficient(o, torch.zeros_like(o), std, m, groups, memory=none) > 0   # the memory's fit
    assert none.share == 0.0                                                                 # this batch's share
    # groups whose scores all agree (std 0) and masked tokens count for nothing
    std2, m2 = std.clone(), m.clone()
    std2[:2], m2[2:, 3:] = 0.0, 0.0
    d = -o / 4
    d[:2] = -o[:2] * 3          # a group of equal scores: its "correction" is ignored
    d[2:, 3:] = 7.0             # masked tokens: ignored
    part = algo.CvMemory(0.0)
    critic_cv_coefficient(o, d, std2, m2, groups, memory=part)
    assert part.share == pytest.approx(0.25, rel=1e-12)


def test_cv_gain_is_the_share_of_grpos_advantage_variance_the_correction_removes():
    """critic/advantages/cv_gain = 1 - sum(A_gae^2) / sum(A_grpo^2) over the batch, computed here from
    the two estimators' advantages; 0 for a critic that knows only the prompt; negative when the
    weight (carried over from earlier batches) no longer fits this batch's critic."""
    from types import SimpleNamespace

    from megappo.config import load_config
    from megappo.trainer import phases

    g = torch.Generator().manual_seed(21)
    rewards, index = torch.zeros(24, 6, dtype=torch.float64), torch.arange(6).repeat_interleave(4)
    rewards[:, -1] = torch.rand(24, generator=g, dtype=torch.float64)
    rewards[:4, -1] = 0.5                                   # a group that scored alike: 0 in both
    mask = torch.ones(24, 6)
    knows = torch.zeros(24, 6, dtype=torch.float64)
    knows[:, 1:] = 0.6 * rewards[:, -1:] + 0.05 * torch.randn(24, 1, generator=g, dtype=torch.float64)
    wrong = torch.zeros(24, 6, dtype=torch.float64)
    wrong[:, 1:] = -0.2 * rewards[:, -1:]                   # a fifth of the outcome, the wrong way round

    def batch(values):
        return SimpleNamespace(token_level_scores=rewards, response_mask=mask, values=values, prompt_index=index,
                               old_log_prob=None, ref_log_prob=None, sum_pi_squared=None, rollout_is_weights=None,
                               reward_components=None)

    cfg = load_config(["actor_rollout_ref.rollout.n=4", "algorithm.gae_cv_decay=0.9"], ("tiny_cpu",))
    grpo_cfg = load_config(["actor_rollout_ref.rollout.n=4", "algorithm.adv_estimator=grpo"], ("tiny_cpu",))
    grpo = phases.rewards_and_advantages(batch(knows), grpo_cfg, None, None)[1].to(torch.float64)
    memory = phases.cv_memory(cfg)
    _, adv, _, m = phases.rewards_and_advantages(batch(knows), cfg, None, None, cv_memory=memory)
    assert 0.3 < m["critic/advantages/cv_beta"] <= cfg.algorithm.gae_cv_beta_max
    want = 1 - float((adv.to(torch.float64) ** 2).sum() / (grpo ** 2).sum())
    assert m["critic/advantages/cv_gain"] == pytest.approx(want, rel=1e-4) and want > 0.2
    # the next batch's critic points the wrong way, but the weight leans on the memory: it costs
    _, adv, _, m = phases.rewards_and_advantages(batch(wrong), cfg, None, None, cv_memory=memory)
    assert m["critic/advantages/cv_beta"] > 0.3
    want = 1 - float((adv.to(torch.float64) ** 2).sum() / (grpo ** 2).sum())
    assert m["critic/advantages/cv_gain"] == pytest.approx(want, rel=1e-4) and want < 0
    # a critic that knows only the prompt (values shared by the group at every position): 0
    prompt_only = torch.zeros(24, 6, dtype=torch.float64) + index[:, None].to(torch.float64) / 10
    m = phases.rewards_and_advantages(batch(prompt_only), cfg, None, None, cv_memory=phases.cv_memory(cfg))[3]
    assert m["critic/advantages/cv_gain"] == 0.0


def test_group_cv_min_t_keeps_grpos_advantages_until_the_fit_is_significant():
    """gae_cv_min_t gates the weight on the fit's t-statistic: a batch whose fit is positive but
    weak (t ~1.5) gets a small weight from the shrinkage alone (min_t 1) and exactly GRPO's
    advantages with min_t 3; a critic that carries the outcome (t far above 3) gets the same weight
    either way. memory.t is the fit's beta_hat / se (critic/advantages/cv_t)."""
    from megappo.algo.advantages import critic_cv_coefficient, critic_cv_fit

    (o, d, std), mask, index = _cv_batch(4, 0.5)
    beta_hat, se = critic_cv_fit(o, d, std, mask, index)
    assert 1.2 < beta_hat / se < 2.5, beta_hat / se          # the construction: a weak, positive fit
    open_, gated = algo.CvMemory(0.0), algo.CvMemory(0.0, min_t=3.0)
    assert critic_cv_coefficient(o, d, std, mask, index, memory=open_) > 0.0
    assert critic_cv_coefficient(o, d, std, mask, index, memory=gated) == 0.0
    assert gated.t == pytest.approx(beta_hat / se, rel=1e-12) and open_.t == gated.t
    assert gated.beta_fit == pytest.approx(beta_hat, rel=1e-12) and gated.gain == 0.0
    # through the estimator: the gated advantages are GRPO's
    rewards, values, mask, index = _weak_critic_batch()
    kw = dict(token_level_rewards=rewards, response_mask=mask, group_index=index, gamma=1.0, lam=1.0,
              values=values, gae_adv_norm="group_cv")
    grpo, _ = algo.compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, group_index=index)
    gated_adv, _ = algo.compute_advantages("gae", cv_memory=algo.CvMemory(0.0, min_t=3.0), **kw)
    open_adv, _ = algo.compute_advantages("gae", cv_memory=algo.CvMemory(0.0), **kw)
    torch.testing.assert_close(gated_adv, grpo.double(), rtol=1e-5, atol=1e-5)
    assert (open_adv - grpo.double()).abs().max() > 1e-3
    # a strong critic: the gate is open and changes nothing
    g = torch.Generator().manual_seed(7)
    o = torch.randn(16, 5, dtype=torch.float64, generator=g)
    d = -o / 2 + 0.1 * torch.randn(16, 5, dtype=torch.float64, generator=g)
    std, m, groups = torch.ones(16, dtype=torch.float64), torch.ones(16, 5), torch.arange(8).repeat_interleave(2)
    strong, plain = algo.CvMemory(0.0, beta_max=3.0, min_t=3.0), algo.CvMemory(0.0, beta_max=3.0)
    assert critic_cv_coefficient(o, d, std, m, groups, memory=strong) == critic_cv_coefficient(o, d, std, m, groups, memory=plain) > 1.5
    assert strong.t > 10.0
    with pytest.raises(ValueError, match="min_t must be >= 1"):
        algo.CvMemory(0.9, min_t=0.5)


def test_the_trainer_passes_gae_cv_min_t_and_logs_cv_t():
    rewards, values, mask, index = _weak_critic_batch()
    got = {}
    for min_t in (1.0, 3.0):
        memory, got[min_t] = _trainer_cv_step(rewards, mask, values, index,
                                              ["algorithm.gae_cv_decay=0.0", f"algorithm.gae_cv_min_t={min_t}"])
        assert memory.min_t == min_t
    assert got[1.0]["critic/advantages/cv_t"] == got[3.0]["critic/advantages/cv_t"]
    assert 1.2 < got[3.0]["critic/advantages/cv_t"] < 2.5
    assert got[1.0]["critic/advantages/cv_beta"] > 0.0 == got[3.0]["critic/advantages/cv_beta"]
