"""Activation recomputation (megatron's recompute_granularity/method/num_layers, verl's
enable_gradient_checkpointing): the same losses and gradients as without it, at TP2 x PP2 with
sequence parallelism on 4 gloo processes -- and the layers really run twice."""
import json
import os
import sys

import pytest
import torch

from harness import spawn
from mcore import run_schedule, setup

pytestmark = pytest.mark.distributed

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
from tiny_models import VOCAB, save_tiny_model  # noqa: E402

VARIANTS = {"none": None, "full_uniform_1": ("full", "uniform", 1), "full_block_1": ("full", "block", 1),
            "full_uniform_2": ("full", "uniform", 2), "selective": ("selective", "uniform", 1)}


def _worker(rank, world, path, out_dir):
    from megatron.core import parallel_state as ps

    from megappo.convert import load_hf_weights

    from megappo.layout import RankCoords
    from megappo.distributed import log_probs_from_logits
    from megappo.models import build_model, describe, load_hf_config, transformer_config

    setup(2, 2)
    tp_group = ps.get_tensor_model_parallel_group()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(3, VOCAB, (2, 24), generator=g) for _ in range(4)]
    weights = torch.randn(2, 23, generator=g)
    out = {}
    for name, recompute in VARIANTS.items():
        info = describe(load_hf_config(path), tp=2)
        cfg = transformer_config(info, tp=2, pp=2, sequence_parallel=True, cpu=True, recompute=recompute)
        chunks = build_model(info, cfg)
        load_hf_weights(chunks, path, info.desc, RankCoords.from_megatron())
        calls = []
        layer = chunks[0].decoder.layers[0]
        layer.mlp.register_forward_hook(lambda *a: calls.append(1))

        def loss(output, ids):
            lp = log_probs_from_logits(output[:, :-1], ids[:, 1:], tp_group, vocab_size=info.desc.vocab_size)
            value = (lp * weights).sum()
            return value, {"loss": value.detach()}

        res = run_schedule(chunks, batches, loss, forward_only=False)
        grads = {n: p.grad.clone() for c in chunks for n, p in c.named_parameters() if p.grad is not None}
        out[name] = {"loss": [float(r["loss"]) for r in res], "calls": len(calls),
                     "grads": {n: t.tolist() for n, t in grads.items()}}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(out, f)


def test_recomputation_gives_the_same_losses_and_gradients(tmp_path):
    save_tiny_model("qwen3", tmp_path / "model")
    spawn(_worker, 4, str(tmp_path / "model"), str(tmp_path))
    for rank in range(4):
        out = json.loads((tmp_path / f"{rank}.json").read_text())
        base = out["none"]
        assert base["calls"] == 4 and len(base["grads"]) > 5
        for name in VARIANTS:
            v = out[name]
            assert v["loss"] == pytest.approx(base["loss"], abs=1e-6), (rank, name)
            assert v["grads"].keys() == base["grads"].keys()
            for k in base["grads"]:
                torch.testing.assert_close(torch.tensor(v["grads"][k]), torch.tensor(base["grads"][k]),
                                           atol=1e-6, rtol=1e-5, msg=f"rank {rank} {name} {k}")
        # full recomputation runs each layer's forward again in backward; selective only core attention
        assert out["full_uniform_1"]["calls"] == 8 and out["full_block_1"]["calls"] == 8
        assert out["full_uniform_2"]["calls"] == 8 and out["selective"]["calls"] == 4
