"""Rule rewards (GSM8K strict/flexible, MATH boxed answers, synthetic echo) and custom functions."""
import pytest

from megappo.rewards import RewardFunctionError, get_reward_fn, load_custom_reward, score_batch
from megappo.rewards import gsm8k, hendrycks_math, synthetic


@pytest.mark.parametrize("text, strict, flexible", [
    ("She has 3 + 4 = 7 apples.\n#### 7", "7", "7"),
    ("#### 1,234 dollars", "1234", "1234"),
    ("first #### 5 then corrected #### 6", "6", "6"),
    ("The answer is 42.", None, "42"),
    ("no numbers here", None, None),
    ("#### -3.5", "-3.5", "-3.5"),
])
def test_gsm8k_extraction(text, strict, flexible):
    assert gsm8k.extract_answer(text, "strict") == strict
    assert gsm8k.extract_answer(text, "flexible") == flexible


def test_gsm8k_scores():
    assert gsm8k.compute_score("... #### 72", "72") == 1.0
    assert gsm8k.compute_score("... #### 71", "72") == 0.0
    assert gsm8k.compute_score("... #### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("the answer is 72", "72") == 0.0                      # strict needs ####
    assert gsm8k.compute_score("the answer is 72", "72", method="flexible") == 1.0
    assert gsm8k.compute_score("#### 72.0", "72") == 1.0
    assert gsm8k.compute_score("x" * 1000 + "#### 9", "9") == 1.0
    assert gsm8k.compute_score("#### 9" + "x" * 1000, "9") == 0.0                     # only the last 300 chars
    with pytest.raises(ValueError, match="method must be"):
        gsm8k.compute_score("#### 1", "1", method="loose")


@pytest.mark.parametrize("solution, truth, want", [
    ("so the result is $\\boxed{\\frac{1}{2}}$.", "\\frac12", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "\\dfrac{1}{2}", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{5^\\circ}", "5", 1.0),
    ("\\boxed{\\text{(B)}}", "(B)", 1.0),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\frac{\\pi}{2})", 1.0),
    ("first \\boxed{3} then \\boxed{4}", "4", 1.0),
    ("\\boxed{4}", "5", 0.0),
    ("no box: 4", "4", 0.0),
    ("\\boxed{\\sqrt2}", "\\sqrt{2}", 1.0),
    ("\\fbox{7}", "The answer is $\\boxed{7}$.", 1.0),
])
def test_math_scores(solution, truth, want):
    assert hendrycks_math.compute_score(solution, truth) == want


def test_last_boxed_handles_nesting():
    assert hendrycks_math.last_boxed("a \\boxed{\\frac{a}{b^{2}}} b") == "\\frac{a}{b^{2}}"
    assert hendrycks_math.last_boxed("\\boxed{unclosed") is None


def test_echo_task():
    rows = synthetic.make_echo_rows(20, ["red", "blue", "green"], seed=1)
    assert all(r["prompt"][0]["content"].split()[1] == r["reward_model"]["ground_truth"] for r in rows)
    assert synthetic.echo_score("red blue", "red") == 1.0 and synthetic.echo_score("blue red", "red") == 0.0
    assert synthetic.echo_score("", "red") == 0.0
    assert rows == synthetic.make_echo_rows(20, ["red", "blue", "green"], seed=1)


def test_registry_by_data_source():
    assert score_batch(["openai/gsm8k", "lighteval/MATH", "synthetic/echo"],
                       ["#### 3", "\\boxed{2}", "blue"], ["3", "3", "blue"]) == [1.0, 0.0, 1.0]
    with pytest.raises(KeyError, match="no reward function for data_source 'my/data'; built in: .*gsm8k"):
        get_reward_fn("my/data")


def test_custom_reward_function(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'boom':\n        raise ValueError('cannot parse')\n"
        "    if solution_str == 'nan':\n        return float('nan')\n"
        "    return {'score': float(solution_str == ground_truth), 'acc': 1}\n"
        "def two_args(a, b):\n    return 0\n")
    fn = load_custom_reward(str(f))
    assert score_batch(["d", "d"], ["a", "b"], ["a", "a"], custom=fn) == [1.0, 0.0]
    with pytest.raises(RewardFunctionError) as ei:
        score_batch(["d", "mine"], ["a", "boom"], ["a", "a"], custom=fn)
    msg = str(ei.value)
    assert str(f) in msg and "sample 1" in msg and "data_source='mine'" in msg and "cannot parse" in msg
    with pytest.raises(RewardFunctionError, match="returned nan for sample 0 .*must be finite"):
        score_batch(["d"], ["nan"], ["a"], custom=fn)
    with pytest.raises(RewardFunctionError, match="defines no function 'missing'"):
        load_custom_reward(str(f), "missing")
    with pytest.raises(RewardFunctionError, match="must accept"):
        load_custom_reward(str(f), "two_args")
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path: file not found"):
        load_custom_reward(str(tmp_path / "nope.py"))
    bad = tmp_path / "bad.py"
    bad.write_text("def compute_score(:\n")
    with pytest.raises(RewardFunctionError, match=f"importing {bad} failed: SyntaxError"):
        load_custom_reward(str(bad))


def test_reward_kwargs_reach_every_call_and_are_checked_first(tmp_path):
    """custom_reward_function.reward_kwargs: passed on every call beside the four arguments, as
    verl's; a name the function cannot take is an error at load time, naming the key."""
    f = tmp_path / "r.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0, bonus=0.0):\n"
                 "    return scale * float(solution_str == ground_truth) + bonus\n"
                 "def open_ended(data_source, solution_str, ground_truth, extra_info, **kw):\n"
                 "    return float(kw['weight'])\n")
    fn = load_custom_reward(str(f), reward_kwargs={"scale": 2.0, "bonus": 0.25})
    assert score_batch(["d", "d"], ["a", "b"], ["a", "a"], custom=fn) == [2.25, 0.25]
    assert score_batch(["d"], ["a"], ["a"], custom=load_custom_reward(str(f))) == [1.0]
    assert score_batch(["d"], ["a"], ["a"], custom=load_custom_reward(str(f), "open_ended", {"weight": 3})) == [3.0]
    assert f"{f}:compute_score" == fn.megappo_origin
    with pytest.raises(RewardFunctionError, match=r"custom_reward_function.reward_kwargs: .*compute_score cannot take "
                                                  r"\['scale', 'typo'\].*'typo'"):
        load_custom_reward(str(f), reward_kwargs={"scale": 2.0, "typo": 1})
    with pytest.raises(RewardFunctionError, match="cannot take \\['extra_info'\\]"):
        load_custom_reward(str(f), reward_kwargs={"extra_info": {}})     # one of the four: given twice


