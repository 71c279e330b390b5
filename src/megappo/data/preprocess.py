"""Prompt datasets in verl's parquet schema from local raw data.

    python -m megappo.data.preprocess gsm8k --input <file or folder> --out <dir>
    python -m megappo.data.preprocess math  --input <file or folder> --out <dir>
    python -m megappo.data.preprocess synthetic --out <dir> [--n-train 512 --n-test 64]

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

from megappo.rewards.hendrycks_math import last_boxed
from megappo.rewards.synthetic import make_echo_rows

__all__ = ["gsm8k_row", "math_row", "load_raw", "main"]

GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
ECHO_WORDS = ["red", "blue", "green", "gold"]


def gsm8k_row(raw: dict, index: int, split: str) -> dict:
    for key in ("question", "answer"):
        if not isinstance(raw.get(key), str):
            raise ValueError(f"gsm8k row {index}: field '{key}' must be a string")
    if "####" not in raw["answer"]:
        raise ValueError(f"gsm8k row {index}: field 'answer' has no '#### <number>'")
    truth = raw["answer"].split("####")[-1].strip().replace(",", "")
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": raw["question"] + " " + GSM8K_INSTRUCTION}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index, "answer": raw["answer"], "question": raw["question"]}}


def math_row(raw: dict, index: int, split: str) -> dict:
    for key in ("problem", "solution"):
        if not isinstance(raw.get(key), str):
            raise ValueError(f"math row {index}: field '{key}' must be a string")
    truth = last_boxed(raw["solution"])
    if truth is None:
        raise ValueError(f"math row {index}: field 'solution' has no \\boxed{{}} answer")
    return {"data_source": "DigitalLearningGmbH/MATH-lighteval",
            "prompt": [{"role": "user", "content": raw["problem"] + " " + MATH_INSTRUCTION}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index}}


def _read_file(path: str) -> list[dict]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.endswith(".arrow"):
        import pyarrow as pa

        with open(path, "rb") as f:
            try:
                return pa.ipc.open_stream(f).read_all().to_pylist()
            except pa.ArrowInvalid:
                f.seek(0)
                return pa.ipc.open_file(f).read_all().to_pylist()
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        data = json.load(f)
    return data if isinstance(data, list) else data.get("data", [])


def load_raw(path: str, split: str = "train") -> dict[str, list[dict]]:
    """{split: rows} from a file or a folder (see the module docstring)."""
    p = os.path.expanduser(path)
    if os.path.isfile(p):
        return {split: _read_file(p)}
    if not os.path.isdir(p):
        raise FileNotFoundError(f"--input: {path} is neither a file nor a folder")
    out: dict[str, list[dict]] = {}
    for f in sorted(glob.glob(os.path.join(p, "**", "*"), recursive=True)):
        if not f.endswith((".json", ".jsonl", ".parquet", ".arrow")) or os.path.basename(f) in (
                "dataset_info.json", "state.json", "dataset_dict.json"):
            continue
        rel = os.path.relpath(f, p).lower()
        name = "test" if "test" in rel else "train" if "train" in rel else None
        if name is None:
            continue
        out.setdefault(name, []).extend(_read_file(f))
    if not out:
        raise FileNotFoundError(f"--input: no train/test json, jsonl, parquet or arrow files under {path}")
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
    ap.add_argument("task", choices=["gsm8k", "math", "synthetic"])
    ap.add_argument("--input", help="raw data file or folder (gsm8k, math)")
    ap.add_argument("--split", default="train", help="split of a single --input file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-train", type=int, default=512)
    ap.add_argument("--n-test", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.task == "synthetic":
        splits = {"train": make_echo_rows(args.n_train, ECHO_WORDS, seed=args.seed),
                  "test": make_echo_rows(args.n_test, ECHO_WORDS, seed=args.seed + 1)}
    else:
        if not args.input:
            ap.error(f"{args.task} needs --input")
        make = gsm8k_row if args.task == "gsm8k" else math_row
        try:
            splits = {s: [make(r, i, s) for i, r in enumerate(rows)] for s, rows in load_raw(args.input, args.split).items()}
        except (ValueError, FileNotFoundError) as e:
            print(f"megappo.data.preprocess: {e}", file=sys.stderr)
            return 2
    for split, rows in splits.items():
        path = os.path.join(args.out, f"{split}.parquet")
        write_parquet(rows, path)
        print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
