"""verl's keys for the model folder and the run's shape: trust_remote_code (tokenizer: data's,
config: the model's), custom_chat_template, external_lib, trainer.val_only."""
import json
import os
import sys

import pytest


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """megappo's tiny model folder whose tokenizer and config name classes of their own code."""
    from megappo.data.tiny import make_tiny_setup

    m = make_tiny_setup(str(tmp_path_factory.mktemp("custom")), n_train=4, n_test=2)["model"]
    with open(os.path.join(m, "my_code.py"), "w") as f:
        f.write("from transformers import PreTrainedTokenizerFast, Qwen3Config\n"
                "class MyTok(PreTrainedTokenizerFast):\n    mine = True\n"
                "class MyConfig(Qwen3Config):\n    mine = True\n")
    for name, entry in (("tokenizer_config.json", {"AutoTokenizer": [None, "my_code.MyTok"]}),
                        ("config.json", {"AutoConfig": "my_code.MyConfig"})):
        path = os.path.join(m, name)
        c = json.load(open(path))
        c["auto_map"] = entry
        if name == "tokenizer_config.json":
            c["tokenizer_class"] = "MyTok"
        json.dump(c, open(path, "w"))
    return m


def test_the_folders_own_code_runs_only_when_trusted(folder):
    from megappo import builders
    from megappo.config import load_config
    from megappo.models import load_hf_config

    base = [f"actor_rollout_ref.model.path={folder}"]
    plain = builders.load_tokenizer(load_config(base, ["tiny_cpu"]))
    trusted = builders.load_tokenizer(load_config(base + ["data.trust_remote_code=true"], ["tiny_cpu"]))
    assert not getattr(plain, "mine", False) and type(trusted).__name__ == "MyTok" and trusted.mine
    assert plain("red blue")["input_ids"] == trusted("red blue")["input_ids"]
    assert not getattr(load_hf_config(folder), "mine", False)
    assert type(load_hf_config(folder, trust_remote_code=True)).__name__ == "MyConfig"
    cfg = load_config(base, ["tiny_cpu"])
    assert cfg.critic.model.trust_remote_code is False
    cfg = load_config(base + ["actor_rollout_ref.model.trust_remote_code=true"], ["tiny_cpu"])
    assert cfg.critic.model.trust_remote_code is True        # the critic's follows the actor's unless set


def test_custom_chat_template_replaces_the_tokenizers(folder):
    from megappo import builders
    from megappo.config import load_config
    from megappo.data import tokenize_prompt

    template = "{% for m in messages %}<|user|> {{ m['content'] }} <|user|> {% endfor %}<|assistant|>"
    tok = builders.load_tokenizer(load_config([f"actor_rollout_ref.model.path={folder}",
                                               f"actor_rollout_ref.model.custom_chat_template={template}"], ["tiny_cpu"]))
    ids = tokenize_prompt(tok, [{"role": "user", "content": "red blue"}])
    assert tok.convert_ids_to_tokens(ids) == ["<|user|>", "red", "blue", "<|user|>", "<|assistant|>"]


def test_external_lib_is_imported_first_and_a_failure_names_the_key(tmp_path, monkeypatch):
    from megappo import builders
    from megappo.config import load_config

    (tmp_path / "megappo_test_plugin.py").write_text("import builtins\nbuiltins.megappo_test_plugin_loaded = True\n")
    (tmp_path / "megappo_test_broken.py").write_text("raise RuntimeError('no such model class')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    builders.import_external_lib(load_config(["actor_rollout_ref.model.external_lib=megappo_test_plugin"]))
    import builtins

    assert builtins.megappo_test_plugin_loaded
    del builtins.megappo_test_plugin_loaded
    with pytest.raises(ImportError, match="actor_rollout_ref.model.external_lib: importing 'megappo_test_broken' "
                                          "failed: RuntimeError: no such model class"):
        builders.import_external_lib(load_config(["actor_rollout_ref.model.external_lib=megappo_test_broken"]))
    sys.modules.pop("megappo_test_plugin", None)


class _Loop:
    """What PPOTrainer.fit reads of a trainer, recorded."""

    def __init__(self, cfg, step_no):
        self.cfg, self.step_no, self.split, self.calls = cfg, step_no, None, []
        outer = self

        class Logger:
            def log(self, step, metrics):
                outer.calls.append(("log", step, dict(metrics)))

            def close(self):
                outer.calls.append(("close",))

        class Timer:
            def pop(self):
                return {"timing_s/testing": 1.0}

            def __call__(self, name):
                import contextlib

                return contextlib.nullcontext()

        class Scorer:
            def close(self):   # the reward workers (prime) stop with the run
                outer.calls.append(("scorer_close",))

        self.logger, self.timer, self.scorer = Logger(), Timer(), Scorer()
        self.val_data = [object()]

    def total_steps(self):
        return 20

    def validate(self):
        self.calls.append(("validate", self.step_no))
        return {"val-core/x/reward/mean@1": 0.5}

    def step(self, log=False):
        self.calls.append(("step", self.step_no))
        self.step_no += 1
        return {}

    def save(self):
        self.calls.append(("save", self.step_no))


@pytest.mark.parametrize("step_no", [0, 7])
def test_val_only_validates_the_start_once_and_trains_nothing(step_no, monkeypatch):
    """trainer.val_only: the start (or the checkpoint resumed from, at its step) validated and
    logged once; no step, no checkpoint. Without it the loop trains (the control)."""
    from megappo import watchdog
    from megappo.config import load_config
    from megappo.trainer.ppo import PPOTrainer

    monkeypatch.setattr(watchdog, "stop", lambda: None)
    loop = _Loop(load_config(["trainer.val_only=true"], ["tiny_cpu"]), step_no)
    assert PPOTrainer.fit(loop) == []
    assert loop.calls == [("validate", step_no), ("log", step_no, {"val-core/x/reward/mean@1": 0.5,
                                                                  "timing_s/testing": 1.0}), ("scorer_close",),
                          ("close",)]
    loop = _Loop(load_config([], ["tiny_cpu"]), step_no)
    PPOTrainer.fit(loop, steps=2)
    assert [c[0] for c in loop.calls].count("step") == 2
