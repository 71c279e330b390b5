"""GSM8K and MATH from the hub (``python -m megappo.data.preprocess gsm8k|math --out DIR`` without
--input), offline: the data set repositories are built in a hub cache in the hub client's layout
(datasets--org--name/snapshots/<rev>/ with the README's configs and parquet files, as on the hub)
and read through ``datasets``; the rows must equal what --input gives on the same parquet files,
which megappo reads with pyarrow alone (two independent readers)."""
import io
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megappo.data import preprocess

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from hub_cache import hub_cache  # noqa: E402

GSM8K_README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
  - split: test
    path: socratic/test-*
---
# gsm8k
"""

MATH_README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
  - split: test
    path: data/test-*
- config_name: algebra
  data_files:
  - split: train
    path: algebra/train-*
  - split: test
    path: algebra/test-*
---
# MATH-lighteval
"""

GSM8K = {"train": [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
                   {"question": "What is 1,000 + 234?", "answer": "1000+234=1234\n#### 1,234"},
                   {"question": "Héloïse reads 12 pages a day for 3 days. Pages?", "answer": "12*3=36\n#### 36"}],
         "test": [{"question": "2+2?", "answer": "#### 4"}]}
SOCRATIC = {"train": [{"question": "Only in socratic?", "answer": "How many? ** 5\n#### 5"}],
            "test": [{"question": "Socratic test?", "answer": "#### 6"}]}
MATH = {"train": [{"problem": "Half of 1?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
                   "type": "Prealgebra"},
                  {"problem": "Solve $x+1=3$.", "solution": "$x=\\boxed{2}$", "level": "Level 2", "type": "Algebra"}],
        "test": [{"problem": "$2^3$?", "solution": "$\\boxed{8}$", "level": "Level 1", "type": "Algebra"}]}


def _parquet(rows) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def _dataset(cache: Path, repo: str, readme: str, configs: dict) -> Path:
    files = {"README.md": readme}
    for folder, splits in configs.items():
        for split, rows in splits.items():
            files[f"{folder}/{split}-00000-of-00001.parquet"] = _parquet(rows)
    return hub_cache(cache, repo, files=files, repo_type="dataset")


