"""One PPO step, megappo's and TRL's, on the same weights and the same samples: do the two
trainers compute the same update?

    python benchmarks/trl_parity.py                       # pick_first_warm16, seed 0
    python benchmarks/trl_parity.py --task words --seed 1 --out /tmp/parity

The learning benchmark (benchmarks/learning.py) compares megappo's PPO with TRL's by samples to a
target over seeds: a noisy yardstick where runs take off at random times. This one has no noise.
megappo takes one step at TRL's settings (learning.py's ``gae1_trl``: 4 epochs of 2 mini-batches,
8 optimizer steps each for policy and critic) and records its batch and the gradients of every
optimizer step; TRL 1.12's PPOTrainer (in its own venv, run by benchmarks/trl_ppo.py) then takes
one step on the same prompts, megappo's sampled responses replayed in place of its generation,
its value model holding the head megappo's critic starts from, and its mini-batches taken in
megappo's order (megappo's epochs are not shuffled here; TRL's permutation is replaced).
Compared, row by row (matched by prompt): TRL's GAE advantages before and after whitening
(megappo: returns - values, and advantages), and at each of the 8 optimizer steps the gradients of
the policy (output layer, final norm, the last MLP's down projection, the embedding) and of the
value model (head, final norm, down projection), as relative differences.

Three conventions differ by construction; by default each is aligned, and a flag shows it:
  * TRL puts the score on the position after an EOS and trains the value there; megappo (as
    verl) on the last response token. Only rows that fill the length limit (no EOS) are trained
    on, by both (``--keep-eos-rows``: all rows).
  * TRL adds ``vf_coef x value loss`` to the policy loss under one Adam: the value gradients are
    scaled by vf_coef (0.1 by default), which Adam undoes except for its eps (then 10x larger
    relative to the gradients). ``--vf-coef 1`` by default (``--vf-coef 0.1``: TRL's default).
  * megappo's value head has a bias (verl's token-classification head; TRL's sequence classifier
    has none): held at 0 here (``--train-value-bias``: trained, as in a run).
Any other difference in the update (advantages, whitening, KL in the reward, ratio and value
clipping, loss aggregation, Adam) shows as a gradient difference above float32 round-off.

Prints the relative differences and ends with one JSON line. Needs the TRL venv
(bash benchmarks/setup_trl.sh; TRL_VENV to put it elsewhere).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

# name suffixes compared: (megatron's, HF's)
POLICY_PARAMS = [("output_layer.weight", "lm_head.weight"), ("decoder.final_layernorm.weight", "model.norm.weight"),
                 ("decoder.layers.1.mlp.linear_fc2.weight", "model.layers.1.mlp.down_proj.weight"),
                 ("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
VALUE_PARAMS = [("output_layer.weight", "score.weight"), ("decoder.final_layernorm.weight", "model.norm.weight"),
                ("decoder.layers.1.mlp.linear_fc2.weight", "model.layers.1.mlp.down_proj.weight")]


def update_overrides(epochs: int, mini_batches: int, batch: int = 32) -> list[str]:
    """One step at gae1_trl's settings with ``epochs`` x ``mini_batches`` optimizer steps, in order."""
    mb = batch // mini_batches
    return [f"actor_rollout_ref.actor.ppo_mini_batch_size={mb}", f"actor_rollout_ref.actor.ppo_epochs={epochs}",
            f"critic.ppo_mini_batch_size={mb}", f"critic.ppo_epochs={epochs}", "actor_rollout_ref.actor.shuffle=false",
            "trainer.total_training_steps=1"]


def prompt_of(input_ids, prompt_lengths, i: int) -> tuple:
    """Row ``i``'s prompt ids: the key that matches a row across the two trainers."""
    return tuple(input_ids[i, :int(prompt_lengths[i])].tolist())


def prompts_of(b: dict) -> list[tuple]:
    return [prompt_of(b["input_ids"], b["prompt_lengths"], i) for i in range(len(b["responses"]))]


