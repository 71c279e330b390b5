"""Does the critic's correction make the policy gradient less noisy? Measured at fixed checkpoints.

    python benchmarks/learning.py --tasks pick_first --methods gae --seeds 0 --full-budget \
        --out /tmp/pgv --extra trainer.save_freq=10
    python benchmarks/pg_variance.py --run /tmp/pgv/pick_first_gae_s0 --setup /tmp/pgv/setup_pick_first_s0 \
        --task pick_first --steps 10,50,100,150 --batches 48

Comparing GRPO and PPO with a critic by their learning curves mixes the estimators' quality with
the chaos of training (two runs part after a few steps and never meet again; three seeds do not
order them). This measures the estimators themselves, on the same policy and the same samples:
for a checkpoint of a ``gae`` run (actor and critic exported to HuggingFace folders with
checkpoints_tools/convert_to_hf.py), draw ``--batches`` independent batches as the trainer does
(``--prompts`` prompts x ``--n`` samples, temperature 1, the task's rule score on the last token),
and on each compute the first policy-gradient step's gradient (token-mean over the batch, ratio
1) for two advantage parts (algorithm.gae_adv_norm=group_cv at lambda = gamma = 1):
    o: GRPO's advantage (score - group mean) / group std
    d: the critic's within-group correction / group std (advantage = o + beta d)
so the gradient at any weight beta is g(beta) = g_o + beta g_d. Since d is a state-dependent
baseline, E[g_d] = 0 and every beta has the same mean gradient; what beta changes is the variance
    V(beta) = E|g(beta) - E g|^2 = V_o + 2 beta C + beta^2 V_d,
minimised at beta* = -C / V_d (the gradient-level control-variate weight). Printed per checkpoint:
the run's own beta at that step (critic/advantages/cv_beta), the token-level least-squares fit on
these batches (what group_cv estimates), beta*, and V(beta) / V(0) at the run's beta, at 1 and at
beta*; the advantages' own sum of squares at the run's beta relative to GRPO's (what the trainer
can see without gradients); the signal-to-noise ratio |E g|^2 / V(0) of one batch; and the bias check |mean g_d|^2
against V_d / batches (equal in expectation when the correction is unbiased).
``--oracle`` adds, for pick_first and copy, the correction of a critic that knows exactly how
many right words precede each token (V(s_t) = right words before t / 8, the part of E[R | s_t]
that is settled), for echo one that knows the outcome once the first word is out: what per-token
values that know the settled credit would buy (each a function of the tokens before t, so its
mean gradient is 0 too: the printed bias check says whether it is).
``--probe`` adds linear values fitted by least squares (on ``--probe-batches`` other batches:
the score of each sample on each of its tokens) on the actor's and on the critic's last hidden
state before each token, with the token's position: what a value head on either trunk could
extract now, against what the trained critic's own head does.

Runs in one process on CPU (transformers, no megatron, no vLLM); ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from megappo import algo  # noqa: E402


def export(run: Path, step: int, out: Path) -> tuple[Path, Path]:
    """(actor, critic) HF folders of ``run``'s checkpoint at ``step``, exported once."""
    dirs = []
    for role in ("actor", "critic"):
        dst = out / f"step{step}_{role}"
        if not (dst / "config.json").exists():
            cmd = [sys.executable, str(ROOT / "checkpoints_tools" / "convert_to_hf.py"), "--ckpt",
                   str(run / f"global_step_{step}" / role), "--out", str(dst), "--quiet"] + (["--critic"] if role == "critic" else [])
            subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
        dirs.append(dst)
    return dirs[0], dirs[1]


def run_beta(run: Path, step: int) -> float | None:
    """critic/advantages/cv_beta the run used at ``step + 1`` (the first step after the checkpoint;
    at the run's last step, that step's)."""
    beta = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        beta[m.get("step")] = m.get("critic/advantages/cv_beta")
    return beta.get(step + 1, beta.get(step))   # the last checkpoint: its own step's


