"""Interactions (verl's multi_turn.interaction_config_path): a simulated user answers each model
turn that calls no tool; its text is a user turn (in the sequence, out of the loss), its score goes
to the reward function as turn_scores, and it may end the conversation."""
import asyncio

import pytest

from megappo.rollout import ToolTurnTokens, multi_turn_generate
from megappo.tools import (Calculator, Interaction, InteractionError, InteractionRunner, ToolConfigError, ToolRunner,
                           interaction_kwargs_of, load_interactions, read_interaction_config)
from test_multi_turn import ScriptedEngine, call, enc, render, tok  # noqa: F401  (tok: the fixture)


class Guess(Interaction):
    """Says 'Correct!' and ends when the model's last message holds the answer, else asks again;
    its score: 1 for a correct turn, 0 otherwise. Records what it saw."""

    log: list = []

    def start_interaction(self, instance_id=None, answer=None, **kwargs):
        self.answers = getattr(self, "answers", {})
        self.answers[instance_id] = answer
        Guess.log.append(("start", instance_id, answer, kwargs))
        return instance_id

    def generate_response(self, instance_id, messages, **kwargs):
        Guess.log.append(("respond", instance_id, [dict(m) for m in messages]))
        right = self.answers[instance_id] in messages[-1]["content"]
        return right, "Correct!" if right else f"No. Try again ({self.config['hint']}).", float(right), {}

    def finalize_interaction(self, instance_id, **kwargs):
        Guess.log.append(("finalize", instance_id))
        del self.answers[instance_id]


class VerlShaped:
    """verl's BaseInteraction shape: async methods, finalize_interaction without an instance id."""

    finalized = 0

    def __init__(self, config):
        self.config = config

    async def start_interaction(self, instance_id=None, **kwargs):
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        await asyncio.sleep(0)
        return True, "bye", 0.25, {}

    async def finalize_interaction(self):
        VerlShaped.finalized += 1


def run(tok, script, questions, interactions, answers, budget=400, runner=None, **kw):
    prompts = [render(tok, [{"role": "user", "content": q}], gen=True) for q in questions]
    engine = ScriptedEngine(tok, script)
    engine.prompt_ids = prompts
    samples, metrics = multi_turn_generate(
        engine, prompts, runner=runner or ToolRunner({"calculator": Calculator()}), decode=tok.decode,
        tool_turn=ToolTurnTokens(tok, [tok.eos_token_id], roles=("tool", "user")), max_response_length=budget,
        interactions=interactions, messages=[[{"role": "user", "content": q}] for q in questions],
        interaction_kwargs=[{"name": "guess", "answer": a} for a in answers], **kw)
    return samples, metrics, prompts


