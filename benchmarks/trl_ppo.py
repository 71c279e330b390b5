"""TRL's PPOTrainer (TRL 1.12.0, ``trl.experimental.ppo``) on one of megappo's synthetic tasks: the
reference point of benchmarks/learning.py. Runs in its own venv (bash benchmarks/setup_trl.sh),
never in megappo's:

    PYTHONPATH=src .venv-trl/bin/python benchmarks/trl_ppo.py --model DIR/model \
        --train DIR/data/train.parquet --task words --steps 500 --batch-size 32 --out words_trl.jsonl

``--model`` is a folder made by ``megappo.data.tiny.make_tiny_setup`` (tiny random-init Qwen3 and a
word-level tokenizer with a chat template); ``--train`` a parquet file in verl's schema.

What TRL gets, and how it matches megappo:
  * queries: the chat template with add_generation_prompt=True (as megappo's PromptDataset);
    one sampled response per prompt and step, as TRL's PPO does; generation stops at EOS.
  * reward: megappo's own rule scorer (megappo.rewards.score_batch: echo_score / words_score by
    data_source), on the response cut at the first EOS and decoded with skip_special_tokens=True
    (as megappo's trainer does). TRL 1.12's PPO has no reward-function hook: it calls a reward
    *model* through ``get_reward`` (a backbone + ``score`` head, read at the last response token),
    so ``RuleRewardModel`` below is a module of that shape whose "hidden state" is the rule score.
    The ground truth of each sample is found from its query tokens (a prompt -> row table).
  * value model: AutoModelForSequenceClassification(num_labels=1) from the same folder (random
    ``score`` head), as TRL's examples do; policy and value share TRL's single optimizer (TRL
    clips no gradients).
  * one optimizer step per PPO mini-batch (per_device_train_batch_size = batch,
    gradient_accumulation_steps = 1, num_mini_batches = batch / mini-batch).
  * a sampled ``<pad>`` (``--pad-handling``): TRL takes every id equal to the tokenizer's pad id
    for padding, so a ``<pad>`` the policy samples ends the response: no gradient on it or after
    it. A random-init policy samples it (1/128 per token at first); on echo the policy drifted
    into starting every response with ``<pad>`` (all tokens masked: no learning, NaN statistics).
    The default, ``token``, gives TRL a pad id no token has (TRL sets padding to id 0 before
    every model call), so ``<pad>`` is an ordinary token, as in megappo. ``end`` is TRL's stock
    rule; the reward then reads the same span (up to the first EOS or ``<pad>``).
  * lr scheduler constant by default (megappo's default; TRL's is linear decay to 0), AdamW
    with weight decay 0 (TRL's default).

Writes one JSON line per step to ``--out``: {"step", "samples", "score", "score_max", "seconds"}: the mean
rule score of the step's batch (before TRL's KL term or any missing-EOS penalty) and the wall
time since training began (model loading excluded). ``--trl-metrics`` adds TRL's own metrics
(objective/kl, policy/entropy_avg, ...) to each line. Deterministic given ``--seed`` (CPU, same
thread count).

Tuned (batch 32, mini-batch 16, 4 PPO epochs, KL 0.01 in the reward, temperature 1): lr 3e-4 on
words, 1e-4 on echo (3e-4 there learns to ~0.7 and then swings between 0.3 and 0.7).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model folder (make_tiny_setup's 'model')")
    ap.add_argument("--train", required=True, help="training prompts, verl-schema parquet")
    ap.add_argument("--task", required=True, choices=["echo", "words", "pick_first", "copy", "pick_last"])
    ap.add_argument("--out", required=True, help="JSON-lines file: one line per step")
    ap.add_argument("--steps", type=int, default=100, help="PPO steps (rollout + update)")
    ap.add_argument("--batch-size", type=int, default=32, help="prompts per step (one sample each)")
    ap.add_argument("--mini-batch-size", type=int, default=None,
                    help="samples per optimizer step (default: the batch size / 2)")
    ap.add_argument("--ppo-epochs", type=int, default=4, help="passes over each batch (TRL's num_ppo_epochs)")
    ap.add_argument("--lr", type=float, default=None,
                    help="learning rate of policy and value model (default: the tuned one, 1e-4 echo, 3e-4 words)")
    ap.add_argument("--lr-scheduler", default="constant", choices=["constant", "linear", "cosine"],
                    help="constant as megappo's default; TRL's own default is linear decay to 0")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--kl-coef", type=float, default=0.01, help="KL penalty in the reward (TRL's kl_coef)")
    ap.add_argument("--kl-estimator", default="k1", choices=["k1", "k3"])
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="response length (default: 4 for echo, 8 for the others)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--vf-coef", type=float, default=0.1)
    ap.add_argument("--cliprange", type=float, default=0.2)
    ap.add_argument("--cliprange-value", type=float, default=0.2)
    ap.add_argument("--gamma", type=float, default=1.0)
    ap.add_argument("--lam", type=float, default=0.95)
    ap.add_argument("--whiten-rewards", action="store_true")
    ap.add_argument("--missing-eos-penalty", type=float, default=None)
    ap.add_argument("--pad-handling", default="token", choices=["token", "end"],
                    help="token: a <pad> the policy samples is an ordinary response token, as in megappo (TRL is "
                         "given a pad id no token has); end: TRL's stock rule, a sampled <pad> ends the response "
                         "(no gradient on it or after it; the reward reads the same span). See the module doc.")
    ap.add_argument("--train-pad-row", action="store_true",
                    help="let the <pad> row of the input embeddings take gradients, as Megatron's embedding (megappo's, "
                         "verl's) does; HF's Embedding(padding_idx=pad) never updates it. Only for model folders whose "
                         "config names a pad_token_id (tiny models made before 2026-12-05: a zero row); the "
                         "current tiny configs name none, so every row trains anyway")
    ap.add_argument("--value-model", default=None,
                    help="folder of the value model (default: --model, with a random one-label head)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (0: torch's default). 1 by default: these models are too small for "
                         "intra-op parallelism, and on a busy machine 2 threads made steps 10-40x slower")
    ap.add_argument("--trl-metrics", action="store_true", help="add TRL's own metrics to each JSON line")
    ap.add_argument("--print-samples", type=int, default=0, metavar="N",
                    help="print N decoded responses with their scores every 25 steps (stderr)")
    args = ap.parse_args(argv)
    if args.lr is None:
        args.lr = 1e-4 if args.task == "echo" else 3e-4
    if args.max_new_tokens is None:
        args.max_new_tokens = 4 if args.task == "echo" else 8
    if args.mini_batch_size is None:
        args.mini_batch_size = max(1, args.batch_size // 2)
    if args.batch_size % args.mini_batch_size:
        ap.error(f"--batch-size {args.batch_size} must be a multiple of --mini-batch-size {args.mini_batch_size}")
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    return args


def load_score_batch():
    """megappo's reward dispatch (score_batch); falls back to the synthetic module's file alone
    when importing megappo.rewards needs something this venv lacks."""
    src = os.path.join(ROOT, "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    try:
        from megappo.rewards import score_batch
        return score_batch
    except ImportError:
        import importlib.util

        spec = importlib.util.spec_from_file_location("megappo_synthetic", os.path.join(src, "megappo", "rewards", "synthetic.py"))
        syn = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(syn)
        fns = {syn.ECHO_SOURCE: lambda s, gt, ex: syn.echo_score(s, gt),
               syn.WORDS_SOURCE: lambda s, gt, ex: syn.words_score(s, gt, (ex or {}).get("max_words", 8)),
               syn.PICK_FIRST_SOURCE: lambda s, gt, ex: syn.pick_first_score(s, gt, (ex or {}).get("max_words", 8)),
               syn.COPY_SOURCE: lambda s, gt, ex: syn.copy_score(s, gt, (ex or {}).get("max_words", 8)),
               syn.PICK_LAST_SOURCE: lambda s, gt, ex: syn.pick_last_score(s, gt, (ex or {}).get("max_words", 8))}

        def score_batch(data_sources, solutions, ground_truths, extra_infos=None, custom=None):
            extra_infos = extra_infos if extra_infos is not None else [None] * len(solutions)
            return [float(fns[d](s, g, e)) for d, s, g, e in zip(data_sources, solutions, ground_truths, extra_infos)]
        return score_batch


def tokenize_prompt(tokenizer, messages) -> list[int]:
    """As megappo.data.dataset.tokenize_prompt: chat template with the generation prompt."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(i) for i in ids]


