"""checkpoints_tools: trainer checkpoints saved at TP2PP2 / TP1PP2 / TP2PP1 export to HF folders
that transformers loads and that compute what the Megatron actor (critic) computed; HF -> Megatron
-> HF is bit-exact; export reads a checkpoint while a newer one is being written; bad inputs end
with exit code 2 and one line naming the path and the problem."""
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from harness import spawn
from mcore import SEQ, build, run_schedule, safetensors_tensors, setup, token_log_probs

pytestmark = pytest.mark.distributed
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
TOOLS = os.path.join(REPO, "checkpoints_tools")
sys.path.insert(0, TESTS)
from tiny_models import VOCAB, save_tiny_model  # noqa: E402

# (name, arch, tp, pp): qwen2 has tied embeddings (shared across the two pipeline stages here).
LAYOUTS = (("tp2pp2", "qwen3", 2, 2), ("tp1pp2", "qwen2", 1, 2), ("tp2pp1", "llama", 2, 1))
CLI_ENV = dict(os.environ, PYTHONWARNINGS="ignore")


def _ids():
    g = torch.Generator().manual_seed(17)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def _actor(path, tp, pp, lr=1e-2):
    from megappo.workers import Actor

    info, cfg, chunks = build(path, tp, pp)
    return info, Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=lr, clip_grad=1.0)


def _update(worker, batch, critic=False):
    if critic:
        batch.values = worker.compute_values(batch, 2)
        worker.update_critic(batch, mini_batch_size=len(batch), micro_batch_size=2)
    else:
        batch.old_log_prob = worker.compute_log_prob(batch, 2)
        worker.update_policy(batch, mini_batch_size=len(batch), micro_batch_size=2)


def _values(chunks):
    def loss(output, ids):
        return output.sum() * 0.0, {"v": output[..., 0].detach().float()}

    with torch.no_grad():
        return [o["v"] for o in run_schedule(chunks, [_ids()], loss)]


def _writer_rank():
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0)


def _train_and_save(rank, world, dirs, runs, imported, out_dir):
    """Per layout: one PPO update (weights leave the HF source), save like the trainer, record the
    actor's log-probs (and at TP2PP2 the critic's values) on fixed sequences."""
    from megappo.checkpoint import load_worker, save_checkpoint
    from megappo.convert import live_hf_writer, write_live_hf
    from megappo.models import build_model, describe, load_hf_config, transformer_config
    from megappo.workers import Actor, Critic
    from test_workers import _global_batch

    for name, arch, tp, pp in LAYOUTS:
        setup(tp, pp)
        path = os.path.join(dirs, arch)
        info, actor = _actor(path, tp, pp)
        workers, record = {"actor": actor}, {}
        if name == "tp2pp2":
            # convert_from_hf's checkpoint (written for TP2PP2) loads through load_worker into
            # an un-initialised model and computes exactly what the HF-loaded one computes.
            fresh_info = describe(load_hf_config(path), tp=tp)
            fresh_cfg = transformer_config(fresh_info, tp=tp, pp=pp, sequence_parallel=True, cpu=True)
            fresh = build_model(fresh_info, fresh_cfg)
            load_worker(Actor(fresh, fresh_cfg, vocab_size=VOCAB), imported)
            a, b = token_log_probs(fresh, info, [_ids()]), token_log_probs(actor.chunks, info, [_ids()])
            assert all(torch.equal(x, y) for x, y in zip(a, b))
            _, ccfg, cchunks = build(path, tp, pp, value_head=True)
            critic = Critic(cchunks, ccfg, lr=1e-2, clip_grad=1.0)
            _update(critic, _global_batch(), critic=True)
            workers["critic"] = critic
            record["values"] = _values(critic.chunks)
        _update(actor, _global_batch())
        save_checkpoint(os.path.join(runs, name), 1, workers, {},
                        hf_sources={k: path for k in workers})
        # the same weights written as HF folders by the save itself (save_contents with hf_model),
        # beside a resumable checkpoint and as an export alone
        descs = {k: describe(load_hf_config(path), tp=tp, value_head=k == "critic").desc for k in workers}
        writers = {k: live_hf_writer(w.chunks, descs[k]) for k, w in workers.items()}
        save_checkpoint(os.path.join(runs, name + "_hf"), 1, workers, {}, hf_sources={k: path for k in workers},
                        hf_weights=writers)
        save_checkpoint(os.path.join(runs, name + "_export"), 1, workers, {}, hf_sources={k: path for k in workers},
                        hf_weights=writers, resumable=False)
        if name == "tp2pp2":   # the disk fills during rank 0's HF writes of the actor: every rank raises (the
            # critic's save and walk after it start on no rank), nothing is published
            from megappo.checkpoint import CheckpointError
            from megappo.convert import hf_export

            real = hf_export.ShardWriter.write

            def full(self, n, t):
                if "layers.1." in n:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real(self, n, t)

            hf_export.ShardWriter.write = full
            try:
                save_checkpoint(os.path.join(runs, name + "_hf"), 2, workers, {}, hf_sources={k: path for k in workers},
                                hf_weights=writers)
                said = "saved"
            except CheckpointError as e:
                said = str(e)
            finally:
                hf_export.ShardWriter.write = real
            with open(os.path.join(out_dir, f"disk_full_{torch.distributed.get_rank()}.txt"), "w") as f:
                f.write(said)
        if name == "tp2pp2":   # files cut at 1 MB: the index names each tensor's file
            sharded = os.path.join(out_dir, "live_sharded")
            if torch.distributed.get_rank() == 0:
                os.makedirs(sharded)
            write_live_hf(actor.chunks, descs["actor"], sharded, json.load(open(os.path.join(path, "config.json"))),
                          write=torch.distributed.get_rank() == 0, max_shard_size="1MB")
        record["lp"] = token_log_probs(actor.chunks, info, [_ids()])
        if _writer_rank():
            torch.save(record, os.path.join(out_dir, f"{name}.pt"))