def sample_batch(policy, tok, queries, table, score_batch, n_prompts: int, n: int, max_new: int, rng: random.Random,
                 gen: torch.Generator):
    """(input_ids (B, L) right-padded, prompt_len (B,), response_mask (B, T), rewards (B, T), group (B,),
    response ids (B, T), each sample's prompt ids) for n samples of each of n_prompts prompts drawn
    at random."""
    picks = [queries[rng.randrange(len(queries))] for _ in range(n_prompts)]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    seqs, plens, resps, groups = [], [], [], []
    by_len: dict[int, list[int]] = {}
    for g, q in enumerate(picks):
        by_len.setdefault(len(q), []).append(g)
    out: dict[int, torch.Tensor] = {}
    for length, gs in by_len.items():   # one generate per prompt length: no padding, exact positions
        ids = torch.tensor([picks[g] for g in gs for _ in range(n)])
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        with torch.no_grad():
            o = policy.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                top_p=1.0, max_new_tokens=max_new, min_new_tokens=1, eos_token_id=eos, pad_token_id=pad)
        for k, g in enumerate(gs):
            out[g] = o[k * n:(k + 1) * n, length:]
    for g, q in enumerate(picks):
        for r in out[g]:
            r = r.tolist()
            cut = r.index(eos) + 1 if eos in r else len(r)   # the response ends with its EOS, as the trainer's
            resps.append(r[:cut])
            seqs.append(q + r[:cut])
            plens.append(len(q))
            groups.append(g)
    B, T = len(seqs), max_new
    L = max(len(s) for s in seqs)
    input_ids = torch.full((B, L), pad, dtype=torch.long)
    response = torch.full((B, T), pad, dtype=torch.long)
    mask = torch.zeros(B, T)
    for i, s in enumerate(seqs):
        input_ids[i, :len(s)] = torch.tensor(s)
        response[i, :len(resps[i])] = torch.tensor(resps[i])
        mask[i, :len(resps[i])] = 1
    texts = [tok.decode([t for t in r if t != eos], skip_special_tokens=True) for r in resps]
    info = [table[tuple(picks[g])] for g in groups]
    scores = score_batch([i[0] for i in info], texts, [i[1] for i in info], [i[2] for i in info])
    rewards = torch.zeros(B, T)
    last = mask.sum(1).long() - 1
    rewards[torch.arange(B), last] = torch.tensor(scores, dtype=torch.float32)
    return input_ids, torch.tensor(plens), mask, rewards, torch.tensor(groups), response, [picks[g] for g in groups]


