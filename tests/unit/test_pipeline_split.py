"""Uneven pipelines (megatron's num_layers_in_first/last_pipeline_stage and
account_for_embedding/loss_in_pipeline_split, verl's override_transformer_config keys): megappo's
placement of the layers equals megatron's own, case by case, and the planner and the config use it."""
import warnings

import pytest
import torch

from megappo.layout import PipelineSplit, global_layer, layer_owner, split_problems, stage_layers

SPLITS = ([PipelineSplit(), PipelineSplit(embedding=True), PipelineSplit(loss=True),
           PipelineSplit(embedding=True, loss=True), PipelineSplit(first=2, embedding=True)]
          + [PipelineSplit(first=f) for f in range(0, 6)] + [PipelineSplit(last=n) for n in range(0, 6)]
          + [PipelineSplit(first=f, last=n) for f in range(1, 5) for n in range(1, 5)])


def _megatron(L, pp, vpp, s):
    """megatron-core's own placement: (offset, layers) per (pp_rank, vp_stage), or None where it
    refuses the split or places the layers wrong (negative counts, gaps or overlaps)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c = TransformerConfig(num_layers=L, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32,
                                  num_layers_in_first_pipeline_stage=s.first, num_layers_in_last_pipeline_stage=s.last,
                                  account_for_embedding_in_pipeline_split=s.embedding,
                                  account_for_loss_in_pipeline_split=s.loss)
            out = {(r, v): (get_transformer_layer_offset(c, vp_stage=v if vpp else None, pp_rank=r),
                            get_num_layers_to_build(c, vp_stage=v if vpp else None, pp_rank=r))
                   for v in range(vpp or 1) for r in range(pp)}
    except (AssertionError, ValueError, ZeroDivisionError):
        return None
    order = [out[(r, v)] for v in range(vpp or 1) for r in range(pp)]
    if any(n < 0 for _, n in order) or [o for o, _ in order] + [L] != [0] + [o + n for o, n in order]:
        return None
    return out


@pytest.mark.parametrize("L", [4, 6, 7, 8, 12, 14, 16, 94])
def test_placement_is_megatrons(L):
    valid = 0
    for pp in (2, 3, 4, 8):
        for vpp in (None, 2):
            for s in SPLITS:
                want = _megatron(L, pp, vpp, s)
                problems = split_problems(L, pp, vpp, s)
                assert (want is None) == bool(problems), (L, pp, vpp, s, problems, want)
                if want is not None:
                    valid += 1
                    assert stage_layers(L, pp, vpp, s) == want, (L, pp, vpp, s)
                    for (r, v), (first, n) in want.items():
                        for local in range(n):
                            assert layer_owner(first + local, L, pp, vpp, s) == (r, v, local)
                            assert global_layer(r, v, local, L, pp, vpp, s) == first + local
    assert valid > 10


def test_qwen3_235b_fits_pp8_only_with_the_embedding_and_loss_counted():
    from megappo import plan as P

    m = P.model_shape({"architectures": ["Qwen3MoeForCausalLM"], "num_attention_heads": 64, "num_key_value_heads": 4,
                       "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 94, "vocab_size": 151936,
                       "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536})
    even = P.PlanOptions(tp=4, pp=8, ep=8)
    assert P.layout_problems(m, even) == ["num_hidden_layers (94) is not divisible by pipeline_model_parallel_size x "
                                          "virtual stages (8 x 1)"]
    split = PipelineSplit(embedding=True, loss=True)
    o = P.PlanOptions(tp=4, pp=8, ep=8, split=split)
    assert P.layout_problems(m, o) == []
    counts = [P.stage_layer_count(m, 8, s, None, split) for s in range(8)]
    assert counts == [11] + [12] * 6 + [11]
    # each stage's parameters follow its own layer count (the first and last also hold the vocabulary)
    per_layer = P.stage_params(m, 4, 8, 3, ep=8, layers=1) - P.stage_params(m, 4, 8, 3, ep=8, layers=0)
    assert P.stage_params(m, 4, 8, 3, ep=8, layers=12) - P.stage_params(m, 4, 8, 3, ep=8, layers=11) == per_layer
    weights = [P.role_params(m, o, o.actor, s)[0] for s in range(8)]
    assert weights[1] == weights[3] == P.stage_params(m, 4, 8, 1, ep=8, layers=12)
    assert weights[0] == P.stage_params(m, 4, 8, 0, ep=8, layers=11)


def test_the_config_keys_reach_the_plan_and_every_role():
    from megappo import plan as P
    from megappo.config import load_config
    from megappo.layout import pipeline_split

    o = "actor_rollout_ref.actor.megatron.override_transformer_config."
    cfg = load_config([o + "account_for_embedding_in_pipeline_split=true", o + "account_for_loss_in_pipeline_split=true",
                       "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                       "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2",
                       "critic.megatron.pipeline_model_parallel_size=2"], ["tiny_cpu"])
    want = PipelineSplit(embedding=True, loss=True)
    assert P.options_from_config(cfg).split == want
    assert pipeline_split(cfg, cfg.actor_rollout_ref.ref.megatron) == want    # no keys of its own: the actor's
    assert pipeline_split(cfg, cfg.critic.megatron) == want                   # verl's default: the actor's
    cfg.critic.megatron.override_transformer_config.num_layers_in_first_pipeline_stage = 1
    cfg.critic.megatron.override_transformer_config.account_for_embedding_in_pipeline_split = False
    cfg.critic.megatron.override_transformer_config.account_for_loss_in_pipeline_split = False
    assert pipeline_split(cfg, cfg.critic.megatron) == PipelineSplit(first=1)   # its own model, its own split
    assert pipeline_split(load_config([], ["tiny_cpu"])) is None
