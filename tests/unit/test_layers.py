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
