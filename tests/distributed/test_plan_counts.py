"""The memory planner's parameter counts (megappo.plan) equal what megatron-core builds, per
pipeline stage and TP rank, for a policy with untied and tied embeddings and for the critic
and for a Mixture-of-Experts policy at EP2 (an independent count: the real modules' parameters at
TP2 x PP2 on 4 gloo processes)."""
import json
import os

import pytest

from harness import spawn

pytestmark = pytest.mark.distributed

SMALL = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
         "tie_word_embeddings": False}


def _count(rank, world, out_dir):
    import transformers
    from megatron.core import parallel_state as ps

    from mcore import setup
    from megappo import plan as P
    from megappo.models import build_model, describe, transformer_config

    setup(2, 2)
    rows = []
    for tied in (False, True):
        for value_head in (False, True):
            if tied and value_head:
                continue
            hf = transformers.Qwen3Config(**{k: v for k, v in SMALL.items() if k not in ("architectures", "tie_word_embeddings")},
                                          tie_word_embeddings=tied, architectures=["Qwen3ForCausalLM"])
            info = describe(hf, tp=2, value_head=value_head)
            chunks = build_model(info, transformer_config(info, tp=2, pp=2, cpu=True), value_head=value_head)
            real = sum(p.numel() for c in chunks for p in c.parameters())
            stage = ps.get_pipeline_model_parallel_rank()
            planned = P.stage_params(P.model_shape({**SMALL, "tie_word_embeddings": tied}), 2, 2, stage, value_head)
            rows.append((tied, value_head, stage, real, planned))
    # Mixture-of-Experts at TP2 x PP2 x EP2: each rank holds half the experts, whole (expert-TP 1)
    from megappo.models import initialize_parallel

    initialize_parallel(2, 2, ep=2, seed=7)
    moe = {**SMALL, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32}
    hf = transformers.Qwen3MoeConfig(**{k: v for k, v in moe.items() if k != "architectures"}, mlp_only_layers=[],
                                     decoder_sparse_step=1)
    hf.architectures = moe["architectures"]
    info = describe(hf, tp=2)
    chunks = build_model(info, transformer_config(info, tp=2, pp=2, cpu=True, sequence_parallel=True, ep=2))
    real = sum(p.numel() for c in chunks for p in c.parameters())
    rows.append(("moe", False, ps.get_pipeline_model_parallel_rank(), real,
                 P.stage_params(P.model_shape(moe), 2, 2, ps.get_pipeline_model_parallel_rank(), ep=2)))
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(rows, f)


def test_planned_parameters_equal_megatron_modules(tmp_path):
    spawn(_count, 4, str(tmp_path))
    rows = [r for i in range(4) for r in json.loads((tmp_path / f"{i}.json").read_text())]
    assert len(rows) == 16 and {r[2] for r in rows} == {0, 1} and sum(r[0] == "moe" for r in rows) == 4
    for tied, value_head, stage, real, planned in rows:
        assert real == planned, (tied, value_head, stage, real, planned)
