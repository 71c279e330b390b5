"""Runs one turn's tool calls for many samples at once.

Samples run concurrently on a thread pool; one sample's calls run in the order the model wrote
them (they may share the sample's tool instances), each under a wall-clock limit. A call past
``max_parallel_calls``, a call the parser or the schema check rejected, a tool that raises and a
tool that overruns its limit are each answered with an error text; the run goes on.

Python cannot stop a thread: a tool that overruns is abandoned (its daemon thread runs on, its
answer is dropped, ``tools/abandoned`` counts it). Tools that may hang should bound themselves,
as the sandboxed Python tool does with its subprocess.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .base import Tool, _resolve, normalise_result
from .parser import TIMEOUT, TOO_MANY_CALLS, TOOL_EXCEPTION, ToolCall, check_call

TRUNCATE_SIDES = ("left", "middle", "right")


def truncate(text: str, max_length: int, side: str) -> str:
    """verl's truncation of a tool response longer than ``max_length`` characters: left keeps the
    end, right the start, middle both ends (half each), the cut marked '(truncated)'. (verl's
    middle keeps the whole text as its 'end' when max_length is 1; here the end is empty then.)"""
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate side must be one of {TRUNCATE_SIDES}, got {side!r}")
    if len(text) <= max_length:
        return text
    if side == "left":
        return "(truncated)..." + text[len(text) - max_length:]
    if side == "right":
        return text[:max_length] + "...(truncated)"
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half:]


@dataclass
class ToolResult:
    """The answer to one call: the text the model sees next, the tool's step reward and metrics."""
    name: Optional[str]
    text: str
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)
    error: Optional[str] = None
    seconds: float = 0.0


def _timed(fn: Callable[[], Any], timeout_s: float) -> tuple[str, Any]:
    """("ok", value), ("raised", exception) or ("timeout", None): ``fn`` in a daemon thread."""
    box: dict = {}

    def target():
        try:
            box["ok"] = fn()
        except BaseException as e:       # a tool's SystemExit is its failure, not ours
            box["raised"] = e

    t = threading.Thread(target=target, daemon=True, name="megappo-tool")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return "timeout", None
    return ("ok", box["ok"]) if "ok" in box else ("raised", box["raised"])


