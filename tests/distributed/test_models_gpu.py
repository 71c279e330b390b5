"""GPU path: TransformerEngine layer spec, NCCL, CUDA parameters. Skipped without a GPU."""
import datetime
import os
import socket
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import VOCAB, save_tiny_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_te_spec_actor_matches_transformers_on_cuda(arch, tmp_path):
    import torch.distributed as dist

    from megappo.convert import iter_hf_tensors, load_hf_weights

    from megappo.layout import RankCoords
    from megappo.distributed import log_probs_from_logits
    from megappo.models import build_model, describe, initialize_parallel, load_hf_config, te_available, transformer_config

    path = tmp_path / arch
    hf = save_tiny_model(arch, path).cuda()
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    initialize_parallel(1, 1)
    info = describe(load_hf_config(str(path)))
    cfg = transformer_config(info, cpu=False)
    chunks = build_model(info, cfg)
    assert chunks[0].megappo_te_spec == te_available()
    load_hf_weights(chunks, str(path), info.desc, RankCoords.from_megatron())
    ids = torch.randint(0, VOCAB, (2, 32), device="cuda")
    with torch.no_grad():
        logits = chunks[0](ids, torch.arange(32, device="cuda")[None].expand(2, 32), attention_mask=None)
        lp = log_probs_from_logits(logits[:, :-1], ids[:, 1:], vocab_size=VOCAB)
        ref = torch.log_softmax(hf(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    # TE's fp32 GEMMs/attention differ from cuBLAS/SDPA in summation order: a looser bound than on CPU.
    assert (lp - ref).abs().max().item() < 1e-4
    sd = hf.state_dict()
    for name, t in iter_hf_tensors(chunks, info.desc, RankCoords.from_megatron()):
        assert torch.equal(t.cpu(), sd[name].cpu()), name
