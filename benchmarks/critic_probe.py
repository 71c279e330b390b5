"""Can the critic learn per-token values? Supervised probe on synthetic rollouts, no policy.

    python benchmarks/critic_probe.py                       # pick_first, the trainer's critic settings
    python benchmarks/critic_probe.py --task copy --steps 240
    python benchmarks/critic_probe.py critic.optim.lr=3e-3  # any config override, one thing at a time

The critic is built by megappo.builders.build_critic from learning.py's config (tiny_cpu + the
`gae_batch` method's overrides (one critic pass, the defaults before group_cv), plus the overrides given here) on the task's tiny model folder, and
trained by Critic.update_critic exactly as the trainer calls it (values of the batch first, for
the clipped loss; mini-batches of critic.ppo_mini_batch_size prompts x n). Rollouts are
synthetic: per prompt a hit rate p in {0.2, 0.5, 0.8} set by its first word (as a policy's skill
depends on the prompt, so V(s_0) can learn it); each of the 8 response words is
right with probability p (pick_first: the prompt's first word; copy: the prompt word at that
index), else another content word; the reward right/8 sits on the last token. Targets: the
Monte-Carlo return (the reward at every token, what GAE with lambda 1 gives the critic),
``--target mc_centred``: that minus the mean of the other samples of its prompt (what
algorithm.critic_target=group_relative gives it), or ``--target exact``: E[R | s_t] =
(right before t + p (8 - t)) / 8. The slope below is per prompt group, so it is comparable
between the three; the MSE and explained variance are against the exact values (not those of
mc_centred's targets).

Printed on a fixed held-out batch every ``--every`` steps: the within-group slope of 8 V(s_t) on
"right words before t" (both centred per prompt group and position; 1.0 = per-token credit, 0 =
the critic knows only the prompt), the value's MSE to the exact E[R | s_t], its explained
variance of the exact values, and the value loss.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

N_WORDS = 8
P_CHOICES = (0.2, 0.5, 0.8)
TOKENS = 2048   # learning.py's critic.ppo_max_token_len_per_gpu (dynamic batch size)


def build(task: str, seed: int, overrides: list[str], model_dir: str | None = None, shape: dict | None = None,
          sft_steps: int = 0):
    """(cfg, critic, value loss spec, tokenizer, prompts) as the trainer builds them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import learning  # the benchmark's own settings, so the probe cannot drift from them
    from transformers import AutoTokenizer

    from megappo import builders
    from megappo.config import load_config
    from megappo.data.tiny import make_tiny_setup
    from megappo.trainer.setup import init_distributed

    out = Path(tempfile.mkdtemp(prefix="critic-probe-"))
    paths = make_tiny_setup(str(out / "setup"), task=task, n_train=2048, seed=seed)
    model = model_dir or paths["model"]
    if shape:   # a random-init critic of another shape on the task's tokenizer
        model = _reshaped(paths["model"], str(out / "critic_model"), shape, seed)
    if sft_steps:
        model = _fine_tuned(model, str(out / "fine_tuned"), paths["train"], sft_steps)
    args = ["trainer.n_gpus_per_node=1", f"actor_rollout_ref.model.path={model}", f"data.train_files=[{paths['train']}]",
            f"data.val_files=[{paths['test']}]", "data.max_prompt_length=16", f"data.max_response_length={N_WORDS}",
            "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
            "critic.ppo_max_token_len_per_gpu=2048", f"actor_rollout_ref.actor.megatron.seed={42 + seed}",
            *learning.MEGAPPO["gae_batch"], *overrides]
    cfg = load_config(args, ["tiny_cpu"])
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    device = init_distributed(cfg)
    tok = AutoTokenizer.from_pretrained(model)
    critic = builders.build_critic(cfg, device, tok.pad_token_id, total_steps=10**6)
    _, vloss = builders.loss_specs(cfg)
    import pandas as pd

    rows = pd.read_parquet(paths["train"])
    prompts = [tok.apply_chat_template(list(m), add_generation_prompt=True, tokenize=True) for m in rows["prompt"]]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    return cfg, critic, vloss, tok, prompts


