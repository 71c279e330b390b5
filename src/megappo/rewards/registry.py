"""Rule rewards keyed by ``data_source`` (verl's names), and users' own reward functions."""
from __future__ import annotations

import functools
import importlib.util
import inspect
import os
from typing import Callable, Optional

from . import gsm8k, hendrycks_math, synthetic

__all__ = ["RewardFunctionError", "register_reward", "get_reward_fn", "list_rewards", "load_custom_reward",
           "score_batch", "call_rewards", "finish_scores", "resolve_reward"]


class RewardFunctionError(RuntimeError):
    """A reward function failed or returned something that is not a finite score; names the
    function, the sample and its data_source."""


_REGISTRY: dict[str, Callable] = {}


def register_reward(*data_sources: str):
    """Decorator: ``fn(solution_str, ground_truth, extra_info) -> float`` for these data sources."""
    def deco(fn):
        for ds in data_sources:
            _REGISTRY[ds] = fn
        return fn
    return deco


@register_reward("openai/gsm8k", "gsm8k")
def _gsm8k(solution, ground_truth, extra_info=None):
    return gsm8k.compute_score(solution, ground_truth, method="strict")


@register_reward("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math")
def _math(solution, ground_truth, extra_info=None):
    return hendrycks_math.compute_score(solution, ground_truth)


@register_reward(synthetic.ECHO_SOURCE)
def _echo(solution, ground_truth, extra_info=None):
    return synthetic.echo_score(solution, ground_truth)


@register_reward(synthetic.WORDS_SOURCE)
def _words(solution, ground_truth, extra_info=None):
    return synthetic.words_score(solution, ground_truth, (extra_info or {}).get("max_words", 8))


@register_reward(synthetic.PICK_FIRST_SOURCE)
def _pick_first(solution, ground_truth, extra_info=None):
    return synthetic.pick_first_score(solution, ground_truth, (extra_info or {}).get("max_words", 8))


@register_reward(synthetic.PICK_LAST_SOURCE)
def _pick_last(solution, ground_truth, extra_info=None):
    return synthetic.pick_last_score(solution, ground_truth, (extra_info or {}).get("max_words", 8))


@register_reward(synthetic.LOOKUP_SOURCE)
def _lookup(solution, ground_truth, extra_info=None):
    return synthetic.lookup_score(solution, ground_truth, extra_info)


@register_reward(synthetic.COPY_SOURCE)
def _copy(solution, ground_truth, extra_info=None):
    return synthetic.copy_score(solution, ground_truth, (extra_info or {}).get("max_words", 8))


def list_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward_fn(data_source: str) -> Callable:
    try:
        return _REGISTRY[data_source]
    except KeyError:
        raise KeyError(f"no reward function for data_source {data_source!r}; built in: {', '.join(list_rewards())}; "
                       "or set custom_reward_function.path") from None