class ToolRunner:
    """The tools of a rollout, their instances per sample, and the turn's calls.

    ``tools``: name -> :class:`Tool`. A sample is named by a hashable key; its tool instances are
    created on its first call of each tool with the row's ``tools_kwargs[<tool>]["create_kwargs"]``
    and released by :meth:`finish`.
    """

    def __init__(self, tools: dict[str, Tool], *, max_parallel_calls: int = 1, max_response_length: int = 256,
                 truncate_side: str = "middle", timeout_s: float = 30.0, max_workers: int = 8):
        if truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"truncate_side must be one of {TRUNCATE_SIDES}, got {truncate_side!r}")
        self.tools = dict(tools)
        self.schemas = {name: t.tool_schema for name, t in self.tools.items()}
        self.max_parallel_calls, self.max_response_length = max_parallel_calls, max_response_length
        self.truncate_side, self.timeout_s, self.max_workers = truncate_side, timeout_s, max_workers
        self._instances: dict[Any, dict[str, str]] = {}
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._seconds: list[float] = []

    def _answer(self, call: ToolCall, error: str, message: str, seconds: float = 0.0) -> ToolResult:
        with self._lock:
            self._counts[f"tools/errors/{error}"] += 1
            self._counts["tools/abandoned"] += error == TIMEOUT
        return ToolResult(call.name, truncate(message, self.max_response_length, self.truncate_side),
                          error=error, seconds=seconds)

    def _instance(self, sample: Any, name: str, tools_kwargs: dict) -> str:
        insts = self._instances.setdefault(sample, {})
        if name not in insts:
            create_kwargs = (tools_kwargs.get(name) or {}).get("create_kwargs") or {}
            # unique across samples, replicas and steps (verl's are uuids): a tool backed by a service
            # keeps each trajectory's state under its id
            iid = _resolve_created(self.tools[name].create(f"{sample}:{name}:{uuid.uuid4().hex}", **create_kwargs))
            insts[name] = iid
        return insts[name]

    def _call(self, sample: Any, call: ToolCall, tools_kwargs: dict) -> ToolResult:
        call = check_call(call, self.schemas)
        if call.error:
            return self._answer(call, call.error, call.message)
        tool = self.tools[call.name]

        def run():
            return normalise_result(tool.execute(self._instance(sample, call.name, tools_kwargs), call.arguments))

        start = time.perf_counter()
        status, value = _timed(run, self.timeout_s)
        seconds = time.perf_counter() - start
        with self._lock:
            self._seconds.append(seconds)
        if status == "timeout":
            return self._answer(call, TIMEOUT, f"Error: tool {call.name!r} did not finish within {self.timeout_s:g} s",
                                seconds)
        if status == "raised":
            return self._answer(call, TOOL_EXCEPTION,
                                f"Error executing tool {call.name!r}: {type(value).__name__}: {value}", seconds)
        text, reward, metrics = value
        truncated = truncate(text, self.max_response_length, self.truncate_side)
        with self._lock:
            self._counts["tools/truncated"] += truncated != text
        return ToolResult(call.name, truncated, reward, metrics, seconds=seconds)

    def _sample_turn(self, sample: Any, calls: list[ToolCall], tools_kwargs: dict) -> list[ToolResult]:
        out = []
        for i, call in enumerate(calls):
            if i >= self.max_parallel_calls:
                out.append(self._answer(call, TOO_MANY_CALLS, f"Error: at most {self.max_parallel_calls} tool "
                                                              f"call(s) per turn; this one was not run"))
            else:
                out.append(self._call(sample, call, tools_kwargs))
        return out

    def run_turn(self, samples: list, calls: list[list[ToolCall]],
                 tools_kwargs: Optional[list[dict]] = None) -> list[list[ToolResult]]:
        """Answer every sample's calls of one turn; ``tools_kwargs[i]`` is sample i's row's
        ``extra_info.tools_kwargs``. Returns one result per call, in order."""
        kwargs = tools_kwargs if tools_kwargs is not None else [{}] * len(samples)
        if not (len(samples) == len(calls) == len(kwargs)):
            raise ValueError(f"run_turn: {len(samples)} samples, {len(calls)} call lists, {len(kwargs)} tools_kwargs")
        with self._lock:
            self._counts["tools/calls"] += sum(len(c) for c in calls)
        busy = [i for i, c in enumerate(calls) if c]
        results: list[list[ToolResult]] = [[] for _ in samples]
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, len(busy) or 1))) as pool:
            futures = {i: pool.submit(self._sample_turn, samples[i], calls[i], kwargs[i] or {}) for i in busy}
            for i, f in futures.items():
                results[i] = f.result()
        return results

    def finish(self, sample: Any) -> dict[str, float]:
        """Each of the sample's tools' ``calc_reward``, then ``release`` of its instances."""
        rewards = {}
        for name, iid in self._instances.pop(sample, {}).items():
            status, value = _timed(lambda: _resolve(self.tools[name].calc_reward(iid)), self.timeout_s)
            rewards[name] = float(value) if status == "ok" and value is not None else 0.0
            if status != "ok":
                self._counts[f"tools/errors/{TIMEOUT if status == 'timeout' else TOOL_EXCEPTION}"] += 1
            status, _ = _timed(lambda: _resolve(self.tools[name].release(iid)), self.timeout_s)
            if status != "ok":
                self._counts[f"tools/errors/{TIMEOUT if status == 'timeout' else TOOL_EXCEPTION}"] += 1
        return rewards

    def finish_all(self, samples: list) -> list[dict[str, float]]:
        """:meth:`finish` of each sample, in order (one call for a whole rollout)."""
        return [self.finish(sample) for sample in samples]

    def pop_metrics(self) -> dict[str, float]:
        """Counts since the last call (calls, errors by kind, truncated, abandoned) and the tools'
        wall seconds (sum and slowest call)."""
        with self._lock:
            out = {k: float(v) for k, v in self._counts.items()}
            out["tools/seconds"] = float(sum(self._seconds))
            out["tools/max_call_seconds"] = float(max(self._seconds, default=0.0))
            self._counts.clear()
            self._seconds.clear()
        return out


def _resolve_created(value: Any) -> str:
    # verl's create returns (instance_id, ToolResponse); megappo's returns the id
    value = _resolve(value)
    return value[0] if isinstance(value, tuple) else value