def _reshaped(src: str, dst: str, shape: dict, seed: int) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d = AutoConfig.from_pretrained(src).to_dict()
    d.pop("layer_types", None)   # derived from num_hidden_layers
    d.update(shape)
    cfg = AutoConfig.for_model(**d)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(dst, safe_serialization=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def _fine_tuned(src: str, dst: str, train: str, steps: int, task: str = "pick_first") -> str:
    """The task's model trained to give the task's answer (pick_first: the prompt's first word 8
    times; copy: the prompt's 8 words; supervised, Adam 1e-3, 64 prompts a step; on pick_first
    300 steps bring the loss to ~0.007): a stand-in for an actor that has learnt the task, to
    start the critic from, or (a few steps) a model that has the skill in part."""
    import pandas as pd
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src)
    prompts = [tok.apply_chat_template(list(m), add_generation_prompt=True, tokenize=True)
               for m in pd.read_parquet(train)["prompt"]]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # the prompt is <|user|> w1 .. w8 <|assistant|>
    answer = {"pick_first": lambda p: [p[1]] * N_WORDS, "copy": lambda p: p[1:1 + N_WORDS]}[task]
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        rows = [prompts[i] for i in torch.randint(len(prompts), (64,), generator=g).tolist()]
        ids = torch.tensor([p + answer(p) for p in rows])
        labels = ids.clone()
        labels[:, :len(rows[0])] = -100
        loss = model(ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"fine-tuned the critic's start to answer the first word: {steps} steps, loss {loss.item():.4f}")
    model.save_pretrained(dst, safe_serialization=True)
    tok.save_pretrained(dst)
    return dst


def synth_batch(prompts, tok, task: str, n_prompts: int, n: int, rng: random.Random):
    """A RolloutBatch of n samples per prompt plus (right_before (B, T), p (B,)) for the checks."""
    from megappo.batch import RolloutBatch

    words = [tok.convert_tokens_to_ids(f"t{i}") for i in range(10, 42)]
    rows, resp, right_before, ps, group = [], [], [], [], []
    for g in range(n_prompts):
        prompt = prompts[rng.randrange(len(prompts))]
        content = [t for t in prompt if t in words][:N_WORDS]
        p = P_CHOICES[content[0] % len(P_CHOICES)]   # the policy's skill on a prompt: learnable from it
        for _ in range(n):
            ids, hits, before = [], 0, []
            for t in range(N_WORDS):
                want = {"pick_first": content[0], "copy": content[t], "const": words[0]}[task]
                before.append(hits)
                if rng.random() < p:
                    ids.append(want)
                    hits += 1
                else:
                    ids.append(rng.choice([w for w in words if w != want]))
            rows.append(prompt)
            resp.append(ids)
            right_before.append(before)
            ps.append(p)
            group.append(g)
    responses = torch.tensor(resp)
    batch = RolloutBatch.from_prompts_and_responses(rows, responses, torch.ones_like(responses, dtype=torch.float32),
                                                    tok.pad_token_id, prompt_index=torch.tensor(group))
    return batch, torch.tensor(right_before, dtype=torch.float32), torch.tensor(ps)


def exact_values(right_before, p):
    t = torch.arange(N_WORDS, dtype=torch.float32)
    return (right_before + p[:, None] * (N_WORDS - t)) / N_WORDS


def within_group_slope(values, right_before, group) -> float:
    """Pooled slope of 8 V on right-before-t, both centred per (prompt group, position), t >= 1."""
    x, y = right_before[:, 1:], 8 * values[:, 1:]
    xs, ys = [], []
    for g in group.unique():
        m = group == g
        xs.append(x[m] - x[m].mean(0))
        ys.append(y[m] - y[m].mean(0))
    x, y = torch.cat(xs).flatten(), torch.cat(ys).flatten()
    return float((x * y).sum() / (x * x).sum().clamp(min=1e-9))


def evaluate(critic, held):
    batch, right_before, p = held
    v = critic.compute_values(batch, max_token_len=TOKENS)
    exact = exact_values(right_before, p)
    mse = float((v - exact).square().mean())
    ev = 1 - float((v - exact).var() / exact.var())
    return within_group_slope(v, right_before, batch.prompt_index), mse, ev


