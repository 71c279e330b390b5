"""Interleaved pipeline (VPP) with token-budget micro-batches, at TP1 PP2 VPP2 (2 gloo processes).

megatron's interleaved schedule needs a multiple of PP micro-batches (at least PP); token budgets
give data-dependent counts. MegatronWorker._micro fits them (batching.fit_to_multiple): the
heaviest micro-batches are split and, with too few samples, padding micro-batches (an all-zero
response mask) follow the real ones. These tests hold that this changes nothing numerically:
- forward (log-probs, values) and one SGD step of actor and critic with budgets giving 1 and 3
  raw micro-batches equal a fixed-size split into 2;
- steps whose mini-batches need padding micro-batches (1 sample; 3 singletons) equal the same
  steps at PP2 without VPP (no fitting, no padding), losses and updated weights alike.
Two spawns (process start-up dominates: one for the forward checks, one for the training ones)
compute everything; the tests compare what they saved. A training hang in megatron's p2p fails
the spawn after HANG_S seconds instead of the harness's four minutes.
"""
import faulthandler
import os
import sys

import pytest
import torch

from harness import spawn
from megappo import algo
from mcore import build, setup, random_batch

pytestmark = pytest.mark.distributed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import VOCAB, hf_config, save_tiny_model  # noqa: E402

B = 6
FIXED = 3  # micro_batch_size of the reference split: 2 micro-batches, a multiple of PP
SGD = dict(lr=0.5, clip_grad=1.0, optimizer="sgd", use_distributed_optimizer=False)
PPO = dict(loss=algo.PolicyLossSpec(entropy_coeff=0.01, loss_agg_mode="token-mean"))
HANG_S = 120  # the whole training spawn takes ~20 s on 2 cores


def _batch():
    return random_batch(B, 11, (4, 14), (2, 12), VOCAB)


def _lengths(batch):
    return (batch.prompt_lengths + batch.response_mask.sum(-1).long()).tolist()


def _budgets(lengths):
    """Token budgets for which token_budget_groups gives 1 and 3 micro-batches."""
    from megappo.workers.batching import token_budget_groups

    one = len(lengths) * max(lengths)
    three = next(b for b in range(max(lengths), one) if len(token_budget_groups(lengths, b)) == 3)
    return one, three


def _hf(chunks, info):
    """Full HF-named tensors (layout-independent), on every rank."""
    from megappo.convert import iter_hf_tensors
    from megappo.layout import RankCoords

    return {n: t.detach().clone() for n, t in iter_hf_tensors(chunks, info.desc, RankCoords.from_megatron())}


def _local(chunks):
    return {f"{i}.{n}": p.detach().clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()}


def _workers(path, pp, vpp):
    from megappo.workers import Actor, Critic

    info, cfg, chunks = build(path, 1, pp, vpp)
    actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, **SGD)
    cinfo, ccfg, cchunks = build(path, 1, pp, vpp, value_head=True)
    critic = Critic(cchunks, ccfg, **SGD)
    return info, cinfo, actor, critic


def _padded_steps(actor, critic, batch, budget):
    """Updates whose mini-batches need padding micro-batches at VPP; the last one's log-probs."""
    out = {"pg": [], "vf": [], "grad": []}
    steps = [  # (rows, mini_batch_size, micro-batching, loss_agg_mode)
        ([0, 3], 1, dict(micro_batch_size=1), "token-mean"),         # 2 mini-batches of 1 sample: 1 + 1 padding
        ([1, 2, 4], 3, dict(micro_batch_size=1), "seq-mean-token-mean"),  # 3 singletons + 1 padding
        ([5], 1, dict(max_token_len=budget), "token-mean"),           # a token budget, 1 sample + 1 padding
    ]
    for rows, mini, mb, mode in steps:
        part = batch.select(rows)
        a = actor.update_policy(part, mini_batch_size=mini, loss=algo.PolicyLossSpec(entropy_coeff=0.01, loss_agg_mode=mode),
                                **mb)
        c = critic.update_critic(part, mini_batch_size=mini, loss=algo.ValueLossSpec(loss_agg_mode=mode), **mb)
        out["pg"] += a["actor/pg_loss_per_minibatch"]
        out["vf"] += c["critic/vf_loss_per_minibatch"]
        out["grad"].append(a["actor/grad_norm"])  # the mean over the call's mini-batches
    part = batch.select([1, 2, 4])
    out["after_lp"] = actor.compute_log_prob(part, micro_batch_size=1)
    out["after_v"] = critic.compute_values(part, micro_batch_size=1)
    return out