def test_the_user_answers_until_the_model_is_right(tok):
    """Sample 0: wrong, then right (two model turns, one user turn between). Sample 1: a tool call,
    then a wrong answer, then right: the interaction reads the tool's answer among its messages.
    Sample 2: right at once. Every sample's instance is started and finalized."""
    Guess.log = []
    runner = InteractionRunner({"guess": Guess({"name": "guess", "hint": "think"})})
    script = [["It is 5.", "It is 7."], [call("3+4"), "It is 8.", "It is 7."], ["It is 9."]]
    samples, metrics, prompts = run(tok, script, ["q0", "q1", "q2"], runner, ["7", "7", "9"])
    eos = [tok.eos_token_id]
    user = ToolTurnTokens(tok, eos, roles=("user",))
    again = user(["No. Try again (think)."], role="user")
    assert samples[0].response_ids == enc(tok, "It is 5.") + eos + again + enc(tok, "It is 7.") + eos
    assert samples[0].response_mask == [1] * 9 + [0] * len(again) + [1] * 9
    assert tok.decode(again) == "\n<|im_start|>user\nNo. Try again (think).<|im_end|>\n<|im_start|>assistant\n"
    tool = user(["7"], role="tool")
    assert samples[1].response_ids == (enc(tok, call("3+4")) + eos + tool + enc(tok, "It is 8.") + eos + again
                                       + enc(tok, "It is 7.") + eos)
    assert samples[2].response_ids == enc(tok, "It is 9.") + eos                 # ended: no trailing user turn
    assert [s.turn_scores for s in samples] == [[0.0, 1.0], [0.0, 1.0], [1.0]]
    assert [s.stop for s in samples] == ["interaction_done"] * 3
    assert [(s.assistant_turns, s.user_turns, s.num_turns) for s in samples] == [(2, 1, 4), (3, 2, 6), (1, 0, 2)]
    # what the interaction read: the chat so far, the model's text without special tokens, the tool's answer
    seen = [e[2] for e in Guess.log if e[0] == "respond" and e[1].startswith("1:guess:")]
    as_text = call("3+4").replace("<tool_call>", "").replace("</tool_call>", "")   # special tokens dropped, as verl
    assert seen[0] == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": as_text},
                       {"role": "tool", "content": "7"}, {"role": "assistant", "content": "It is 8."}]
    assert seen[1][-2:] == [{"role": "user", "content": "No. Try again (think)."},
                            {"role": "assistant", "content": "It is 7."}]
    starts = [e for e in Guess.log if e[0] == "start"]
    assert [(e[1].rsplit(":", 1)[0], e[2], e[3]) for e in starts] == [(f"{i}:guess", a, {"name": "guess"})
                                                                       for i, a in enumerate("779")]
    assert len({e[1] for e in starts}) == 3          # each sample's own instance id (unique, as verl's uuids)
    assert sorted(e[1] for e in Guess.log if e[0] == "finalize") == sorted(e[1] for e in starts)
    assert metrics["interaction/turns"] == 5 and metrics["interaction/terminated"] == 3
    assert metrics["multi_turn/stop/interaction_done"] == 3


@pytest.mark.parametrize("kw, stop, scores", [
    (dict(max_user_turns=1), "max_user_turns", [0.0]),       # the user's turn counts as verl's user_turns
    (dict(max_assistant_turns=2), "max_assistant_turns", [0.0]),
    (dict(budget=20), "length", [0.0]),                       # the user's turn would pass the budget
])
def test_turn_limits_stop_the_conversation(tok, kw, stop, scores):
    runner = InteractionRunner({"guess": Guess({"name": "guess", "hint": "h"})})
    (s,), _, _ = run(tok, [["It is 5.", "It is 6.", "It is 7."]], ["q"], runner, ["7"], **kw)
    assert s.stop == stop and s.turn_scores == scores and s.response_mask[-1] == 1


def test_a_turn_without_a_score_records_none(tok):
    """A turn whose score is None is not recorded in turn_scores (verl appends only given scores)."""
    class Unscored(Interaction):
        def generate_response(self, instance_id, messages, **kwargs):
            return len(messages) >= 4, "more", None, {}

    (s,), _, _ = run(tok, [["a", "b"]], ["q"], InteractionRunner({"guess": Unscored({})}), ["x"])
    assert s.turn_scores == [] and s.assistant_turns == 2 and s.stop == "interaction_done"


def test_a_verl_shaped_async_interaction_runs_as_it_is(tok):
    VerlShaped.finalized = 0
    runner = InteractionRunner({"guess": VerlShaped({"name": "guess"})})
    samples, _, _ = run(tok, [["a"], ["b"]], ["q0", "q1"], runner, ["x", "y"])
    assert [s.turn_scores for s in samples] == [[0.25], [0.25]] and VerlShaped.finalized == 2


def test_an_interaction_that_fails_is_named(tok):
    class Broken(Interaction):
        def generate_response(self, instance_id, messages, **kwargs):
            raise KeyError("ground_truth")

    class Shapeless(Interaction):
        def generate_response(self, instance_id, messages, **kwargs):
            return "done"

    with pytest.raises(InteractionError, match="interaction 'guess' raised in generate_response for sample 0: "
                                               "KeyError: 'ground_truth'"):
        run(tok, [["a"]], ["q"], InteractionRunner({"guess": Broken({})}), ["x"])
    with pytest.raises(InteractionError, match=r"must return \(should_terminate, text, turn_score, metrics\)"):
        run(tok, [["a"]], ["q"], InteractionRunner({"guess": Shapeless({})}), ["x"])