def read_prompts(path: str, tokenizer, task: str):
    """Query ids of every row, and a table query ids -> (data_source, ground_truth, extra_info)."""
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    if not rows:
        raise SystemExit(f"{path}: no rows")
    queries, table = [], {}
    want = f"synthetic/{task}"
    for r, row in enumerate(rows):
        if row.get("data_source") != want:
            raise SystemExit(f"{path}, row {r}: data_source {row.get('data_source')!r}, but --task {task} "
                             f"expects {want!r}")
        ids = tokenize_prompt(tokenizer, row["prompt"])
        if tokenizer.pad_token_id in ids:
            raise SystemExit(f"{path}, row {r}: the prompt tokenizes to the pad id; TRL treats it as padding")
        info = (row["data_source"], row["reward_model"]["ground_truth"], row.get("extra_info") or {})
        key = tuple(ids)
        if key in table and (table[key][0], table[key][1]) != info[:2]:
            raise SystemExit(f"{path}, row {r}: the same prompt appears with two ground truths "
                             f"({table[key][1]!r}, {info[1]!r}); the reward could not tell them apart")
        table.setdefault(key, info)
        queries.append(ids)
    return queries, table


def build_reward_model(tokenizer, table, score_batch, pad_ends_response: bool):
    """A module of the shape TRL's get_reward expects (``getattr(m, m.base_model_prefix)(input_ids=...)``
    -> ``.hidden_states[-1]``, then ``m.score(hidden)`` read at the last response token) that
    returns megappo's rule score at every position."""
    import torch
    from torch import nn

    eos = tokenizer.eos_token_id
    lengths = sorted({len(k) for k in table}, reverse=True)

    class _Out:
        def __init__(self, h):
            self.hidden_states = (h,)

    class RuleBackbone(nn.Module):
        def __init__(self):
            super().__init__()
            self.batches: list[list[float]] = []   # scores of each call, read by the step callback
            self.texts: list[str] = []

        def split(self, ids: list[int]):
            for n in lengths:                               # the longest known prompt that is a prefix
                info = table.get(tuple(ids[:n]))
                if info is not None:
                    return n, info
            raise RuntimeError(f"reward: the query of {ids} is not a prompt of the training file")

        def forward(self, input_ids, attention_mask=None, **kwargs):
            # TRL passes query + response with its padding set to id 0 and masked out.
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            sources, texts, truths, extras = [], [], [], []
            for row, mask in zip(input_ids.tolist(), attention_mask.tolist()):
                start = mask.index(1) if 1 in mask else len(mask)   # the query's left padding
                row, mask = row[start:], mask[start:]
                n, (ds, gt, extra) = self.split(row)
                resp = []
                for t, m in zip(row[n:], mask[n:]):
                    if t == eos:                             # stop at EOS (megappo's response mask)
                        break
                    if not m:                                # a position TRL counts as padding:
                        if pad_ends_response:                # --pad-handling end: the response ends here
                            break
                        continue
                    resp.append(t)
                texts.append(tokenizer.decode(resp, skip_special_tokens=True))
                sources.append(ds), truths.append(gt), extras.append(extra)
            scores = score_batch(sources, texts, truths, extras)
            self.batches.append(scores)
            self.texts = texts
            s = torch.tensor(scores, dtype=torch.float32, device=input_ids.device)
            return _Out(s[:, None, None].expand(input_ids.shape[0], input_ids.shape[1], 1))

    class RuleRewardModel(nn.Module):
        base_model_prefix = "backbone"

        def __init__(self):
            super().__init__()
            self.backbone = RuleBackbone()

        def score(self, hidden):
            return hidden

    return RuleRewardModel()


