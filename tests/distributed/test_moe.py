"""Qwen3-MoE as a megatron MoE GPTModel (issue 6/7, first slice): built from the HF config (router
renormalisation, dense and expert layers mixed by mlp_only_layers), each expert-parallel rank
loading only its experts from the HF checkpoint, and per-token log-probs equal to transformers'
at EP1, EP2, TP2 x EP2 (sequence parallel) and PP2 x EP2, with norm_topk_prob on and off."""
import os
import sys

import pytest
import torch

from harness import spawn
from mcore import token_log_probs

pytestmark = pytest.mark.distributed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import VOCAB, save_tiny_model  # noqa: E402


def _worker(rank, world, path, tp, pp, ep):
    from megappo import megatron_cpu

    megatron_cpu.install()
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from megappo.convert.hf_io import RankCoords, load_hf_weights
    from megappo.models import build_model, describe, initialize_parallel, load_hf_config, transformer_config

    initialize_parallel(tp, pp, ep=ep)
    info = describe(load_hf_config(path), tp=tp)
    assert info.desc.num_experts == 4 and info.desc.moe_layers == (1, 2, 3)
    cfg = transformer_config(info, tp=tp, pp=pp, sequence_parallel=tp > 1, cpu=True, ep=ep)
    chunks = build_model(info, cfg)
    coords = RankCoords.from_megatron()
    assert (coords.ep, coords.ep_rank) == (ep, ps.get_expert_model_parallel_rank())
    # each EP rank holds only its experts: 4 / EP of them in every MoE layer it builds
    names = [n for n, _ in chunks[0].named_parameters()]
    experts = {n.split(".local_experts.")[1].split(".")[0] for n in names if ".local_experts." in n}
    assert experts == {str(k) for k in range(4 // ep)}, experts
    load_hf_weights(chunks, path, info.desc, coords)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, VOCAB, (2, 24), generator=g) for _ in range(2)]
    got = token_log_probs(chunks, info, batches)
    if not ps.is_pipeline_last_stage():
        return
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for ids, lp in zip(batches, got):
        with torch.no_grad():
            ref = torch.log_softmax(hf(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        diff = (lp - ref).abs().max().item()
        assert diff < 1e-5, f"TP{tp} PP{pp} EP{ep}: |megatron - transformers| log-prob {diff}"


@pytest.mark.parametrize("tp, pp, ep, norm_topk_prob, world", [(1, 1, 1, True, 1), (1, 1, 2, False, 2),
                                                               (2, 1, 2, True, 4), (1, 2, 2, True, 4)])
def test_moe_log_probs_equal_transformers(tp, pp, ep, norm_topk_prob, world, tmp_path):
    path = tmp_path / "moe"
    save_tiny_model("qwen3_moe", path, norm_topk_prob=norm_topk_prob)
    spawn(_worker, world, str(path), tp, pp, ep)
