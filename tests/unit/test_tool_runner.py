"""The tool runner: concurrency across samples, per-call limits, errors as answers, truncation, metrics."""
import threading
import time
from pathlib import Path

import pytest

from megappo.tools import (TIMEOUT, TOO_MANY_CALLS, TOOL_EXCEPTION, UNKNOWN_TOOL, Tool, ToolCall, ToolRunner,
                           function_schema, parse_hermes, truncate)


def verls_truncate(text, n, side):
    """verl v0.9.0 ToolAgentLoop._call_tool's truncation, verbatim in substance."""
    if text and len(text) > n:
        if side == "left":
            return "(truncated)..." + text[-n:]
        if side == "right":
            return text[:n] + "...(truncated)"
        length = n // 2
        return text[:length] + "...(truncated)..." + text[-length:]
    return text


@pytest.mark.parametrize("side", ["left", "middle", "right"])
@pytest.mark.parametrize("n", [2, 3, 7, 10, 11, 50])
def test_truncation_is_verls(side, n):
    text = "".join(chr(ord("a") + i % 26) for i in range(23))
    assert truncate(text, n, side) == verls_truncate(text, n, side)


def test_truncation_keeps_what_each_side_says():
    text = "0123456789"
    assert truncate(text, 4, "left") == "(truncated)...6789"
    assert truncate(text, 4, "right") == "0123...(truncated)"
    assert truncate(text, 4, "middle") == "01...(truncated)...89"
    assert truncate(text, 10, "middle") == text
    assert truncate(text, 1, "middle") == "...(truncated)..."      # verl would keep the whole text here
    with pytest.raises(ValueError, match="truncate side must be one of"):
        truncate(text, 4, "top")


class Counter(Tool):
    """Counts per sample; the row's create_kwargs give the start; calc_reward is the count."""

    def __init__(self):
        super().__init__({}, function_schema("count", "Count up.", {"by": {"type": "integer"}}, ["by"]))
        self.state, self.released, self.lock = {}, [], threading.Lock()

    def create(self, instance_id=None, start=0, **kwargs):
        self.state[instance_id] = start
        return instance_id

    def execute(self, instance_id, parameters, **kwargs):
        self.state[instance_id] += parameters["by"]
        return str(self.state[instance_id]), 0.25, {"n": 1}

    def calc_reward(self, instance_id, **kwargs):
        return float(self.state[instance_id])

    def release(self, instance_id, **kwargs):
        with self.lock:
            self.released.append(instance_id)
        del self.state[instance_id]


class Sleeper(Tool):
    def __init__(self):
        super().__init__({}, function_schema("sleep", "Sleep.", {"s": {"type": "number"}}, ["s"]))
        self.started = 0

    def execute(self, instance_id, parameters, **kwargs):
        self.started += 1
        time.sleep(parameters["s"])
        return f"slept {parameters['s']}"


class Boom(Tool):
    def __init__(self):
        super().__init__({}, function_schema("boom", "Fail.", {}, []))

    def execute(self, instance_id, parameters, **kwargs):
        raise ZeroDivisionError("no " * 200)


def call(name, **args):
    return ToolCall(name, args)


def test_create_kwargs_per_row_and_state_across_turns():
    c = Counter()
    r = ToolRunner({"count": c}, max_parallel_calls=2)
    kw = [{"count": {"create_kwargs": {"start": 10}}}, {"count": {"create_kwargs": {"start": 20}}}, {}]
    out = r.run_turn(["a", "b", "c"], [[call("count", by=1)], [call("count", by=2), call("count", by=3)],
                                       [call("count", by=5)]], kw)
    assert [[x.text for x in o] for o in out] == [["11"], ["22", "25"], ["5"]]
    assert out[1][0].reward == 0.25 and out[1][0].metrics == {"n": 1} and out[1][0].error is None
    out = r.run_turn(["a", "b", "c"], [[call("count", by=1)], [], []], kw)      # the instance lives on
    assert [[x.text for x in o] for o in out] == [["12"], [], []]
    assert r.finish("a") == {"count": 12.0} and r.finish("b") == {"count": 25.0} and r.finish("nobody") == {}
    # each sample's instance under its own id (unique across samples, replicas and steps, as verl's uuids)
    assert sorted(i.rsplit(":", 1)[0] for i in c.released) == ["a:count", "b:count"]
    assert [i.rsplit(":", 1)[0] for i in c.state] == ["c:count"]
    assert len(set(c.released) | set(c.state)) == 3


