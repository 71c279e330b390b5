"""benchmarks/pg_variance.py's yardsticks: the variance algebra against a direct computation, the
log-probs and values read at the right positions, GRPO's advantage as the critic-free part, and the
oracle's settled credit (else its figures mean nothing)."""
import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("pg_variance_bench", REPO / "benchmarks" / "pg_variance.py")
pgv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pgv)

from megappo import algo  # noqa: E402


def _direct_ratio(go, gd, beta):
    def var(g):
        return float(((g - g.mean(0)) ** 2).sum() / (g.shape[0] - 1))
    return var(go + beta * gd) / var(go)


def test_variance_ratios_equal_a_direct_computation_and_beta_star_is_the_minimum():
    g = torch.Generator().manual_seed(0)
    K, D = 30, 40
    noise = torch.randn(K, D, generator=g, dtype=torch.float64)
    go = 0.3 + noise                                                    # a mean gradient plus noise
    gd = -0.6 * noise + 0.5 * torch.randn(K, D, generator=g, dtype=torch.float64)   # a partial control variate
    res = pgv._variances(go, gd, 0.25, "critic")
    assert res["critic_V_ratio_at_1"] == pytest.approx(_direct_ratio(go, gd, 1.0), rel=1e-9)
    assert res["critic_V_ratio_at_run_beta"] == pytest.approx(_direct_ratio(go, gd, 0.25), rel=1e-9)
    b = res["critic_beta_star"]
    assert res["critic_V_ratio_at_beta_star"] == pytest.approx(_direct_ratio(go, gd, b), rel=1e-9)
    assert all(_direct_ratio(go, gd, b) < _direct_ratio(go, gd, b + e) for e in (-0.05, 0.05))
    assert 0.9 < b < 1.4 and res["critic_corr"] < -0.5      # -cov/var of this construction: 0.6 / (0.36 + 0.25)
    # a correction independent of the noise buys nothing: its best weight is ~0
    none = pgv._variances(go, 0.5 * torch.randn(K, D, generator=g, dtype=torch.float64), None, "oracle")
    assert abs(none["oracle_beta_star"]) < 0.3 and "critic_V_ratio_at_run_beta" not in none


def _tiny(kind):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForTokenClassification
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64, num_labels=1)
    return (Qwen3ForCausalLM if kind == "policy" else Qwen3ForTokenClassification)(cfg).eval()


def _batch():
    """Two sequences of different prompt lengths, right-padded with 0: (ids, prompt lengths, mask)."""
    seqs = [([5, 6, 7, 8], [20, 21, 22]), ([9, 10], [23, 24, 25])]
    T = 3
    L = max(len(p) + len(r) for p, r in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, (p, r) in enumerate(seqs):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
    return ids, torch.tensor([len(p) for p, _ in seqs]), torch.ones(len(seqs), T), seqs


def test_response_logp_scores_each_response_token_as_a_per_sequence_loop_does():
    policy = _tiny("policy")
    ids, plen, mask, seqs = _batch()
    logp = pgv.response_logp(policy, ids, pgv.response_positions(plen, mask.shape[1]))
    for i, (p, r) in enumerate(seqs):
        full = torch.tensor([p + r])
        lp = torch.log_softmax(policy(full).logits[0].float(), -1)
        want = torch.stack([lp[len(p) - 1 + t, r[t]] for t in range(len(r))])
        torch.testing.assert_close(logp[i], want, rtol=1e-5, atol=1e-5)


def test_critic_values_are_read_before_each_response_token():
    critic = _tiny("critic")
    ids, plen, mask, seqs = _batch()
    pos = pgv.response_positions(plen, mask.shape[1])
    v = pgv.critic_values(critic, ids, pos, mask)
    full = critic(torch.tensor([seqs[1][0] + seqs[1][1]])).logits[0, :, 0]
    torch.testing.assert_close(v[1], full[1:4].float())           # V(s_0) at the last prompt token
    changed = ids.clone()
    changed[:, plen[0] + 1] = 30                                  # response token 1 of the first sequence
    w = pgv.critic_values(critic, changed, pos, mask)
    assert torch.equal(w[0, :2], v[0, :2]) and not torch.equal(w[0, 2], v[0, 2])


def test_critic_free_part_is_grpos_advantage_and_the_correction_is_centred_per_position():
    g = torch.Generator().manual_seed(1)
    group = torch.arange(4).repeat_interleave(6)
    mask = torch.ones(24, 5)
    mask[3, 3:] = 0
    rewards = torch.zeros(24, 5)
    score = torch.randint(0, 4, (24,), generator=g).float() / 4
    rewards[torch.arange(24), mask.sum(1).long() - 1] = score
    values = torch.rand(24, 5, generator=g) * mask
    o = pgv.centred(rewards, torch.zeros_like(values), mask, group)
    grpo, _ = algo.compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, group_index=group)
    torch.testing.assert_close(o.float(), grpo, rtol=1e-5, atol=1e-6)
    d = (pgv.centred(rewards, values, mask, group) - o) * mask
    assert d.abs().max() > 0.01
    for k in range(4):
        live = group == k
        if score[live].std() > 0:   # a group that scored alike gets 0 throughout
            torch.testing.assert_close(d[live].sum(0), torch.zeros(5, dtype=torch.float64), atol=1e-6, rtol=0)


