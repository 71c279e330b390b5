"""Multi-turn generation with tools, token-exact: a pure loop over a small engine protocol.

Each turn continues from the token ids the sample holds so far (the prompt, the model's turns as
the engine produced them, the tool turns), so earlier turns are never decoded and re-encoded,
which can change tokens and break the equality of the engine's and the trainer's log-probs. A
tool turn is the chat template's rendering of the tool messages *after* an assistant turn (its
delta), appended with mask 0; the model's tokens have mask 1. The trainer runs it through
:class:`VLLMTurns` (``megappo.trainer.turns``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

from megappo.seeds import turn_seed
from megappo.tools import PARSERS, InteractionRunner, Tool, ToolRunner, load_tools, parse_hermes

from .engine import SamplingConfig

if TYPE_CHECKING:
    from megappo.config import MultiTurnConfig


class TurnEngine(Protocol):
    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[tuple[list[int], list[float]]]:
        """For each prompt (token ids) the generated token ids (ending with EOS unless cut at
        ``max_tokens``) and the engine's log-prob of each."""


class VLLMTurns:
    """The engine protocol over a :class:`~megappo.rollout.VLLMRollout` (or anything with its
    ``generate``): one sample per prompt with ``sampling``'s settings; a call asks for the largest
    remaining budget and cuts each output to its own (the kept tokens are what a smaller
    ``max_tokens`` would have given). ``seeds``: each prompt's own seed (the loop passes each
    sample's seed of this turn); without them a ``sampling.seed`` seeds the call by the prompts'
    positions in it."""

    def __init__(self, rollout: Any, sampling: SamplingConfig):
        self.rollout, self.sampling = rollout, replace(sampling, n=1)

    def generate(self, prompts: list[list[int]], max_tokens: list[int],
                 seeds: Optional[list[int]] = None) -> list[tuple[list[int], list[float]]]:
        sampling = replace(self.sampling, max_tokens=max(max_tokens))
        out = self.rollout.generate(prompts, sampling) if seeds is None else self.rollout.generate(prompts, sampling,
                                                                                                   seeds=seeds)
        lengths = out.response_lengths.tolist()
        return [(out.responses[j, :min(n, m)].tolist(), out.rollout_log_probs[j, :min(n, m)].tolist())
                for j, (n, m) in enumerate(zip(lengths, max_tokens))]


@dataclass
class MultiTurnSample:
    """One sample: ``response_ids`` holds every token after the prompt, model and tool turns alike."""
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)   # 1: the model's token, 0: a tool turn's
    logprobs: list[float] = field(default_factory=list)      # the engine's; 0.0 on tool tokens
    assistant_turns: int = 0
    user_turns: int = 0                                       # tool turns (verl's name)
    step_rewards: list[float] = field(default_factory=list)  # each call's reward from execute
    tool_rewards: dict = field(default_factory=dict)         # each used tool's calc_reward at the end
    tool_seconds: float = 0.0
    turn_scores: list[float] = field(default_factory=list)   # each interaction turn's score (verl's name)
    messages: Optional[list] = None   # the conversation as messages (interactions read it); None without
    stop: str = ""        # length | max_assistant_turns | max_user_turns | no_tool_call | interaction_done

    @property
    def num_turns(self) -> int:
        """verl's count: the prompt, the assistant turns and the tool turns."""
        return self.assistant_turns + self.user_turns + 1


def _ids(rendered: Any) -> list[int]:
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


