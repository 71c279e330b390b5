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
    # the metrics: against verl's formulas in tests/unit/test_verl_parity.py
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
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, dro_beta=0.05)   # dro has no default beta
    if mode in algo.COV_LOSSES:   # a few tokens selected (here: every third)
        kw["cov_selected"] = (torch.arange(mask.numel()).reshape(mask.shape) % 3 == 0) & (mask > 0)
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


# -- rejection sampling (rollout_rs) ---------------------------------------------------------------

RC = "algorithm.rollout_correction."
# per option: the threshold as written, and the (lower, upper) it means (k1: ratio bounds; k2/k3:
# None and the divergence bound); bounds chosen so that the data below keeps some and rejects some
RS = {"token_k1": ("0.7_1.3", 0.7, 1.3), "token_k2": ("0.05", None, 0.05), "token_k3": ("0.05", None, 0.05),
      "seq_sum_k1": ("2", 0.5, 2.0), "seq_sum_k2": ("0.3", None, 0.3), "seq_sum_k3": ("0.3", None, 0.3),
      "seq_mean_k1": ("0.8_1.2", 0.8, 1.2), "seq_mean_k2": ("0.08", None, 0.08), "seq_mean_k3": ("0.08", None, 0.08),
      "seq_max_k2": ("0.15", None, 0.15), "seq_max_k3": ("0.15", None, 0.15)}


def _rs_data(seed):
    old, rollout, mask = _data(seed, B=10, T=6)
    mask[5, 1] = 1
    rollout[5, 1] = old[5, 1] - 40.0      # a wild engine log-prob: the log-ratio is clamped to 20
    rollout[7] = old[7]                    # the engine agrees with the trainer on one sequence
    return old, rollout, mask


def ref_rejection(old, rollout, mask, opts):
    """Keep mask and metrics from the definitions, a loop over tokens and sequences in floats.
    opts: [(name, lower, upper)]. d = clamp(old - rollout, +-20); k1 = -d, k2 = d^2/2,
    k3 = e^d - 1 - d; token options test each token, seq_sum/mean/max the sequence's sum/mean/max;
    k1 is kept within [log lower, log upper], k2/k3 up to upper; every option must pass."""
    B, T = mask.shape
    rows = [[t for t in range(T) if mask[i, t] > 0] for i in range(B)]
    toks = [(i, t) for i in range(B) for t in rows[i]]
    seqs = [i for i in range(B) if rows[i]]

    def div(k, i, t):
        x = min(max(float(old[i, t] - rollout[i, t]), -20.0), 20.0)
        return -x if k == 1 else 0.5 * x * x if k == 2 else math.exp(x) - 1.0 - x

    keep = [[1.0 if mask[i, t] > 0 else 0.0 for t in range(T)] for i in range(B)]
    metrics = {}
    for name, lower, upper in opts:
        k, agg = int(name[-1]), "token" if name.startswith("token") else name.split("_")[1]
        lo, hi = (math.log(lower), math.log(upper)) if k == 1 else (None, upper)
        tok = {(i, t): div(k, i, t) for i, t in toks}
        if agg == "token":
            stat = tok
            seqval = {i: sum(tok[i, t] for t in rows[i]) / len(rows[i]) for i in seqs}
            units = [tok[it] for it in toks]
        else:
            f = {"sum": sum, "mean": lambda xs: sum(xs) / len(xs), "max": max}[agg]
            seqval = {i: f([tok[i, t] for t in rows[i]]) for i in seqs}
            stat = {(i, t): seqval[i] for i, t in toks}
            units = [seqval[i] for i in seqs]
        rejected = {(i, t) for i, t in toks if not ((lo is None or stat[i, t] >= lo) and stat[i, t] <= hi)}
        for i, t in rejected:
            keep[i][t] = 0.0
        clamped = [min(max(stat[it], 0.0 if lo is None else lo), hi) for it in toks]
        cm = sum(clamped) / len(clamped)
        sv = [seqval[i] for i in seqs]
        svm = sum(sv) / len(sv)
        p = f"rollout_corr/rollout_rs_{name}_"
        metrics.update({
            p + "mean": sum(stat[it] for it in toks) / len(toks), p + "max": max(units), p + "min": min(units),
            p + "fraction_high": sum(u > hi for u in units) / len(units),
            p + "fraction_low": 0.0 if lo is None else sum(u < lo for u in units) / len(units),
            p + "std": math.sqrt(sum((c - cm) ** 2 for c in clamped) / len(clamped)),
            p + "seq_mean": svm, p + "seq_std": math.sqrt(sum((v - svm) ** 2 for v in sv) / (len(sv) - 1)),
            p + "seq_max": max(sv), p + "seq_min": min(sv), p + "seq_max_deviation": max(abs(v) for v in sv),
            p + "seq_fraction_high": sum(v > hi for v in sv) / len(sv),
            p + "masked_fraction": len(rejected) / len(toks),
            p + "seq_masked_fraction": len({i for i, _ in rejected}) / len(seqs)})
        if lo is not None:
            metrics[p + "seq_fraction_low"] = sum(v < lo for v in sv) / len(sv)
    out = [(i, t) for i, t in toks if keep[i][t] == 0.0]
    metrics["rollout_corr/rollout_rs_masked_fraction"] = len(out) / len(toks)
    metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = len({i for i, _ in out}) / len(seqs)
    return torch.tensor(keep, dtype=DT), metrics


