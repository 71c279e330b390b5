"""The tiny model folders the CPU job and the learning benchmark train from."""
import json
import os

import torch
from safetensors.torch import load_file


def test_the_tiny_model_has_no_frozen_pad_row(tmp_path):
    """As Qwen's released configs, the tiny model's config names no pad id (its tokenizer does):
    transformers then builds no padding_idx, so the <pad> row is drawn like every other row and
    trained by HF (TRL) as by Megatron."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megappo.data.tiny import make_tiny_setup

    paths = make_tiny_setup(str(tmp_path / "s"), task="pick_first", n_train=8, n_test=4, seed=3)
    cfg = json.loads(open(os.path.join(paths["model"], "config.json")).read())
    assert cfg.get("pad_token_id") is None
    pad = AutoTokenizer.from_pretrained(paths["model"]).pad_token_id
    assert pad == 0   # the tokenizer keeps its pad (megappo pads batches with it)

    emb = load_file(os.path.join(paths["model"], "model.safetensors"))["model.embed_tokens.weight"]
    assert emb[pad].abs().min() > 0   # a padding_idx init leaves it zero
    others = torch.cat([emb[:pad], emb[pad + 1:]])
    assert abs(emb[pad].std().item() - others.std().item()) < 0.3 * others.std().item()

    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
    assert model.get_input_embeddings().padding_idx is None
    model.get_input_embeddings()(torch.tensor([[pad, 5]])).sum().backward()
    assert model.get_input_embeddings().weight.grad[pad].abs().sum() > 0   # HF trains the row