def load_custom_reward(path: str, name: str = "compute_score", reward_kwargs: Optional[dict] = None,
                       batched: bool = False) -> Callable:
    """Load ``name`` from a Python file, as verl's custom_reward_function does. The function is
    called as fn(data_source, solution_str, ground_truth, extra_info, **reward_kwargs) and returns
    a float or a dict with a "score" entry; ``batched`` (verl's batch reward manager): once per
    batch as fn(data_sources=, solution_strs=, ground_truths=, extra_infos=, **reward_kwargs),
    returning one such score per sample. ``reward_kwargs`` (custom_reward_function.reward_kwargs)
    must fit its signature: checked here, before any sample is scored."""
    p = os.path.expanduser(path)
    if not os.path.isfile(p):
        raise FileNotFoundError(f"custom_reward_function.path: file not found: {path}")
    spec = importlib.util.spec_from_file_location(f"megappo_custom_reward_{abs(hash(p))}", p)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise RewardFunctionError(f"custom_reward_function.path: importing {path} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardFunctionError(f"custom_reward_function.name: {path} defines no function {name!r}")
    params = inspect.signature(fn).parameters
    if batched:
        try:
            inspect.signature(fn).bind(data_sources=[], solution_strs=[], ground_truths=[], extra_infos=[],
                                       **(reward_kwargs or {}))
        except TypeError as e:
            raise RewardFunctionError(
                f"{path}:{name} must accept data_sources=, solution_strs=, ground_truths=, extra_infos= (lists: "
                f"reward_model.reward_manager=batch)" + (f" and custom_reward_function.reward_kwargs "
                                                         f"{sorted(reward_kwargs)}" if reward_kwargs else "")
                + f": {e}") from None
    elif len(params) < 4 and not any(q.kind == q.VAR_POSITIONAL or q.kind == q.VAR_KEYWORD for q in params.values()):
        raise RewardFunctionError(f"{path}:{name} must accept (data_source, solution_str, ground_truth, extra_info)")
    if reward_kwargs:
        try:
            if not batched:
                inspect.signature(fn).bind("data_source", "solution_str", "ground_truth", {}, **reward_kwargs)
        except TypeError as e:
            raise RewardFunctionError(f"custom_reward_function.reward_kwargs: {path}:{name} cannot take "
                                      f"{sorted(reward_kwargs)} beside its reward arguments: {e}") from None
        fn = functools.partial(fn, **reward_kwargs)
    if batched:
        fn.megappo_batched = True
    fn.megappo_origin = f"{path}:{name}"
    return fn


def _origin(fn: Callable) -> str:
    """Where a reward function came from, for messages (a partial has no __name__)."""
    return getattr(fn, "megappo_origin", None) or getattr(fn, "__name__", None) or repr(fn)


def score_batch(data_sources, solutions, ground_truths, extra_infos=None, custom: Optional[Callable] = None,
                details: Optional[list] = None) -> list[float]:
    """Score every sample; a failing or non-finite reward raises RewardFunctionError naming the
    sample (verl v0.9.0's reward manager stops on an exception too, with less said, but lets NaN/inf
    through and scores a timed-out call 0). A ``custom`` function loaded ``batched`` is called once
    with the lists (verl's batch reward manager) and must return one score per sample.
    ``details``: a list that receives, per sample, the dict a reward function returned (e.g. with
    DAPO's ``acc``), or None for a plain number."""
    results, wheres = call_rewards(data_sources, solutions, ground_truths, extra_infos, custom)
    return finish_scores(results, wheres, data_sources, details)


def call_rewards(data_sources, solutions, ground_truths, extra_infos=None, custom: Optional[Callable] = None,
                 index: Optional[list] = None) -> tuple[list, list]:
    """(what the reward function returned, where the function came from) per sample, unchecked
    (:func:`finish_scores` checks); ``index``: the samples' numbers in the batch, for messages."""
    extra_infos = extra_infos if extra_infos is not None else [None] * len(solutions)
    index = list(index) if index is not None else list(range(len(solutions)))
    if custom is not None and getattr(custom, "megappo_batched", False):
        return _score_batched(custom, data_sources, solutions, ground_truths, extra_infos)
    results, wheres = [], []
    for i, ds, sol, gt, extra in zip(index, data_sources, solutions, ground_truths, extra_infos):
        fn, where, args = resolve_reward(ds, sol, gt, extra, custom, i)
        try:
            results.append(fn(*args))
        except Exception as e:
            raise RewardFunctionError(f"{where} raised on sample {i} (data_source={ds!r}): {type(e).__name__}: {e}") from e
        wheres.append(where)
    return results, wheres


def resolve_reward(ds, sol, gt, extra, custom: Optional[Callable], i: int) -> tuple[Callable, str, tuple]:
    """(function, where it came from, its arguments) for one sample: ``custom`` (verl's argument
    order), or the built-in rule for its data_source."""
    if custom is not None:
        return custom, _origin(custom), (ds, sol, gt, extra)
    try:
        fn = get_reward_fn(ds)
    except KeyError as e:
        raise RewardFunctionError(f"sample {i}: {e.args[0]}") from None
    return fn, f"built-in reward for {ds!r}", (sol, gt, extra)


def finish_scores(results: list, wheres: list, data_sources, details: Optional[list] = None) -> list[float]:
    """Each result as a finite float (a dict gives its 'score'); ``details`` receives the dicts."""
    import math

    out = []
    for i, (ds, where, r) in enumerate(zip(data_sources, wheres, results)):
        if details is not None:
            details.append(r if isinstance(r, dict) else None)
        if isinstance(r, dict):
            if "score" not in r:
                raise RewardFunctionError(f"{where} returned a dict without 'score' for sample {i} (data_source={ds!r})")
            r = r["score"]
        try:
            r = float(r)
        except (TypeError, ValueError):
            raise RewardFunctionError(f"{where} returned {r!r} for sample {i} (data_source={ds!r}); expected a number") from None
        if not math.isfinite(r):
            raise RewardFunctionError(f"{where} returned {r} for sample {i} (data_source={ds!r}); rewards must be finite")
        out.append(r)
    return out


def _score_batched(custom: Callable, data_sources, solutions, ground_truths, extra_infos) -> tuple[list, list]:
    """One call of a batch reward function with the lists; its per-sample results, checked for count."""
    where, n = _origin(custom), len(solutions)
    try:
        results = custom(data_sources=list(data_sources), solution_strs=list(solutions),
                         ground_truths=list(ground_truths), extra_infos=list(extra_infos))
    except Exception as e:
        raise RewardFunctionError(f"{where} raised on a batch of {n} samples: {type(e).__name__}: {e}") from e
    if isinstance(results, (str, bytes, dict)) or not hasattr(results, "__len__"):
        raise RewardFunctionError(f"{where} returned {type(results).__name__}; expected a list of {n} scores "
                                  "(reward_model.reward_manager=batch)")
    results = list(results)
    if len(results) != n:
        raise RewardFunctionError(f"{where} returned {len(results)} scores for a batch of {n} samples")
    return results, [where] * n
