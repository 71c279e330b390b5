"""Interactions: a simulated user who answers the model between its turns (verl's Interaction).

After a model turn that calls no tool, the sample's interaction reads the conversation so far and
answers: ``generate_response(instance_id, messages, **interaction_kwargs) -> (should_terminate,
text, turn_score, metrics)``. Its text becomes the next user turn (in the sequence, out of the
loss); the turn's score goes to the reward function as ``extra_info["turn_scores"]``, as verl
passes it; ``should_terminate`` ends the sample. Which interaction a row talks to, and its
arguments, are the row's ``extra_info.interaction_kwargs`` (``name`` required, verl's layout).

The interaction config YAML (``multi_turn.interaction_config_path``), verl's::

    interaction:
      - name: gsm8k                          # optional: the class name, less "Interaction", lower case
        class_name: pkg.mod.Gsm8kInteraction # an Interaction subclass (or a verl BaseInteraction-shaped class)
        config: {}                           # passed to the class (with its name)

Methods are synchronous; verl's are ``async`` and a verl-shaped class runs here as it is (each
coroutine is run to its end). Where verl and megappo differ: megappo calls ``finalize_interaction``
for every sample when its conversation ends (verl's agent loop never calls it, so an interaction's
per-sample state is never released there), and a conversation the interaction ends does not take
the interaction's last message (verl appends it to the sequence after the last model turn, where
the reward function then reads it as part of the response).
"""
from __future__ import annotations

import inspect
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


from .base import _resolve
from .registry import ToolConfigError, class_entries, import_class, resolve_env


class InteractionError(RuntimeError):
    """An interaction failed (it raised, or answered in another shape); names it and the sample."""


class Interaction:
    """Base class of an interaction. Subclass it, override :meth:`generate_response` (and
    :meth:`start_interaction`, :meth:`finalize_interaction` for per-sample state), and name it in
    an interaction config YAML. ``config``: the YAML entry's ``config`` with its ``name``."""

    def __init__(self, config: Optional[dict] = None):
        self.config = dict(config or {})
        self.name = self.config.get("name", "interaction_agent")

    def start_interaction(self, instance_id: Optional[str] = None, **kwargs) -> str:
        """Start one sample's state; ``kwargs``: the row's ``extra_info.interaction_kwargs``."""
        return instance_id if instance_id is not None else uuid.uuid4().hex

    def generate_response(self, instance_id: str, messages: list[dict], **kwargs) -> tuple[bool, str, float, dict]:
        """The user's answer to the conversation so far: (should_terminate, text, turn_score, metrics)."""
        return True, "", 0.0, {}

    def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        """Release one sample's state."""


class Gsm8kInteraction(Interaction):
    """A teacher for GSM8K (verl's ``Gsm8kInteraction``, the same messages): the model's last
    answer graded as the GSM8K rule reward grades it (strict: the number after ``####``, compared
    as a number); right: "Your response is correct!" and the conversation ends (turn score 1),
    wrong: it asks the model to reflect and try again (turn score 0). Its arguments: the row's
    ``interaction_kwargs`` with ``ground_truth`` (verl's GSM8K interaction rows; write them with
    ``python -m megappo.data.preprocess gsm8k_interaction``)."""

    RIGHT = "Your response is correct!"
    WRONG = "Your response is incorrect! You need to reflect on your answer and try again."

    def __init__(self, config: Optional[dict] = None):
        super().__init__(config)
        self.truths: dict[str, Any] = {}

    def start_interaction(self, instance_id: Optional[str] = None, ground_truth: Any = None, **kwargs) -> str:
        iid = super().start_interaction(instance_id)
        if ground_truth is None:
            raise ValueError("gsm8k interaction: the row's interaction_kwargs need a ground_truth")
        self.truths[iid] = ground_truth
        return iid

    def generate_response(self, instance_id: str, messages: list[dict], **kwargs) -> tuple[bool, str, float, dict]:
        from megappo.rewards import gsm8k

        answer = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        score = gsm8k.compute_score(answer, self.truths[instance_id], method="strict")
        return (True, self.RIGHT, score, {}) if score == 1.0 else (False, self.WRONG, score, {})

    def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        self.truths.pop(instance_id, None)


# verl's classes megappo has its own of: used for their names where verl is not installed
VERL_INTERACTIONS = {"verl.interactions.gsm8k_interaction.Gsm8kInteraction": "megappo.tools.Gsm8kInteraction"}


@dataclass
class InteractionSpec:
    """One entry of an interaction config YAML, checked but not yet imported."""
    name: str
    class_name: str
    config: dict
    where: str


def read_interaction_config(path: str | Path) -> list[InteractionSpec]:
    """Parse and check an interaction config YAML without importing any class."""
    specs: list[InteractionSpec] = []
    for where, entry, cls, config in class_entries(path, "interaction", "name, class_name, config", nonempty=True):
        name = entry.get("name")
        if name is None:   # verl's default: the class name, less a trailing "Interaction", lower case
            simple = cls.rsplit(".", 1)[-1]
            name = (simple[:-len("Interaction")] if simple.endswith("Interaction") else simple).lower()
        if not isinstance(name, str) or not name:
            raise ToolConfigError(f"{where}.name: expected a non-empty string, got {name!r}")
        if any(s.name == name for s in specs):
            raise ToolConfigError(f"{where}.name: {name!r} is already another entry's (each name once)")
        specs.append(InteractionSpec(name, cls, config, where))
    return specs


