"""Reliability against bad input: every bad value, file or reward function gets a clear error naming
what is wrong and what was expected, before any work starts (the config and data cases in detail
live in test_config.py and test_data.py; this file holds the reward-function cases and checks that
sweep every config key)."""
import sys
import types
import typing

import pytest

from megappo import config as C
from megappo.config import parse as P
from megappo.config import schema as S
from megappo.config import ConfigError, load_config, validate
from megappo.rewards import RewardFunctionError, load_custom_reward, score_batch

# ------------------------------------------------------------------------------------------
# A user's reward function misbehaving on one sample
# ------------------------------------------------------------------------------------------

REWARD_PY = '''
import math

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise ZeroDivisionError("division by zero in my parser")
    if solution_str == "nan":
        return math.nan
    if solution_str == "inf":
        return float("inf")
    if solution_str == "-inf":
        return {"score": -math.inf}
    if solution_str == "text":
        return "correct"
    if solution_str == "none":
        return None
    if solution_str == "list":
        return [1.0]
    if solution_str == "nodict":
        return {"acc": 1.0}
    if solution_str == "badscore":
        return {"score": "high"}
    return float(solution_str == ground_truth)

not_a_function = 3
'''


@pytest.fixture
def reward_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(REWARD_PY)
    return f


def test_reward_that_works_scores_every_sample(reward_file):
    fn = load_custom_reward(str(reward_file))
    assert score_batch(["a", "b", "c"], ["x", "y", "z"], ["x", "x", "z"], custom=fn) == [1.0, 0.0, 1.0]


def test_reward_raising_on_one_sample_names_file_sample_source_and_cause(reward_file):
    fn = load_custom_reward(str(reward_file))
    with pytest.raises(RewardFunctionError) as ei:
        score_batch(["openai/gsm8k", "openai/gsm8k", "my/set"], ["x", "y", "boom"], ["x", "x", "x"], custom=fn)
    msg = str(ei.value)
    assert msg == (f"{reward_file}:compute_score raised on sample 2 (data_source='my/set'): "
                   "ZeroDivisionError: division by zero in my parser")
    assert isinstance(ei.value.__cause__, ZeroDivisionError)       # the original traceback is kept


@pytest.mark.parametrize("solution, fragment", [
    ("nan", "returned nan for sample 1 (data_source='s1'); rewards must be finite"),
    ("inf", "returned inf for sample 1 (data_source='s1'); rewards must be finite"),
    ("-inf", "returned -inf for sample 1 (data_source='s1'); rewards must be finite"),
    ("text", "returned 'correct' for sample 1 (data_source='s1'); expected a number"),
    ("none", "returned None for sample 1 (data_source='s1'); expected a number"),
    ("list", "returned [1.0] for sample 1 (data_source='s1'); expected a number"),
    ("nodict", "returned a dict without 'score' for sample 1 (data_source='s1')"),
    ("badscore", "returned 'high' for sample 1 (data_source='s1'); expected a number"),
])
def test_reward_returning_a_non_finite_or_non_number_is_an_error(reward_file, solution, fragment):
    fn = load_custom_reward(str(reward_file))
    with pytest.raises(RewardFunctionError) as ei:
        score_batch(["s0", "s1"], ["x", solution], ["x", "x"], custom=fn)
    assert str(ei.value) == f"{reward_file}:compute_score {fragment}"


def test_builtin_reward_for_unknown_data_source_names_the_sample():
    with pytest.raises(RewardFunctionError) as ei:
        score_batch(["openai/gsm8k", "my/own"], ["#### 1", "x"], ["1", "x"])
    msg = str(ei.value)
    assert msg.startswith("sample 1: no reward function for data_source 'my/own'; built in: ")
    assert "openai/gsm8k" in msg and msg.endswith("or set custom_reward_function.path")


