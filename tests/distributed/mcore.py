"""Helpers for tests that drive real megatron-core models on CPU (gloo)."""
import torch

SEQ = 24


def setup(tp, pp, vpp=None, seed=7, cp=1, ep=None):
    from megappo import megatron_cpu

    megatron_cpu.install()
    from megappo.models import initialize_parallel

    initialize_parallel(tp, pp, vpp, seed=seed, cp=cp, ep=ep)


def build(path, tp, pp, vpp=None, value_head=False, sp=True, cpu=True, value_head_std=None, cp=1, ep=1, split=None):
    """A critic gets a random head (std 1/sqrt(hidden + 1) unless given) so that tests of its
    alignment and gradients see non-zero values; the trainer's default head starts at zero."""
    from megappo.convert import load_hf_weights
    from megappo.layout import RankCoords
    from megappo.models import build_model, describe, load_hf_config, transformer_config

    info = describe(load_hf_config(path), tp=tp, value_head=value_head)
    cfg = transformer_config(info, tp=tp, pp=pp, vpp=vpp, sequence_parallel=sp, cpu=cpu, cp=cp, ep=ep, split=split)
    if value_head_std is None:
        value_head_std = (info.desc.hidden_size + 1) ** -0.5
    chunks = build_model(info, cfg, value_head=value_head, value_head_std=value_head_std)
    load_hf_weights(chunks, path, info.desc, RankCoords.from_megatron(cfg))
    return info, cfg, chunks


def run_schedule(chunks, batches, loss_from_output, forward_only=True):
    """megatron's pipeline schedule over micro-batches of token ids (B, S); returns what the last
    stage's loss function collected."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    its = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)

    def forward_step(data_iterator, model):
        ids = next(data_iterator)
        pos = torch.arange(ids.shape[1])[None].expand_as(ids)
        out = model(ids, pos, attention_mask=None)
        return out, lambda output: loss_from_output(output, ids)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=its, model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(batches), seq_length=max(b.shape[1] for b in batches),
        micro_batch_size=batches[0].shape[0], forward_only=forward_only)


def train_step(ddp_chunks, optimizer, info, batches):
    """One real update: maximise the log-likelihood of random tokens (moves every weight)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from megappo.distributed import log_probs_from_logits

    tp_group = ps.get_tensor_model_parallel_group()

    def loss(output, ids):
        lp = log_probs_from_logits(output[:, :-1], ids[:, 1:], tp_group, vocab_size=info.desc.vocab_size)
        return -lp.mean(), {"nll": -lp.mean().detach()}

    for c in ddp_chunks:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    run_schedule(ddp_chunks, batches, loss, forward_only=False)
    finalize_model_grads(ddp_chunks)
    ok, _, _ = optimizer.step()
    assert ok


def token_log_probs(chunks, info, batches):
    """Per-token log-probs of each batch's tokens 1.. under the model; on the last PP stage (else [])."""
    from megatron.core import parallel_state as ps

    from megappo.distributed import log_probs_from_logits

    tp_group = ps.get_tensor_model_parallel_group()

    def loss(output, ids):
        lp = log_probs_from_logits(output[:, :-1], ids[:, 1:], tp_group, vocab_size=info.desc.vocab_size)
        return lp.sum() * 0.0, {"lp": lp.detach()}

    with torch.no_grad():
        out = run_schedule(chunks, batches, loss)
    return [o["lp"] for o in out]


def random_batch(n, seed, prompt_len, response_len, vocab, prompt_index=None):
    """A RolloutBatch of ``n`` random samples: prompt lengths in ``prompt_len`` [lo, hi), response
    lengths in ``response_len`` [lo, hi), random advantages and returns on the response tokens."""
    from megappo.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(torch.randint(*prompt_len, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    lengths = torch.randint(*response_len, (n,), generator=g)
    T = int(lengths.max())
    responses = torch.randint(3, vocab, (n, T), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    batch = RolloutBatch.from_prompts_and_responses(prompts, responses, mask, pad_token_id=0, prompt_index=prompt_index)
    batch.advantages = torch.randn(n, T, generator=g) * mask
    batch.returns = torch.randn(n, T, generator=g) * mask
    return batch


def safetensors_tensors(folder):
    """Every tensor of an HF folder's safetensors files, by name."""
    import os

    from safetensors import safe_open

    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), framework="pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out
