"""The critic's values sit on the same positions as the actor's log-probs (checked by hand through
transformers), GAE's returns line up with the response tokens, and a fresh critic (the trainer's
zero-initialised head) fits a constant return in a few updates.

Why this matters: a value head whose outputs start far larger than the early returns
drowns the GAE advantage in the critic's noise; the trainer's head therefore starts at zero, so
that at step 1 the advantage IS the (lambda-)return. tests/e2e/test_trainer.py checks that
consequence on the main job (advantage/return correlation 1 at step 1)."""
import json
import os
import sys

import pytest
import torch

from harness import spawn
from mcore import build, setup, random_batch

pytestmark = pytest.mark.distributed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import VOCAB, save_tiny_model  # noqa: E402

TARGET = 0.7


def _batch():
    return random_batch(6, 11, (4, 9), (3, 8), VOCAB)


def _worker(rank, world, root, out_file):
    setup(1, 1)
    from megappo import algo
    from megappo.config import CriticModelConfig
    from megappo.workers import Actor, Critic

    info, cfg, chunks = build(os.path.join(root, "causal"), 1, 1)
    actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=1e-3)
    _, ccfg, cchunks = build(os.path.join(root, "tokcls"), 1, 1, value_head=True)  # head loaded from score.*
    critic = Critic(cchunks, ccfg, lr=1e-3)
    batch = _batch()
    log_probs = actor.compute_log_prob(batch, micro_batch_size=2)
    values = critic.compute_values(batch, micro_batch_size=3)

    # A fresh critic as the trainer builds it (no score.* in the causal folder: the configured
    # init), fitted to a constant return on every response token.
    std = CriticModelConfig().value_head_init_std
    _, fcfg, fchunks = build(os.path.join(root, "causal"), 1, 1, value_head=True, value_head_std=std)
    fresh = Critic(fchunks, fcfg, lr=1e-3)
    # torch's multi-tensor Adam (its per-parameter loop is the default off CUDA, and slow)
    opts = getattr(fresh.optimizer, "chained_optimizers", [fresh.optimizer])
    assert all(g["foreach"] is True for o in opts for g in o.optimizer.param_groups)
    batch.returns = TARGET * batch.response_mask
    fit = []
    for _ in range(25):
        batch.values = fresh.compute_values(batch, micro_batch_size=3)
        fit.append(float(algo.masked_mean((batch.values - TARGET).abs(), batch.response_mask)))
        fresh.update_critic(batch, mini_batch_size=len(batch), micro_batch_size=3)
    torch.save({"log_probs": log_probs, "values": values, "fit": fit}, out_file)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """HF models (a causal LM and a token-classification critic on the same backbone with a
    non-trivial head), and what the megatron workers computed from them."""
    from transformers import AutoModelForTokenClassification

    root = tmp_path_factory.mktemp("align")
    causal = save_tiny_model("qwen3", root / "causal", seed=5)
    cfg = causal.config.__class__.from_dict(causal.config.to_dict())
    cfg.architectures, cfg.num_labels = ["Qwen3ForTokenClassification"], 1
    tokcls = AutoModelForTokenClassification.from_config(cfg, dtype=torch.float32).eval()
    tokcls.model.load_state_dict(causal.model.state_dict(), strict=True)
    with torch.no_grad():
        tokcls.score.weight.normal_(0, 0.3)
        tokcls.score.bias.fill_(0.25)
    tokcls.save_pretrained(str(root / "tokcls"), safe_serialization=True)
    out = str(root / "out.pt")
    spawn(_worker, 1, str(root), out)
    return {"causal": causal, "tokcls": tokcls, **torch.load(out)}


def _by_hand(run):
    """Per sample and response token t: log p(response[t]) and the value, both read from the
    position that predicts it, prompt_len + t - 1, of one transformers forward."""
    batch = _batch()
    lp, v = torch.zeros(batch.responses.shape), torch.zeros(batch.responses.shape)
    v_next = torch.zeros(batch.responses.shape)  # one position later: what a shifted critic would give
    with torch.no_grad():
        for i in range(len(batch)):
            P, n = int(batch.prompt_lengths[i]), int(batch.response_mask[i].sum())
            ids = batch.input_ids[i:i + 1, :P + n]
            logits = run["causal"](input_ids=ids).logits[0]
            values = run["tokcls"](input_ids=ids).logits[0, :, 0]
            for t in range(n):
                lp[i, t] = torch.log_softmax(logits[P + t - 1], -1)[batch.responses[i, t]]
                v[i, t] = values[P + t - 1]
                v_next[i, t] = values[P + t]
    return batch, lp, v, v_next


def test_values_sit_where_the_log_probs_are(run):
    batch, lp, v, v_next = _by_hand(run)
    mask = batch.response_mask.bool()
    assert (run["log_probs"][~mask] == 0).all() and (run["values"][~mask] == 0).all()
    assert (run["log_probs"] - lp).abs().max() < 1e-5
    assert (run["values"] - v).abs().max() < 1e-5
    # the check can tell a one-token shift apart
    assert (run["values"] - v_next)[mask].abs().max() > 1e-2


def test_gae_returns_line_up_with_the_response_tokens(run):
    """Outcome reward on the last response token: with gamma = lambda = 1 every response token's
    return is the score whatever the values; with lambda = 0 the advantage of token t is
    r_t + V(t+1) - V(t), read off the values by hand."""
    from megappo import algo

    batch, _, v, _ = _by_hand(run)
    mask = batch.response_mask
    n = mask.sum(-1).long()
    scores = torch.linspace(-1, 1, len(batch))
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(batch)), n - 1] = scores
    adv, ret = algo.gae(rewards, run["values"], mask, gamma=1.0, lam=1.0)
    assert torch.allclose(ret, scores[:, None] * mask, atol=1e-6)
    adv0, _ = algo.gae(rewards, run["values"], mask, gamma=1.0, lam=0.0)
    for i in range(len(batch)):
        for t in range(int(n[i])):
            nxt = v[i, t + 1] if t + 1 < n[i] else 0.0
            assert abs(adv0[i, t] - (rewards[i, t] + nxt - v[i, t])) < 1e-5


def test_a_fresh_critic_starts_at_zero_and_fits_a_constant_return(run):
    fit = run["fit"]
    assert fit[0] == pytest.approx(TARGET, abs=1e-6), fit  # zero head: every value is 0
    # Adam at lr 1e-3 wanders around the target once there: the mean error of the last 5 of 24
    # updates is within 10% of it (measured 3%)
    assert sum(fit[-5:]) / 5 < 0.1 * TARGET, fit
