"""The hermes tool-call parser and the argument check: every kind of bad call is an error call."""
import json
import re

import pytest

from megappo.tools import (ERROR_KINDS, INVALID_ARGUMENTS, MALFORMED_CALL, MALFORMED_JSON, UNCLOSED, UNKNOWN_TOOL,
                           ToolCall, check_arguments, check_call, function_schema, parse_hermes)

SCHEMAS = {
    "calculator": function_schema("calculator", "Evaluate arithmetic.", {"expression": {"type": "string"}},
                                  ["expression"]),
    "lookup": function_schema("lookup", "Read a table.", {
        "key": {"type": "string"}, "limit": {"type": "integer"}, "scale": {"type": "number"},
        "exact": {"type": "boolean"}, "mode": {"type": "string", "enum": ["a", "b"]},
        "table": {"type": "string", "nullable": True}, "ids": {"type": ["integer", "string"]}}, ["key"]),
}

QWEN_TURN = (
    "I will compute both.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*7\"}}\n"
    "</tool_call>\n<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"key\": \"b\", \"limit\": 2}}\n</tool_call>"
)


def verls_hermes(text):
    """verl's HermesToolParser.extract_tool_calls (v0.9.0) on decoded text, for comparison."""
    regex = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    if "<tool_call>" not in text or "</tool_call>" not in text:
        return text, []
    calls = []
    for match in regex.findall(text):
        try:
            c = json.loads(match)
            calls.append((c["name"], c["arguments"]))
        except Exception:
            pass
    return regex.sub("", text), calls


@pytest.mark.parametrize("text", [QWEN_TURN, "no call at all", "<tool_call>{\"name\": \"x\", \"arguments\": {}}</tool_call>",
                                  "a<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1\"}}"
                                  "</tool_call>b<tool_call>{\"name\": \"lookup\", \"arguments\": {\"key\": \"k\"}}</tool_call>c"])
def test_well_formed_calls_parse_as_verls_parser_does(text):
    content, calls = parse_hermes(text)
    v_content, v_calls = verls_hermes(text)
    assert content == v_content
    assert [(c.name, c.arguments) for c in calls] == v_calls and all(c.error is None for c in calls)


def test_several_calls_in_one_turn_keep_their_order():
    content, calls = parse_hermes(QWEN_TURN)
    assert content == "I will compute both.\n\n"
    assert [c.name for c in calls] == ["calculator", "lookup"]
    assert calls[1].arguments == {"key": "b", "limit": 2}


@pytest.mark.parametrize("block, kind, fragment", [
    ('{"name": "calculator", "arguments": {"expression": "1+1"', MALFORMED_JSON, "not valid JSON"),
    ("calculator(1+1)", MALFORMED_JSON, "not valid JSON"),
    ('["calculator"]', MALFORMED_CALL, 'must be {"name": <tool name>, "arguments": {...}}'),
    ('{"arguments": {}}', MALFORMED_CALL, 'must be {"name"'),
    ('{"name": "calculator", "arguments": [1]}', MALFORMED_CALL, 'must be {"name"'),
])
def test_malformed_blocks_become_error_calls(block, kind, fragment):
    content, calls = parse_hermes(f"x<tool_call>{block}</tool_call>y")
    assert content == "xy" and len(calls) == 1
    assert calls[0].error == kind and fragment in calls[0].message and calls[0].message.startswith("Error")


def test_arguments_given_as_a_json_string_are_decoded():
    (call,) = parse_hermes('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2\\"}"}</tool_call>')[1]
    assert call.error is None and call.arguments == {"expression": "2"}


def test_an_unclosed_block_is_an_error_call_and_not_content():
    content, calls = parse_hermes('ok <tool_call>{"name": "calculator", "arguments": {"expression": "1"}}')
    assert content == "ok " and [c.error for c in calls] == [UNCLOSED]
    content, calls = parse_hermes('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
                                  " then <tool_call>{")
    assert [c.error for c in calls] == [None, UNCLOSED] and content == " then "


@pytest.mark.parametrize("args, problem", [
    ({}, "missing required argument(s) key"),
    ({"key": "k", "colour": 1}, "unexpected argument(s) colour (expected: key, limit, scale, exact, mode, table, ids)"),
    ({"key": 3}, "argument key must be of type string, got 3"),
    ({"key": "k", "limit": "2"}, 'argument limit must be of type integer, got "2"'),
    ({"key": "k", "limit": 2.5}, "argument limit must be of type integer, got 2.5"),
    ({"key": "k", "limit": True}, "argument limit must be of type integer, got true"),
    ({"key": "k", "scale": False}, "argument scale must be of type number, got false"),
    ({"key": "k", "exact": 1}, "argument exact must be of type boolean, got 1"),
    ({"key": "k", "mode": "c"}, "argument mode must be one of ['a', 'b'], got \"c\""),
    ({"key": "k", "ids": [1]}, "argument ids must be of type ['integer', 'string'], got [1]"),
    ({"key": None}, "argument key must be of type string, got null"),
])
def test_arguments_failing_the_schema_say_why(args, problem):
    assert check_arguments(SCHEMAS["lookup"], args)[0] == problem
    call = check_call(ToolCall("lookup", args), SCHEMAS)
    assert call.error == INVALID_ARGUMENTS and call.message == f"Error: lookup: {problem}"


def test_good_arguments_pass_and_whole_floats_become_integers():
    problem, args = check_arguments(SCHEMAS["lookup"], {"key": "k", "limit": 3.0, "scale": 2, "exact": False,
                                                        "mode": "a", "table": None, "ids": "x"})
    assert problem is None and args["limit"] == 3 and isinstance(args["limit"], int) and args["scale"] == 2
    open_schema = function_schema("f", "d", {"a": {"type": "string"}}, [])
    open_schema["function"]["parameters"]["additionalProperties"] = True
    assert check_arguments(open_schema, {"a": "x", "b": 1}) == (None, {"a": "x", "b": 1})


def test_unknown_tools_name_the_available_ones():
    call = check_call(ToolCall("search", {"q": "x"}), SCHEMAS)
    assert call.error == UNKNOWN_TOOL and call.message == "Error: unknown tool 'search'; available: calculator, lookup"
    bad = ToolCall(None, error=MALFORMED_JSON, message="m")
    assert check_call(bad, SCHEMAS) is bad


def test_error_kinds_are_distinct_metric_suffixes():
    assert len(set(ERROR_KINDS)) == len(ERROR_KINDS) and all(re.fullmatch(r"[a-z_]+", k) for k in ERROR_KINDS)
