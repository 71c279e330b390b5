"""Prompt data: verl-schema parquet, chat template, overlong handling, sampling, preprocessing."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megappo.data import DataError, PromptDataset, PromptSampler, build_word_tokenizer, tokenize_prompt
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


def test_chat_template_kwargs_render_every_prompt(tok, tmp_path):
    """data.apply_chat_template_kwargs reach the template for every row (and its length check)."""
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = ("{% for m in messages %}<|user|> {{ m.content }} {% endfor %}<|assistant|>"
                       "{% if style is defined %} {{ style }}{% endif %}")
    path = write(tmp_path / "a.parquet", [row("echo: red"), row("echo: blue", "blue")])
    plain = PromptDataset(path, t, max_prompt_length=16)
    styled = PromptDataset(path, t, max_prompt_length=16, chat_template_kwargs={"style": "red"})
    red = t.convert_tokens_to_ids("red")
    assert [it.prompt_ids + [red] for it in plain] == [it.prompt_ids for it in styled]
    PromptDataset(path, t, max_prompt_length=5)
    with pytest.raises(DataError, match="prompt is 6 tokens, longer than data.max_prompt_length=5"):
        PromptDataset(path, t, max_prompt_length=5, chat_template_kwargs={"style": "red"})


def test_max_samples_keeps_the_rows_verl_keeps(tok, tmp_path):
    """data.train_max_samples / val_max_samples: with shuffle, numpy's default_rng(seed).choice
    over the concatenated files (in its order), else the first rows; chosen before the overlong
    filter, as verl's dataset."""
    import numpy as np

    colours = ["red", "blue", "gold", "green", "red", "blue", "gold", "green"]
    a = write(tmp_path / "a.parquet", [row(f"echo: {c}", c) for c in colours[:5]])
    b = write(tmp_path / "b.parquet", [row(f"echo: {c}", c) for c in colours[5:]])
    every = PromptDataset([a, b], tok, max_prompt_length=16)
    first = PromptDataset([a, b], tok, max_prompt_length=16, max_samples=3)
    assert [it.origin for it in first] == [it.origin for it in every][:3]
    chosen = PromptDataset([a, b], tok, max_prompt_length=16, max_samples=5, shuffle=True, seed=7)
    want = np.random.default_rng(7).choice(8, size=5, replace=False)
    assert [it.origin for it in chosen] == [every[int(i)].origin for i in want]
    assert len(PromptDataset([a, b], tok, max_prompt_length=16, max_samples=99, shuffle=True, seed=7)) == 8
    long = write(tmp_path / "c.parquet", [row("echo: red"), row("echo: " + " ".join(["red"] * 30)), row("echo: blue")])
    kept = PromptDataset(long, tok, max_prompt_length=16, max_samples=2, filter_overlong_prompts=True)
    assert len(kept) == 1 and kept.num_filtered == 1          # two chosen, then one filtered


def test_files_concatenated_in_order(tok, tmp_path):
    a = write(tmp_path / "a.parquet", [row("echo: red"), row("echo: blue", "blue")])
    b = write(tmp_path / "b.parquet", [row("echo: gold", "gold")])
    ds = PromptDataset([a, b], tok, max_prompt_length=16)
    assert [it.ground_truth for it in ds] == ["red", "blue", "gold"]
    assert ds[2].origin == f"{b}:0" and ds[0].extra_info == {"k": 1} and ds[0].ability == "copy"


def test_raw_chat_kept_only_when_asked(tok, tmp_path):
    """data.return_raw_chat: the prompt's messages travel with the row (multi-turn rollouts render
    them with the tool schemas); otherwise nothing is kept."""
    a = write(tmp_path / "a.parquet", [row("echo: red"), row("echo: blue", "blue")])
    assert [it.raw_chat for it in PromptDataset([a], tok, max_prompt_length=16)] == [None, None]
    ds = PromptDataset([a], tok, max_prompt_length=16, return_raw_chat=True)
    assert [it.raw_chat for it in ds] == [[{"role": "user", "content": "echo: red"}],
                                          [{"role": "user", "content": "echo: blue"}]]
    assert tokenize_prompt(tok, ds[1].raw_chat) == ds[1].prompt_ids


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


