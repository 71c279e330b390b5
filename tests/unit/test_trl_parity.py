"""benchmarks/trl_parity.py's comparison: rows matched by prompt, TRL's value gradients scaled by
its vf_coef, every optimizer step compared (the yardstick that says megappo's update is TRL's)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import trl_parity  # noqa: E402


def _records(tmp_path, vf_coef=0.1, perturb=None):
    g = torch.Generator().manual_seed(0)
    B, P, T, H, V = 4, 3, 2, 5, 7
    prompts = torch.arange(B * P).reshape(B, P) + 10   # distinct prompts
    responses = torch.randint(0, V, (B, T), generator=g)
    values, returns = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    batch = dict(input_ids=torch.cat([prompts, responses], 1), prompt_lengths=torch.full((B,), P),
                 responses=responses, response_mask=torch.ones(B, T), values=values, returns=returns, advantages=adv)
    shapes = {"output_layer.weight": (V, H), "decoder.final_layernorm.weight": (H,),
              "decoder.layers.1.mlp.linear_fc2.weight": (H, 2 * H), "embedding.word_embeddings.weight": (V, H)}
    actor = [{f"module.{k}": torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(2)]
    critic = [{f"module.{k}": torch.randn((1, H) if k.startswith("output") else s, generator=g)
               for k, s in shapes.items() if not k.startswith("embedding")} for _ in range(2)]
    names = dict(trl_parity.POLICY_PARAMS)
    vnames = dict(trl_parity.VALUE_PARAMS)
    trl_grads = [{"policy": {names[k[7:]]: v.clone() for k, v in a.items()},
                  "value": {vnames[k[7:]]: v * vf_coef for k, v in c.items()}} for a, c in zip(actor, critic)]
    if perturb:
        step, role, name, by = perturb
        trl_grads[step][role][name] *= 1 + by
    order = [3, 1, 0, 2]   # TRL's rows are megappo's in another order
    tp = [tuple(prompts[i].tolist()) for i in order]
    pre = (returns - values)[order]
    post = adv[order]
    torch.save({"batch": batch, "grads": {"actor": actor, "critic": critic}}, tmp_path / "megappo.pt")
    torch.save({"grads": trl_grads, "whiten": [(pre, post, torch.ones(B, T, dtype=torch.bool))], "order": tp},
               tmp_path / "trl.pt")


def test_equal_updates_read_as_equal_whatever_trl_s_row_order(tmp_path):
    _records(tmp_path)
    res = trl_parity.compare(tmp_path, vf_coef=0.1)
    assert res["optimizer steps"] == 2 and res["rows trained on"] == 4
    for key in ("actor gradients: worst relative difference", "critic gradients: worst relative difference",
                "advantage before whitening (full-length rows)", "advantage after whitening (full-length rows)"):
        assert res[key] < 1e-6, (key, res[key])


@pytest.mark.parametrize("perturb, key", [
    ((1, "policy", "lm_head.weight", 0.01), "actor gradients: worst relative difference"),
    ((0, "value", "model.norm.weight", -0.02), "critic gradients: worst relative difference")])
def test_a_difference_in_any_step_is_reported_at_its_size(tmp_path, perturb, key):
    _records(tmp_path, perturb=perturb)
    res = trl_parity.compare(tmp_path, vf_coef=0.1)
    assert res[key] == pytest.approx(abs(perturb[3]) / (1 + perturb[3]), rel=1e-4)


def test_trl_s_value_gradients_are_read_through_its_vf_coef(tmp_path):
    _records(tmp_path, vf_coef=0.1)
    assert trl_parity.compare(tmp_path, vf_coef=1.0)["critic gradients: worst relative difference"] > 1