def test_interaction_config_files_in_verls_layout(tmp_path):
    f = tmp_path / "i.yaml"
    f.write_text("interaction:\n  - class_name: test_interactions.Guess\n    config: {hint: h}\n"
                 "  - name: other\n    class_name: megappo.tools.Interaction\n")
    specs = read_interaction_config(f)
    assert [(s.name, s.class_name, s.config) for s in specs] == [("guess", "test_interactions.Guess", {"hint": "h"}),
                                                                  ("other", "megappo.tools.Interaction", {})]
    built = load_interactions(f)
    assert isinstance(built["guess"], Guess) and built["guess"].config == {"hint": "h", "name": "guess"}
    for text, fragment in [("tools: []\n", "expected a mapping with a non-empty 'interaction' list"),
                           ("interaction:\n  - class_name: NoDots\n", "interaction[0].class_name: expected a dotted path"),
                           ("interaction:\n  - {class_name: a.B, config: 3}\n", "interaction[0].config: expected a mapping"),
                           ("interaction:\n  - {class_name: a.GuessInteraction}\n  - {name: guess, class_name: b.C}\n",
                            "interaction[1].name: 'guess' is already another entry's")]:
        f.write_text(text)
        with pytest.raises(ToolConfigError) as ei:
            read_interaction_config(f)
        assert str(ei.value).startswith(f"{f}: ") and fragment in str(ei.value), str(ei.value)
    f.write_text("interaction:\n  - class_name: nowhere_module.Guess\n")
    with pytest.raises(ToolConfigError, match="interaction\\[0\\].class_name: cannot import module 'nowhere_module'"):
        load_interactions(f)


def test_a_rows_interaction_kwargs_are_checked():
    assert interaction_kwargs_of({"interaction_kwargs": {"name": "guess", "answer": "7", "x": None}}, ["guess"]) == {
        "name": "guess", "answer": "7"}
    with pytest.raises(ToolConfigError, match="f.parquet:3: extra_info.interaction_kwargs must be a mapping with the "
                                              "'name' of one of the interactions \\(guess\\)"):
        interaction_kwargs_of({}, ["guess"], "f.parquet:3")
    with pytest.raises(ToolConfigError, match="interaction_kwargs.name='other' is none of the interactions"):
        interaction_kwargs_of({"interaction_kwargs": {"name": "other"}}, ["guess"])


