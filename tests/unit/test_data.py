"""Prompt data: verl-schema parquet, chat template, overlong handling, sampling, preprocessing."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megappo.data import DataError, PromptDataset, PromptSampler, build_word_tokenizer, dp_slice, tokenize_prompt
from megappo.data import preprocess
from megappo.rewards import score_batch

WORDS = ["echo", ":", "red", "blue", "green", "gold", "one", "two", "three", "four", "five", "six"]


@pytest.fixture(scope="module")
def tok():
    return build_word_tokenizer(WORDS)


def row(content, truth="red", source="synthetic/echo"):
    return {"data_source": source, "prompt": [{"role": "user", "content": content}], "ability": "copy",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"k": 1}}


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def test_word_tokenizer_and_chat_template(tok, tmp_path):
    ids = tokenize_prompt(tok, [{"role": "user", "content": "echo: red blue"}])
    assert tok.convert_ids_to_tokens(ids) == ["<|user|>", "echo", ":", "red", "blue", "<|assistant|>"]
    assert tok.eos_token == "</s>" and tok.pad_token_id == 0
    tok.save_pretrained(str(tmp_path / "t"))
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(str(tmp_path / "t"))
    assert tokenize_prompt(again, [{"role": "user", "content": "echo: red blue"}]) == ids


def test_files_concatenated_in_order(tok, tmp_path):
    a = write(tmp_path / "a.parquet", [row("echo: red"), row("echo: blue", "blue")])
    b = write(tmp_path / "b.parquet", [row("echo: gold", "gold")])
    ds = PromptDataset([a, b], tok, max_prompt_length=16)
    assert [it.ground_truth for it in ds] == ["red", "blue", "gold"]
    assert ds[2].origin == f"{b}:0" and ds[0].extra_info == {"k": 1} and ds[0].ability == "copy"


def test_overlong_prompts(tok, tmp_path):
    long = "echo: " + " ".join(["one", "two", "three", "four", "five", "six"] * 2)   # 2 + 12 words + 2 specials
    f = write(tmp_path / "d.parquet", [row("echo: red"), row(long), row("echo: blue", "blue")])
    with pytest.raises(DataError, match=rf"{f}, row 1: prompt is 16 tokens, longer than data.max_prompt_length=8"):
        PromptDataset(f, tok, max_prompt_length=8)
    ds = PromptDataset(f, tok, max_prompt_length=8, filter_overlong_prompts=True)
    assert len(ds) == 2 and ds.num_filtered == 1
    full = tokenize_prompt(tok, [{"role": "user", "content": long}])
    for how, want in [("left", full[-8:]), ("right", full[:8]), ("middle", full[:4] + full[-4:])]:
        ds = PromptDataset(f, tok, max_prompt_length=8, truncation=how)
        assert ds[1].prompt_ids == want and ds[1].truncated and ds.num_truncated == 1
    with pytest.raises(DataError, match="no prompts left after filtering"):
        PromptDataset(write(tmp_path / "e.parquet", [row(long)]), tok, max_prompt_length=8,
                      filter_overlong_prompts=True)


@pytest.mark.parametrize("bad, fragment", [
    ({"prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": "a"}}, "missing column 'data_source'"),
    ({"data_source": "d", "reward_model": {"ground_truth": "a"}}, "missing column 'prompt'"),
    ({"data_source": 3, "prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": "a"}},
     "field 'data_source' must be a string"),
    ({"data_source": "d", "prompt": "just text", "reward_model": {"ground_truth": "a"}},
     "field 'prompt' must be a non-empty list of chat messages"),
    ({"data_source": "d", "prompt": [{"role": "user"}], "reward_model": {"ground_truth": "a"}}, "field 'prompt[0]'"),
    ({"data_source": "d", "prompt": [{"role": "user", "content": "x"}], "reward_model": {"style": "rule"}},
     "field 'reward_model.ground_truth' is missing"),
])
def test_schema_errors_name_file_row_field(tok, tmp_path, bad, fragment):
    good = write(tmp_path / "good.parquet", [row("echo: red")])
    f = write(tmp_path / "bad.parquet", [bad])
    with pytest.raises(DataError) as ei:
        PromptDataset([good, f], tok, max_prompt_length=16)
    assert f"{f}, row 0: " in str(ei.value) and fragment in str(ei.value)


def test_null_field_in_a_later_row(tok, tmp_path):
    f = write(tmp_path / "nulls.parquet", [row("echo: red"), {**row("echo: blue"), "data_source": None}])
    with pytest.raises(DataError, match=r"nulls.parquet, row 1: field 'data_source' is null"):
        PromptDataset(f, tok, max_prompt_length=16)


def test_file_errors(tok, tmp_path):
    with pytest.raises(DataError, match="missing.parquet: file not found"):
        PromptDataset(str(tmp_path / "missing.parquet"), tok, max_prompt_length=8)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"data_source": pa.array([], pa.string())}), str(empty))
    with pytest.raises(DataError, match="empty.parquet: the file has no rows"):
        PromptDataset(str(empty), tok, max_prompt_length=8)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"\xff\xfe not parquet")
    with pytest.raises(DataError, match="junk.parquet: cannot read as parquet"):
        PromptDataset(str(junk), tok, max_prompt_length=8)
    with pytest.raises(ValueError, match="data.truncation must be"):
        PromptDataset(str(junk), tok, max_prompt_length=8, truncation="both")


def test_sampler_epochs_shuffle_and_resume():
    s = PromptSampler(10, 4, seed=3)
    assert s.batches_per_epoch == 2
    first = [s.next_batch() for _ in range(6)]          # 3 epochs of 2 batches
    assert len(set(first[0] + first[1])) == 8             # no repeats inside an epoch
    assert first[0] != first[2]                           # reshuffled per epoch
    again = PromptSampler(10, 4, seed=3)
    assert [again.next_batch() for _ in range(6)] == first  # seeded
    resumed = PromptSampler(10, 4, seed=3)
    head = PromptSampler(10, 4, seed=3)
    for _ in range(3):
        head.next_batch()
    resumed.load_state_dict(head.state_dict())
    assert [resumed.next_batch() for _ in range(3)] == first[3:]
    with pytest.raises(ValueError, match="cannot resume the data order: seed was 3 and is now 4"):
        PromptSampler(10, 4, seed=4).load_state_dict(head.state_dict())
    assert PromptSampler(5, 5, shuffle=False).next_batch() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="train_batch_size=8 is larger than the dataset"):
        PromptSampler(5, 8)
    assert dp_slice(list(range(8)), 1, 4) == [2, 3]
    with pytest.raises(ValueError, match="do not split evenly"):
        dp_slice(list(range(6)), 0, 4)


def test_preprocess_gsm8k_and_reward(tok, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    train = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
             {"question": "What is 1,000 + 234?", "answer": "#### 1,234"}]
    (raw / "train.jsonl").write_text("\n".join(json.dumps(r) for r in train))
    (raw / "test").mkdir()
    table = pa.Table.from_pylist([{"question": "2+2?", "answer": "#### 4"}])
    with pa.OSFile(str(raw / "test" / "data-00000-of-00001.arrow"), "wb") as sink:   # HF save_to_disk layout
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    out = tmp_path / "gsm8k"
    assert preprocess.main(["gsm8k", "--input", str(raw), "--out", str(out)]) == 0
    rows = pq.read_table(str(out / "train.parquet")).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1234"]
    assert rows[0]["data_source"] == "openai/gsm8k" and "####" in rows[0]["prompt"][0]["content"]
    assert pq.read_table(str(out / "test.parquet")).to_pylist()[0]["reward_model"]["ground_truth"] == "4"
    ds = PromptDataset([str(out / "train.parquet")], build_word_tokenizer(WORDS), max_prompt_length=64)
    truths = [it.ground_truth for it in ds]
    assert truths == ["7", "1234"]
    assert score_batch(["openai/gsm8k"] * 4, ["so #### 7", "#### 8", "it is #### 1,234", "1234"],
                       [truths[0], truths[0], truths[1], truths[1]]) == [1.0, 0.0, 1.0, 0.0]


def test_preprocess_math_synthetic_and_errors(tmp_path, capsys):
    f = tmp_path / "math.json"
    f.write_text(json.dumps([{"problem": "Half of 1?", "solution": "It is $\\boxed{\\frac{1}{2}}$."}]))
    assert preprocess.main(["math", "--input", str(f), "--out", str(tmp_path / "m")]) == 0
    r = pq.read_table(str(tmp_path / "m" / "train.parquet")).to_pylist()[0]
    assert r["reward_model"]["ground_truth"] == "\\frac{1}{2}"
    assert score_batch([r["data_source"]], ["\\boxed{0.5}"], [r["reward_model"]["ground_truth"]]) == [1.0]
    assert preprocess.main(["synthetic", "--out", str(tmp_path / "s"), "--n-train", "16", "--n-test", "4"]) == 0
    assert pq.read_table(str(tmp_path / "s" / "train.parquet")).num_rows == 16
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}))
    assert preprocess.main(["gsm8k", "--input", str(bad), "--out", str(tmp_path / "x")]) == 2
    assert "gsm8k row 0: field 'answer' has no '#### <number>'" in capsys.readouterr().err
    assert not (tmp_path / "x" / "train.parquet").exists()