def _runs(batch):
    one, three = _budgets(_lengths(batch))
    return one, {"fixed": dict(micro_batch_size=FIXED), "budget1": dict(max_token_len=one),
                 "budget3": dict(max_token_len=three)}


def _forward_worker(rank, world, path, out_dir):
    """(a) log-probs and values at TP1 PP2 VPP2 with each micro-batching, from the same weights."""
    from megappo.workers import Actor, Critic
    from megappo.workers.batching import token_budget_groups

    setup(1, 2, 2)
    batch = _batch()
    lengths = _lengths(batch)
    _, runs = _runs(batch)
    res = {"raw_counts": [len(token_budget_groups(lengths, mb["max_token_len"])) for mb in list(runs.values())[1:]]}
    info, cfg, chunks = build(path, 1, 2, 2)
    actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size)
    _, ccfg, cchunks = build(path, 1, 2, 2, value_head=True)
    critic = Critic(cchunks, ccfg)
    assert len(actor.ddp_chunks) == 2  # two model chunks per rank: the interleaved schedule
    for name, mb in runs.items():
        micros, order = actor._micro(batch, mb.get("micro_batch_size"), mb.get("max_token_len"))[:2]
        res[f"{name}/micros"] = (len(micros), len(order))
        res[f"{name}/lp"] = actor.compute_log_prob(batch, **mb)
        res[f"{name}/v"] = critic.compute_values(batch, **mb)
    torch.save(res, os.path.join(out_dir, f"fwd{rank}.pt"))


def _train_worker(rank, world, path, out_dir):
    """(b) one SGD step of actor and critic with each micro-batching, from the same weights;
    (c) steps whose mini-batches need padding micro-batches at VPP, and the same at PP2."""
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    res = {}
    batch = _batch()
    one, runs = _runs(batch)

    # -- TP1 PP2 VPP2 -------------------------------------------------------------------------
    setup(1, 2, 2)
    for name, mb in runs.items():
        info, cinfo, actor, critic = _workers(path, 2, 2)
        if name == "fixed":  # old log-probs and values from the initial weights, shared by all runs
            batch.old_log_prob = actor.compute_log_prob(batch, micro_batch_size=FIXED)
            batch.values = critic.compute_values(batch, micro_batch_size=FIXED)
            res["init/actor"] = _local(actor.chunks)
        a = actor.update_policy(batch, mini_batch_size=B, **PPO, **mb)
        c = critic.update_critic(batch, mini_batch_size=B, **mb)
        res[f"{name}/pg"], res[f"{name}/vf"] = a["actor/pg_loss_per_minibatch"], c["critic/vf_loss_per_minibatch"]
        res[f"{name}/grad"] = a["actor/grad_norm"]
        res[f"{name}/actor"], res[f"{name}/critic"] = _local(actor.chunks), _local(critic.chunks)

    # (c) padding micro-batches: mini-batches of 1 sample, 3 singletons
    info, cinfo, actor, critic = _workers(path, 2, 2)
    fitted = [actor._micro(batch.select(rows), mbs, budget)[:2]
              for rows, mbs, budget in (([0], 1, None), ([1, 2, 4], 1, None), ([5], None, one))]
    res["padding_micros"] = [(len(m), len(o)) for m, o in fitted]
    res["padding_mask_sums"] = [float(m[-1].response_mask.sum()) for m, _ in fitted]
    res["vpp"] = _padded_steps(actor, critic, batch, one)
    res["vpp"]["actor"], res["vpp"]["critic"] = _hf(actor.chunks, info), _hf(critic.chunks, cinfo)

    # -- the same steps at TP1 PP2 without VPP: one chunk, no fitting, no padding ----------------
    setup(1, 2)
    info, cinfo, actor, critic = _workers(path, 2, None)
    assert len(actor.ddp_chunks) == 1
    res["pp2"] = _padded_steps(actor, critic, batch, one)
    res["pp2"]["actor"], res["pp2"]["critic"] = _hf(actor.chunks, info), _hf(critic.chunks, cinfo)
    res["init/hf"] = _hf(build(path, 1, 2)[2], info)
    torch.save(res, os.path.join(out_dir, f"train{rank}.pt"))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("vpp")
    assert hf_config("qwen3").num_hidden_layers % 4 == 0  # PP2 x VPP2 chunks of whole layers
    save_tiny_model("qwen3", root / "qwen3", seed=4)
    return str(root / "qwen3")