def _assert_metrics(got, want):
    assert set(got) == set(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), k


@pytest.mark.parametrize("option", sorted(RS))
@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_mask_equals_the_loop(option, seed):
    old, rollout, mask = _rs_data(seed)
    spec, lower, upper = RS[option]
    keep, metrics = algo.rollout_correction.rollout_rejection_mask(old, rollout, mask, rs=option, threshold=spec)
    want, ref = ref_rejection(old, rollout, mask, [(option, lower, upper)])
    assert keep.dtype == mask.dtype and not keep.requires_grad
    assert torch.equal(keep, want)
    assert 0 < keep.sum() < mask.sum()        # the data exercises both sides
    assert (keep[7] == mask[7]).all()          # the engine agreeing with the trainer: nothing rejected
    if not option.startswith("token"):         # a sequence criterion keeps or drops whole sequences
        assert all(keep[i].sum() in (0, mask[i].sum()) for i in range(len(mask)))
    _assert_metrics(metrics, ref)


def test_chained_options_must_all_pass():
    old, rollout, mask = _rs_data(2)
    names = ["token_k1", "seq_mean_k3", "seq_max_k2"]
    keep, metrics = algo.rollout_correction.rollout_rejection_mask(
        old, rollout, mask, rs=" token_k1, seq_mean_k3 ,seq_max_k2,token_k1", threshold="0.7_1.3, 0.08,0.15")
    want, ref = ref_rejection(old, rollout, mask, [(n, *RS[n][1:]) for n in names])
    assert torch.equal(keep, want)
    alone = [algo.rollout_correction.rollout_rejection_mask(old, rollout, mask, rs=n, threshold=RS[n][0]) for n in names]
    assert torch.equal(keep, alone[0][0] * alone[1][0] * alone[2][0])
    assert 0 < keep.sum() < max(float(a[0].sum()) for a in alone)   # a token one option keeps, another rejects
    _assert_metrics(metrics, ref)
    for _, m in alone:     # each option's metrics are its own
        assert all(metrics[k] == pytest.approx(v, rel=1e-12, abs=1e-15) for k, v in m.items()
                   if not k.startswith("rollout_corr/rollout_rs_masked") and "rs_seq_masked" not in k)
    # one threshold for every option
    keep, _ = algo.rollout_correction.rollout_rejection_mask(old, rollout, mask, rs="token_k2,seq_sum_k3", threshold=0.1)
    want, _ = ref_rejection(old, rollout, mask, [("token_k2", None, 0.1), ("seq_sum_k3", None, 0.1)])
    assert torch.equal(keep, want)


def test_k1_bounds_are_on_the_rollout_to_trainer_ratio():
    """verl's k1 statistic is -log(pi_old / pi_rollout): 'lower_upper' bounds pi_rollout / pi_old
    (one number u: 1/u to u). Tokens with known ratios q = pi_rollout / pi_old."""
    q = [0.5, 0.65, 0.75, 1.0, 1.2, 1.3, 1.5]
    old = torch.full((1, len(q)), math.log(0.4), dtype=DT)
    rollout = old + torch.log(torch.tensor([q], dtype=DT))
    mask = torch.ones_like(old)
    rrm = algo.rollout_correction.rollout_rejection_mask
    keep, m = rrm(old, rollout, mask, rs="token_k1", threshold="0.7_1.25")
    assert [x for x, k in zip(q, keep[0].tolist()) if k] == [0.75, 1.0, 1.2]
    assert m["rollout_corr/rollout_rs_token_k1_fraction_high"] == pytest.approx(2 / 7)   # q > 1.25
    assert m["rollout_corr/rollout_rs_token_k1_fraction_low"] == pytest.approx(2 / 7)    # q < 0.7
    keep, _ = rrm(old, rollout, mask, rs="token_k1", threshold=1.25)                      # 0.8 to 1.25
    assert [x for x, k in zip(q, keep[0].tolist()) if k] == [1.0, 1.2]
    # a sequence: the product of its ratios (seq_sum) or their geometric mean (seq_mean)
    keep, _ = rrm(old, rollout, mask, rs="seq_sum_k1", threshold="0.5_0.6")   # prod q = 0.5704
    assert keep.sum() == 7
    keep, _ = rrm(old, rollout, mask, rs="seq_sum_k1", threshold="0.6_10")
    assert keep.sum() == 0
    keep, _ = rrm(old, rollout, mask, rs="seq_mean_k1", threshold="0.9_0.95")  # geometric mean 0.9229
    assert keep.sum() == 7
    keep, _ = rrm(old, rollout, mask, rs="seq_mean_k1", threshold="0.93_1.2")
    assert keep.sum() == 0