def test_missing_function_name_names_file_and_name(reward_file):
    with pytest.raises(RewardFunctionError) as ei:
        load_custom_reward(str(reward_file), "compute_reward")
    assert str(ei.value) == f"custom_reward_function.name: {reward_file} defines no function 'compute_reward'"
    with pytest.raises(RewardFunctionError, match=f"{reward_file} defines no function 'not_a_function'"):
        load_custom_reward(str(reward_file), "not_a_function")     # a name that is not callable


def test_reward_file_with_a_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "broken_reward.py"
    bad.write_text("import math\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                   "    return math.sqrt(\n")
    with pytest.raises(RewardFunctionError) as ei:
        load_custom_reward(str(bad))
    msg = str(ei.value)
    assert msg.startswith(f"custom_reward_function.path: importing {bad} failed: SyntaxError: ")
    assert "line 4" in msg
    assert isinstance(ei.value.__cause__, SyntaxError)


def test_reward_file_failing_at_import_and_missing_file(tmp_path):
    bad = tmp_path / "needs_pkg.py"
    bad.write_text("import a_package_that_is_not_installed\n")
    with pytest.raises(RewardFunctionError, match=f"importing {bad} failed: ModuleNotFoundError: "
                                                  "No module named 'a_package_that_is_not_installed'"):
        load_custom_reward(str(bad))
    with pytest.raises(FileNotFoundError, match=f"custom_reward_function.path: file not found: {tmp_path}/nope.py"):
        load_custom_reward(str(tmp_path / "nope.py"))


# ------------------------------------------------------------------------------------------
# Every config key: a value of the wrong type is named with what was expected, and no value of
# the right type makes validate() crash instead of reporting
# ------------------------------------------------------------------------------------------

def _leaf_type(key: str):
    obj, name, tp = S._locate(C.PPOConfig(), key)
    return tp


def _strict(tp) -> bool:
    """Whether the text 'xyz?' is not a valid value of ``tp`` (everything but free strings)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return all(_strict(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is list:
        return _strict(typing.get_args(tp)[0])
    return tp is not str


STRICT_KEYS = [k for k in C.all_keys() if _strict(_leaf_type(k))]


def test_typed_key_sweep_is_not_empty():
    assert len(STRICT_KEYS) >= 60 and "data.train_batch_size" in STRICT_KEYS and "data.truncation" in STRICT_KEYS


@pytest.mark.parametrize("key", STRICT_KEYS)
def test_every_typed_key_rejects_a_wrong_type_naming_key_and_type(key):
    tp = _leaf_type(key)
    with pytest.raises(ConfigError) as ei:
        load_config([f"{key}=xyz?"], ())
    assert ei.value.errors[0][0] == key
    msg = ei.value.errors[0][1]
    assert "expected" in msg and "'xyz?'" in msg, msg
    assert P._type_name(typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp).split(" or ")[0] in msg, msg


def _numeric_keys():
    out = []
    for k in C.all_keys():
        tp = _leaf_type(k)
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        if args[0] in (int, float) and typing.get_origin(tp) is not list:
            out.append((k, args[0]))
    return out


NUMERIC = _numeric_keys()
EXTREMES = {int: ["0", "-1", "1000000000000"], float: ["-1", "0", "1e30", "inf", "-inf"]}


def test_extreme_numbers_never_crash_validate():
    """Every numeric key at 0, negative, huge and infinite values: validate() either accepts the
    config or raises ConfigError, and an error never lands on an empty key."""
    assert len(NUMERIC) >= 50
    for key, tp in NUMERIC:
        for v in EXTREMES[tp]:
            cfg = load_config([f"{key}={v}"], ("tiny_cpu",))
            try:
                validate(cfg, world_size=2)
            except ConfigError as e:
                assert all(k for k, _ in e.errors), (key, v, e)
            except Exception as e:  # pragma: no cover - the failure this test exists to catch
                pytest.fail(f"{key}={v}: validate raised {type(e).__name__}: {e}")


def test_nan_is_refused_for_every_float_key():
    floats = [k for k, tp in NUMERIC if tp is float]
    assert len(floats) >= 20
    for key in floats:
        with pytest.raises(ConfigError) as ei:
            load_config([f"{key}=nan"], ())
        assert ei.value.errors == [(key, "expected a number, got 'nan'")]


def test_non_finite_floats_in_yaml(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("actor_rollout_ref:\n  actor:\n    clip_ratio: .nan\n")
    with pytest.raises(ConfigError) as ei:
        load_config([], [str(f)])
    assert ei.value.errors == [("actor_rollout_ref.actor.clip_ratio", f"expected a number, got nan (in {f}, line 3)")]


# ------------------------------------------------------------------------------------------
# The entry point stops on bad input before any work starts
# ------------------------------------------------------------------------------------------

@pytest.fixture
def fake_trainer(monkeypatch):
    """Stand-in for megappo.trainer: records whether the entry point got as far as starting work."""
    calls = []
    mod = types.ModuleType("megappo.trainer")

    def init_distributed(cfg):
        calls.append("init_distributed")

    class PPOTrainer:
        def __init__(self, cfg):
            calls.append("PPOTrainer")

        def fit(self):
            calls.append("fit")

    mod.init_distributed, mod.PPOTrainer = init_distributed, PPOTrainer
    monkeypatch.setitem(sys.modules, "megappo.trainer", mod)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    return calls


@pytest.fixture
def real_paths(tmp_path):
    from megappo.data.preprocess import write_parquet
    from megappo.rewards.synthetic import make_echo_rows

    rows = make_echo_rows(8, ["red", "blue"], seed=0)
    write_parquet(rows, str(tmp_path / "train.parquet"))
    write_parquet(rows, str(tmp_path / "test.parquet"))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return ["--config", "tiny_cpu", f"data.train_files={tmp_path}/train.parquet", f"data.val_files={tmp_path}/test.parquet",
            f"actor_rollout_ref.model.path={tmp_path}/model"]


def test_entry_point_starts_work_on_good_input(fake_trainer, real_paths, capsys, monkeypatch):
    from megappo import train

    monkeypatch.setenv("RANK", "0")  # as a launcher starts the preset's two ranks
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.main(real_paths) == 0
    assert fake_trainer == ["init_distributed", "PPOTrainer", "fit"]   # the stand-in is what main uses


@pytest.mark.parametrize("extra, fragment", [
    (["data.train_batch_size=abc"], "data.train_batch_size: expected an integer, got 'abc'"),
    (["algorithm.adv_estimator=ppo2"], "algorithm.adv_estimator: unknown advantage estimator 'ppo2'"),
    (["actor_rollout_ref.actor.kl_loss_type=k9"], "actor_rollout_ref.actor.kl_loss_type: unknown KL estimator 'k9'"),
    (["data.val_files=/nonexistent/val.parquet"], "data.val_files: file not found: /nonexistent/val.parquet"),
    (["trainer.n_gpus_per_node=3", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
     "must be divisible by TP x PP = 2 x 1 = 2 (actor_rollout_ref.actor.megatron.tensor_model_parallel_size x "
     "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size)"),
])
def test_entry_point_stops_before_any_work(fake_trainer, real_paths, capsys, extra, fragment):
    from megappo import train

    assert train.main(real_paths + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("megappo: invalid configuration, nothing was started.")
    assert fragment in err, err
    assert fake_trainer == []


def test_entry_point_reports_yaml_syntax_error_with_file_and_line(fake_trainer, tmp_path, capsys):
    from megappo import train

    f = tmp_path / "mine.yaml"
    f.write_text("data:\n  train_batch_size: 8\n   max_prompt_length: 64\n")
    assert train.main(["--dry-run", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"--config: cannot parse '{f}' as YAML: line 3" in err, err
    assert fake_trainer == []


def test_launcher_world_size_mismatch_stops_before_work(fake_trainer, real_paths, capsys, monkeypatch):
    from megappo import train

    monkeypatch.setenv("WORLD_SIZE", "3")
    assert train.main(real_paths) == 2
    assert "but the launcher started WORLD_SIZE=3 processes" in capsys.readouterr().err
    assert fake_trainer == []