NO_TOKEN_PAD_ID = -1   # the pad id TRL sees with --pad-handling token: no token has it


class TRLTokenizerView:
    """The tokenizer as TRL's PPOTrainer sees it: everything delegated, but ``pad_token_id``
    replaced. TRL finds padding (and the end of each response) by comparing ids with
    ``processing_class.pad_token_id`` and sets those positions to id 0 before every model call,
    so an id no token has is safe there."""

    def __init__(self, tokenizer, pad_token_id: int):
        self._tokenizer = tokenizer
        self.pad_token_id = pad_token_id

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def left_pad_collator(pad_id: int):
    import torch

    def collate(features):
        n = max(len(f["input_ids"]) for f in features)
        return {"input_ids": torch.tensor([[pad_id] * (n - len(f["input_ids"])) + list(f["input_ids"])
                                           for f in features], dtype=torch.long)}
    return collate


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers
    from datasets import Dataset
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                              TrainerCallback)
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from trl.experimental.ppo import PPOConfig, PPOTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.set_seed(args.seed)
    transformers.logging.set_verbosity_error()

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
        raise SystemExit(f"{args.model}: the tokenizer needs a pad and an EOS token")
    queries, table = read_prompts(args.train, tokenizer, args.task)
    if len(queries) < args.batch_size:
        raise SystemExit(f"{args.train}: {len(queries)} prompts, fewer than --batch-size {args.batch_size}")
    train_dataset = Dataset.from_dict({"input_ids": queries})
    score_batch = load_score_batch()
    reward_model = build_reward_model(tokenizer, table, score_batch, pad_ends_response=args.pad_handling == "end")
    if args.pad_handling == "token":
        # Random-init policies sample <pad> (1/vocab per token at first). TRL's stock rule makes it
        # the end of the response with no gradient on it; on echo the policy then drifted into
        # starting every response with <pad> (every token masked: no learning, NaN statistics).
        trl_tokenizer = TRLTokenizerView(tokenizer, NO_TOKEN_PAD_ID)
    else:
        trl_tokenizer = tokenizer

    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    ref_policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    torch.manual_seed(args.seed)
    value_model = AutoModelForSequenceClassification.from_pretrained(args.value_model or args.model, num_labels=1,
                                                                     dtype=torch.float32)
    for m in (policy, ref_policy, value_model):
        m.config.pad_token_id = tokenizer.pad_token_id
    if args.train_pad_row or os.environ.get("TRL_TRAIN_PAD"):
        for m in (policy, value_model):
            m.get_input_embeddings().padding_idx = None

    out_dir = tempfile.mkdtemp(prefix="trl_ppo_")   # TRL's output_dir: nothing is saved there
    config = PPOConfig(
        output_dir=out_dir, save_strategy="no", report_to="none", logging_steps=1, disable_tqdm=True,
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, seed=args.seed, data_seed=args.seed,
        learning_rate=args.lr, lr_scheduler_type=args.lr_scheduler, weight_decay=args.weight_decay,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=1,
        num_mini_batches=args.batch_size // args.mini_batch_size, num_ppo_epochs=args.ppo_epochs,
        # one generation chunk per step: TRL pads chunks of different lengths with the pad id, and
        # with --pad-handling token that id is not a token (it would reach the log-prob gather)
        total_episodes=args.steps * args.batch_size, local_rollout_forward_batch_size=args.batch_size,
        num_sample_generations=0, response_length=args.max_new_tokens, stop_token="eos",
        temperature=args.temperature, kl_coef=args.kl_coef, kl_estimator=args.kl_estimator,
        vf_coef=args.vf_coef, cliprange=args.cliprange, cliprange_value=args.cliprange_value,
        gamma=args.gamma, lam=args.lam, whiten_rewards=args.whiten_rewards,
        missing_eos_penalty=args.missing_eos_penalty, dataloader_num_workers=0,
    )

    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    fout = open(args.out, "w")
    backbone = reward_model.backbone

    class StepWriter(TrainerCallback):
        def __init__(self):
            self.t0 = None
            self.logs = {}

        def on_train_begin(self, a, state, control, **kw):
            self.t0 = time.time()

        def on_log(self, a, state, control, logs=None, **kw):
            self.logs = dict(logs or {})

        def on_step_end(self, a, state, control, **kw):
            scores = [s for b in backbone.batches for s in b]
            backbone.batches.clear()
            line = {"step": state.global_step, "samples": state.episode,
                    "score": round(sum(scores) / len(scores), 6) if scores else math.nan,
                    "score_max": max(scores) if scores else math.nan,
                    "seconds": round(time.time() - self.t0, 3)}
            if args.trl_metrics:
                line.update({k: v for k, v in self.logs.items() if k not in line})
            fout.write(json.dumps(line) + "\n")
            fout.flush()
            if args.print_samples and (state.global_step % 25 == 0 or state.global_step == 1):
                print(f"step {state.global_step} score {line['score']:.3f}: "
                      + " | ".join(backbone.texts[:args.print_samples]), file=sys.stderr, flush=True)

    trainer = PPOTrainer(args=config, processing_class=trl_tokenizer, model=policy, ref_model=ref_policy,
                         reward_model=reward_model, train_dataset=train_dataset, value_model=value_model,
                         data_collator=left_pad_collator(trl_tokenizer.pad_token_id), callbacks=[StepWriter()])
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    # TRL calls gc.collect() twice a step; with torch/transformers/datasets loaded each call scans
    # ~1M objects (~0.2 s, about half of a step of these tiny models). Freezing what exists now
    # (modules, models, data) leaves those calls only the step's own garbage: same training,
    # faster steps.
    gc.collect()
    gc.freeze()
    try:
        trainer.train()
    finally:
        fout.close()
        shutil.rmtree(out_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