def test_empty_and_all_masked_batches():
    """A rank's share may be empty or all padding: nothing kept, every metric 0."""
    rrm = algo.rollout_correction.rollout_rejection_mask
    for B, T in ((0, 4), (3, 4)):
        z = torch.zeros(B, T, dtype=DT)
        keep, m = rrm(z, z, z, rs="token_k1,seq_max_k3", threshold="0.5_2.0,0.1")
        assert keep.shape == (B, T) and keep.sum() == 0
        assert len(m) == 15 + 14 + 2 and all(v == 0.0 for v in m.values()), m   # k1: seq_fraction_low too
    keep, _ = rrm(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), rs="token_k3", threshold=1)
    assert keep.dtype == torch.float32 and keep.sum() == 6


@pytest.mark.parametrize("rs, threshold, key, message", [
    ("token_k4", 1.0, "rollout_rs", "unknown option 'token_k4'; supported: token_k1, token_k2, token_k3, seq_sum_k1"),
    ("seq_max_k1", 1.0, "rollout_rs", "unknown option 'seq_max_k1'"),
    (None, 1.0, "rollout_rs", "must name one or more options (comma-separated) of token_k1"),
    (" , ", 1.0, "rollout_rs", "must name one or more options"),
    ("token_k1", None, "rollout_rs_threshold", "is required with rollout_rs=token_k1 (no default, as verl)"),
    ("token_k2", True, "rollout_rs_threshold", "must be a number or a string of comma-separated entries, got True"),
    ("token_k2,token_k3", "0.1,0.2,0.3", "rollout_rs_threshold",
     "has 3 entries for 2 options (token_k2, token_k3): give one for all or one per option"),
    ("token_k2", "0.5_2", "rollout_rs_threshold", "entry '0.5_2' for token_k2: a k2/k3 option takes one upper bound"),
    ("token_k1", "0.5_2_3", "rollout_rs_threshold", "entry '0.5_2_3' for token_k1: a k1 option takes ratio bounds"),
    ("token_k1", "x_2", "rollout_rs_threshold", "entry 'x_2' for token_k1: 'x' is not a number"),
    ("seq_sum_k1", "0.5", "rollout_rs_threshold",
     "entry '0.5' for seq_sum_k1: lower bound 2 above upper bound 0.5 keeps nothing (one number u means lower 1/u"),
    ("seq_mean_k1", "1.2_1.1", "rollout_rs_threshold", "lower bound 1.2 above upper bound 1.1 keeps nothing"),
    ("seq_mean_k3", "0", "rollout_rs_threshold", "entry '0' for seq_mean_k3: bounds must be finite and > 0, got 0"),
    ("seq_mean_k3", -0.1, "rollout_rs_threshold", "bounds must be finite and > 0, got -0.1"),
    ("seq_mean_k3", "inf", "rollout_rs_threshold", "bounds must be finite and > 0, got inf"),
    ("token_k1", "0_2", "rollout_rs_threshold", "bounds must be finite and > 0, got 0"),
])
def test_bad_options_and_thresholds_are_named(rs, threshold, key, message):
    rc = algo.rollout_correction
    with pytest.raises(rc.RolloutRSError) as e:
        rc.parse_rollout_rs(rs, threshold)
    assert isinstance(e.value, ValueError) and e.value.key == RC + key and message in e.value.reason
    assert str(e.value) == f"{RC + key}: {e.value.reason}"
    old, rollout, mask = _data()
    with pytest.raises(ValueError, match=RC + key):
        rc.rollout_rejection_mask(old, rollout, mask, rs=rs, threshold=threshold)


def test_parse_gives_the_bounds():
    p = algo.rollout_correction.parse_rollout_rs
    opts = p("token_k1,seq_sum_k1,seq_max_k3,token_k1", "0.5_2.0, 4 ,1e-3")
    assert [(o.name, o.lower, o.upper) for o in opts] == [("token_k1", 0.5, 2.0), ("seq_sum_k1", 0.25, 4.0),
                                                          ("seq_max_k3", None, 1e-3)]
    assert [(o.name, o.lower, o.upper) for o in p("seq_mean_k2", 2)] == [("seq_mean_k2", None, 2.0)]
    assert opts[0].stat_bounds() == (math.log(0.5), math.log(2.0)) and opts[2].stat_bounds() == (None, 1e-3)


