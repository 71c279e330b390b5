"""Training Qwen3-MoE under TP x EP and PP x EP, on 4 processes per layout, each
against transformers computing the same thing another way:

- one backward through megatron's schedule, DDP and finalize_model_grads: every parameter's
  reduced gradient, gathered to HF names by the exporter, equals transformers' gradient of the
  same loss over every data-parallel rank's batch (experts from the EP rank holding them);
- the actor's router metrics after update_policy with a load-balancing loss and a z-loss: the
  unweighted losses equal megatron's formulas evaluated on transformers' router logits of the
  same micro-batches, and the expert load equals the top-k counts of those logits;
- the critic on the MoE backbone: its values equal transformers' Qwen3MoeForTokenClassification
  holding the same weights, and an update runs and reports the router's load.
"""
import os
import sys

import pytest
import torch

from harness import raise_if_failed, spawn_each
from mcore import random_batch

pytestmark = pytest.mark.distributed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import VOCAB, save_tiny_model  # noqa: E402

AUX, Z = 0.01, 0.001


def _build(path, tp, pp, ep, value_head=False, moe=None):
    from megappo.convert import load_hf_weights
    from megappo.layout import RankCoords
    from megappo.models import MoEOptions, build_model, describe, load_hf_config, transformer_config

    info = describe(load_hf_config(path), tp=tp, value_head=value_head)
    cfg = transformer_config(info, tp=tp, pp=pp, sequence_parallel=tp > 1, cpu=True, ep=ep, moe=moe or MoEOptions())
    chunks = build_model(info, cfg, value_head=value_head, value_head_std=0.1)
    load_hf_weights(chunks, path, info.desc, RankCoords.from_megatron())
    return info, cfg, chunks