def load_interactions(path: str | Path) -> dict[str, Any]:
    """Every interaction of the file by name, built as verl builds them: ``cls(config={..., name})``.
    verl's GSM8K interaction, where verl is not installed, is megappo's (VERL_INTERACTIONS)."""
    import importlib.util

    out = {}
    for spec in read_interaction_config(path):
        name = spec.class_name
        if name in VERL_INTERACTIONS and importlib.util.find_spec("verl") is None:
            name = VERL_INTERACTIONS[name]
        cls = import_class(name, spec.where)
        config = resolve_env(spec.config, spec.where + ".config")
        try:
            out[spec.name] = cls(config={**config, "name": spec.name})
        except Exception as e:
            raise ToolConfigError(f"{spec.where}: {spec.class_name}(config=...) failed: {type(e).__name__}: {e}") from e
    return out


def interaction_kwargs_of(extra_info: Optional[dict], names, where: str = "row") -> dict:
    """A row's ``extra_info.interaction_kwargs``, checked: a mapping whose ``name`` is one of ``names``."""
    kw = (extra_info or {}).get("interaction_kwargs")
    if not isinstance(kw, dict) or not isinstance(kw.get("name"), str):
        raise ToolConfigError(f"{where}: extra_info.interaction_kwargs must be a mapping with the 'name' of one of "
                              f"the interactions ({', '.join(sorted(names))}), got {kw!r:.80}")
    if kw["name"] not in names:
        raise ToolConfigError(f"{where}: extra_info.interaction_kwargs.name={kw['name']!r} is none of the "
                              f"interactions ({', '.join(sorted(names))})")
    return {k: v for k, v in kw.items() if v is not None}


class InteractionRunner:
    """The interactions of a rollout and their per-sample instances. A sample is named by a
    hashable key; :meth:`start` opens its instance, :meth:`respond` answers many samples' turns
    at once (a thread pool: a simulated user may wait on a service), :meth:`finish` closes it."""

    def __init__(self, interactions: dict[str, Any], max_workers: int = 8):
        self.interactions, self.max_workers = dict(interactions), max_workers
        self._open: dict[Any, tuple[str, str, dict]] = {}   # sample -> (interaction name, instance id, kwargs)
        self._counts: dict[str, float] = {}

    def _call(self, sample: Any, what: str, fn, *args, **kwargs) -> Any:
        try:
            return _resolve(fn(*args, **kwargs))
        except Exception as e:
            name = self._open.get(sample, ("?",))[0]
            raise InteractionError(f"interaction {name!r} raised in {what} for sample {sample}: "
                                   f"{type(e).__name__}: {e}") from e

    def start(self, sample: Any, kwargs: dict) -> None:
        name = kwargs["name"]
        iid = f"{sample}:{name}:{uuid.uuid4().hex}"   # unique across samples, replicas and steps, as verl's uuids
        self._open[sample] = (name, iid, dict(kwargs))
        got = self._call(sample, "start_interaction", self.interactions[name].start_interaction, iid, **kwargs)
        self._open[sample] = (name, got if isinstance(got, str) else iid, dict(kwargs))

    def start_all(self, samples: list, kwargs: list[dict]) -> None:
        """:meth:`start` of each sample (one call for a whole rollout)."""
        for sample, kw in zip(samples, kwargs):
            self.start(sample, kw)

    def finish_all(self, samples: list) -> None:
        """:meth:`finish` of each sample (one call for a whole rollout)."""
        for sample in samples:
            self.finish(sample)

    def _respond_one(self, sample: Any, messages: list[dict]) -> tuple[bool, str, float, float]:
        name, iid, kwargs = self._open[sample]
        t0 = time.perf_counter()
        out = self._call(sample, "generate_response", self.interactions[name].generate_response, iid,
                         [dict(m) for m in messages], **kwargs)
        if not (isinstance(out, (tuple, list)) and len(out) >= 3 and isinstance(out[1], str)):
            raise InteractionError(f"interaction {name!r}: generate_response must return (should_terminate, text, "
                                   f"turn_score, metrics), got {out!r:.120} for sample {sample}")
        score = None if out[2] is None else float(out[2])
        return bool(out[0]), out[1], score, time.perf_counter() - t0

    def respond(self, samples: list, messages: list[list[dict]]) -> list[tuple[bool, str, float]]:
        """Each sample's (should_terminate, user text, turn score) for its conversation so far."""
        if not samples:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, len(samples)))) as pool:
            outs = list(pool.map(self._respond_one, samples, messages))
        self._counts["interaction/turns"] = self._counts.get("interaction/turns", 0.0) + len(outs)
        self._counts["interaction/terminated"] = self._counts.get("interaction/terminated", 0.0) + sum(o[0] for o in outs)
        self._counts["interaction/seconds"] = self._counts.get("interaction/seconds", 0.0) + sum(o[3] for o in outs)
        return [o[:3] for o in outs]

    def finish(self, sample: Any) -> None:
        if sample not in self._open:
            return
        name, iid, kwargs = self._open[sample]
        fin = getattr(self.interactions[name], "finalize_interaction", None)
        if fin is not None:   # verl's base class takes no instance id; its GSM8K interaction does
            takes_id = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                           for p in inspect.signature(fin).parameters.values())
            self._call(sample, "finalize_interaction", fin, *((iid,) if takes_id else ()))
        del self._open[sample]

    def pop_metrics(self) -> dict[str, float]:
        out, self._counts = dict(self._counts), {}
        return out