def _spawn(worker, path, tmp_path_factory, prefix):
    out = tmp_path_factory.mktemp(prefix)
    spawn(worker, 2, path, str(out))
    return [torch.load(out / f"{prefix}{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def forward(model_path, tmp_path_factory):
    return _spawn(_forward_worker, model_path, tmp_path_factory, "fwd")


@pytest.fixture(scope="module")
def training(model_path, tmp_path_factory):
    return _spawn(_train_worker, model_path, tmp_path_factory, "train")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_budgets_give_1_and_3_micro_batches_fitted_to_2_and_4(forward):
    for res in forward:
        assert res["raw_counts"] == [1, 3]
        assert res["fixed/micros"] == (2, B)
        assert res["budget1/micros"] == (2, B)   # the one micro-batch halved
        assert res["budget3/micros"] == (4, B)   # the heaviest of 3 halved; no padding (samples enough)


@pytest.mark.parametrize("run", ["budget1", "budget3"])
def test_forward_with_token_budget_equals_fixed_micro_batches(forward, run):
    for res in forward:
        for key in ("lp", "v"):
            diff = (res[f"{run}/{key}"] - res[f"fixed/{key}"]).abs().max().item()
            assert diff < 1e-5, f"{run} {key}: max diff {diff}"
        assert res["fixed/lp"].abs().max() > 0 and res["fixed/v"].abs().max() > 0


@pytest.mark.parametrize("run", ["budget1", "budget3"])
def test_update_with_token_budget_equals_fixed_micro_batches(training, run):
    for res in training:   # each rank: its own chunks' parameters
        for key in ("pg", "vf"):
            assert res[f"{run}/{key}"] == pytest.approx(res[f"fixed/{key}"], abs=1e-5), key
        assert res[f"{run}/grad"] == pytest.approx(res["fixed/grad"], abs=1e-5)
        for model in ("actor", "critic"):
            diff = _max_diff(res[f"{run}/{model}"], res[f"fixed/{model}"])
            assert diff < 1e-5, f"{run} {model}: max weight diff {diff}"
        assert _max_diff(res["fixed/actor"], res["init/actor"]) > 1e-3  # the step moved the weights


def test_padding_micro_batches_change_nothing(training):
    for res in training:
        # every mini-batch got padding: (micro-batches, real rows); the padding has no response
        assert res["padding_micros"] == [(2, 1), (4, 3), (2, 1)]
        assert res["padding_mask_sums"] == [0.0, 0.0, 0.0]
        vpp, ref = res["vpp"], res["pp2"]
        assert len(vpp["pg"]) == len(ref["pg"]) == 4  # 2 + 1 + 1 optimizer steps
        for key in ("pg", "vf", "grad"):
            assert vpp[key] == pytest.approx(ref[key], abs=1e-5), key
        for key in ("after_lp", "after_v"):
            diff = (vpp[key] - ref[key]).abs().max().item()
            assert diff < 1e-5, f"{key}: max diff {diff}"
        for model in ("actor", "critic"):
            diff = _max_diff(vpp[model], ref[model])
            assert diff < 1e-5, f"{model}: max weight diff {diff}"
        assert _max_diff(ref["actor"], res["init/hf"]) > 1e-3