# -- megappo's side (its venv) -----------------------------------------------------------------
def megappo_side(args) -> None:
    import torch

    from megappo.trainer import phases
    from megappo.workers import megatron_worker as mw

    out = Path(args.out)
    record = {"grads": {}}

    def grab(role):
        def wrap(fn):
            def inner(worker, batch, *a, **k):
                record["batch"] = {f: getattr(batch, f).clone() for f in (   # what compare() reads
                    "input_ids", "prompt_lengths", "responses", "response_mask", "values", "advantages", "returns")}
                record["role"] = role
                return fn(worker, batch, *a, **k)
            return inner
        return wrap

    for name, role in (("update_critic", "critic"), ("update_actor", "actor")):
        setattr(phases, name, grab(role)(getattr(phases, name)))
    step = mw.MegatronWorker._step

    def every_step(self):
        grads = {}
        for chunk in self.chunks:
            for name, p in chunk.named_parameters():
                g = getattr(p, "main_grad", None)
                if name.endswith("output_layer.bias") and g is not None and not args.train_value_bias:
                    g.zero_()   # TRL's value head (a sequence classifier's) has no bias: megappo's stays 0
                grads[name] = (g if g is not None else p.grad).detach().float().clone()
        record["grads"].setdefault(record["role"], []).append(grads)
        return step(self)

    mw.MegatronWorker._step = every_step
    # the rows both trainers train on: one per prompt (TRL's replay finds a response by its prompt),
    # those that fill the length limit (where the EOS conventions agree), whole mini-batches
    from megappo.batch import RolloutBatch
    from megappo.trainer import ppo

    pieces = args.mini_batches
    dp_rows = ppo.PPOTrainer.dp_rows

    def kept_rows(self, batch):
        keep, seen = [], set()
        for i in dp_rows(self, batch):
            prompt = prompt_of(batch.input_ids, batch.prompt_lengths, i)
            if prompt not in seen and (bool(batch.response_mask[i].all()) or not args.full_length_only):
                keep.append(i)
                seen.add(prompt)
        return keep[:len(keep) - len(keep) % pieces]

    ppo.PPOTrainer.dp_rows = kept_rows
    split = RolloutBatch.split   # the rows kept, cut into as many mini-batches as the full batch

    def split_kept(self, size):
        return split(self, len(self) // pieces if len(self) % size else size)

    RolloutBatch.split = split_kept
    from megappo.train import main

    rc = main(json.loads(args.megappo_args))
    if rc:
        raise SystemExit(rc)
    torch.save(record, out / "megappo.pt")


def value_model_folder(model: str, dst: Path, seed: int) -> str:
    """The model with a random one-label head (TRL's value model, as trl_ppo.py makes it), saved:
    megappo's critic loads that head, TRL's value model the same file."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if not (dst / "config.json").exists():
        torch.manual_seed(seed)
        m = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1, dtype=torch.float32)
        m.save_pretrained(dst)
        AutoTokenizer.from_pretrained(model).save_pretrained(dst)
    return str(dst)


# -- TRL's side (its venv) ---------------------------------------------------------------------
def trl_side(args) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    import trl_ppo
    from trl.experimental.ppo import ppo_trainer as pt

    out = Path(args.out)
    rec = torch.load(out / "megappo.pt", weights_only=False)
    b = rec["batch"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    replies = {}
    for i, prompt in enumerate(prompts_of(b)):
        n = int(b["response_mask"][i].sum())
        replies[prompt] = b["responses"][i, :n].tolist()
    if len(replies) != len(b["responses"]):
        raise SystemExit(f"megappo trained on {len(b['responses'])} rows but {len(replies)} distinct prompts")
    # the training file cut to megappo's prompts: TRL's first batch is then exactly those
    rows = pq.read_table(args.train).to_pylist()
    keep, seen = [], set()
    for r in rows:   # one row per prompt (words and echo repeat prompts)
        ids = tuple(trl_ppo.tokenize_prompt(tok, r["prompt"]))
        if ids in replies and ids not in seen:
            keep.append(r)
            seen.add(ids)
    if len(keep) != len(replies):
        raise SystemExit(f"found {len(keep)} of megappo's {len(replies)} prompts in {args.train}")
    sub = out / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(keep), sub)

    captured = {"whiten": [], "grads": [], "order": []}
    whiten = pt.masked_whiten

    def masked_whiten(values, mask, shift_mean=True):
        res = whiten(values, mask, shift_mean)
        captured["whiten"].append((values.clone(), res.clone(), mask.clone()))
        return res

    pt.masked_whiten = masked_whiten

    def batch_generation(model, queries, local_bs, pad_token_id, generation_config):
        """megappo's responses in place of sampling, with the logits TRL's generate would return."""
        rows = []
        for q in queries.tolist():
            prompt = tuple(t for t in q if t != pad_token_id)
            captured["order"].append(prompt)
            rows.append(list(q) + replies[prompt])
        width = max(map(len, rows))
        # after an EOS generate writes the model's pad id (a real token: TRL gathers log-probs there)
        gc = model.generation_config
        fill = gc.pad_token_id if gc.pad_token_id is not None else gc.eos_token_id   # as generate falls back
        fill = fill[0] if isinstance(fill, list) else fill
        qr = torch.tensor([r + [fill] * (width - len(r)) for r in rows])
        out_ = pt.forward(model, qr, pad_token_id)
        ctx = queries.shape[1]
        logits = out_.logits[:, ctx - 1:-1] / generation_config.temperature
        return qr, logits

    pt.batch_generation = batch_generation
    # every epoch takes megappo's rows in megappo's order (its mini-batches are not shuffled)
    pt.np.random.permutation = lambda n: pt.np.array([captured["order"].index(p) for p in prompts_of(b)])

    orig_trainer = pt.PPOTrainer

    class Capturing(orig_trainer):
        def create_optimizer_and_scheduler(self, num_training_steps):
            super().create_optimizer_and_scheduler(num_training_steps)
            names = {id(p): ("policy", n) for n, p in self.model.policy.named_parameters()}
            names.update({id(p): ("value", n) for n, p in self.model.value_model.named_parameters()})
            opt_step = self.optimizer.step

            def step(*a, **k):
                g = {"policy": {}, "value": {}}
                for group in self.optimizer.param_groups:
                    for p in group["params"]:
                        if id(p) in names and p.grad is not None:
                            role, n = names[id(p)]
                            g[role][n] = p.grad.detach().clone()
                captured["grads"].append(g)
                return opt_step(*a, **k)

            self.optimizer.step = step

    pt.PPOTrainer = Capturing
    import trl.experimental.ppo as ppo_pkg

    ppo_pkg.PPOTrainer = Capturing
    rows_n = len(replies)
    argv = ["--model", args.model, "--train", str(sub), "--task", args.setup, "--steps", "1", "--batch-size", str(rows_n),
            "--mini-batch-size", str(rows_n // args.mini_batches), "--ppo-epochs", str(args.epochs), "--seed", str(args.seed), "--out", str(out / "trl.jsonl"),
            "--lr", str(args.lr), "--kl-coef", "0.01", "--max-new-tokens", str(args.response),
            "--value-model", args.value_model, "--cliprange-value", str(args.cliprange_value),
            "--vf-coef", str(args.vf_coef)]
    trl_ppo.main(argv)
    torch.save({k: captured[k] for k in ("grads", "whiten", "order")}, out / "trl.pt")


# -- the comparison ----------------------------------------------------------------------------
def compare(out: Path, vf_coef: float) -> dict:
    import torch

    m = torch.load(out / "megappo.pt", weights_only=False)
    t = torch.load(out / "trl.pt", weights_only=False)
    b = m["batch"]
    rel = lambda a, ref: float((a - ref).norm() / ref.norm().clamp_min(1e-30))  # noqa: E731
    res = {}

    def find(grads, suffix):
        hits = [v for k, v in grads.items() if k.endswith(suffix)]
        if len(hits) != 1:
            raise SystemExit(f"{len(hits)} parameters end with {suffix!r}: {sorted(grads)[:8]}...")
        return hits[0]

    steps = len(t["grads"])
    if any(len(m["grads"][r]) != steps for r in ("actor", "critic")):
        raise SystemExit(f"optimizer steps: TRL {steps}, megappo {[len(m['grads'][r]) for r in ('actor', 'critic')]}")
    res["optimizer steps"] = steps
    worst = {}
    for k in range(steps):
        for role, trl_role, pairs, scale in (("actor", "policy", POLICY_PARAMS, 1.0),
                                             ("critic", "value", VALUE_PARAMS, 1.0 / vf_coef)):
            for mg, hf in pairs:
                a = find(m["grads"][role][k], mg)
                r = find(t["grads"][k][trl_role], hf) * scale
                a = a[: r.shape[0]]       # megatron pads the vocabulary
                key = f"gradient, {role}: {hf}"
                worst[key] = max(worst.get(key, 0.0), rel(a, r))
                if k == 0:
                    res[f"first step {key}"] = rel(a, r)
    res.update({f"worst of {steps} steps {k}": v for k, v in worst.items()})
    for role in ("actor", "critic"):
        res[f"{role} gradients: worst relative difference"] = max(v for k, v in worst.items() if f" {role}:" in k)
    # advantages, by prompt: TRL's GAE output before whitening (megappo: returns - values) and after
    pre, post, _ = t["whiten"][0]
    prompts = prompts_of(b)
    rows = [t["order"].index(p) for p in prompts]   # TRL's row of each of megappo's
    mask = b["response_mask"].bool()
    full = mask.all(1)   # rows that fill the length limit: no EOS, both put the score on the last token
    res["rows trained on"] = len(prompts)
    res["of them ending with EOS before the length limit (TRL's convention differs there)"] = int((~full).sum())
    T = mask.shape[1]
    mine_pre = (b["returns"] - b["values"])[full][mask[full]]
    theirs_pre = pre[rows][:, :T][full][mask[full]]
    res["advantage before whitening (full-length rows)"] = rel(mine_pre, theirs_pre)
    res["advantage after whitening (full-length rows)"] = rel(b["advantages"][full][mask[full]],
                                                               post[rows][:, :T][full][mask[full]])
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="pick_first_warm16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--keep-eos-rows", dest="full_length_only", action="store_false",
                    help="keep the responses that end with EOS before the length limit (by default both trainers "
                         "train on the rows that fill it, where TRL's and megappo's conventions agree)")
    ap.add_argument("--cliprange-value", type=float, default=0.2, help="the value clip of both (TRL's and gae1_trl's: 0.2)")
    ap.add_argument("--vf-coef", type=float, default=1.0,
                    help="TRL's value-loss weight in its one loss (TRL's default 0.1: Adam undoes it but for its eps)")
    ap.add_argument("--train-value-bias", action="store_true",
                    help="train megappo's value-head bias (TRL's head has none; by default it stays at 0)")
    ap.add_argument("--epochs", type=int, default=4, help="PPO epochs (gae1_trl's and TRL's: 4)")
    ap.add_argument("--mini-batches", type=int, default=2, help="mini-batches per epoch (gae1_trl's and TRL's: 2)")
    ap.add_argument("--side", choices=["megappo", "trl"], help=argparse.SUPPRESS)
    for hidden in ("--model", "--train", "--setup", "--megappo-args", "--value-model"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--lr", type=float, default=3e-4, help=argparse.SUPPRESS)
    ap.add_argument("--response", type=int, default=8, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side == "megappo":
        megappo_side(args)
        return 0
    if args.side == "trl":
        trl_side(args)
        return 0
    import tempfile

    import learning

    out = Path(args.out or tempfile.mkdtemp(prefix="megappo-parity-"))
    out.mkdir(parents=True, exist_ok=True)
    spec = learning.TASKS[args.task]
    setup = spec.get("setup", args.task)
    from megappo.data.tiny import make_tiny_setup

    paths = make_tiny_setup(str(out / f"setup_{setup}_s{args.seed}"), task=setup, n_train=8192, seed=args.seed)
    if spec.get("warm_sft_steps"):
        paths = learning.warm_start(paths, spec["warm_sft_steps"], setup)
    vm = value_model_folder(paths["model"], out / "value_model", args.seed)
    margs = learning.megappo_args("gae1_trl", args.task, paths, out / "megappo_run", 1, args.seed)[3:]
    margs += [f"critic.model.path={vm}", *update_overrides(args.epochs, args.mini_batches),
              f"critic.cliprange_value={args.cliprange_value}"]
    lr = learning.TRL_ARGS.get(setup, ["--lr", "3e-4"])[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    me = Path(__file__).resolve()
    subprocess.run([sys.executable, str(me), "--side", "megappo", "--out", str(out), "--megappo-args", json.dumps(margs),
                    "--mini-batches", str(args.mini_batches), "--epochs", str(args.epochs),
                    *([] if args.full_length_only else ["--keep-eos-rows"]),
                    *(["--train-value-bias"] if args.train_value_bias else [])],
                   check=True, env=env, cwd=str(out), stdout=open(out / "megappo.log", "w"), stderr=subprocess.STDOUT)
    trl_py = learning.trl_python()
    if trl_py is None:
        raise SystemExit("no TRL venv: bash benchmarks/setup_trl.sh")
    subprocess.run([str(trl_py), str(me), "--side", "trl", "--out", str(out), "--model", paths["model"],
                    "--train", paths["train"], "--setup", setup, "--seed", str(args.seed), "--lr", lr,
                    "--response", str(spec["response"]), "--value-model", vm,
                    "--mini-batches", str(args.mini_batches), "--epochs", str(args.epochs),
                    "--cliprange-value", str(args.cliprange_value), "--vf-coef", str(args.vf_coef)],
                   check=True, env=env, cwd=str(out), stdout=open(out / "trl.log", "w"), stderr=subprocess.STDOUT)
    res = compare(out, vf_coef=args.vf_coef)
    for k, v in res.items():
        print(f"  {k:60s} {v:.3g}" if isinstance(v, float) else f"  {k:60s} {v}")
    print(json.dumps({"task": args.task, "seed": args.seed, **res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