def test_batch_reward_manager_calls_the_function_once_with_the_lists(tmp_path):
    """reward_model.reward_manager=batch (verl's BatchRewardManager): one call per batch with
    keyword lists (and reward_kwargs); one score per sample back, numbers or dicts; the same
    scores as the per-sample path of an equivalent function; a wrong count or shape is named."""
    f = tmp_path / "judge.py"
    f.write_text("calls = []\n"
                 "def judge(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):\n"
                 "    calls.append(len(solution_strs))\n"
                 "    return [{'score': float(s == g) + bonus, 'src': d} if i % 2 else float(s == g) + bonus\n"
                 "            for i, (d, s, g) in enumerate(zip(data_sources, solution_strs, ground_truths))]\n"
                 "def one(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
                 "    return float(solution_str == ground_truth) + bonus\n"
                 "def short(data_sources, solution_strs, ground_truths, extra_infos):\n"
                 "    return [1.0]\n"
                 "def scalar(data_sources, solution_strs, ground_truths, extra_infos):\n"
                 "    return 1.0\n")
    fn = load_custom_reward(str(f), "judge", {"bonus": 0.5}, batched=True)
    details = []
    sols, truths = ["a", "b", "a", "c"], ["a", "a", "a", "c"]
    got = score_batch(["x", "y", "x", "y"], sols, truths, [{}] * 4, custom=fn, details=details)
    assert got == score_batch(["x"] * 4, sols, truths, custom=load_custom_reward(str(f), "one", {"bonus": 0.5}))
    assert got == [1.5, 0.5, 1.5, 1.5] and details == [None, {"score": 0.5, "src": "y"}, None, {"score": 1.5, "src": "y"}]
    assert fn.func.__globals__["calls"] == [4]          # one call for the batch
    with pytest.raises(RewardFunctionError, match="judge.py:short returned 1 scores for a batch of 2 samples"):
        score_batch(["x", "x"], ["a", "b"], ["a", "a"], custom=load_custom_reward(str(f), "short", batched=True))
    with pytest.raises(RewardFunctionError, match="returned float; expected a list of 2 scores"):
        score_batch(["x", "x"], ["a", "b"], ["a", "a"], custom=load_custom_reward(str(f), "scalar", batched=True))
    with pytest.raises(RewardFunctionError, match="must accept data_sources=, solution_strs=, ground_truths=, extra_infos="):
        load_custom_reward(str(f), "one", batched=True)
    with pytest.raises(RewardFunctionError, match=r"and custom_reward_function.reward_kwargs \['typo'\]"):
        load_custom_reward(str(f), "judge", {"typo": 1}, batched=True)