def test_the_trainers_rollout_reads_each_rows_chat_and_interaction(tok, tmp_path):
    """MultiTurnRollout with interaction_config_path: each prompt's raw chat and interaction_kwargs
    reach the loop; the reward function's extra_info carries turn_scores; a row without
    interaction_kwargs is refused naming it."""
    from megappo.config import load_config
    from megappo.data import PromptItem
    from megappo.rollout import SamplingConfig
    from megappo.trainer.turns import MultiTurnRollout, interaction_runner_of
    from test_multi_turn import ScriptedRollout

    f = tmp_path / "i.yaml"
    f.write_text("interaction:\n  - class_name: test_interactions.Guess\n    config: {hint: h}\n")
    cfg = load_config(["actor_rollout_ref.rollout.multi_turn.enable=true",
                       f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={f}"], ["tiny_cpu"])
    chat = [[{"role": "user", "content": "Guess?"}], [{"role": "user", "content": "Again?"}]]
    prompts = [render(tok, c, gen=True) for c in chat]
    items = [PromptItem(p, "src", "gt", {"interaction_kwargs": {"name": "guess", "answer": a}}, origin=f"f:{j}",
                        raw_chat=c) for j, (p, a, c) in enumerate(zip(prompts, "79", chat))]
    engine = ScriptedRollout(tok, prompts, [["It is 7."], ["It is 9."]])
    Guess.log = []
    mt = MultiTurnRollout(cfg, engine, tok, ToolRunner({}), pad_id=tok.pad_token_id,
                          interactions=interaction_runner_of(cfg))
    batch, its, metrics, samples = mt.rollout(items, SamplingConfig(n=2, max_tokens=200, seed=3), rank=0, world=1)
    assert [it.extra_info["turn_scores"] for it in its] == [[1.0]] * 4
    assert [e[2][0]["content"] for e in Guess.log if e[0] == "respond"] == ["Guess?", "Guess?", "Again?", "Again?"]
    assert "turn_scores" not in items[0].extra_info
    items[1] = PromptItem(prompts[1], "src", "gt", {}, origin="f:1", raw_chat=chat[1])
    with pytest.raises(ToolConfigError, match="f:1: extra_info.interaction_kwargs must be a mapping"):
        mt.rollout(items, SamplingConfig(n=1, max_tokens=200, seed=3), rank=0, world=1)
    # the trainer checks every row at start, before any work
    from megappo.trainer.turns import check_interaction_rows

    check_interaction_rows(cfg, items[:1], None)
    with pytest.raises(ToolConfigError, match="f:1: extra_info.interaction_kwargs must be a mapping"):
        check_interaction_rows(cfg, items[:1], items)
    check_interaction_rows(load_config([], ["tiny_cpu"]), items)      # no interactions: nothing to check


def test_the_split_placement_sends_each_prompts_chat_and_interaction_to_the_rollout_ranks(tok, tmp_path,
                                                                                         monkeypatch):
    """Split placement: the training side's request carries each prompt's chat and
    interaction_kwargs (synchronous and one step off, Generation.request_next), and a rollout
    rank's GENERATE_TURNS hands them to its turn loop."""
    import types

    from megappo.config import load_config
    from megappo.data import PromptItem
    from megappo.distributed import split
    from megappo.rollout import SamplingConfig
    from megappo.trainer import remote
    from megappo.trainer.generation import Generation
    from megappo.trainer.turns import MultiTurnRollout

    sent = []
    monkeypatch.setattr(split, "send_command", lambda groups, op, obj=None: sent.append((op, obj)))
    f = tmp_path / "i.yaml"
    f.write_text("interaction:\n  - class_name: test_interactions.Guess\n")
    cfg = load_config(["actor_rollout_ref.rollout.multi_turn.enable=true",
                       f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={f}"], ["tiny_cpu"])
    engine = remote.RemoteRollout(types.SimpleNamespace(is_sender=True), pad_token_id=0)
    engine.policy_version = 1
    mt = MultiTurnRollout(cfg, engine, tok, None, pad_id=0)
    chat = [{"role": "user", "content": "Guess?"}]
    items = [PromptItem([5, 6], "src", "gt", {"interaction_kwargs": {"name": "guess", "answer": "7"}}, origin="f:0",
                         raw_chat=chat)]
    engine.request_turns(*mt.inputs(items)[:2], SamplingConfig(n=1), mt.inputs(items)[2])
    gen = types.SimpleNamespace(sampler=types.SimpleNamespace(next_batch=lambda: [0]), train_data=items,
                                sampling=lambda s, *a: s, turns=mt, engine=engine)
    engine.pending = None
    Generation.request_next(gen, SamplingConfig(n=1), 2)
    want = [{"messages": chat, "interaction_kwargs": {"name": "guess", "answer": "7"}}]
    assert [(op, obj["contexts"]) for op, obj in sent] == [(remote.GENERATE_TURNS, want)] * 2

    got = []
    turns = types.SimpleNamespace(generate=lambda *a: got.append(a) or "out")
    groups = types.SimpleNamespace(role_rank=0, role_world=1, bridge_rank=0, global_rank=2)
    remote._serve_one(remote.GENERATE_TURNS, sent[0][1], None, groups, 1, turns)
    assert got[0][0] == [[5, 6]] and got[0][-1] == want


def test_the_gsm8k_teacher_on_preprocessed_rows(tok, tmp_path):
    """python -m megappo.data.preprocess gsm8k_interaction writes verl's row shape; the shipped
    config's GSM8K interaction grades each answer as the GSM8K rule reward (numbers compared as
    numbers), asks again while it is wrong and ends the conversation when it is right. verl's class
    name in a config runs megappo's where verl is not installed."""
    import importlib.util
    from pathlib import Path

    from megappo.data.preprocess import gsm8k_interaction_row
    from megappo.tools import Gsm8kInteraction

    row = gsm8k_interaction_row({"question": "2+5?", "answer": "2+5=7\n#### 7"}, 3, "train")
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["extra_info"]["interaction_kwargs"] == {"name": "gsm8k", "query": row["prompt"][1]["content"],
                                                       "ground_truth": "7"}
    assert (row["extra_info"]["split"], row["extra_info"]["index"], row["reward_model"]["ground_truth"]) == ("train", 3, "7")
    shipped = load_interactions(Path(__file__).resolve().parents[2] / "examples/interactions/gsm8k.yaml")
    assert isinstance(shipped["gsm8k"], Gsm8kInteraction)
    runner = InteractionRunner(shipped)
    q = row["prompt"][1]["content"]
    prompts = [render(tok, [{"role": "user", "content": q}], gen=True)]
    engine = ScriptedEngine(tok, [["#### 8", "It is 7.0 so #### 7.0"]])
    engine.prompt_ids = prompts
    (s,), metrics = multi_turn_generate(
        engine, prompts, runner=ToolRunner({}), decode=tok.decode,
        tool_turn=ToolTurnTokens(tok, [tok.eos_token_id], roles=("user",)), max_response_length=300,
        interactions=runner, messages=[row["prompt"]], interaction_kwargs=[row["extra_info"]["interaction_kwargs"]])
    assert s.turn_scores == [0.0, 1.0] and s.stop == "interaction_done" and s.user_turns == 1
    assert Gsm8kInteraction.WRONG in tok.decode(s.response_ids) and Gsm8kInteraction.RIGHT not in tok.decode(s.response_ids)
    assert shipped["gsm8k"].truths == {}            # finalized
    if importlib.util.find_spec("verl") is None:
        f = tmp_path / "verl.yaml"
        f.write_text("interaction:\n  - name: gsm8k\n    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n"
                     "    config: {}\n")
        assert isinstance(load_interactions(f)["gsm8k"], Gsm8kInteraction)


def test_config_values_read_environment_variables_as_omegaconf(tmp_path, monkeypatch):
    """${oc.env:NAME} and ${oc.env:NAME,default} in an interaction's or a tool's config (verl
    resolves its files with OmegaConf: API keys, endpoints) are resolved when the class is built;
    an unset variable without a default is named."""
    from megappo.tools import tools_from_config

    monkeypatch.setenv("MEGAPPO_TEST_KEY", "sk-123")
    monkeypatch.delenv("MEGAPPO_TEST_UNSET", raising=False)
    f = tmp_path / "i.yaml"
    f.write_text("interaction:\n  - name: guess\n    class_name: test_interactions.Guess\n    config:\n"
                 "      key: ${oc.env:MEGAPPO_TEST_KEY}\n      url: http://${oc.env:MEGAPPO_TEST_UNSET,localhost}:80\n"
                 "      opt: ${oc.env:MEGAPPO_TEST_UNSET,null}\n      nested: [{k: '${oc.env:MEGAPPO_TEST_KEY}'}]\n")
    assert load_interactions(f)["guess"].config == {"key": "sk-123", "url": "http://localhost:80", "opt": None,
                                                    "nested": [{"k": "sk-123"}], "name": "guess"}
    assert read_interaction_config(f)[0].config["key"] == "${oc.env:MEGAPPO_TEST_KEY}"   # read: not yet resolved
    f.write_text("interaction:\n  - class_name: test_interactions.Guess\n    config: {key: '${oc.env:MEGAPPO_TEST_UNSET}'}\n")
    with pytest.raises(ToolConfigError, match=r"interaction\[0\].config.key: environment variable MEGAPPO_TEST_UNSET is "
                                              r"not set"):
        load_interactions(f)
    t = tmp_path / "t.yaml"
    t.write_text("tools:\n  - class_name: megappo.tools.Calculator\n    config: {type: native, key: '${oc.env:MEGAPPO_TEST_KEY}'}\n")
    assert tools_from_config(t)[0].config["key"] == "sk-123"
