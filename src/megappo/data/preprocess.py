"""Prompt datasets in verl's parquet schema, from the HuggingFace hub or local raw data.

    python -m megappo.data.preprocess gsm8k [--input <file or folder>] --out <dir>
    python -m megappo.data.preprocess gsm8k_tool [--input <file or folder>] --out <dir>
    python -m megappo.data.preprocess gsm8k_interaction [--input <file or folder>] --out <dir>
    python -m megappo.data.preprocess gsm8k_multiturn_w_tool [--input <file or folder>] --out <dir>
    python -m megappo.data.preprocess math  [--input <file or folder>] --out <dir>
    python -m megappo.data.preprocess synthetic --out <dir> [--n-train 512 --n-test 64]

gsm8k_tool is GSM8K for multi-turn rollouts with megappo's ``calculator`` tool, in the row shape of
verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py (a system prompt offering the tool,
``extra_info.need_tools_kwargs`` and ``tools_kwargs.calculator.create_kwargs``). gsm8k_interaction
is GSM8K for multi-turn rollouts with the GSM8K interaction (a teacher who asks again until the
answer is right), in the row shape of verl's gsm8k_multiturn_w_interaction.py.
gsm8k_multiturn_w_tool writes the rows of verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py
(its prompts, the ``calc_gsm8k_reward`` tool's create_kwargs): the data of verl's multi-turn GSM8K
command, whose tool config megappo runs with its own ``megappo.tools.Gsm8kTool``.

Without ``--input``, gsm8k, gsm8k_tool and math read the hub data sets verl's preprocessing reads
(HUB_DATASETS: ``openai/gsm8k`` config ``main``, ``DigitalLearningGmbH/MATH-lighteval``), splits
train and test: the data set repository is fetched into the HF cache (megappo.hub: HF_HOME,
HF_TOKEN, HF_HUB_OFFLINE=1 reads the cache only) and read with ``datasets.load_dataset``.

``--input``: a json/jsonl/parquet file (its split is --split, default train), or a folder holding
such files or a HuggingFace ``save_to_disk`` dataset (``*.arrow``), whose split is read from the
file or sub-folder name (train/test). Writes ``train.parquet`` and/or ``test.parquet``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from megappo import hub
from megappo.rewards import last_boxed, synthetic

__all__ = ["gsm8k_row", "gsm8k_tool_row", "gsm8k_interaction_row", "gsm8k_verl_tool_row", "math_row", "HUB_DATASETS",
           "main"]

# task: (hub data set id, its config), as verl's examples/data_preprocess load them.
HUB_DATASETS = {"gsm8k": ("openai/gsm8k", "main"), "gsm8k_tool": ("openai/gsm8k", "main"),
                "gsm8k_interaction": ("openai/gsm8k", "main"), "gsm8k_multiturn_w_tool": ("openai/gsm8k", "main"), "math": ("DigitalLearningGmbH/MATH-lighteval", None)}

GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
GSM8K_TOOL_SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
                     "You may call the `calculator` tool to evaluate an arithmetic expression exactly; its result "
                     "comes back as the tool's response. Put your final answer in the format of `#### <answer>`.")
GSM8K_INTERACTION_SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
                            "Reconsider your answer carefully when the user says it is wrong. Put your final answer "
                            "in the format of `#### <answer>`.")
# verl's multi-turn GSM8K rows (gsm8k_multiturn_w_tool.py): its system prompt and instruction, as they are
VERL_TOOL_SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
                    "Reasoning step by step before any tool call. You should use the `calc_gsm8k_reward` tool after "
                    "step by step solving the question, before generate final answer at least once and refine your "
                    "answer if necessary. Put your final answer in the format of `#### <answer>`.")
VERL_TOOL_INSTRUCTION = "Let's think step by step and output the final answer after `####`."
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
ECHO_WORDS = ["red", "blue", "green", "gold"]


def _got(v) -> str:
    return "nothing (missing or null)" if v is None else type(v).__name__


def gsm8k_row(raw: dict, index: int, split: str) -> dict:
    for key in ("question", "answer"):
        if not isinstance(raw.get(key), str):
            raise ValueError(f"gsm8k: field '{key}' must be a string, got {_got(raw.get(key))}")
    if "####" not in raw["answer"]:
        raise ValueError("gsm8k: field 'answer' has no '#### <number>'")
    truth = raw["answer"].split("####")[-1].strip().replace(",", "")
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": raw["question"] + " " + GSM8K_INSTRUCTION}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index, "answer": raw["answer"], "question": raw["question"]}}


def gsm8k_tool_row(raw: dict, index: int, split: str) -> dict:
    """A GSM8K row for multi-turn rollouts with the ``calculator`` tool. As verl's rows, each
    carries ``tools_kwargs.<tool>.create_kwargs`` (the ground truth, which the calculator ignores:
    a tool that grades, as verl's calc_gsm8k_reward, reads it) and ``need_tools_kwargs``. verl's
    ``interaction_kwargs`` is written by gsm8k_interaction_row."""
    row = gsm8k_row(raw, index, split)
    truth = row["reward_model"]["ground_truth"]
    row["prompt"] = [{"role": "system", "content": GSM8K_TOOL_SYSTEM}] + row["prompt"]
    row["extra_info"].update(need_tools_kwargs=True,
                             tools_kwargs={"calculator": {"create_kwargs": {"ground_truth": truth}}})
    return row


def gsm8k_interaction_row(raw: dict, index: int, split: str) -> dict:
    """A GSM8K row for multi-turn rollouts with the GSM8K interaction: as verl's rows, a system
    prompt saying the user may point out a wrong answer, and ``extra_info.interaction_kwargs``
    naming the interaction (``gsm8k``) with the question and the ground truth."""
    row = gsm8k_row(raw, index, split)
    truth = row["reward_model"]["ground_truth"]
    row["prompt"] = [{"role": "system", "content": GSM8K_INTERACTION_SYSTEM}] + row["prompt"]
    row["extra_info"]["interaction_kwargs"] = {"name": "gsm8k", "query": row["prompt"][-1]["content"],
                                               "ground_truth": truth}
    return row


def gsm8k_verl_tool_row(raw: dict, index: int, split: str) -> dict:
    """verl's multi-turn GSM8K row: its system prompt asking for the ``calc_gsm8k_reward`` tool,
    its instruction, ``tools_kwargs.calc_gsm8k_reward.create_kwargs`` with the ground truth and
    ``interaction_kwargs`` with the query and the ground truth (no interaction name: verl's
    command configures no interaction)."""
    row = gsm8k_row(raw, index, split)
    truth, question = row["reward_model"]["ground_truth"], raw["question"] + " " + VERL_TOOL_INSTRUCTION
    row["prompt"] = [{"role": "system", "content": VERL_TOOL_SYSTEM}, {"role": "user", "content": question}]
    row["extra_info"].update(need_tools_kwargs=True,
                             tools_kwargs={"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
                             interaction_kwargs={"query": question, "ground_truth": truth})
    return row


def math_row(raw: dict, index: int, split: str) -> dict:
    for key in ("problem", "solution"):
        if not isinstance(raw.get(key), str):
            raise ValueError(f"math: field '{key}' must be a string, got {_got(raw.get(key))}")
    truth = last_boxed(raw["solution"])
    if truth is None:
        raise ValueError("math: field 'solution' has no \\boxed{} answer")
    return {"data_source": "DigitalLearningGmbH/MATH-lighteval",
            "prompt": [{"role": "user", "content": raw["problem"] + " " + MATH_INSTRUCTION}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index}}


def _read_table(path: str) -> list[dict]:
    import pyarrow as pa

    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            table = pq.read_table(path)
        else:
            with open(path, "rb") as f:
                try:
                    table = pa.ipc.open_stream(f).read_all()
                except pa.ArrowInvalid:
                    f.seek(0)
                    table = pa.ipc.open_file(f).read_all()
    except Exception as e:  # pyarrow raises several types for a damaged file
        kind = "parquet" if path.endswith(".parquet") else "arrow"
        raise ValueError(f"{path}: cannot read as {kind}: {type(e).__name__}: {e}") from None
    rows = []
    for i in range(0, table.num_rows, 1024):
        part = table.slice(i, 1024)
        try:
            rows += part.to_pylist()
        except UnicodeDecodeError:
            for j in range(part.num_rows):
                try:
                    part.slice(j, 1).to_pylist()
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}, row {i + j}: text is not valid UTF-8 ({e.reason}); "
                                     "re-encode the data as UTF-8") from None
            raise  # pragma: no cover - the block failed but no single row did
    return rows


def _read_file(path: str) -> list[dict]:
    """Rows of one raw file; every problem names the file (and the line or row where known)."""
    if path.endswith((".parquet", ".arrow")):
        return _read_table(path)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}, line {line}: not valid UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                         f"{e.start}); re-encode the file as UTF-8") from None
    if path.endswith(".jsonl"):
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {n}: invalid JSON: {e.msg} (column {e.colno})") from None
        data = rows
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        if isinstance(data, dict):
            data = data.get("data", [])
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records (or {{\"data\": [...]}}), "
                             f"got {type(data).__name__}")
    for i, r in enumerate(data):
        if not isinstance(r, dict):
            where = f"line {i + 1}" if path.endswith(".jsonl") else f"record {i}"
            raise ValueError(f"{path}, {where}: expected a JSON object, got {type(r).__name__}")
    return data


def _raw_files(path: str, split: str) -> list[tuple[str, str]]:
    """(split, file) pairs of --input, in reading order."""
    p = os.path.expanduser(path)
    if os.path.isfile(p):
        return [(split, p)]
    if not os.path.isdir(p):
        raise FileNotFoundError(f"--input: {path} is neither a file nor a folder")
    out = []
    for f in sorted(glob.glob(os.path.join(p, "**", "*"), recursive=True)):
        if not f.endswith((".json", ".jsonl", ".parquet", ".arrow")) or os.path.basename(f) in (
                "dataset_info.json", "state.json", "dataset_dict.json"):
            continue
        rel = os.path.relpath(f, p).lower()
        name = "test" if "test" in rel else "train" if "train" in rel else None
        if name is not None:
            out.append((name, f))
    if not out:
        raise FileNotFoundError(f"--input: no train/test json, jsonl, parquet or arrow files under {path}")
    return out


def _convert(path: str, split: str, make) -> dict[str, list[dict]]:
    """{split: verl rows}; a bad record's error names its file."""
    out: dict[str, list[dict]] = {}
    for name, f in _raw_files(path, split):
        rows = out.setdefault(name, [])
        for j, raw in enumerate(_read_file(f)):
            try:
                rows.append(make(raw, len(rows), name))
            except ValueError as e:
                raise ValueError(f"{f}, row {j}: {e}") from None
    return out


def _hub_rows(task: str) -> dict[str, list[dict]]:
    """{split: raw rows} of the task's hub data set (train and test)."""
    repo, config = HUB_DATASETS[task]
    instead = f"or pass --input <{task} json/jsonl/parquet files or folder>"
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{repo}: reading the hub data set needs the `datasets` package (pip install datasets), "
                         f"{instead}") from None
    try:
        folder = hub.resolve(repo, repo_type="dataset")
    except hub.HubError as e:
        raise ValueError(f"{e}; {instead}") from None
    try:
        loaded = datasets.load_dataset(folder, config)
    except Exception as e:   # datasets raises many types for a repository it cannot read
        raise ValueError(f"{repo}{f' (config {config})' if config else ''}: datasets cannot read {folder}: "
                         f"{type(e).__name__}: {e}; {instead}") from None
    splits = {name: loaded[name].to_list() for name in ("train", "test") if name in loaded}
    if not splits:
        raise ValueError(f"{repo}: no train or test split in {folder} (splits: {sorted(loaded)}); {instead}")
    return splits