def test_samples_run_concurrently():
    s = Sleeper()
    r = ToolRunner({"sleep": s}, max_workers=8)
    t0 = time.perf_counter()
    out = r.run_turn(list(range(8)), [[call("sleep", s=0.4)] for _ in range(8)])
    took = time.perf_counter() - t0
    assert all(o[0].text == "slept 0.4" for o in out) and s.started == 8
    assert took < 0.4 * 8 / 2, took           # serially it would take 3.2 s
    m = r.pop_metrics()
    assert m["tools/calls"] == 8 and 8 * 0.4 <= m["tools/seconds"] < 8 * 0.4 + 2 and m["tools/max_call_seconds"] >= 0.4


def test_calls_past_max_parallel_calls_are_answered_not_run():
    c = Counter()
    r = ToolRunner({"count": c}, max_parallel_calls=2)
    (out,) = r.run_turn(["a"], [[call("count", by=1), call("count", by=1), call("count", by=1)]])
    assert [x.text for x in out[:2]] == ["1", "2"] and out[2].error == TOO_MANY_CALLS
    assert out[2].text == "Error: at most 2 tool call(s) per turn; this one was not run"
    assert list(c.state.values()) == [2] and next(iter(c.state)).startswith("a:count:")
    assert r.pop_metrics()["tools/errors/too_many_calls"] == 1


def test_a_hanging_tool_times_out_and_the_turn_goes_on():
    s = Sleeper()
    r = ToolRunner({"sleep": s, "count": Counter()}, timeout_s=0.3, max_parallel_calls=2)
    t0 = time.perf_counter()
    out = r.run_turn(["a", "b"], [[call("sleep", s=30), call("count", by=1)], [call("sleep", s=0.01)]])
    assert time.perf_counter() - t0 < 2
    assert out[0][0].error == TIMEOUT and out[0][0].text == "Error: tool 'sleep' did not finish within 0.3 s"
    assert out[0][1].text == "1" and out[1][0].text == "slept 0.01"
    m = r.pop_metrics()
    assert m["tools/errors/timeout"] == 1 and m["tools/abandoned"] == 1 and m["tools/calls"] == 3


def test_a_raising_tool_is_an_error_answer_truncated_like_any():
    r = ToolRunner({"boom": Boom()}, max_response_length=40, truncate_side="right")
    (out,) = r.run_turn(["a"], [[call("boom")]])
    assert out[0].error == TOOL_EXCEPTION
    assert out[0].text == truncate("Error executing tool 'boom': ZeroDivisionError: " + "no " * 200, 40, "right")
    assert r.pop_metrics()["tools/errors/tool_exception"] == 1


def test_bad_calls_from_the_parser_are_answered_and_counted():
    r = ToolRunner({"count": Counter()}, max_parallel_calls=4)
    text = ('<tool_call>{"name": "count", "arguments": {"by": 2}}</tool_call>'
            '<tool_call>{"name": "count", "arguments": {"by": "two"}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "count" "arguments"}</tool_call>')
    (out,) = r.run_turn(["a"], [parse_hermes(text)[1]])
    assert [x.error for x in out] == [None, "invalid_arguments", UNKNOWN_TOOL, "malformed_json"]
    assert out[0].text == "2" and out[1].text == "Error: count: argument by must be of type integer, got \"two\""
    m = r.pop_metrics()
    assert m == {"tools/calls": 4.0, "tools/errors/invalid_arguments": 1.0, "tools/errors/unknown_tool": 1.0,
                 "tools/errors/malformed_json": 1.0, "tools/abandoned": 0.0, "tools/truncated": 0.0,
                 "tools/seconds": m["tools/seconds"], "tools/max_call_seconds": m["tools/max_call_seconds"]}
    assert r.pop_metrics() == {"tools/seconds": 0.0, "tools/max_call_seconds": 0.0}