class ToolTurnTokens:
    """The token ids the chat template puts after an assistant turn the model ended with EOS:
    the tool messages (or, with ``role="user"``, a user's message) and the next assistant header.

    They are what the template renders after the assistant's EOS in a short conversation
    (a user turn, an assistant turn, the new messages, the generation prompt): the template's
    tokens after that EOS (Qwen's '\\n', which the model never writes) come first. Earlier turns
    may render differently once messages follow (Qwen3's template drops an earlier turn's empty
    thinking block): the sample keeps the tokens the model produced and saw, as verl's agent loop
    (``use_inference_chat_template=False``), so only the delta is taken from the template.
    ``chat_template_kwargs``: ``data.apply_chat_template_kwargs`` (e.g. ``enable_thinking``),
    so the next assistant header is the one the prompts were rendered with.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], chat_template_kwargs: Optional[dict] = None,
                 roles: Sequence[str] = ("tool",)):
        self.tokenizer, self.eos = tokenizer, set(int(t) for t in eos_token_ids)
        self.kwargs = dict(chat_template_kwargs or {})
        self._checked_roles: set = set()
        for role in roles:    # checked now, before any work; other roles on their first use
            self._check(role)

    def _render(self, content: str, texts: Optional[list[str]] = None, role: str = "tool") -> list[int]:
        """A user turn, an assistant turn saying ``content`` and (``texts``) the new messages with
        the generation prompt, rendered."""
        msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": content}]
        if texts is None:
            return _ids(self.tokenizer.apply_chat_template(msgs, tokenize=True, **self.kwargs))
        msgs += [{"role": role, "content": t} for t in texts]
        return _ids(self.tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, **self.kwargs))

    def _delta(self, texts: list[str], role: str, content: str = "a") -> list[int]:
        base, full = self._render(content), self._render(content, texts, role)
        # EOS tokens up to the assistant's, included; a template that writes none (the model's EOS
        # ends its turn unseen, e.g. megappo's tiny one) must render the short conversation as a prefix
        turn_end = sum(1 for t in base if t in self.eos)
        if not turn_end:
            if full[:len(base)] != base:
                raise ValueError("the chat template writes no EOS token and renders the earlier turns differently once "
                                 "messages follow, so the turn has no token-exact continuation with this template")
            return full[len(base):]
        ends = [i for i, t in enumerate(full) if t in self.eos]
        if len(ends) < turn_end:
            raise ValueError("the chat template ends fewer turns with EOS once messages follow an assistant turn, "
                             "so the turn has no token-exact continuation with this template")
        return full[ends[turn_end - 1] + 1:]

    def _check(self, role: str) -> None:
        """Refuse a template whose rendering of a ``role`` message is not where the delta is taken:
        it must render one message (templates that need roles to alternate take one user message
        after an assistant turn), its text must be in the delta, and the delta must not depend on
        what the assistant said (a template that writes the last assistant turn's EOS only once
        messages follow would put the assistant's turn in it)."""
        self._checked_roles.add(role)
        try:
            short, long = self._delta(["x"], role), self._delta(["x x x x"], role)
            other = self._delta(["x"], role, content="a a a a")
        except ValueError:
            raise
        except Exception as e:   # jinja's raise_exception: e.g. roles must alternate, no tool role
            raise ValueError(f"the chat template cannot render a {role!r} message after an assistant turn "
                             f"({type(e).__name__}: {e})") from None
        if len(long) <= len(short):
            raise ValueError(f"the chat template leaves {role!r} messages out of what it renders after an assistant "
                             f"turn (their text does not change it)")
        if other != short:
            raise ValueError(f"the chat template renders the assistant's turn again after it when a {role!r} message "
                             f"follows (it writes that turn's EOS only then), so the turn has no token-exact "
                             f"continuation with this template")

    def __call__(self, texts: list[str], role: str = "tool") -> list[int]:
        if role not in self._checked_roles:
            self._check(role)
        return self._delta(texts, role)


def tool_runner(multi_turn: MultiTurnConfig, *, timeout_s: float = 60.0, max_workers: int = 8,
                extra: tuple[Tool, ...] = ()) -> ToolRunner:
    """The runner ``actor_rollout_ref.rollout.multi_turn`` describes: its tool files loaded (and
    ``extra`` tools), its per-turn call limit and its truncation of long answers."""
    tools = load_tools(multi_turn.tool_config_path, multi_turn.function_tool_path, extra)
    return ToolRunner(tools, max_parallel_calls=multi_turn.max_parallel_calls,
                      max_response_length=multi_turn.max_tool_response_length,
                      truncate_side=multi_turn.tool_response_truncate_side, timeout_s=timeout_s,
                      max_workers=max_workers)


def loop_settings(multi_turn: MultiTurnConfig) -> dict:
    """:func:`multi_turn_generate`'s keyword arguments the settings give: the parser of
    ``format`` and the turn limits."""
    return dict(parse=PARSERS[multi_turn.format], max_assistant_turns=multi_turn.max_assistant_turns,
                max_user_turns=multi_turn.max_user_turns)


def _after_model_turn(s: MultiTurnSample, ids: list[int], budget: int, limits: tuple, decode,
                      parse) -> tuple[str, list]:
    """Why the sample stops after this model turn ('' if it goes on), and its tool calls."""
    max_assistant, max_user = limits
    if len(s.response_ids) >= budget:
        return "length", []
    if max_assistant and s.assistant_turns >= max_assistant:
        return "max_assistant_turns", []
    if max_user and s.user_turns >= max_user:
        return "max_user_turns", []
    calls = parse(decode(ids))[1]
    return ("", calls) if calls else ("no_tool_call", [])


def multi_turn_generate(engine: TurnEngine, prompts: list[list[int]], *, runner: ToolRunner,
                        decode: Callable[[list[int]], str], tool_turn: Callable[..., list[int]],
                        max_response_length: int, max_assistant_turns: Optional[int] = None,
                        max_user_turns: Optional[int] = None, tools_kwargs: Optional[list[dict]] = None,
                        parse: Callable[[str], tuple] = parse_hermes,
                        seeds: Optional[list[int]] = None, interactions: Optional[InteractionRunner] = None,
                        messages: Optional[list[list[dict]]] = None,
                        interaction_kwargs: Optional[list[dict]] = None) -> tuple[list[MultiTurnSample], dict]:
    """Generate every prompt's conversation: model turn, tool calls (hermes), tool turn, ... until
    the model calls no tool, a turn limit is reached or ``max_response_length`` tokens after the
    prompt are used (a tool or user turn that would reach it is not appended: verl does so for a tool turn). ``seeds``:
    each sample's seed; its turn k samples with :func:`~megappo.seeds.turn_seed` of it (the
    engine's ``generate`` gets ``seeds=``). With ``interactions`` (and each prompt's chat
    ``messages`` and ``interaction_kwargs``), a model turn that calls no tool is answered by the
    sample's interaction: a user turn (``tool_turn(texts, role="user")``), until it ends the
    conversation. Returns the samples and the step's metrics."""
    samples = [MultiTurnSample(list(p)) for p in prompts]
    kwargs = tools_kwargs or [{} for _ in prompts]
    if interactions is not None:
        for i, s in enumerate(samples):
            s.messages = [dict(m) for m in messages[i]]
        interactions.start_all(list(range(len(samples))), list(interaction_kwargs))
    active = list(range(len(prompts)))
    while active:
        turn = ([samples[i].prompt_ids + samples[i].response_ids for i in active],
                [max_response_length - len(samples[i].response_ids) for i in active])
        outs = (engine.generate(*turn) if seeds is None else
                engine.generate(*turn, seeds=[turn_seed(seeds[i], samples[i].assistant_turns) for i in active]))
        callers, asked = [], []
        for i, (ids, lps) in zip(active, outs):
            s = samples[i]
            room = max_response_length - len(s.response_ids)
            ids, lps = list(ids)[:room], list(lps)[:room]
            s.response_ids += ids
            s.response_mask += [1] * len(ids)
            s.logprobs += [float(x) for x in lps]
            s.assistant_turns += 1
            s.stop, calls = _after_model_turn(s, ids, max_response_length, (max_assistant_turns, max_user_turns),
                                              decode, parse)
            if s.messages is not None:   # what an interaction reads: the text, as verl decodes it
                s.messages.append({"role": "assistant", "content": decode(ids, skip_special_tokens=True)})
            if not s.stop:
                callers.append((i, calls))
            elif s.stop == "no_tool_call" and interactions is not None:
                s.stop = ""
                asked.append(i)
        results = runner.run_turn([i for i, _ in callers], [c for _, c in callers], [kwargs[i] for i, _ in callers])
        active = []
        for (i, _), answers in zip(callers, results):
            s = samples[i]
            s.step_rewards += [a.reward for a in answers]
            s.tool_seconds += sum(a.seconds for a in answers)
            if s.messages is not None:
                s.messages += [{"role": "tool", "content": a.text} for a in answers]
            if _append_turn(s, tool_turn([a.text for a in answers]), max_response_length):
                active.append(i)
        replies = interactions.respond(asked, [samples[i].messages for i in asked]) if asked else []
        for i, (done, text, score) in zip(asked, replies):
            s = samples[i]
            if score is not None:   # verl records a turn's score only when the interaction gives one
                s.turn_scores.append(score)
            if done:   # the conversation is over: its last message is not the model's to answer
                s.stop = "interaction_done"
                continue
            s.messages.append({"role": "user", "content": text})
            if _append_turn(s, tool_turn([text], role="user"), max_response_length):
                active.append(i)
    for s, rewards in zip(samples, runner.finish_all(list(range(len(samples))))):
        s.tool_rewards = rewards
    if interactions is not None:
        interactions.finish_all(list(range(len(samples))))
    return samples, _metrics(samples, runner, interactions)


def _append_turn(s: MultiTurnSample, ids: list[int], max_response_length: int) -> bool:
    """Append a tool or user turn (out of the loss) unless it would reach the response budget
    (then the sample stops at "length", as verl's loop for a tool turn; verl appends a user turn
    and cuts the sequence at the end); True when it was appended."""
    if len(s.response_ids) + len(ids) >= max_response_length:
        s.stop = "length"
        return False
    s.response_ids += ids
    s.response_mask += [0] * len(ids)
    s.logprobs += [0.0] * len(ids)
    s.user_turns += 1
    return True


def _metrics(samples: list[MultiTurnSample], runner: ToolRunner, interactions=None) -> dict[str, float]:
    return {**runner.pop_metrics(), **(interactions.pop_metrics() if interactions is not None else {}),
            **sample_metrics(samples)}


def sample_metrics(samples: list[MultiTurnSample]) -> dict[str, float]:
    """The samples' turn counts (verl's num_turns/*), tool seconds per sample, share of tool
    tokens and why each stopped."""
    out = {}
    turns = [s.num_turns for s in samples] or [0]
    seconds = [s.tool_seconds for s in samples] or [0.0]
    for name, xs in (("num_turns", turns), ("agent_loop/tool_calls", seconds)):     # verl's names
        out[f"{name}/min"], out[f"{name}/max"], out[f"{name}/mean"] = float(min(xs)), float(max(xs)), sum(xs) / len(xs)
    tokens = sum(len(s.response_mask) for s in samples)
    out["multi_turn/tool_token_share"] = (tokens - sum(sum(s.response_mask) for s in samples)) / max(tokens, 1)
    for s in samples:
        out[f"multi_turn/stop/{s.stop}"] = out.get(f"multi_turn/stop/{s.stop}", 0.0) + 1
    return out
