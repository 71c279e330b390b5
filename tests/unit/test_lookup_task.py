"""The synthetic tool-use task ``lookup`` (benchmarks/learning.py --tasks lookup,lookup_notools):
its data carry no answer a tool-free policy could read, its tokenizer spells a call as one token
that ends the turn, its tool answers each row's hidden value, and its score reads the model's
answer, not the tool's."""

import pytest

from megappo.rewards import score_batch, synthetic
from megappo.tools import Lookup, ToolRunner, load_tools, parse_hermes

ROW_SEEDS = (0, 1, 2)


@pytest.mark.parametrize("seed", ROW_SEEDS)
def test_no_policy_without_the_tool_can_reach_the_target(seed):
    """The benchmark's data (8192 rows per seed): a policy that sees only the prompt scores at
    most its prompt's most frequent answer; that bound is far under the target (0.8)."""
    rows = synthetic.make_lookup_rows(8192, seed)
    ceiling = synthetic.lookup_ceiling_without_tools(rows)
    assert 1 / 8 <= ceiling < 0.2
    # the bound, computed another way: the best constant answer per prompt, tried exhaustively
    best = 0.0
    for prompt in {r["prompt"][-1]["content"] for r in rows}:
        mine = [r for r in rows if r["prompt"][-1]["content"] == prompt]
        best += max(sum(synthetic.lookup_score(v, r["reward_model"]["ground_truth"]) for r in mine)
                    for v in synthetic.LOOKUP_VALUES)
    assert best / len(rows) == pytest.approx(ceiling)
    # each row's answer is only in its tool's create_kwargs and its ground truth
    for r in rows[:50]:
        answer = r["reward_model"]["ground_truth"]
        assert r["extra_info"]["tools_kwargs"]["lookup"]["create_kwargs"] == {"answer": answer}
        assert answer not in r["prompt"][-1]["content"]


def test_the_answer_is_the_models_word_after_the_tools():
    s = synthetic.lookup_score
    assert s("= v3 v3", "v3") == 1.0                # called, copied the tool's answer
    assert s("= v3", "v3") == 0.0                   # called and stopped: the tool's word is not an answer
    assert s("= v3 v5", "v3") == 0.0
    assert s("v3", "v3") == 1.0 and s("v4 v3", "v3") == 0.0   # no call: the first word (a lucky guess)
    assert s("= v1 = v3 v3", "v3") == 1.0           # after the last tool answer
    assert s("", "v3") == 0.0
    # a wrong answer is worth what the tool's calc_reward gave (a call); a right one 1
    called = {"rollout_reward_scores": {"lookup": 0.1}}
    assert s("= v3 v5", "v3", called) == 0.1 and s("= v3 v3", "v3", called) == 1.0
    assert score_batch([synthetic.LOOKUP_SOURCE] * 2, ["= v2 v2", "= v2 v7"], ["v2", "v2"], [called, called]) == [1.0, 0.1]


def test_the_tool_answers_each_samples_row_and_rewards_a_call():
    runner = ToolRunner(load_tools(extra=(Lookup(),)), max_parallel_calls=1, max_response_length=64,
                        truncate_side="right", timeout_s=10.0)
    call = parse_hermes(synthetic.LOOKUP_CALL)[1]
    assert [c.name for c in call] == ["lookup"]
    kwargs = [{"lookup": {"create_kwargs": {"answer": v}}} for v in ("v1", "v6")]
    answers = runner.run_turn([0, 1], [call, call], kwargs)
    assert [[a.text for a in x] for x in answers] == [["= v1"], ["= v6"]]
    assert runner.finish(0) == {"lookup": 0.1} and runner.finish(1) == {"lookup": 0.1}
    assert runner.finish(2) == {}            # a sample that never called: no reward from the tool
    assert Lookup(config={"call_reward": 0.0}).calc_reward("x") == 0.0


def test_the_tiny_tokenizer_spells_a_call_as_one_turn_ending_token(tmp_path):
    import json

    from transformers import AutoTokenizer

    from megappo.data.tiny import make_tiny_setup
    from megappo.rollout import ToolTurnTokens

    paths = make_tiny_setup(str(tmp_path / "lookup"), task="lookup", n_train=16, n_test=4)
    tok = AutoTokenizer.from_pretrained(paths["model"])
    call = tok.convert_tokens_to_ids(synthetic.LOOKUP_CALL)
    assert tok.encode(synthetic.LOOKUP_CALL, add_special_tokens=False) == [call]
    eos = json.load(open(f"{paths['model']}/generation_config.json"))["eos_token_id"]
    assert eos == [tok.eos_token_id, call]
    # the parser reads the decoded token as a lookup call; the reward text drops it
    assert [c.name for c in parse_hermes(tok.decode([call], skip_special_tokens=False))[1]] == ["lookup"]
    turn = ToolTurnTokens(tok, eos)(["= v5"])
    assert tok.convert_ids_to_tokens(turn) == ["<|tool|>", "=", "v5", "<|assistant|>"]
    v5 = tok.convert_tokens_to_ids("v5")
    text = tok.decode([call, *turn, v5, tok.eos_token_id], skip_special_tokens=True)
    assert synthetic.lookup_answer(text) == "v5"
    # every word of the task has its own id, under the model's vocabulary
    words = synthetic.LOOKUP_WORDS
    ids = [tok.convert_tokens_to_ids(w) for w in words]
    assert len(set(ids)) == len(words) and tok.unk_token_id not in ids and max(ids) < 64 and call < 64
    # the other tasks' ids did not move (the extra special tokens come after the words)
    other = make_tiny_setup(str(tmp_path / "pf"), task="pick_first", n_train=16, n_test=4)
    pf = AutoTokenizer.from_pretrained(other["model"])
    assert pf.convert_tokens_to_ids("t10") == len(pf.all_special_tokens) and "<|tool|>" not in pf.get_vocab()