def _run_cli(script, *args, check=None):
    quiet = [] if script == "verify.py" else ["--quiet"]
    r = subprocess.run([sys.executable, os.path.join(TOOLS, script), *args, *quiet], capture_output=True, text=True,
                       env=CLI_ENV, timeout=300)
    if check is not None:
        assert r.returncode == check, (r.returncode, r.stdout, r.stderr[-3000:])
    return r


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    dirs = root / "hf"
    for i, (_, arch, _, _) in enumerate(LAYOUTS):
        save_tiny_model(arch, dirs / arch, seed=11 + i)
        (dirs / arch / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    imported = root / "imported"
    t = time.time()
    r = _run_cli("convert_from_hf.py", "--hf", str(dirs / "qwen3"), "--out", str(imported), "--tp", "2", "--pp", "2",
                 check=0)
    assert "vocabulary padded to 512" in r.stdout
    print(f"convert_from_hf CLI: {time.time() - t:.1f}s")
    t = time.time()
    spawn(_train_and_save, 4, str(dirs), str(root / "runs"), str(imported), str(root))
    print(f"train and save 3 layouts: {time.time() - t:.1f}s")
    rec = {name: torch.load(root / f"{name}.pt") for name, *_ in LAYOUTS}
    return {"root": root, "hf": dirs, "runs": root / "runs", "imported": imported, "rec": rec}


def _to_hf(*argv):
    from megappo.convert.cli import convert_to_hf_main

    return convert_to_hf_main([*map(str, argv), "--quiet"])


def _hf_log_probs(model, ids):
    with torch.no_grad():
        logits = model(ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def _load(out, cls_name="AutoModelForCausalLM"):
    import transformers

    model, info = getattr(transformers, cls_name).from_pretrained(str(out), dtype=torch.float32,
                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize("name,arch,tp,pp", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_export_matches_actor(ckpts, tmp_path, name, arch, tp, pp):
    out = tmp_path / "hf"
    assert _to_hf("--ckpt", ckpts["runs"] / name / "global_step_1" / "actor", "--out", out) == 0
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer_config.json"]
    model = _load(out)
    lp = _hf_log_probs(model, _ids())
    diff = (lp - ckpts["rec"][name]["lp"][0]).abs().max().item()
    assert diff < 1e-5, f"{name}: max log-prob difference {diff}"
    names = set(safetensors_tensors(out))
    if arch == "qwen2":  # tied: no lm_head tensor written; transformers ties it to the embedding
        assert "lm_head.weight" not in names and json.loads((out / "config.json").read_text())["tie_word_embeddings"]
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert "lm_head.weight" in names
    # the update moved the weights: the export is not just the source model again
    src = safetensors_tensors(ckpts["hf"] / arch)
    assert not torch.equal(src["model.layers.0.mlp.down_proj.weight"], safetensors_tensors(out)["model.layers.0.mlp.down_proj.weight"])


def test_sharded_and_bf16_exports(ckpts, tmp_path):
    ckpt = ckpts["runs"] / "tp2pp2" / "global_step_1"  # a global_step_N folder: its actor/
    assert _to_hf("--ckpt", ckpt, "--out", tmp_path / "one") == 0
    assert _to_hf("--ckpt", ckpt, "--out", tmp_path / "sharded", "--max-shard-size", "1MB") == 0
    assert _to_hf("--ckpt", ckpt, "--out", tmp_path / "bf16", "--dtype", "bf16") == 0
    files = sorted(f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for f in files:
        assert os.path.getsize(tmp_path / "sharded" / f) < 1_000_000 + 4096
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    one, sharded, bf16 = (safetensors_tensors(tmp_path / d) for d in ("one", "sharded", "bf16"))
    assert set(index["weight_map"]) == set(one) == set(sharded) == set(bf16)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in one.values())
    for k, t in one.items():
        assert torch.equal(t, sharded[k]), k
        assert bf16[k].dtype == torch.bfloat16 and torch.equal(t.to(torch.bfloat16), bf16[k]), k
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    lp = _hf_log_probs(_load(tmp_path / "sharded"), _ids())
    assert (lp - ckpts["rec"]["tp2pp2"]["lp"][0]).abs().max().item() < 1e-5


def test_hf_megatron_hf_roundtrip_is_bit_exact(ckpts, tmp_path):
    imported = ckpts["imported"]
    assert (imported / "metadata.json").is_file() and (imported / "huggingface" / "config.json").is_file()
    assert json.loads((imported / "megappo_import.json").read_text())["tp"] == 2
    assert _to_hf("--ckpt", imported, "--out", tmp_path / "back") == 0
    src, back = safetensors_tensors(ckpts["hf"] / "qwen3"), safetensors_tensors(tmp_path / "back")
    assert set(src) == set(back)
    for k in src:
        assert src[k].dtype == back[k].dtype and torch.equal(src[k], back[k]), k


def test_critic_export(ckpts, tmp_path):
    out = tmp_path / "critic"
    assert _to_hf("--ckpt", ckpts["runs"] / "tp2pp2" / "global_step_1" / "critic", "--out", out, "--critic") == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForTokenClassification"] and len(cfg["id2label"]) == 1
    t = safetensors_tensors(out)
    assert t["score.weight"].shape == (1, 128) and t["score.bias"].shape == (1,) and "lm_head.weight" not in t
    assert t["score.bias"].abs().item() > 0  # trained: the bias left its zero init
    model = _load(out, "AutoModelForTokenClassification")
    assert model.config.num_labels == 1
    with torch.no_grad():
        values = model(_ids()).logits[..., 0]
    diff = (values - ckpts["rec"]["tp2pp2"]["values"][0]).abs().max().item()
    assert diff < 1e-5, f"critic: max value difference {diff}"
    r = _run_cli("verify.py", "--ckpt", str(ckpts["runs"] / "tp2pp2" / "global_step_1"), "--hf", str(out), "--critic",
                 check=0)
    assert "max |value difference|" in r.stdout and "OK" in r.stdout


@pytest.mark.parametrize("name", [x[0] for x in LAYOUTS])
def test_checkpoint_writes_hf_model(ckpts, tmp_path, name):
    """save_contents with hf_model: the save's own huggingface/ folder holds the tensors the
    converter exports from the checkpoint (bit-exact), and transformers computes the actor's
    log-probs from it; alone (an export) it writes that folder only, which nothing resumes from."""
    from megappo.checkpoint import CheckpointError, latest_step, load_checkpoint

    conv = tmp_path / "conv"
    assert _to_hf("--ckpt", ckpts["runs"] / name / "global_step_1" / "actor", "--out", conv) == 0
    want = safetensors_tensors(conv)
    for run in (name + "_hf", name + "_export"):
        hf = ckpts["runs"] / run / "global_step_1" / "actor" / "huggingface"
        got = safetensors_tensors(hf)
        assert set(got) == set(want), run
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (run, k)
        assert json.loads((hf / "config.json").read_text()) == json.loads((conv / "config.json").read_text())
        assert (hf / "tokenizer_config.json").is_file() and (hf / "generation_config.json").is_file()
        lp = _hf_log_probs(_load(hf), _ids())
        assert (lp - ckpts["rec"][name]["lp"][0]).abs().max().item() < 1e-5, run
    full = ckpts["runs"] / (name + "_hf")
    assert latest_step(str(full)) == 1 and (full / "global_step_1" / "actor" / "metadata.json").is_file()
    export = ckpts["runs"] / (name + "_export")
    assert latest_step(str(export)) is None
    assert sorted(os.listdir(export / "global_step_1")) == sorted(["actor", "manifest.json"] + (["critic"] if name == "tp2pp2" else []))
    assert os.listdir(export / "global_step_1" / "actor") == ["huggingface"]
    with pytest.raises(CheckpointError, match="holds HuggingFace weights only .* nothing to resume; start a new run "
                                              "from them with actor_rollout_ref.model.path="):
        load_checkpoint(str(export / "global_step_1"), {})


def test_checkpoint_hf_model_disk_full(ckpts):
    """A write that fails on rank 0 mid-walk of the actor: the other ranks' gathers still pair up,
    no rank goes on to the critic (no hang), every rank raises the same error, the partial save is
    gone and 'latest' still names step 1."""
    from megappo.checkpoint import latest_step

    said = [(ckpts["root"] / f"disk_full_{r}.txt").read_text() for r in range(4)]
    assert len(set(said)) == 1, said
    assert said[0].startswith("checkpoint ") and "global_step_2 was not saved (the previous checkpoint global_step_1 " \
        "and 'latest' are untouched): rank 0: disk full" in said[0], said[0]
    run = ckpts["runs"] / "tp2pp2_hf"
    assert latest_step(str(run)) == 1 and sorted(os.listdir(run)) == ["global_step_1", "latest"]


def test_live_hf_sharded(ckpts, tmp_path):
    assert _to_hf("--ckpt", ckpts["runs"] / "tp2pp2" / "global_step_1", "--out", tmp_path / "one") == 0
    one, live = safetensors_tensors(tmp_path / "one"), ckpts["root"] / "live_sharded"
    files = sorted(f for f in os.listdir(live) if f.endswith(".safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all(os.path.getsize(live / f) < 1_000_000 + 4096 for f in files)
    index = json.loads((live / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(one) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in one.values())
    got = safetensors_tensors(live)
    assert all(torch.equal(got[k], one[k]) for k in one)
    lp = _hf_log_probs(_load(live), _ids())
    assert (lp - ckpts["rec"]["tp2pp2"]["lp"][0]).abs().max().item() < 1e-5


def test_checkpoint_writes_hf_critic(ckpts, tmp_path):
    """A critic's hf_model: *ForTokenClassification, the converter's tensors and config."""
    conv = tmp_path / "critic"
    assert _to_hf("--ckpt", ckpts["runs"] / "tp2pp2" / "global_step_1" / "critic", "--out", conv, "--critic") == 0
    want = safetensors_tensors(conv)
    for run in ("tp2pp2_hf", "tp2pp2_export"):
        hf = ckpts["runs"] / run / "global_step_1" / "critic" / "huggingface"
        got = safetensors_tensors(hf)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), run
        assert json.loads((hf / "config.json").read_text()) == json.loads((conv / "config.json").read_text())
        with torch.no_grad():
            values = _load(hf, "AutoModelForTokenClassification")(_ids()).logits[..., 0]
        assert (values - ckpts["rec"]["tp2pp2"]["values"][0]).abs().max().item() < 1e-5
    # the converter still reads a checkpoint whose huggingface/ is a token classifier now
    again = tmp_path / "again"
    assert _to_hf("--ckpt", ckpts["runs"] / "tp2pp2_hf" / "global_step_1" / "critic", "--out", again, "--critic") == 0
    assert all(torch.equal(t, want[k]) for k, t in safetensors_tensors(again).items())


def test_verify_cli(ckpts, tmp_path):
    ckpt = ckpts["runs"] / "tp2pp1" / "global_step_1" / "actor"
    assert _to_hf("--ckpt", ckpt, "--out", tmp_path / "hf") == 0
    ok = _run_cli("verify.py", "--ckpt", str(ckpt), "--hf", str(tmp_path / "hf"), check=0)
    assert "OK" in ok.stdout and "max |log-prob difference|" in ok.stdout
    bad = _run_cli("verify.py", "--ckpt", str(ckpt), "--hf", str(ckpts["hf"] / "llama"), check=1)
    assert "FAIL" in bad.stdout


# -- a newer checkpoint being written meanwhile ---------------------------------------------------
def _background_saver(rank, world, path, run, out_dir):
    setup(1, 1)
    from megappo.checkpoint import save_checkpoint
    from test_workers import _global_batch

    info, actor = _actor(path, 1, 1, lr=3e-2)
    _update(actor, _global_batch())
    torch.save(token_log_probs(actor.chunks, info, [_ids()]), os.path.join(out_dir, "writer_lp.pt"))
    spans = []
    for step in range(2, 60):
        t0 = time.time()
        save_checkpoint(run, step, {"actor": actor}, {}, hf_sources={"actor": path})
        spans.append((t0, time.time()))
        if os.path.exists(os.path.join(out_dir, "stop")):
            break
    with open(os.path.join(out_dir, "spans.json"), "w") as f:
        json.dump(spans, f)


def _digest(folder):
    h = hashlib.sha256()
    for dp, _, files in sorted(os.walk(folder)):
        for f in sorted(files):
            h.update(f.encode())
            h.update(open(os.path.join(dp, f), "rb").read())
    return h.hexdigest()


def test_export_while_a_newer_checkpoint_is_saved(ckpts, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ckpts["runs"] / "tp2pp2", run)
    before = _digest(run / "global_step_1")
    errors = []

    def saver():
        try:
            spawn(_background_saver, 1, str(ckpts["hf"] / "qwen3"), str(run), str(tmp_path))
        except BaseException as e:  # surfaced in the test thread
            errors.append(e)

    th = threading.Thread(target=saver, daemon=True)
    th.start()
    deadline = time.time() + 200
    while int((run / "latest").read_text()) < 2:  # step 2 published, step 3 being written
        assert th.is_alive() and time.time() < deadline, errors
        time.sleep(0.1)
    t0 = time.time()
    assert _to_hf("--ckpt", run / "global_step_1" / "actor", "--out", tmp_path / "step1") == 0
    from megappo.convert.hf_export import export_hf

    then = export_hf(str(run), str(tmp_path / "latest_then"), progress=False)  # the run folder: its latest step
    t1 = time.time()
    (tmp_path / "stop").touch()
    th.join(240)
    assert not th.is_alive() and not errors, errors
    spans = json.loads((tmp_path / "spans.json").read_text())
    assert any(a < t1 and b > t0 for a, b in spans), "no save overlapped the export"
    assert _digest(run / "global_step_1") == before
    assert not [d for d in os.listdir(run) if d.startswith(".tmp_")]
    writer = torch.load(tmp_path / "writer_lp.pt")[0]
    lp1 = _hf_log_probs(_load(tmp_path / "step1"), _ids())
    assert (lp1 - ckpts["rec"]["tp2pp2"]["lp"][0]).abs().max().item() < 1e-5
    assert os.path.basename(os.path.dirname(then["ckpt"])) != "global_step_1"  # one of the writer's steps
    lp_then = _hf_log_probs(_load(tmp_path / "latest_then"), _ids())
    assert (lp_then - writer).abs().max().item() < 1e-5  # complete, not a half-written save
    last = int((run / "latest").read_text())
    assert last == len(spans) + 1
    assert _to_hf("--ckpt", run / f"global_step_{last}" / "actor", "--out", tmp_path / "last") == 0
    assert (_hf_log_probs(_load(tmp_path / "last"), _ids()) - writer).abs().max().item() < 1e-5


# -- errors: exit code 2, one line naming the path and the problem ----------------------------------
def _err(capsys, main, *argv):
    capsys.readouterr()
    rc = main([*map(str, argv), "--quiet"])
    err = capsys.readouterr().err.strip()
    return rc, err


def _assert_error(rc, err, *needles):
    assert rc == 2, (rc, err)
    assert "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert str(n) in err, (n, err)


def test_errors_bad_paths(ckpts, tmp_path, capsys):
    from megappo.convert.cli import convert_to_hf_main as main

    run = tmp_path / "run"
    shutil.copytree(ckpts["runs"] / "tp2pp1", run)
    out = tmp_path / "out"
    missing = tmp_path / "nope"
    _assert_error(*_err(capsys, main, "--ckpt", missing, "--out", out), missing, "not a checkpoint directory")
    hf = ckpts["hf"] / "llama"
    _assert_error(*_err(capsys, main, "--ckpt", hf, "--out", out), hf, "not a checkpoint directory")
    _assert_error(*_err(capsys, main, "--ckpt", run / "global_step_1", "--out", out, "--critic"),
                  "global_step_1", "no critic/")
    # a save in progress / interrupted
    shutil.copytree(run / "global_step_1", run / ".tmp_global_step_2")
    _assert_error(*_err(capsys, main, "--ckpt", run / ".tmp_global_step_2" / "actor", "--out", out),
                  ".tmp_global_step_2", "unfinished checkpoint")
    _assert_error(*_err(capsys, main, "--ckpt", run / ".tmp_global_step_2", "--out", out), "unfinished checkpoint")
    # renamed into place, but not yet named by latest
    shutil.copytree(run / "global_step_1", run / "global_step_3")
    _assert_error(*_err(capsys, main, "--ckpt", run / "global_step_3" / "actor", "--out", out),
                  "global_step_3", "unfinished checkpoint", "latest names step 1")
    os.remove(run / "global_step_3" / "actor" / "metadata.json")
    (run / "latest").write_text("3")
    _assert_error(*_err(capsys, main, "--ckpt", run / "global_step_3" / "actor", "--out", out),
                  "global_step_3", "unfinished checkpoint", "no metadata.json")
    os.remove(run / "latest")
    _assert_error(*_err(capsys, main, "--ckpt", run / "global_step_1" / "actor", "--out", out),
                  "unfinished checkpoint", "latest is missing")
    assert not out.exists()
    # the real command line: exit status 2 and one line on stderr, no traceback
    r = _run_cli("convert_to_hf.py", "--ckpt", str(run / ".tmp_global_step_2" / "actor"), "--out", str(out))
    _assert_error(r.returncode, r.stderr.strip(), "convert_to_hf: error:", ".tmp_global_step_2", "unfinished checkpoint")


def test_errors_architecture_mismatch(ckpts, tmp_path, capsys):
    from megappo.convert.cli import convert_to_hf_main as main

    ckpt = ckpts["runs"] / "tp2pp2" / "global_step_1"
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((ckpts["hf"] / "qwen3" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 384}))
    out = tmp_path / "out"
    _assert_error(*_err(capsys, main, "--ckpt", ckpt / "actor", "--out", out, "--hf-config", other / "config.json"),
                  "architecture mismatch", other / "config.json", "linear_fc1.weight", "(4, 512, 128)", "(4, 768, 128)")
    _assert_error(*_err(capsys, main, "--ckpt", ckpt / "critic", "--out", out), "architecture mismatch",
                  "pass --critic")
    _assert_error(*_err(capsys, main, "--ckpt", ckpt / "actor", "--out", out, "--critic"), "architecture mismatch")
    assert not out.exists()
    (out / "x").mkdir(parents=True)
    _assert_error(*_err(capsys, main, "--ckpt", ckpt / "actor", "--out", out), out, "not an empty directory")


def test_errors_out_of_disk(ckpts, tmp_path, capsys, monkeypatch):
    from megappo.convert import hf_export
    from megappo.convert.cli import convert_from_hf_main, convert_to_hf_main

    ckpt = ckpts["runs"] / "tp2pp2" / "global_step_1" / "actor"
    out = tmp_path / "out"
    # 1. the free-space check before anything is written
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    _assert_error(*_err(capsys, convert_to_hf_main, "--ckpt", ckpt, "--out", out), out, "not enough free disk space")
    _assert_error(*_err(capsys, convert_from_hf_main, "--hf", ckpts["hf"] / "qwen3", "--out", out),
                  out, "not enough free disk space")
    monkeypatch.setattr(shutil, "disk_usage", real)
    assert not out.exists() and not (tmp_path / ".tmp_out").exists()
    # 2. the disk fills up during the export (after a first shard file was complete)
    write, calls = hf_export.ShardWriter.write, []

    def failing(self, name, t):
        calls.append(name)
        if len(calls) == 30:
            assert len([f for f in os.listdir(tmp_path / ".tmp_out") if f.endswith(".safetensors")]) >= 2
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, name, t)

    monkeypatch.setattr(hf_export.ShardWriter, "write", failing)
    _assert_error(*_err(capsys, convert_to_hf_main, "--ckpt", ckpt, "--out", out, "--max-shard-size", "1MB"),
                  out, "out of disk space", "partial output was removed")
    assert not out.exists() and not (tmp_path / ".tmp_out").exists()


def test_errors_convert_from_hf(ckpts, tmp_path, capsys):
    from megappo.convert.cli import convert_from_hf_main as main

    out = tmp_path / "out"
    _assert_error(*_err(capsys, main, "--hf", tmp_path / "nope", "--out", out), "nope", "not an HF model directory")
    _assert_error(*_err(capsys, main, "--hf", ckpts["hf"] / "qwen3", "--out", out, "--tp", "3"),
                  "qwen3", "not divisible by tensor_model_parallel_size (3)")
    _assert_error(*_err(capsys, main, "--hf", ckpts["hf"] / "qwen3", "--out", out, "--pp", "3"),
                  "qwen3", "divisible by pipeline_model_parallel_size")
    assert not out.exists()


def test_load_model_weights_refuses_a_checkpoint_of_another_shape(ckpts, tmp_path):
    """The converters' weight loader checks names and shapes before loading (the trainer's start
    reader does the work): a model one size off gets a ConvertError naming the tensor, not a
    partly loaded model."""
    from megatron.core import parallel_state as ps

    from megappo import megatron_cpu
    from megappo.convert.megatron_ckpt import ConvertError, load_model_weights, single_process_group
    from megappo.models import build_model, describe, initialize_parallel, load_hf_config, transformer_config

    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((ckpts["hf"] / "qwen3" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 384}))
    megatron_cpu.install()
    with single_process_group():
        initialize_parallel(1, 1)
        try:
            info = describe(load_hf_config(str(other)), tp=1)
            chunks = build_model(info, transformer_config(info, tp=1, pp=1, cpu=True), use_te=False)
            before = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
            named = r"linear_fc[12]\.weight is \(4, \d+, \d+\) in the checkpoint, the model has"
            with pytest.raises(ConvertError, match=named) as e:
                load_model_weights(chunks, str(ckpts["runs"] / "tp2pp2" / "global_step_1" / "actor"))
            assert "does not match the model" in str(e.value) and "384" in str(e.value), e.value
            assert all(torch.equal(p, before[n]) for n, p in chunks[0].named_parameters()), "loaded in part"
        finally:
            ps.destroy_model_parallel()