MSG = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("bad, fragment", [
    ({"prompt": MSG, "reward_model": {"ground_truth": "a"}}, "missing column 'data_source'"),
    ({"data_source": "d", "reward_model": {"ground_truth": "a"}}, "missing column 'prompt'"),
    ({"data_source": "d", "prompt": MSG}, "missing column 'reward_model'"),
    ({"data_source": 3, "prompt": MSG, "reward_model": {"ground_truth": "a"}},
     "field 'data_source' must be a string, got int"),
    ({"data_source": b"d", "prompt": MSG, "reward_model": {"ground_truth": "a"}},
     "field 'data_source' must be a string, got bytes (a binary column"),
    ({"data_source": "d", "prompt": "just text", "reward_model": {"ground_truth": "a"}},
     "field 'prompt' must be a non-empty list of chat messages [{'role': str, 'content': str}, ...], got str"),
    ({"data_source": "d", "prompt": [], "reward_model": {"ground_truth": "a"}},
     "field 'prompt' must be a non-empty list of chat messages"),
    ({"data_source": "d", "prompt": ["hello"], "reward_model": {"ground_truth": "a"}},
     "field 'prompt[0]' must be {'role': str, 'content': str}, got str"),
    ({"data_source": "d", "prompt": [{"role": "user"}], "reward_model": {"ground_truth": "a"}},
     "field 'prompt[0].content' must be a string (messages are {'role': str, 'content': str}), got nothing"),
    ({"data_source": "d", "prompt": [{"role": 1, "content": "x"}], "reward_model": {"ground_truth": "a"}},
     "field 'prompt[0].role' must be a string"),
    ({"data_source": "d", "prompt": MSG, "reward_model": {"style": "rule"}},
     "field 'reward_model.ground_truth' is missing"),
    ({"data_source": "d", "prompt": MSG, "reward_model": "42"},
     "field 'reward_model' must be a mapping {'style': ..., 'ground_truth': ...}, got str"),
    ({"data_source": "d", "prompt": MSG, "reward_model": {"ground_truth": b"\x00\x01"}},
     "field 'reward_model.ground_truth' must be a string, a number, a list or a mapping, got bytes"),
    ({"data_source": "d", "prompt": MSG, "reward_model": {"ground_truth": "a"}, "extra_info": "idx 3"},
     "field 'extra_info' must be a mapping or null, got str"),
    ({"data_source": "d", "prompt": MSG, "reward_model": {"ground_truth": "a"}, "ability": 7},
     "field 'ability' must be a string or null, got int"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_schema_errors_name_file_row_field(tok, tmp_path, bad, fragment):
    good = write(tmp_path / "good.parquet", [row("echo: red")])
    f = write(tmp_path / "bad.parquet", [bad])
    with pytest.raises(DataError) as ei:
        PromptDataset([good, f], tok, max_prompt_length=16)
    assert f"{f}, row 0: " in str(ei.value) and fragment in str(ei.value)


@pytest.mark.parametrize("truth", ["42", 42, 4.5, ["1/2", "0.5"]])
def test_ground_truth_scalar_or_list_accepted(tok, tmp_path, truth):
    f = write(tmp_path / "ok.parquet", [row("echo: red", truth)])
    assert PromptDataset(f, tok, max_prompt_length=16)[0].ground_truth == truth


def test_wrong_type_in_a_later_row_names_that_row(tok, tmp_path):
    # The prompt column is a list of structs; a struct row missing 'content' reads back as None.
    rows = [row("echo: red"), row("echo: blue"), {**row("echo: gold"), "prompt": [{"role": "user", "content": None}]}]
    f = write(tmp_path / "later.parquet", rows)
    with pytest.raises(DataError, match=r"later.parquet, row 2: field 'prompt\[0\].content' must be a string"):
        PromptDataset(f, tok, max_prompt_length=16)


def test_null_field_in_a_later_row(tok, tmp_path):
    f = write(tmp_path / "nulls.parquet", [row("echo: red"), {**row("echo: blue"), "data_source": None}])
    with pytest.raises(DataError, match=r"nulls.parquet, row 1: field 'data_source' is null"):
        PromptDataset(f, tok, max_prompt_length=16)


def test_file_errors(tok, tmp_path):
    with pytest.raises(DataError, match="missing.parquet: file not found"):
        PromptDataset(str(tmp_path / "missing.parquet"), tok, max_prompt_length=8)
    good = write(tmp_path / "good.parquet", [row("echo: red")])
    with pytest.raises(DataError, match="missing2.parquet: file not found"):   # a later file of several
        PromptDataset([good, str(tmp_path / "missing2.parquet")], tok, max_prompt_length=8)
    zero = tmp_path / "zero.parquet"
    zero.write_bytes(b"")
    with pytest.raises(DataError, match=r"zero.parquet: the file is empty \(0 bytes\), expected a parquet file"):
        PromptDataset(str(zero), tok, max_prompt_length=8)
    with pytest.raises(DataError, match=rf"{tmp_path}: is a directory, expected a parquet file"):
        PromptDataset(str(tmp_path), tok, max_prompt_length=8)
    with pytest.raises(DataError, match="no data files given"):
        PromptDataset([], tok, max_prompt_length=8)
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
    import re

    # a vocabulary that covers the text (a word tokenizer without it is refused: mostly unknown tokens)
    words = sorted({w for r in rows for w in re.findall(r"\w+|[^\w\s]+", r["prompt"][0]["content"])})
    ds = PromptDataset([str(out / "train.parquet")], build_word_tokenizer(WORDS + words), max_prompt_length=256)
    truths = [it.ground_truth for it in ds]
    assert truths == ["7", "1234"]
    assert score_batch(["openai/gsm8k"] * 4, ["so #### 7", "#### 8", "it is #### 1,234", "1234"],
                       [truths[0], truths[0], truths[1], truths[1]]) == [1.0, 0.0, 1.0, 0.0]
    # the interaction rows: the same data, each row naming the GSM8K interaction with its truth
    assert preprocess.main(["gsm8k_interaction", "--input", str(raw), "--out", str(tmp_path / "gi")]) == 0
    irows = pq.read_table(str(tmp_path / "gi" / "train.parquet")).to_pylist()
    assert [r["extra_info"]["interaction_kwargs"]["ground_truth"] for r in irows] == ["7", "1234"]
    assert all(r["extra_info"]["interaction_kwargs"]["name"] == "gsm8k" and r["prompt"][0]["role"] == "system"
               for r in irows)


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
    assert f"{bad}, row 0: gsm8k: field 'answer' has no '#### <number>'" in capsys.readouterr().err
    assert not (tmp_path / "x" / "train.parquet").exists()


def test_overlong_prompt_in_second_file_names_file_and_row(tok, tmp_path):
    long = "echo: " + " ".join(["one", "two", "three"] * 4)
    a = write(tmp_path / "a.parquet", [row("echo: red")])
    b = write(tmp_path / "b.parquet", [row("echo: blue"), row("echo: gold"), row(long)])
    with pytest.raises(DataError) as ei:
        PromptDataset([a, b], tok, max_prompt_length=8, truncation="error")
    msg = str(ei.value)
    assert msg.startswith(f"{b}, row 2: prompt is 16 tokens, longer than data.max_prompt_length=8")
    assert "data.filter_overlong_prompts=true" in msg
    ds = PromptDataset([a, b], tok, max_prompt_length=8, filter_overlong_prompts=True)
    assert ds.num_filtered == 1 and [it.ground_truth for it in ds] == ["red", "red", "red"]
    assert [it.origin for it in ds] == [f"{a}:0", f"{b}:0", f"{b}:1"]


def _invalid_utf8_parquet(path, bad_row, column):
    """A parquet whose string column holds bytes that are not UTF-8 (pyarrow only validates on
    conversion from Python str, so a binary array viewed as string writes them unchecked)."""
    n = 3
    texts = [b"echo: red"] * n
    texts[bad_row] = b"echo: \xff\xfe red"
    sources = [b"synthetic/echo"] * n
    if column == "data_source":
        sources[bad_row] = b"synthetic/\xc3"
        texts[bad_row] = b"echo: red"
    content = pa.array(texts, pa.binary()).view(pa.string())
    msgs = pa.StructArray.from_arrays([pa.array(["user"] * n), content], names=["role", "content"])
    prompt = pa.ListArray.from_arrays(pa.array(list(range(n + 1)), pa.int32()), msgs)
    rm = pa.StructArray.from_arrays([pa.array(["rule"] * n), pa.array(["red"] * n)], names=["style", "ground_truth"])
    table = pa.table({"data_source": pa.array(sources, pa.binary()).view(pa.string()), "prompt": prompt,
                      "reward_model": rm})
    pq.write_table(table, str(path))
    with pytest.raises(UnicodeDecodeError):          # the hazard the loader must turn into a DataError
        pq.read_table(str(path)).to_pylist()
    return str(path)


@pytest.mark.parametrize("bad_row, column", [(1, "prompt"), (2, "data_source")])
def test_parquet_with_invalid_utf8_names_file_row_field(tok, tmp_path, bad_row, column):
    f = _invalid_utf8_parquet(tmp_path / "latin1.parquet", bad_row, column)
    with pytest.raises(DataError) as ei:
        PromptDataset(f, tok, max_prompt_length=16)
    assert str(ei.value).startswith(f"{f}, row {bad_row}: field '{column}' is not valid UTF-8 text")


def test_parquet_binary_column_with_invalid_utf8(tok, tmp_path):
    rows = [row("echo: red"), {**row("echo: blue"), "data_source": b"synthetic/\xff"}]
    table = pa.Table.from_pylist(rows)
    assert table.schema.field("data_source").type == pa.binary()
    pq.write_table(table, str(tmp_path / "bin.parquet"))
    with pytest.raises(DataError, match=r"bin.parquet, row 0: field 'data_source' must be a string, got bytes \(a binary"):
        PromptDataset(str(tmp_path / "bin.parquet"), tok, max_prompt_length=16)
    pq.write_table(pa.Table.from_pylist([rows[1]]), str(tmp_path / "bin1.parquet"))
    with pytest.raises(DataError, match="bin1.parquet, row 0: field 'data_source' must be a string, got bytes that "
                                        "are not valid UTF-8 text"):
        PromptDataset(str(tmp_path / "bin1.parquet"), tok, max_prompt_length=16)


GOOD = {"question": "2+2?", "answer": "#### 4"}


@pytest.mark.parametrize("name, content, fragment", [
    ("bad.json", b'[{"question": "q", "answer": "#### 1"},\n {"question": "q" "answer": 2}]',
     "bad.json, line 2: invalid JSON: Expecting ',' delimiter"),
    ("bad.jsonl", b'{"question": "q", "answer": "#### 1"}\n{"question": \n',
     "bad.jsonl, line 2: invalid JSON: Expecting value"),
    ("latin1.jsonl", b'{"question": "q", "answer": "#### 1"}\n{"question": "caf\xe9", "answer": "#### 2"}\n',
     "latin1.jsonl, line 2: not valid UTF-8 text (byte 0xe9"),
    ("latin1.json", b'[{"question": "\xff", "answer": "#### 2"}]', "latin1.json, line 1: not valid UTF-8 text"),
    ("scalar.json", b"42", "scalar.json: expected a JSON list of records"),
    ("strings.jsonl", b'"just a string"\n', "strings.jsonl, line 1: expected a JSON object, got str"),
    ("noq.jsonl", json.dumps(GOOD).encode() + b'\n{"answer": "#### 3"}\n',
     "noq.jsonl, row 1: gsm8k: field 'question' must be a string, got nothing (missing or null)"),
    ("junk.parquet", b"PAR1 not really", "junk.parquet: cannot read as parquet"),
])
def test_preprocess_bad_input_exit_2_names_file(tmp_path, capsys, name, content, fragment):
    f = tmp_path / name
    f.write_bytes(content)
    assert preprocess.main(["gsm8k", "--input", str(f), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megappo.data.preprocess: ") and err.count("\n") == 1, err   # one line, no traceback
    assert f"{tmp_path}/{fragment}" in err, err
    assert not (tmp_path / "out").exists()                                              # nothing written


def test_preprocess_parquet_with_invalid_utf8(tmp_path, capsys):
    n = 3
    q = [b"2+2?", b"caf\xe9?", b"1+1?"]
    table = pa.table({"question": pa.array(q, pa.binary()).view(pa.string()), "answer": ["#### 4"] * n})
    pq.write_table(table, str(tmp_path / "train.parquet"))
    assert preprocess.main(["gsm8k", "--input", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert f"{tmp_path}/train.parquet, row 1: text is not valid UTF-8" in capsys.readouterr().err


def test_preprocess_missing_input(tmp_path, capsys):
    assert preprocess.main(["gsm8k", "--input", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o")]) == 2
    assert f"--input: {tmp_path}/nope.json is neither a file nor a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert preprocess.main(["gsm8k", "--input", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    assert "no train/test json, jsonl, parquet or arrow files under" in capsys.readouterr().err


def test_structured_ground_truth_reaches_the_reward_function(tok, tmp_path):
    """verl datasets for code or multi-part answers carry a mapping as ground truth; it is kept
    as is for a custom reward function."""
    gt = {"tests": ["assert f(1) == 2"], "answer": 2}
    f = write(tmp_path / "d.parquet", [{"data_source": "d", "prompt": MSG, "reward_model": {"ground_truth": gt}}])
    ds = PromptDataset([str(f)], tok, max_prompt_length=64)
    assert ds[0].ground_truth == gt


def _byte_level_over_words():
    """The trap users hit: a word-level vocabulary behind a byte-level pre-tokenizer (what
    transformers 5 builds when it loads such a folder with Qwen2Tokenizer): every word arrives as
    'Ġword' or 'word' glued to punctuation and is unknown."""
    from tokenizers import pre_tokenizers

    bad = build_word_tokenizer(WORDS)
    bad.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return bad


def test_a_tokenizer_that_does_not_fit_the_data_is_named(tok, tmp_path):
    good = [row("echo: red blue green gold one two"), row("echo: three four five six red")]
    f = write(tmp_path / "d.parquet", good + [row("echo: red blue green gold")])
    assert len(PromptDataset([f], tok, max_prompt_length=64)) == 3
    bad = _byte_level_over_words()
    ids = tokenize_prompt(bad, good[0]["prompt"])
    assert ids.count(bad.unk_token_id) >= 5   # the trap is real: words became unknown
    with pytest.raises(DataError, match=r"d\.parquet, row 0: \d+% of the prompt's tokens are the unknown token "
                                        rf"with the tokenizer loaded \({type(bad).__name__}\)"):
        PromptDataset([f], bad, max_prompt_length=64)


def test_text_that_vanishes_into_the_template_is_named(tok, tmp_path):
    class Dropping:
        """A tokenizer whose pre-tokenizer drops the text: only template tokens remain."""
        unk_token_id = None

        def apply_chat_template(self, messages, **kw):
            return tok.apply_chat_template([dict(m, content="") for m in messages], **kw)

    f = write(tmp_path / "d.parquet", [row("echo: red blue green gold one two")])
    with pytest.raises(DataError, match=r"d\.parquet, row 0: 33 characters of prompt text became 0 tokens beyond "
                                        r"the chat template's 2 with the tokenizer loaded \(Dropping\)"):
        PromptDataset([f], Dropping(), max_prompt_length=64)