class _WordTok:
    all_special_ids = [0, 1, 2, 3]

    def __len__(self):
        return 42   # ids 42.. are the model's padded vocabulary: no word

    def convert_tokens_to_ids(self, w):
        return int(w[1:])   # "t17" -> 17: content words are ids 10..41


@pytest.mark.parametrize("task", ["pick_first", "copy"])
def test_oracle_values_count_the_right_words_before_each_token(task):
    prompt = [1, 2, 17, 12, 33, 40, 11, 19, 25, 30, 3]      # specials 1-3 around 8 content words
    if task == "pick_first":
        resp = [17, 5, 17, 17, 20, 0, 0, 0]                  # right at 0, 2, 3
    else:
        resp = [17, 12, 9, 40, 20, 0, 0, 0]                  # right at 0, 1, 3 (33 missed at 2)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    v = pgv.oracle_values(task, _WordTok(), [prompt], torch.tensor([resp]), mask)
    before = [0, 1, 1, 2, 3] if task == "pick_first" else [0, 1, 2, 2, 3]
    want = torch.tensor([before + [0, 0, 0]], dtype=torch.float32) / 8
    torch.testing.assert_close(v, want)


def test_echo_oracle_knows_the_outcome_once_the_first_word_is_out():
    """The score is settled after the first response token that is a word; a special token or an
    id past the tokenizer's vocabulary (both decode to nothing) leaves it open: the values stay
    functions of the tokens before t."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.float32)
    response = torch.tensor([[20, 21, 22, 0], [2, 20, 21, 22], [23, 24, 25, 26], [50, 3, 20, 21]])
    v = pgv.oracle_values("echo", _WordTok(), [[1]] * 4, response, mask, torch.tensor([1.0, 1.0, 0.0, 1.0]))
    torch.testing.assert_close(v, torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1]],
                                               dtype=torch.float32))


def test_probe_features_are_the_last_hidden_state_before_each_response_token():
    policy = _tiny("policy")
    ids, plen, mask, seqs = _batch()
    f = pgv.features(policy, ids, pgv.response_positions(plen, mask.shape[1]))
    p, r = seqs[1]
    h = policy(torch.tensor([p + r]), output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(f[1], h[len(p) - 1:len(p) - 1 + len(r)].float(), rtol=1e-5, atol=1e-5)
    x = pgv.probe_inputs(f)
    assert x.shape == (2, 3, 32 + 3 + 1)
    assert torch.equal(x[:, :, 32:35], torch.eye(3, dtype=torch.float64).expand(2, 3, 3)) and bool((x[..., -1] == 1).all())


def test_fit_probe_is_least_squares_on_the_masked_tokens():
    """Without the ridge, the weights of two batches' masked tokens equal lstsq on their rows
    stacked (the outcome of each sample repeated on each of its tokens); unmasked rows count for nothing."""
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(6, 4, 5, generator=g, dtype=torch.float64) for _ in range(2)]
    ys = [torch.randn(6, generator=g) for _ in range(2)]
    ms = [torch.ones(6, 4), torch.ones(6, 4)]
    ms[1][2:, 3] = 0
    w = pgv.fit_probe(xs, ys, ms, ridge=0.0)
    rows = torch.cat([x[m.bool()] for x, m in zip(xs, ms)])
    tgt = torch.cat([y.double()[:, None].expand(-1, 4)[m.bool()] for y, m in zip(ys, ms)])
    torch.testing.assert_close(w, torch.linalg.lstsq(rows, tgt[:, None]).solution[:, 0], rtol=1e-8, atol=1e-10)
    xs[1][2:, 3] = 1e3                                          # garbage where the mask is 0
    torch.testing.assert_close(pgv.fit_probe(xs, ys, ms, ridge=0.0), w, rtol=1e-8, atol=1e-10)