def test_words_task():
    rows = synthetic.make_words_rows(40, seed=2)
    assert {r["reward_model"]["ground_truth"] for r in rows} == set(synthetic.CATEGORIES)
    for r in rows:
        words = r["prompt"][0]["content"].split()
        assert words[:2] == ["list:", r["reward_model"]["ground_truth"]]
        assert not set(words[2:]) & set(synthetic.CATEGORIES[words[1]])  # distractors are other categories
    fruit = synthetic.CATEGORIES["fruit"]
    # each right word in the first 8 slots adds 1/8; later words and wrong words add nothing
    assert synthetic.words_score(" ".join(fruit[:3]), "fruit") == 3 / 8
    assert synthetic.words_score(" ".join(fruit + fruit), "fruit") == 1.0
    assert synthetic.words_score("cat " + " ".join(fruit[:2]), "fruit") == 2 / 8
    assert synthetic.words_score("", "fruit") == 0.0
    assert synthetic.words_score("apple pear", "fruit", max_words=4) == 0.5
    with pytest.raises(ValueError, match="unknown category 'veg'"):
        synthetic.words_score("apple", "veg")
    from megappo.rewards import score_batch

    assert score_batch(["synthetic/words"], ["apple cat"], ["fruit"], [{"max_words": 2}]) == [0.5]


def test_pick_first_and_copy_scores():
    from megappo.rewards import score_batch
    from megappo.rewards import synthetic

    gt = "t10 t11 t12 t13 t14 t15 t16 t17"
    assert synthetic.pick_first_score("t10 t10 t11 t10", gt) == 3 / 8
    assert synthetic.pick_first_score(" ".join(["t10"] * 12), gt) == 1.0      # only the first 8 words count
    assert synthetic.copy_score("t10 t11 t99 t13", gt) == 3 / 8
    assert synthetic.copy_score("t11 t12 t13", gt) == 0.0                     # position matters
    assert synthetic.copy_score(gt + " t18", gt) == 1.0
    rows = synthetic.make_token_rows(16, seed=3, source=synthetic.PICK_FIRST_SOURCE)
    assert len(rows) == 16 and all(len(r["prompt"][0]["content"].split()) == 8 for r in rows)
    assert rows == synthetic.make_token_rows(16, seed=3, source=synthetic.PICK_FIRST_SOURCE)   # deterministic
    assert score_batch([synthetic.PICK_FIRST_SOURCE, synthetic.COPY_SOURCE], ["t10 t10", "t10 t11"], [gt, gt]) == [0.25, 0.25]
    assert synthetic.pick_last_score("t17 t10 t17 t17", gt) == 3 / 8        # the prompt's LAST word
    assert synthetic.pick_last_score(" ".join(["t17"] * 9) + " t10", gt) == 1.0
    assert score_batch([synthetic.PICK_LAST_SOURCE], ["t10 t17"], [gt]) == [0.125]
    import pytest
    with pytest.raises(ValueError, match="unknown source"):
        synthetic.make_token_rows(2, seed=0, source="synthetic/nope")