def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    return {**env, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def _preprocess(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megappo.data.preprocess", *args], env=_env(tmp_path),
                          capture_output=True, text=True, timeout=600)


def _rows(folder: Path) -> dict:
    return {split: pq.read_table(str(folder / f"{split}.parquet")).to_pylist() for split in ("train", "test")}


@pytest.mark.parametrize("task,repo,readme,configs,folder", [
    ("gsm8k", "openai/gsm8k", GSM8K_README, {"main": GSM8K, "socratic": SOCRATIC}, "main"),
    ("math", "DigitalLearningGmbH/MATH-lighteval", MATH_README, {"data": MATH, "algebra": {"train": MATH["test"],
                                                                                          "test": MATH["test"]}}, "data"),
])
def test_hub_data_set_equals_the_same_files_as_input(tmp_path, task, repo, readme, configs, folder):
    assert preprocess.HUB_DATASETS[task][0] == repo
    snap = _dataset(tmp_path / "home" / "hub", repo, readme, configs)
    r = _preprocess(tmp_path, task, "--out", str(tmp_path / "hub_out"))
    assert r.returncode == 0, r.stderr[-3000:]
    r = _preprocess(tmp_path, task, "--input", str(snap / folder), "--out", str(tmp_path / "input_out"))
    assert r.returncode == 0, r.stderr[-3000:]
    from_hub, from_input = _rows(tmp_path / "hub_out"), _rows(tmp_path / "input_out")
    assert from_hub == from_input
    # the data set's own rows, in order (its main/default config, not another one)
    expected = GSM8K if task == "gsm8k" else MATH
    key = "question" if task == "gsm8k" else "problem"
    for split in ("train", "test"):
        assert [row["prompt"][0]["content"].split(" Let's")[0] for row in from_hub[split]] == [
            raw[key] for raw in expected[split]]
    assert [row["reward_model"]["ground_truth"] for row in from_hub["train"]] == (
        ["7", "1234", "36"] if task == "gsm8k" else ["\\frac{1}{2}", "2"])


def test_hub_data_set_that_cannot_be_had_names_it_and_input(tmp_path):
    r = _preprocess(tmp_path, "gsm8k", "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("megappo.data.preprocess: dataset openai/gsm8k: not in the HF cache")
    assert "HF_HUB_OFFLINE=1" in r.stderr and "--input" in r.stderr
    assert not (tmp_path / "out").exists()


def test_missing_datasets_package_names_the_data_set_and_input(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)   # import datasets -> ImportError
    assert preprocess.main(["math", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "DigitalLearningGmbH/MATH-lighteval: reading the hub data set needs the `datasets` package" in err
    assert "--input" in err


def test_gsm8k_tool_rows_offer_the_calculator_that_examples_tools_ships(tmp_path):
    """gsm8k_tool: the GSM8K rows with a system prompt offering the calculator and verl's
    tools_kwargs shape; the tool config megappo ships builds that tool, and a row's create_kwargs
    reach its create (as the multi-turn rollout passes them)."""
    from megappo.tools import tools_from_config, tools_kwargs_of

    _dataset(tmp_path / "home" / "hub", "openai/gsm8k", GSM8K_README, {"main": GSM8K, "socratic": SOCRATIC})
    r = _preprocess(tmp_path, "gsm8k_tool", "--out", str(tmp_path / "tool_out"))
    assert r.returncode == 0, r.stderr[-3000:]
    r = _preprocess(tmp_path, "gsm8k", "--out", str(tmp_path / "plain_out"))
    assert r.returncode == 0, r.stderr[-3000:]
    tool, plain = _rows(tmp_path / "tool_out"), _rows(tmp_path / "plain_out")
    assert [len(tool[s]) for s in ("train", "test")] == [3, 1]
    for split in ("train", "test"):
        for t, p in zip(tool[split], plain[split]):
            system, *rest = t["prompt"]
            assert system["role"] == "system" and "`calculator` tool" in system["content"]
            assert "`#### <answer>`" in system["content"] and rest == p["prompt"]
            assert t["reward_model"] == p["reward_model"] and t["data_source"] == "openai/gsm8k"
            extra = t["extra_info"]
            assert extra["need_tools_kwargs"] is True and "interaction_kwargs" not in extra
            assert {k: extra[k] for k in ("split", "index", "answer", "question")} == p["extra_info"]
            assert tools_kwargs_of(extra) == {"calculator": {"create_kwargs": {
                "ground_truth": p["reward_model"]["ground_truth"]}}}
    (calc,) = tools_from_config(REPO / "examples" / "tools" / "calculator.yaml")
    assert calc.name == "calculator" and calc.tool_schema["function"]["parameters"]["required"] == ["expression"]
    iid = calc.create(**tools_kwargs_of(tool["train"][1]["extra_info"])["calculator"]["create_kwargs"])
    assert calc.execute(iid, {"expression": "1000 + 234"})[0] == "1234"


def test_verls_multi_turn_gsm8k_rows_run_with_verls_tool_config(tmp_path):
    """gsm8k_multiturn_w_tool: verl's rows (its prompts, the calc_gsm8k_reward tool's create_kwargs);
    verl's tool config builds megappo's Gsm8kTool where verl is absent, and a row's create_kwargs
    make it grade the row's answer."""
    sys.path.insert(0, str(REPO / "tests" / "unit"))
    from verl_commands import VERL_GSM8K_TOOL_CONFIG

    from megappo.tools import ToolRunner, ToolCall, tools_from_config, tools_kwargs_of

    _dataset(tmp_path / "home" / "hub", "openai/gsm8k", GSM8K_README, {"main": GSM8K, "socratic": SOCRATIC})
    r = _preprocess(tmp_path, "gsm8k_multiturn_w_tool", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(tmp_path / "out")
    assert [len(rows[s]) for s in ("train", "test")] == [3, 1]
    for t in rows["train"]:
        system, user = t["prompt"]
        assert "`calc_gsm8k_reward` tool" in system["content"] and system["role"] == "system"
        assert user == {"role": "user", "content": t["extra_info"]["question"] + " Let's think step by step and "
                                                   "output the final answer after `####`."}
        truth = t["reward_model"]["ground_truth"]
        assert truth == t["extra_info"]["answer"].split("####")[-1].strip().replace(",", "")
        assert tools_kwargs_of(t["extra_info"]) == {
            "calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}}
        assert t["extra_info"]["interaction_kwargs"] == {"query": user["content"], "ground_truth": truth}
    (tmp_path / "tools.yaml").write_text(VERL_GSM8K_TOOL_CONFIG)
    (tool,) = tools_from_config(tmp_path / "tools.yaml")
    runner = ToolRunner({tool.name: tool})
    row = rows["train"][0]
    truth = row["reward_model"]["ground_truth"]
    out = runner.run_turn(["s"], [[ToolCall("calc_gsm8k_reward", {"answer": truth})]], [tools_kwargs_of(row["extra_info"])])
    assert out[0][0].text == f"Current parsed answer={truth!r} reward=1.0" and runner.finish("s") == {"calc_gsm8k_reward": 1.0}