def _from_hub(task: str, make) -> dict[str, list[dict]]:
    repo = HUB_DATASETS[task][0]
    out: dict[str, list[dict]] = {}
    for name, raws in _hub_rows(task).items():
        rows = out.setdefault(name, [])
        for j, raw in enumerate(raws):
            try:
                rows.append(make(raw, len(rows), name))
            except ValueError as e:
                raise ValueError(f"{repo}, {name} row {j}: {e}") from None
    return out


def write_parquet(rows: list[dict], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)  # never leave a half-written dataset under the final name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megappo.data.preprocess", description=__doc__.split("\n")[0])
    ap.add_argument("task", choices=["gsm8k", "gsm8k_tool", "gsm8k_interaction", "gsm8k_multiturn_w_tool", "math",
                                     "synthetic"])
    ap.add_argument("--input", help="raw data file or folder (gsm8k, gsm8k_tool, math; default: the hub data set, see "
                                     "HUB_DATASETS)")
    ap.add_argument("--split", default="train", help="split of a single --input file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-train", type=int, default=512)
    ap.add_argument("--n-test", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.task == "synthetic":
        splits = {"train": synthetic.make_echo_rows(args.n_train, ECHO_WORDS, seed=args.seed),
                  "test": synthetic.make_echo_rows(args.n_test, ECHO_WORDS, seed=args.seed + 1)}
    else:
        make = {"gsm8k": gsm8k_row, "gsm8k_tool": gsm8k_tool_row, "gsm8k_interaction": gsm8k_interaction_row,
                "gsm8k_multiturn_w_tool": gsm8k_verl_tool_row, "math": math_row}[args.task]
        try:
            splits = _convert(args.input, args.split, make) if args.input else _from_hub(args.task, make)
        except (ValueError, OSError) as e:
            print(f"megappo.data.preprocess: {e}", file=sys.stderr)
            return 2
    for split, rows in splits.items():
        path = os.path.join(args.out, f"{split}.parquet")
        write_parquet(rows, path)
        print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
