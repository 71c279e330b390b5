"""verl's use_dist_checkpointing: a role starts from a megatron-core dist_checkpointing model
checkpoint (what megatron's dist_checkpointing.save writes for a model's sharded_state_dict,
as verl's converter_hf_to_mcore.py does) at another TP/PP than the run's; names and shapes that
do not match the model are errors naming the key and the tensors."""
import os
import sys

import pytest
import torch

from harness import raise_if_failed, spawn_each
from mcore import build, setup, token_log_probs

pytestmark = pytest.mark.distributed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import save_tiny_model  # noqa: E402

# 600 pads to 640 rows at TP1 and 768 at TP2: the checkpoint's vocabulary padding differs from the run's
VOCAB = 600
KEY = "actor_rollout_ref.actor.megatron.dist_checkpointing_path"


def _batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (2, 12), generator=g) for _ in range(2)]


def _perturb(chunks):
    """Move every weight away from the HF folder's (the same noise on every rank, so replicated
    tensors stay equal): a load that fell back to model.path would be seen."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for c in chunks:
            for _, p in sorted(c.named_parameters()):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _save_tp2(rank, world, path, ckpt, out_file, prefix):
    setup(2, 1)
    from megatron.core import dist_checkpointing

    info, _, chunks = build(path, 2, 1)
    hf = torch.cat(token_log_probs(chunks, info, _batches()))
    _perturb(chunks)
    if rank == 0:
        os.makedirs(ckpt)
    torch.distributed.barrier()
    dist_checkpointing.save(chunks[0].sharded_state_dict(prefix=prefix), ckpt)
    lp = torch.cat(token_log_probs(chunks, info, _batches()))
    if rank == 0:
        torch.save({"hf": hf, "ckpt": lp}, out_file)


def _config(path, ckpt, **over):
    from megappo.config import load_config

    a = "actor_rollout_ref.actor.megatron."
    return load_config([f"actor_rollout_ref.model.path={path}", "trainer.device=cpu", f"{a}tensor_model_parallel_size=1",
                        f"{a}pipeline_model_parallel_size=2", f"{a}use_dist_checkpointing=True",
                        f"{a}dist_checkpointing_path={ckpt}", "critic.megatron.use_dist_checkpointing=True",
                        f"critic.megatron.dist_checkpointing_path={ckpt}",
                        *[f"{k}={v}" for k, v in over.items()]])


def _load_tp1pp2(rank, world, path, ckpt, out_file):
    setup(1, 2)
    from megappo import builders

    cfg = _config(path, ckpt)
    cpu = torch.device("cpu")
    info, _, actor = builders.build_model(cfg, path, cfg.actor_rollout_ref.actor.megatron, value_head=False,
                                          device=cpu, section="actor_rollout_ref.actor.megatron")
    lp = token_log_probs(actor, info, _batches())
    if rank == 1:   # the last pipeline stage
        ref = torch.load(out_file)
        lp = torch.cat(lp)
        assert (lp - ref["ckpt"]).abs().max().item() < 1e-5
        assert (lp - ref["hf"]).abs().max().item() > 1e-2   # the weights are the checkpoint's, not model.path's
    # the critic from the same language-model checkpoint: its trunk is the actor's, its head its own
    _, _, critic = builders.build_model(cfg, path, cfg.critic.megatron, value_head=True, device=cpu,
                                        section="critic.megatron")
    actor_params = dict(actor[0].named_parameters())
    for name, p in critic[0].named_parameters():
        if name.startswith("output_layer."):
            assert torch.equal(p, torch.zeros_like(p)), name   # value_head_init_std 0: untouched
        else:
            assert torch.equal(p, actor_params[name]), name


def _start(path, ckpt, prefix="", value_head=False):
    from megappo.checkpoint import load_start_weights

    _, _, chunks = build(path, 1, 1, value_head=value_head)
    return load_start_weights(chunks, ckpt, prefix=prefix, value_head=value_head, key=KEY)


def _mismatches(rank, world, paths, ckpts):
    setup(1, 1)
    from megatron.core import dist_checkpointing

    from megappo.checkpoint import CheckpointError

    for name, prefix in (("qwen3", "model."), ("deep", ""), ("qwen3_as_llama", "")):
        os.makedirs(ckpts[name])
        _, _, chunks = build(paths[name], 1, 1)
        dist_checkpointing.save(chunks[0].sharded_state_dict(prefix=prefix), ckpts[name])
    # names: the checkpoint keeps the model under "model."
    with pytest.raises(CheckpointError, match=rf"{KEY}=.*embedding\.word_embeddings\.weight is missing from the "
                                              r"checkpoint.*dist_checkpointing_prefix='model\.'"):
        _start(paths["qwen3"], ckpts["qwen3"])
    assert _start(paths["qwen3"], ckpts["qwen3"], prefix="model.") == []
    # shapes: 6 layers in the checkpoint, 4 in the model
    with pytest.raises(CheckpointError, match=r"decoder\.layers\.\S+ is \(6, .* in the checkpoint, the model has \(4, "):
        _start(paths["qwen3"], ckpts["deep"])
    # names the model lacks: Qwen3's q/k norms offered to a Llama of the same size
    with pytest.raises(CheckpointError, match=r"it has 2 tensor\(s\) the model lacks: "
                                              r"decoder\.layers\.self_attention\.k_layernorm\.weight"):
        _start(paths["llama"], ckpts["qwen3_as_llama"])
    # a critic from a language-model checkpoint keeps its head and says so
    notes = _start(paths["qwen3"], ckpts["qwen3"], prefix="model.", value_head=True)
    assert notes == ["the checkpoint has a language-model head of shape (640, 128): the value head keeps its "
                     "initialisation"]


def _moe(path, ep):
    from megappo import megatron_cpu
    from megappo.convert import load_hf_weights
    from megappo.layout import RankCoords
    from megappo.models import build_model, describe, initialize_parallel, load_hf_config, transformer_config

    megatron_cpu.install()
    initialize_parallel(1, 1, ep=ep)
    info = describe(load_hf_config(path), tp=1)
    chunks = build_model(info, transformer_config(info, tp=1, pp=1, cpu=True, ep=ep))
    load_hf_weights(chunks, path, info.desc, RankCoords.from_megatron())
    return info, chunks


def _save_moe_ep2(rank, world, path, ckpt, out_file):
    from megatron.core import dist_checkpointing

    info, chunks = _moe(path, ep=2)
    _perturb(chunks)
    if rank == 0:
        os.makedirs(ckpt)
    torch.distributed.barrier()
    dist_checkpointing.save(chunks[0].sharded_state_dict(), ckpt)
    lp = torch.cat(token_log_probs(chunks, info, _batches()))
    if rank == 0:
        torch.save(lp, out_file)


def _load_moe_ep1(rank, world, path, ckpt, out_file):
    from megappo.checkpoint import load_start_weights

    info, chunks = _moe(path, ep=1)
    hf = torch.cat(token_log_probs(chunks, info, _batches()))
    assert load_start_weights(chunks, ckpt, key=KEY) == []
    lp, ref = torch.cat(token_log_probs(chunks, info, _batches())), torch.load(out_file)
    assert (lp - ref).abs().max().item() < 1e-5 and (hf - ref).abs().max().item() > 1e-2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this file in two spawned worlds (2 ranks, then 1): name -> its error file."""
    root = tmp_path_factory.mktemp("start")
    dense, moe = str(root / "qwen3"), str(root / "moe")
    save_tiny_model("qwen3", dense, seed=4, vocab_size=VOCAB)
    save_tiny_model("qwen3_moe", moe, seed=4, vocab_size=VOCAB)
    paths = {n: str(root / n) for n in ("qwen3_1", "deep", "llama")}
    save_tiny_model("qwen3", paths["qwen3_1"], seed=1, vocab_size=VOCAB)
    save_tiny_model("qwen3", paths["deep"], seed=1, vocab_size=VOCAB, num_hidden_layers=6)
    save_tiny_model("llama", paths["llama"], seed=1, vocab_size=VOCAB)
    paths = {"qwen3": paths["qwen3_1"], "deep": paths["deep"], "llama": paths["llama"],
             "qwen3_as_llama": paths["qwen3_1"]}
    ckpts = {n: str(root / f"ckpt_{n}") for n in ("qwen3", "deep", "qwen3_as_llama")}
    dense_ckpt, moe_ckpt = str(root / "mcore_dense"), str(root / "mcore_moe")
    err = {n: str(root / f"{n}.error") for n in ("save_tp2", "load_tp1pp2", "save_moe_ep2", "mismatches",
                                                  "load_moe_ep1")}
    spawn_each(2, [(_save_tp2, (dense, dense_ckpt, str(root / "lp.pt"), ""), err["save_tp2"]),
                   (_load_tp1pp2, (dense, dense_ckpt, str(root / "lp.pt")), err["load_tp1pp2"]),
                   (_save_moe_ep2, (moe, moe_ckpt, str(root / "moe_lp.pt")), err["save_moe_ep2"])])
    spawn_each(1, [(_mismatches, (paths, ckpts), err["mismatches"]),
                   (_load_moe_ep1, (moe, moe_ckpt, str(root / "moe_lp.pt")), err["load_moe_ep1"])])
    return err


def test_checkpoint_saved_at_tp2_starts_a_tp1_pp2_run(runs):
    raise_if_failed(runs["save_tp2"])
    raise_if_failed(runs["load_tp1pp2"])


def test_mismatched_checkpoints_are_named_errors(runs):
    raise_if_failed(runs["mismatches"])


def test_moe_checkpoint_saved_at_ep2_starts_an_ep1_run(runs):
    """Experts are keyed by their global index: a checkpoint saved with experts split over two
    ranks loads into one rank holding all four."""
    raise_if_failed(runs["save_moe_ep2"])
    raise_if_failed(runs["load_moe_ep1"])