def test_long_answers_are_truncated_and_counted():
    class Long(Tool):
        def __init__(self):
            super().__init__({}, function_schema("long", "Long.", {}, []))

        def execute(self, instance_id, parameters, **kwargs):
            return "x" * 100 + "END"

    r = ToolRunner({"long": Long()}, max_response_length=10, truncate_side="left")
    (out,) = r.run_turn(["a"], [[call("long")]])
    assert out[0].text == "(truncated)...xxxxxxxEND" and out[0].error is None
    assert r.pop_metrics()["tools/truncated"] == 1


def test_a_verl_style_async_tool_runs():
    class Resp:
        def __init__(self, text):
            self.text = text

    class AsyncEcho:
        name = "echo"
        tool_schema = function_schema("echo", "Echo.", {"s": {"type": "string"}}, ["s"])

        async def create(self, instance_id=None, **kwargs):
            return instance_id, Resp("")

        async def execute(self, instance_id, parameters, **kwargs):
            return Resp(f"{instance_id} {parameters['s']}"), 0.5, {}

        async def calc_reward(self, instance_id, **kwargs):
            return 1.0

        async def release(self, instance_id, **kwargs):
            return None

    r = ToolRunner({"echo": AsyncEcho()})
    (out,) = r.run_turn([7], [[call("echo", s="hi")]])
    assert out[0].text.startswith("7:echo:") and out[0].text.endswith(" hi") and out[0].reward == 0.5
    assert r.finish(7) == {"echo": 1.0}


def test_mismatched_lists_and_bad_side_are_errors():
    r = ToolRunner({"count": Counter()})
    with pytest.raises(ValueError, match="2 samples, 1 call lists, 2 tools_kwargs"):
        r.run_turn(["a", "b"], [[]], [{}, {}])
    with pytest.raises(ValueError, match="truncate_side must be one of"):
        ToolRunner({}, truncate_side="up")


def test_verls_gsm8k_tool_config_runs_as_verl_grades(tmp_path):
    """verl's multi-turn GSM8K tool config, unchanged (class verl.tools.gsm8k_tool.Gsm8kTool, verl
    not installed): megappo's Gsm8kTool under verl's schema; verl's grading (flexible extraction of
    "#### " + answer), its answer text, its -0.05 for a submission that does not improve, and
    calc_reward the last grade, per sample from its row's create_kwargs."""
    import importlib.util
    import sys

    from megappo.tools import Gsm8kTool, tools_from_config

    sys.path.insert(0, str(Path(__file__).parent))
    from verl_commands import VERL_GSM8K_TOOL_CONFIG

    assert importlib.util.find_spec("verl") is None
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text(VERL_GSM8K_TOOL_CONFIG)
    (tool,) = tools_from_config(path)
    assert isinstance(tool, Gsm8kTool) and tool.name == "calc_gsm8k_reward"
    assert tool.tool_schema["function"]["description"].endswith("or not correctly parsed)")   # verl's file's schema
    r = ToolRunner({"calc_gsm8k_reward": tool})
    kw = [{"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}},
          {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "1,000"}}}]
    turns = [[call("calc_gsm8k_reward", answer="70")], [call("calc_gsm8k_reward", answer="1000")]]
    out = r.run_turn(["a", "b"], turns, kw)
    assert [(o[0].text, o[0].reward) for o in out] == [("Current parsed answer='70' reward=0.0", -0.05),
                                                       ("Current parsed answer='1000' reward=1.0", 0.0)]
    out = r.run_turn(["a", "b"], [[call("calc_gsm8k_reward", answer="The answer is 72.")],
                                  [call("calc_gsm8k_reward", answer="#### 1000")]], kw)
    assert [(o[0].text, o[0].reward) for o in out] == [("Current parsed answer='The answer is 72.' reward=1.0", 0.0),
                                                       ("Current parsed answer='#### 1000' reward=1.0", -0.05)]
    assert r.finish("a") == {"calc_gsm8k_reward": 1.0} and r.finish("b") == {"calc_gsm8k_reward": 1.0}
    assert tool._state == {}   # released