def response_positions(plen: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T) index of the position whose output predicts response token t (the token before it)."""
    return plen[:, None] - 1 + torch.arange(T)[None, :]


def oracle_values(task: str, tok, prompts: list[list[int]], response: torch.Tensor, mask: torch.Tensor,
                  score: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) the settled part of E[R | s_t], a function of the tokens before t (so a baseline):
    right words before each response token / 8 (pick_first: the prompt's first word; copy: the
    prompt word at that index); echo, whose outcome its first word decides: the score (B,) after
    the first response token that is a word (special tokens, and the ids of the model's padded
    vocabulary past the tokenizer's, decode to nothing), 0 before it."""
    B, T = response.shape
    if task == "echo":
        words = torch.tensor(sorted(set(range(len(tok))) - set(tok.all_special_ids)))
        is_word = torch.isin(response, words) & mask.bool()   # ids past the tokenizer's decode to nothing too
        words_before = torch.cumsum(is_word.float(), 1) - is_word.float()
        return score[:, None] * (words_before > 0) * mask
    words = {tok.convert_tokens_to_ids(f"t{i}") for i in range(10, 42)}
    want = torch.zeros(B, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        content = [t for t in p if t in words]
        for t in range(T):
            want[i, t] = content[0] if task == "pick_first" else (content[t] if t < len(content) else -1)
    right = ((response == want) & mask.bool()).float()
    before = torch.cumsum(right, 1) - right
    return before / 8 * mask


def centred(rewards, values, mask, group) -> torch.Tensor:
    """(B, T) float64 group_centred advantages at lambda = gamma = 1 (a critic of zeros: GRPO's)."""
    adv, _ = algo.compute_advantages("gae", token_level_rewards=rewards, response_mask=mask, values=values,
                                     group_index=group, gamma=1.0, lam=1.0, gae_adv_norm="group_centred")
    return adv.double()


def response_logp(policy, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(B, T) log-probability of each response token under ``policy`` (with its graph): the output
    at position pos[:, t] scores the token at pos[:, t] + 1."""
    logits = policy(ids).logits.float()
    rows = torch.gather(logits, 1, pos[..., None].expand(-1, -1, logits.shape[-1]))   # (B, T, V)
    target = torch.gather(ids, 1, (pos + 1).clamp(max=ids.shape[1] - 1))
    return torch.gather(torch.log_softmax(rows, -1), 2, target[..., None])[..., 0]


def critic_values(critic, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) V(s_t): the critic's output at the position before response token t (column 0 is the
    prompt's value, as the trainer's), 0 past the response."""
    with torch.no_grad():
        v = critic(ids).logits[..., 0].float()
    return torch.gather(v, 1, pos) * mask


def features(model, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(B, T, H) ``model``'s last hidden state (after its final norm) at the position before each
    response token: what a linear value head on that trunk sees of the state s_t."""
    with torch.no_grad():
        h = model(ids, output_hidden_states=True).hidden_states[-1].float()
    return torch.gather(h, 1, pos[..., None].expand(-1, -1, h.shape[-1]))


def probe_inputs(feats: torch.Tensor) -> torch.Tensor:
    """(B, T, H + T + 1): the features, a one-hot of the response position and a constant."""
    B, T, _ = feats.shape
    return torch.cat([feats, torch.eye(T).expand(B, T, T), torch.ones(B, T, 1)], -1).double()


def fit_probe(xs: list[torch.Tensor], ys: list[torch.Tensor], ms: list[torch.Tensor], ridge: float = 1e-3) -> torch.Tensor:
    """Least-squares weights w (D,) of returns on probe inputs over the masked tokens of batches
    (xs (B, T, D), ys (B,) scores, ms (B, T)), with a ridge of ``ridge`` times the mean diagonal."""
    A = sum(torch.einsum("btd,bte,bt->de", x, x, m.double()) for x, m in zip(xs, ms))
    b = sum(torch.einsum("btd,b,bt->d", x, y.double(), m.double()) for x, y, m in zip(xs, ys, ms))
    A = A + ridge * torch.diagonal(A).mean() * torch.eye(A.shape[0], dtype=A.dtype)
    return torch.linalg.solve(A, b)


def flat_grad(loss, params) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)]).to(torch.float64)


def measure(policy, critic, tok, queries, table, score_batch, args, step_beta, task):
    params = [p for p in policy.parameters() if p.requires_grad]
    probes = {}
    if args.probe:   # linear values on each trunk's features, fitted on batches the measurement does not use
        rng, gen = random.Random(args.seed + 10_000), torch.Generator().manual_seed(args.seed + 10_000)
        xs, ys, ms = {"actor": [], "critic": []}, [], []
        for _ in range(args.probe_batches):
            ids, plen, mask, rewards, group, response, prompts = sample_batch(
                policy, tok, queries, table, score_batch, args.prompts, args.n, args.max_new, rng, gen)
            pos = response_positions(plen, mask.shape[1]).clamp(max=ids.shape[1] - 1)
            for name, model in (("actor", policy), ("critic", critic)):
                xs[name].append(probe_inputs(features(model, ids, pos)))
            ys.append(rewards.sum(1))
            ms.append(mask)
        probes = {name: fit_probe(x, ys, ms) for name, x in xs.items()}
    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    go, gd, gor, fits = [], [], [], []
    gp = {name: [] for name in probes}
    scores = []
    for _ in range(args.batches):
        ids, plen, mask, rewards, group, response, prompts = sample_batch(
            policy, tok, queries, table, score_batch, args.prompts, args.n, args.max_new, rng, gen)
        pos = response_positions(plen, mask.shape[1]).clamp(max=ids.shape[1] - 1)
        values = critic_values(critic, ids, pos, mask)
        o = centred(rewards, torch.zeros_like(values), mask, group)
        full = centred(rewards, values, mask, group)
        d = full - o
        logp = response_logp(policy, ids, pos)

        def pg(adv):   # the token-mean policy gradient of advantages adv at ratio 1
            return flat_grad((adv.float() * logp * mask).sum() / mask.sum(), params)

        go.append(pg(o))
        gd.append(pg(d))
        if args.oracle:
            ov = oracle_values(task, tok, prompts, response, mask, rewards.sum(1))
            gor.append(pg(centred(rewards, ov, mask, group) - o))
        for name, w in probes.items():
            model = policy if name == "actor" else critic
            pv = (probe_inputs(features(model, ids, pos)) @ w).float() * mask
            gp[name].append(pg(centred(rewards, pv, mask, group) - o))
        # the token-level least-squares weight group_cv estimates (sums over the batches)
        m = mask.double()
        fits.append(torch.stack([(-d * o * m).sum(), (d * d * m).sum(), (o * o * m).sum()]))
        scores.append(float(rewards.sum(1).mean()))
    res = {"score": sum(scores) / len(scores), "run_beta": step_beta}
    f = torch.stack(fits).sum(0)
    res["token_fit_beta"] = float(f[0] / f[1]) if float(f[1]) > 0 else None
    if step_beta is not None:   # the advantages' own sum of squares at the run's beta, relative to GRPO's
        res["token_ratio_at_run_beta"] = float((f[2] - 2 * step_beta * f[0] + step_beta ** 2 * f[1]) / f[2])
    res.update(_variances(torch.stack(go), torch.stack(gd), step_beta, "critic"))
    if args.oracle:
        res.update(_variances(torch.stack(go), torch.stack(gor), None, "oracle"))
    for name, g in gp.items():
        res.update(_variances(torch.stack(go), torch.stack(g), None, f"probe_{name}"))
    return res


def _variances(go: torch.Tensor, gd: torch.Tensor, step_beta, name: str) -> dict:
    """Variances over batches (unbiased) of g_o + beta g_d and the gradient-level optimal beta."""
    K = go.shape[0]
    mo, md = go.mean(0), gd.mean(0)
    co, cd = go - mo, gd - md
    Vo = float((co * co).sum(1).sum() / (K - 1))
    Vd = float((cd * cd).sum(1).sum() / (K - 1))
    C = float((co * cd).sum(1).sum() / (K - 1))
    beta_star = -C / Vd if Vd > 0 else 0.0

    def ratio(b):
        return (Vo + 2 * b * C + b * b * Vd) / Vo

    signal = float((mo * mo).sum()) - Vo / K   # |E g|^2, its noise removed
    out = {f"{name}_Vd_over_Vo": Vd / Vo, f"{name}_beta_star": beta_star, f"{name}_V_ratio_at_1": ratio(1.0), f"{name}_V_ratio_at_beta_star": ratio(beta_star),
           f"{name}_corr": C / (Vo * Vd) ** 0.5 if Vd > 0 else 0.0, f"{name}_mean_d_sq_over_noise": float((md * md).sum()) / (Vd / K) if Vd > 0 else None}
    if name == "critic":
        out["snr_grpo"] = signal / Vo
        if step_beta is not None:
            out["critic_V_ratio_at_run_beta"] = ratio(step_beta)
    return out


def markdown_table(rows: list[dict]) -> str:
    """The figures per checkpoint as a markdown table (V: the gradient's variance over batches
    relative to GRPO's advantage alone; a ratio below 1 is the critic earning something)."""
    cols = [("step", "step", "{}"), ("score", "score", "{:.3f}"), ("run_beta", "run's beta", "{:.2f}"),
            ("token_fit_beta", "token fit", "{:.2f}"), ("critic_beta_star", "beta*", "{:.2f}"),
            ("critic_V_ratio_at_run_beta", "V at run's beta", "{:.3f}"), ("token_ratio_at_run_beta", "sum A^2 at run's beta", "{:.3f}"), ("critic_V_ratio_at_1", "V at 1", "{:.3f}"),
            ("critic_V_ratio_at_beta_star", "V at beta*", "{:.3f}"), ("oracle_V_ratio_at_1", "oracle V at 1", "{:.3f}"),
            ("probe_actor_V_ratio_at_beta_star", "actor probe V at beta*", "{:.3f}"),
            ("probe_critic_V_ratio_at_beta_star", "critic probe V at beta*", "{:.3f}"),
            ("snr_grpo", "GRPO's SNR", "{:.3f}")]
    cols = [c for c in cols if any(c[0] in r for r in rows)]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("-" if r.get(k) is None else f.format(r[k]) for k, _, f in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, type=Path, help="a gae run's folder (trainer.default_local_dir) with checkpoints")
    ap.add_argument("--setup", required=True, type=Path, help="its task folder (model/, data/train.parquet)")
    ap.add_argument("--task", required=True, help="pick_first, copy, words, echo, pick_last")
    ap.add_argument("--steps", required=True, help="checkpoint steps, comma-separated")
    ap.add_argument("--batches", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=None, help="default: learning.py's response length for the task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--oracle", action="store_true", help="pick_first, copy, echo: also a critic with the settled part of E[R | s_t]")
    ap.add_argument("--probe", action="store_true",
                    help="also linear values fitted (least squares on --probe-batches other batches) on the actor's and the critic's last hidden state")
    ap.add_argument("--probe-batches", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None, help="where the exports go (default: RUN/hf)")
    args = ap.parse_args(argv)
    import learning
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer
    from trl_ppo import load_score_batch, read_prompts

    if args.max_new is None:
        args.max_new = learning.TASKS[args.task]["response"]
    if args.oracle and args.task not in ("pick_first", "copy", "echo"):
        raise SystemExit(f"--oracle: only pick_first, copy and echo, got --task {args.task}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = args.out or args.run / "hf"
    tok = AutoTokenizer.from_pretrained(str(args.setup / "model"))
    queries, table = read_prompts(str(args.setup / "data" / "train.parquet"), tok, learning.TASKS[args.task].get("setup", args.task))
    score_batch = load_score_batch()
    rows = []
    for step in [int(s) for s in args.steps.split(",")]:
        t0 = time.time()
        actor_dir, critic_dir = export(args.run, step, out)
        policy = AutoModelForCausalLM.from_pretrained(str(actor_dir), dtype=torch.float32).eval()
        critic = AutoModelForTokenClassification.from_pretrained(str(critic_dir), dtype=torch.float32).eval()
        res = dict(step=step, **measure(policy, critic, tok, queries, table, score_batch, args, run_beta(args.run, step), args.task))
        res["seconds"] = round(time.time() - t0, 1)
        rows.append(res)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()), flush=True)
    print(markdown_table(rows))
    print(json.dumps({"task": args.task, "run": str(args.run), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