def _hf_grads_by_name(hf):
    """transformers' gradients under the exporter's names (per-expert tensors from the fused ones)."""
    out = {}
    for name, p in hf.named_parameters():
        if p.grad is None:
            continue
        if name.endswith("experts.gate_up_proj"):
            base, inter = name[:-len("gate_up_proj")], p.shape[1] // 2
            for e in range(p.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = p.grad[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = p.grad[e, inter:]
        elif name.endswith("experts.down_proj"):
            for e in range(p.shape[0]):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = p.grad[e]
        else:
            out[name] = p.grad
    return out


def _gradients(path, tp, pp, ep, info, cfg, chunks, batches):
    """One backward of sum(-log p) (each DP rank on its batch) through DDP; the reduced gradients
    (main_grad) placed in the weights and exported against transformers' over all batches."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from transformers import AutoModelForCausalLM

    from megappo.convert import iter_hf_tensors

    from megappo.layout import RankCoords
    from megappo.distributed import log_probs_from_logits
    from mcore import run_schedule

    dp = ps.get_data_parallel_world_size()
    ddp = [DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=False,
                                                                      grad_reduce_in_fp32=True), c) for c in chunks]
    cfg.finalize_model_grads_func = finalize_model_grads
    ids = batches[ps.get_data_parallel_rank()]

    def loss(output, ids):   # x dp: DDP averages over DP, the reference sums over every rank's batch
        lp = log_probs_from_logits(output[:, :-1], ids[:, 1:], ps.get_tensor_model_parallel_group(),
                                   vocab_size=info.desc.vocab_size)
        return -lp.sum() * dp, {}

    run_schedule(ddp, [ids], loss, forward_only=False)
    with torch.no_grad():
        for c in ddp:
            for p in c.module.parameters():
                p.copy_(p.main_grad)
    got = dict(iter_hf_tensors(chunks, info.desc, RankCoords.from_megatron()))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for b in batches:
        lp = torch.log_softmax(hf(b).logits[:, :-1].float(), -1).gather(-1, b[:, 1:, None])[..., 0]
        (-lp.sum()).backward()
    ref = _hf_grads_by_name(hf)
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))[:6]
    worst = max((got[n] - ref[n]).abs().max().item() for n in ref)
    scale = max(g.abs().max().item() for g in ref.values())
    assert worst < 1e-5 * max(1.0, scale), f"TP{tp} PP{pp} EP{ep}: |megatron - transformers| grad {worst} (scale {scale})"
    if dist.get_rank() == 0:
        print(f"TP{tp} PP{pp} EP{ep} gradients: worst |diff| {worst:.2e}, largest grad {scale:.2f}", flush=True)


def _router_reference(hf, micro_batches, topk, num_experts):
    """megatron's unweighted load-balancing loss (E x sum_i f_i P_i per layer and micro-batch)
    and z-loss (mean logsumexp^2), averaged over micro-batches and MoE layers, and the top-k
    counts per layer, from transformers' router logits."""
    aux, z, counts = [], [], None
    for ids in micro_batches:
        with torch.no_grad():
            logits = hf(ids, output_router_logits=True).router_logits
        if counts is None:
            counts = torch.zeros(len(logits), num_experts, dtype=torch.float64)
        for layer, lg in enumerate(logits):
            lg = lg.float()
            p = torch.softmax(lg, -1)
            top = torch.zeros_like(p).scatter(1, p.topk(topk, -1).indices, 1.0)
            T = lg.shape[0]
            aux.append(num_experts * ((top.sum(0) / (T * topk)) * (p.sum(0) / T)).sum().item())
            z.append((torch.logsumexp(lg, -1) ** 2).mean().item())
            counts[layer] += top.sum(0).double()
    return sum(aux) / len(aux), sum(z) / len(z), counts


def _router_metrics(path, tp, pp, ep):
    """update_policy with both router losses on: its metrics against _router_reference."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from megappo.models import MoEOptions
    from megappo.workers import Actor
    from megappo.workers.megatron_worker import _pad_seq

    info, cfg, chunks = _build(path, tp, pp, ep, moe=MoEOptions(aux_loss_coeff=AUX, z_loss_coeff=Z))
    actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=1e-4, use_distributed_optimizer=True)
    # equal lengths (6 + 5 tokens): each micro-batch is its token ids padded to a multiple of TP
    batch = random_batch(4, 20 + ps.get_data_parallel_rank(), (6, 7), (5, 6), VOCAB)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    micro = [_pad_seq(batch.input_ids[i:i + 2], tp, actor.pad_token_id) for i in (0, 2)]
    aux, z, counts = _router_reference(hf, micro, info.desc.moe_topk, info.desc.num_experts)
    batch.old_log_prob = actor.compute_log_prob(batch, micro_batch_size=2)   # forward only: records nothing
    m = actor.update_policy(batch, mini_batch_size=4, micro_batch_size=2)
    ref = torch.tensor([aux, z], dtype=torch.float64)
    dist.all_reduce(ref)
    ref /= dist.get_world_size()                       # DP ranks' means (equal across TP and PP)
    dist.all_reduce(counts)
    counts /= tp * pp                                  # each DP rank's tokens counted once
    ratio = counts / counts.mean(-1, keepdim=True)
    want = dict(moe_aux_loss=ref[0].item(), moe_z_loss=ref[1].item(),
                moe_expert_load_max=ratio.max(-1).values.mean().item(), moe_expert_load_min=ratio.min(-1).values.mean().item())
    for k, v in want.items():
        got = m[f"actor/{k}"]
        assert abs(got - v) <= 1e-5 * max(1.0, abs(v)), (f"TP{tp} PP{pp} EP{ep}", k, got, v)
    assert want["moe_expert_load_max"] > 1.0 > want["moe_expert_load_min"]   # random weights: not balanced
    if dist.get_rank() == 0:
        print(f"TP{tp} PP{pp} EP{ep} router metrics: " + ", ".join(f"{k} {m['actor/' + k]:.5f}" for k in want), flush=True)


def _critic(path, tp, pp, ep):
    """Values of the MoE critic equal transformers' token-classification model of its weights."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig, AutoModelForTokenClassification

    from megappo.convert import iter_hf_tensors

    from megappo.layout import RankCoords
    from megappo.workers import Critic

    info, cfg, chunks = _build(path, tp, pp, ep, value_head=True)
    sd = dict(iter_hf_tensors(chunks, info.desc, RankCoords.from_megatron()))
    # on disk with per-expert names, as the exporter writes them: transformers fuses them on load
    from safetensors.torch import save_file

    folder = os.path.join(os.path.dirname(path), f"critic_rank{dist.get_rank()}")
    conf = AutoConfig.from_pretrained(path, num_labels=1)
    conf.architectures = ["Qwen3MoeForTokenClassification"]
    conf.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(folder, "model.safetensors"))
    hf, load = AutoModelForTokenClassification.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not load["missing_keys"] and not load["unexpected_keys"], load
    critic = Critic(chunks, cfg, lr=1e-3)
    batch = random_batch(4, 30 + ps.get_data_parallel_rank(), (4, 8), (3, 7), VOCAB)
    values = critic.compute_values(batch, micro_batch_size=2)
    with torch.no_grad():
        full = hf(batch.input_ids).logits[..., 0]
    # the value of response token t is read at the position before it (the critic's convention)
    ref = full[:, :-1].gather(1, batch.response_positions.clamp(max=full.shape[1] - 2))
    mask = batch.response_mask.bool()
    diff = (values - ref).abs()[mask].max().item()
    assert diff < 1e-5, f"TP{tp} PP{pp} EP{ep}: |critic - transformers| value {diff}"
    batch.values, batch.returns = values, values + 1.0
    m = critic.update_critic(batch, mini_batch_size=4, micro_batch_size=2)
    assert torch.isfinite(torch.tensor(m["critic/vf_loss"])) and m["critic/moe_expert_load_max"] >= 1.0
    assert "critic/moe_aux_loss" not in m          # no load-balancing loss configured for it
    if dist.get_rank() == 0:
        print(f"TP{tp} PP{pp} EP{ep} critic: |values - transformers| {diff:.2e}", flush=True)


def _worker(rank, world, path, tp, pp, ep):
    from megappo import megatron_cpu

    megatron_cpu.install()
    from megatron.core import parallel_state as ps

    from megappo.models import initialize_parallel

    initialize_parallel(tp, pp, ep=ep, seed=3)
    info, cfg, chunks = _build(path, tp, pp, ep)
    dp = ps.get_data_parallel_world_size()
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(3, VOCAB, (2, 16), generator=g) for _ in range(dp)]
    _gradients(path, tp, pp, ep, info, cfg, chunks, batches)
    _router_metrics(path, tp, pp, ep)
    _critic(path, tp, pp, ep)