def test_rejection_mask_shapes_must_agree():
    old, rollout, mask = _data()
    with pytest.raises(ValueError, match=r"old_log_prob \(6, 5\), rollout_log_prob \(6, 4\) and response_mask \(6, 5\)"):
        algo.rollout_correction.rollout_rejection_mask(old, rollout[:, :4], mask, rs="token_k2", threshold=1)


# -- bypass mode's REINFORCE loss (loss_type=reinforce) ----------------------------------------------

def ref_reinforce(old, lp, adv, mask, level, C):
    """-A w logp token-mean, w a number: min(exp(lp - old), C) per token, or min(exp(sum over the
    sequence), C) on its tokens; w = 1 without a level."""
    total, n, cut = 0.0, 0, 0
    for i in range(mask.shape[0]):
        ts = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
        seq = math.exp(sum(float(lp[i, t] - old[i, t]) for t in ts))
        for t in ts:
            r = math.exp(float(lp[i, t] - old[i, t])) if level == "token" else seq
            w = 1.0 if level is None else min(r, C)
            cut += level is not None and r > C
            total = total - adv[i, t] * w * lp[i, t]
            n += 1
    return total / n, cut / n


@pytest.mark.parametrize("level", [None, "token", "sequence"])
def test_reinforce_equals_the_loop(level):
    old, rollout, mask = _data(4)
    g = torch.Generator().manual_seed(8)
    lp = old + torch.randn(old.shape, generator=g, dtype=DT) * 0.3
    adv = torch.randn(old.shape, generator=g, dtype=DT)
    a = lp.clone().requires_grad_(True)
    loss, m = algo.compute_policy_loss("reinforce", old, a, adv, mask, rollout_is=level, rollout_is_threshold=1.2)
    ga, = torch.autograd.grad(loss, a)
    b = lp.clone().requires_grad_(True)
    ref, cut = ref_reinforce(old, b, adv, mask, level, 1.2)
    gb, = torch.autograd.grad(ref, b)
    torch.testing.assert_close(loss, ref.reshape(()), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ga, gb, atol=1e-12, rtol=1e-12)
    assert m["pg_clipfrac"].item() == pytest.approx(cut, abs=1e-12) and (cut > 0) == (level is not None)
    assert m["ppo_kl"].item() == pytest.approx(float(((old - lp) * mask).sum() / mask.sum()), abs=1e-12)
    if level is None:   # plain REINFORCE is GPG's loss
        torch.testing.assert_close(loss, algo.compute_policy_loss("gpg", old, lp, adv, mask)[0], atol=1e-15, rtol=0)


def test_reinforce_in_bypass_mode():
    """Bypass mode passes the engine's log-probs as old_log_prob: the weights are
    min(pi_theta / pi_rollout, C) from the current policy; at pi_theta = pi_rollout they are 1 and
    the gradient is -A / N; a sequence's weight is shared by its tokens and truncation caps it."""
    old, rollout, mask = _data(5)
    g = torch.Generator().manual_seed(9)
    adv = torch.randn(old.shape, generator=g, dtype=DT)
    x = rollout.clone().requires_grad_(True)
    loss, m = algo.compute_policy_loss("reinforce", rollout, x, adv, mask, rollout_is="sequence")
    gx, = torch.autograd.grad(loss, x)
    torch.testing.assert_close(gx, -adv * mask / mask.sum(), atol=1e-15, rtol=0)
    assert m["pg_clipfrac"].item() == 0
    x = old.clone().requires_grad_(True)   # the trainer's policy has moved from the engine's
    loss, m = algo.compute_policy_loss("reinforce", rollout, x, adv, mask, rollout_is="sequence", rollout_is_threshold=1.5)
    gx, = torch.autograd.grad(loss, x)
    w = torch.exp(((old - rollout) * mask).sum(-1, keepdim=True)).clamp(max=1.5)
    torch.testing.assert_close(gx, -adv * w * mask / mask.sum(), atol=1e-15, rtol=1e-12)
    assert (w == 1.5).any() and (w < 1.5).any()
    # with the trainer's weights as well (rollout_is_weights): both multiply
    ext = torch.full_like(mask, 0.5)
    loss2, _ = algo.compute_policy_loss("reinforce", rollout, old, adv, mask, rollout_is="sequence",
                                        rollout_is_threshold=1.5, rollout_is_weights=ext)
    torch.testing.assert_close(loss2, 0.5 * loss.detach(), atol=1e-15, rtol=1e-12)
    with pytest.raises(ValueError, match="rollout_is must be one of token, sequence, got 'seq'"):
        algo.compute_policy_loss("reinforce", rollout, old, adv, mask, rollout_is="seq")
    with pytest.raises(ValueError, match="rollout_is_threshold must be > 0, got 0"):
        algo.compute_policy_loss("reinforce", rollout, old, adv, mask, rollout_is="token", rollout_is_threshold=0)
