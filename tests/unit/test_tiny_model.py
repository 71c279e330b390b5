"""The tiny model folders the CPU job and the learning benchmark train from."""
import os

import torch
from safetensors.torch import load_file


def test_the_pad_row_is_drawn_like_every_other_row_and_nothing_else_moves(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from megappo.data.tiny import make_tiny_setup

    paths = make_tiny_setup(str(tmp_path / "s"), task="pick_first", n_train=8, n_test=4, seed=3)
    saved = load_file(os.path.join(paths["model"], "model.safetensors"))
    cfg = AutoConfig.from_pretrained(paths["model"])
    emb = saved["model.embed_tokens.weight"]
    pad = cfg.pad_token_id
    # HF's init leaves it zero; a zero row takes RMSNorm's 1/sqrt(eps) gradient
    assert emb[pad].abs().min() > 0
    others = torch.cat([emb[:pad], emb[pad + 1:]])
    std = others.std().item()
    assert abs(emb[pad].std().item() - std) < 0.3 * std, (emb[pad].std().item(), std)

    # every other weight is what from_config draws for the same seed
    torch.manual_seed(3)
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).state_dict()
    assert fresh["model.embed_tokens.weight"][pad].abs().max() == 0
    for name, w in saved.items():
        ref = fresh[name]
        if name == "model.embed_tokens.weight":
            w, ref = torch.cat([w[:pad], w[pad + 1:]]), torch.cat([ref[:pad], ref[pad + 1:]])
        assert torch.equal(w, ref), name

    # loading the folder (as TRL does) keeps the row
    loaded = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
    assert torch.equal(loaded.get_input_embeddings().weight[pad], emb[pad])
