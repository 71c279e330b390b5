"""Tools for multi-turn rollouts (verl's tool interface and tool config files).

- :class:`Tool`: the base class a user's tool implements (``create``, ``execute``, ``calc_reward``,
  ``release``, its OpenAI function schema); :func:`function_tool` makes a plain function a tool.
- :func:`parse_hermes` / :func:`check_call`: tool calls from the model's text, checked against the
  schemas; a bad call carries its error kind and the message the model is answered with.
- :class:`ToolRunner`: one turn's calls for many samples at once (thread pool, per-call wall-clock
  limit, ``max_parallel_calls`` per sample and turn, verl's truncation of long answers, metrics).
- Two tools that ship: :class:`Calculator` (arithmetic on the syntax tree, no eval) and
  :class:`PythonSandbox` (a subprocess under CPU, memory, process, output and wall-clock limits;
  see its module for exactly what is isolated). In a tool config: ``megappo.tools.Calculator``,
  ``megappo.tools.PythonSandbox``. :class:`Lookup` is the tool of the synthetic ``lookup`` task;
  :class:`Gsm8kTool` is verl's GSM8K answer-grading tool (its class name in a verl tool config
  loads it where verl is not installed).
- :func:`read_tool_config` / :func:`load_tools`: verl's tool config YAML and function-tool files;
  :func:`tools_kwargs_of` reads a row's ``extra_info.tools_kwargs``.
- :class:`Interaction` / :class:`InteractionRunner`: a simulated user answering between the
  model's turns (verl's interactions, ``multi_turn.interaction_config_path``).

Importing this package imports neither torch nor vLLM.
"""
from .base import FunctionTool, Tool, function_schema, function_tool, normalise_result, schema_from_function
from .calculator import Calculator, CalculatorError, calculate
from .lookup import Lookup
from .gsm8k import Gsm8kTool
from .parser import (ERROR_KINDS, INVALID_ARGUMENTS, MALFORMED_CALL, MALFORMED_JSON, TIMEOUT, TOO_MANY_CALLS,
                     TOOL_EXCEPTION, UNCLOSED, UNKNOWN_TOOL, PARSERS, ToolCall, check_arguments, check_call,
                     parse_hermes)
from .runner import TRUNCATE_SIDES, ToolResult, ToolRunner, truncate
from .registry import (ToolConfigError, ToolSpec, load_tools, read_tool_config, tools_from_config,
                       tools_from_file, tools_kwargs_of)
from .sandbox import PythonSandbox
from .interaction import (Gsm8kInteraction, Interaction, InteractionError, InteractionRunner, InteractionSpec,
                          interaction_kwargs_of, load_interactions, read_interaction_config)

__all__ = ["FunctionTool", "Tool", "function_schema", "function_tool", "normalise_result", "schema_from_function",
           "ERROR_KINDS", "INVALID_ARGUMENTS", "MALFORMED_CALL", "MALFORMED_JSON", "TIMEOUT", "TOO_MANY_CALLS",
           "TOOL_EXCEPTION", "UNCLOSED", "UNKNOWN_TOOL", "PARSERS", "ToolCall", "check_arguments", "check_call",
           "parse_hermes",
           "TRUNCATE_SIDES", "ToolResult", "ToolRunner", "truncate",
           "Calculator", "CalculatorError", "calculate", "Lookup", "Gsm8kTool", "PythonSandbox",
           "ToolConfigError", "ToolSpec", "load_tools", "read_tool_config", "tools_from_config",
           "tools_from_file", "tools_kwargs_of",
           "Gsm8kInteraction", "Interaction", "InteractionError", "InteractionRunner", "InteractionSpec", "interaction_kwargs_of",
           "load_interactions", "read_interaction_config"]