def alignment(critic, held, t: int = 3) -> tuple[float, float]:
    """(max |change of V(s_t)|, mean |change of V(s_t+1)|) when response token t is replaced: the
    value of token t is read before t is emitted, so the first must be 0 and the second not."""
    batch = held[0]
    v = critic.compute_values(batch, max_token_len=TOKENS)
    other = batch.select(list(range(len(batch))))
    col = other.prompt_lengths + t
    other.input_ids = other.input_ids.clone()
    other.responses = other.responses.clone()
    rows = torch.arange(len(batch))
    other.input_ids[rows, col] = other.input_ids[rows.roll(1), col.roll(1)]
    other.responses[:, t] = other.input_ids[rows, col]
    w = critic.compute_values(other, max_token_len=TOKENS)
    return float((w[:, t] - v[:, t]).abs().max()), float((w[:, t + 1] - v[:, t + 1]).abs().mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="pick_first", choices=("pick_first", "copy", "const"),
                    help="const: the right word is always t10 (no lookup into the prompt: isolates counting)")
    ap.add_argument("--target", default="mc", choices=("mc", "mc_centred", "exact"),
                    help="mc_centred: the return minus the mean score of the other samples of its prompt (the "
                         "critic learns only what differs within a group)")
    ap.add_argument("--steps", type=int, default=120, help="training steps of 32 prompts x 8 samples (120 = 30,720 samples)")
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="a model folder to build the critic from (default: the task's)")
    ap.add_argument("--layers", type=int, default=None, help="a random-init critic with this many layers")
    ap.add_argument("--hidden", type=int, default=None, help="... and this hidden size (intermediate 2x)")
    ap.add_argument("--sft-steps", type=int, default=0,
                    help="start the critic from the model fine-tuned this many steps to answer the first word")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    a = ap.parse_args(argv)
    torch.manual_seed(a.seed)
    shape = {k: v for k, v in (("num_hidden_layers", a.layers), ("hidden_size", a.hidden),
                               ("intermediate_size", a.hidden and 2 * a.hidden)) if v}
    cfg, critic, vloss, tok, prompts = build("copy" if a.task == "const" else a.task, a.seed, a.overrides, a.model, shape,
                                           a.sft_steps)
    n, per_step = cfg.actor_rollout_ref.rollout.n, cfg.data.train_batch_size
    rng = random.Random(1000 + a.seed)
    held = synth_batch(prompts, tok, a.task, 64, n, random.Random(7))
    print(f"probe {a.task} target={a.target} overrides={a.overrides}")
    print(f"{'step':>5} {'samples':>8} {'slope':>7} {'mse':>8} {'ev':>6} {'vf_loss':>8}")
    s, mse, ev = evaluate(critic, held)
    print(f"{0:>5} {0:>8} {s:7.3f} {mse:8.5f} {ev:6.3f}", flush=True)
    curve = [{"samples": 0, "slope": round(s, 4), "mse": round(mse, 6), "ev": round(ev, 4)}]
    mini = cfg.critic.ppo_mini_batch_size * n
    for step in range(1, a.steps + 1):
        batch, right_before, p = synth_batch(prompts, tok, a.task, per_step, n, rng)
        final = _final_reward(batch, right_before, tok, a.task, prompts)
        if a.target == "mc_centred":   # minus the mean of the other samples of its prompt
            group_sum = torch.zeros(per_step).index_add_(0, batch.prompt_index, final)
            final = final - (group_sum[batch.prompt_index] - final) / (n - 1)
        batch.returns = (exact_values(right_before, p) if a.target == "exact"
                         else final[:, None].expand(-1, N_WORDS).contiguous())
        batch.values = critic.compute_values(batch, max_token_len=TOKENS)
        m = critic.update_critic(batch, mini_batch_size=mini, ppo_epochs=cfg.critic.ppo_epochs, loss=vloss,
                                 max_token_len=TOKENS)
        if step % a.every == 0 or step == a.steps:
            s, mse, ev = evaluate(critic, held)
            curve.append({"samples": step * per_step * n, "slope": round(s, 4), "mse": round(mse, 6), "ev": round(ev, 4)})
            print(f"{step:>5} {step * per_step * n:>8} {s:7.3f} {mse:8.5f} {ev:6.3f} {m['critic/vf_loss']:8.5f}",
                  flush=True)
    same, nxt = alignment(critic, held)
    print(f"alignment: replacing response token 3 changes V(s_3) by at most {same:.2e} (must be 0), "
          f"V(s_4) by {nxt:.4f} on average")
    print(json.dumps({"task": a.task, "target": a.target, "seed": a.seed, "overrides": a.overrides, "curve": curve,
                      "alignment_same_max": same, "alignment_next_mean": round(nxt, 6)}))
    torch.distributed.destroy_process_group()   # after the fine-tuning's autograd threads, exit hangs without it
    return 0


def _final_reward(batch, right_before, tok, task, prompts):
    """right/8 over the whole response: the hits before the last word plus the last word's."""
    ids = batch.input_ids
    last = batch.responses[:, -1]
    first = ids[torch.arange(len(ids)), _first_word_pos(batch, tok)]
    if task == "pick_first":
        want = first
    elif task == "const":
        want = torch.full_like(first, tok.convert_tokens_to_ids("t10"))
    else:
        want = ids[torch.arange(len(ids)), _first_word_pos(batch, tok) + N_WORDS - 1]
    return (right_before[:, -1] + (last == want).float()) / N_WORDS


def _first_word_pos(batch, tok):
    user = tok.convert_tokens_to_ids("<|user|>")
    return (batch.input_ids == user).float().argmax(1) + 1


if __name__ == "__main__":
    sys.exit(main())