LAYOUTS = [(2, 1, 2), (1, 2, 2)]


@pytest.fixture(scope="module")
def world_of_4(tmp_path_factory):
    """Both layouts in one spawned world of 4 (each sets up its own parallel state)."""
    root = tmp_path_factory.mktemp("moe_training")
    save_tiny_model("qwen3_moe", root / "moe")
    errors = {layout: str(root / f"{'_'.join(map(str, layout))}.error") for layout in LAYOUTS}
    spawn_each(4, [(_worker, (str(root / "moe"), *layout), errors[layout]) for layout in LAYOUTS])
    return errors


@pytest.mark.parametrize("tp, pp, ep", LAYOUTS, ids=["TP2xEP2", "PP2xEP2"])
def test_moe_training_under_expert_parallelism(tp, pp, ep, world_of_4):
    raise_if_failed(world_of_4[(tp, pp, ep)])


def _cp_worker(rank, world, path, cp, ep, out_file, packed=False):
    """One PPO update of the MoE actor with both router losses, each sequence split over ``cp``
    context-parallel ranks and the experts over ``ep`` of them (``packed``: each micro-batch's
    sequences end to end in one row); what it reports on rank 0."""
    from megappo import megatron_cpu

    megatron_cpu.install()
    from megappo.convert import load_hf_weights
    from megappo.layout import RankCoords
    from megappo.models import (MoEOptions, build_model, describe, initialize_parallel, load_hf_config,
                                transformer_config)
    from megappo.workers import Actor

    initialize_parallel(1, 1, ep=ep, seed=3, cp=cp)
    info = describe(load_hf_config(path))
    cfg = transformer_config(info, cpu=True, ep=ep, cp=cp, moe=MoEOptions(aux_loss_coeff=AUX, z_loss_coeff=Z))
    chunks = build_model(info, cfg)
    load_hf_weights(chunks, path, info.desc, RankCoords.from_megatron())
    actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=0.5, optimizer="sgd", use_distributed_optimizer=False)
    actor.pack_sequences = packed
    # 12 tokens a sample (a multiple of 2 x CP): no padding token is routed at either layout
    batch = random_batch(4, 21, (6, 7), (6, 7), VOCAB)
    batch.old_log_prob = actor.compute_log_prob(batch, micro_batch_size=2)
    m = actor.update_policy(batch, mini_batch_size=4, micro_batch_size=2)
    after = actor.compute_log_prob(batch, micro_batch_size=2)
    if rank == 0:
        torch.save({"old": batch.old_log_prob, "after": after, "metrics": m}, out_file)


def test_moe_update_at_cp2_equals_cp1(tmp_path):
    """Context parallelism on the MoE model, with the experts on one rank and over both (EP2),
    and CP2 x EP2 with packed sequences (no token is padding at either layout, so the router sees
    the same tokens): the log-probs, the losses, the gradient norm, the router's losses and the
    expert load of one update equal those of one rank holding whole padded sequences."""
    save_tiny_model("qwen3_moe", tmp_path / "moe")
    runs = {(1, 1, False): 1, (2, 1, False): 2, (2, 2, False): 2, (2, 2, True): 2}
    for (cp, ep, packed), world in runs.items():
        spawn_each(world, [(_cp_worker, (str(tmp_path / "moe"), cp, ep, str(tmp_path / f"{cp}_{ep}_{packed}.pt"), packed),
                            str(tmp_path / f"err_{cp}_{ep}_{packed}"))])
        raise_if_failed(str(tmp_path / f"err_{cp}_{ep}_{packed}"))
    ref = torch.load(tmp_path / "1_1_False.pt")
    assert (ref["after"] - ref["old"]).abs().max() > 1e-3   # the update moved the policy
    for cp, ep, packed in ((2, 1, False), (2, 2, False), (2, 2, True)):
        got = torch.load(tmp_path / f"{cp}_{ep}_{packed}.pt")
        assert (got["old"] - ref["old"]).abs().max() < 1e-5, (cp, ep, packed)
        assert (got["after"] - ref["after"]).abs().max() < 1e-4, (cp, ep, packed)
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/moe_aux_loss", "actor/moe_z_loss",
                    "actor/moe_expert_load_max", "actor/moe_expert_load_min"):
            assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6), (cp, ep, packed, key)
