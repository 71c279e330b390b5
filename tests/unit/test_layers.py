"""Layer-spec choice: TransformerEngine only when megatron itself can use it."""
import sys
import types

import torch


def test_te_available_asks_megatron_not_the_import(monkeypatch):
    from megatron.core.extensions import transformer_engine as mte
    from megatron.core.models.gpt import gpt_layer_specs

    from megappo.models import te_available

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # A broken TE install: `import transformer_engine` succeeds (its __init__ swallows the error)
    # while megatron's import of TE's pieces failed and left HAVE_TE False.
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", False)
    monkeypatch.setattr(mte, "HAVE_TE", False)
    assert te_available() is False
    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", True)
    assert te_available() is False  # both of megatron's modules must have TE
    monkeypatch.setattr(mte, "HAVE_TE", True)
    assert te_available() is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert te_available() is False  # TE's spec is CUDA-only


def test_layer_spec_calls_match_megatrons_signatures():
    """The TE branches never run here (no GPU, no TE): each megatron spec builder megappo calls is
    replaced by an autospec of itself, which raises TypeError on an argument megatron's function
    does not take, as the real call would on a GPU. Dense and MoE (Qwen3: q/k norms) models."""
    from unittest import mock

    from megatron.core.models.gpt import gpt_layer_specs as specs

    from megappo.models import describe, layer_spec, transformer_config
    from tiny_models import hf_config

    names = ("get_gpt_decoder_block_spec", "get_gpt_layer_with_transformer_engine_spec", "get_gpt_layer_local_spec")
    for arch in ("qwen3", "qwen3_moe", "llama"):
        info = describe(hf_config(arch))
        config = transformer_config(info, cpu=True)
        with mock.patch.multiple(specs, **{n: mock.create_autospec(getattr(specs, n)) for n in names}):
            layer_spec(config, info.desc.qk_layernorm, use_te=True)
            called = {n: getattr(specs, n).call_args for n in names if getattr(specs, n).called}
        if arch == "qwen3_moe":
            assert set(called) == {"get_gpt_decoder_block_spec"}
            assert called["get_gpt_decoder_block_spec"].args[0].qk_layernorm is True   # megatron reads it here
        else:
            assert called == {"get_gpt_layer_with_transformer_engine_spec": mock.call(
                qk_layernorm=arch == "qwen3")}
