"""megappo.tools: the tool interface, function tools' schemas, verl's tool config files."""
import sys
import textwrap
from typing import Literal, Optional

import pytest

from megappo.tools import (FunctionTool, Tool, ToolConfigError, function_tool, load_tools, normalise_result,
                           read_tool_config, schema_from_function, tools_from_config, tools_from_file)

# verl's GSM8K tool config, verbatim (the multi-turn verl command names it)
from verl_commands import VERL_GSM8K_TOOL_CONFIG as GSM8K_TOOL_CONFIG  # noqa: E402


def lookup(key: str, table: Optional[str] = None, mode: Literal["exact", "prefix"] = "exact",
           limit: int = 3, weights: list[float] = None, strict: bool = False) -> str:
    """Read a value from a hidden table.

    The table is not in the prompt.

    Args:
        key: the row to read,
            case-sensitive.
        table: which table (null: the default one)
        mode: how the key matches
        limit: most rows returned
        weights: per-column weights
        strict: fail on a missing key
    """
    return f"{key}@{table}"


def test_function_schema_is_what_verls_builder_writes():
    """verl builds function tools' schemas with transformers' get_json_schema (and drops its
    'return' entry when pydantic validates the schema); ours match it."""
    from transformers.utils import get_json_schema

    def add(a: int, b: float) -> float:
        """Add two numbers.

        Args:
            a: first
            b: second
        """
        return a + b

    for fn in (lookup, add):
        want = get_json_schema(fn)
        want["function"].pop("return", None)
        assert schema_from_function(fn) == want
    s = schema_from_function(lookup, name="table_lookup")["function"]
    assert s["name"] == "table_lookup" and s["parameters"]["required"] == ["key"]
    assert s["parameters"]["properties"]["key"]["description"] == "the row to read, case-sensitive."


def test_function_schema_errors_name_the_function_and_parameter():
    def no_hint(a):
        """Doc."""

    def star(*a: int):
        """Doc."""

    def no_doc(a: int):
        pass

    def odd(a: set):
        """Doc."""

    with pytest.raises(TypeError, match=r"function tool 'no_hint' .*parameter 'a' needs a type hint"):
        schema_from_function(no_hint)
    with pytest.raises(ValueError, match=r"\*a cannot be described in a tool schema"):
        schema_from_function(star)
    with pytest.raises(ValueError, match=r"'no_doc' .*needs a docstring"):
        schema_from_function(no_doc)
    with pytest.raises(TypeError, match=r"parameter 'a': type hint <class 'set'> has no JSON schema type"):
        schema_from_function(odd)


def test_function_tool_decorator_keeps_the_function_and_runs_it():
    @function_tool
    def twice(x: int) -> int:
        """Double it.

        Args:
            x: a number
        """
        return 2 * x

    @function_tool(name="thrice")
    def three(x: int):
        """Triple it.

        Args:
            x: a number
        """
        return str(3 * x), 0.5, {"n": 1}

    assert twice(4) == 8                                   # still a plain function
    assert twice.__megappo_tool__.name == "twice" and three.__megappo_tool__.name == "thrice"
    assert twice.__megappo_tool__.execute("i", {"x": 4}) == ("8", 0.0, {})
    assert three.__megappo_tool__.execute("i", {"x": 2}) == ("6", 0.5, {"n": 1})


def test_results_normalise_as_verls_function_tools_do():
    class Resp:                                           # verl's ToolResponse has .text
        text = "t"

    assert normalise_result("a") == ("a", 0.0, {})
    assert normalise_result({"b": 1}) == ('{"b": 1}', 0.0, {})
    assert normalise_result(("a", None)) == ("a", 0.0, {})
    assert normalise_result(("a", 1, None)) == ("a", 1.0, {})
    assert normalise_result(Resp()) == ("t", 0.0, {})
    assert normalise_result(7) == ("7", 0.0, {})
    with pytest.raises(TypeError, match="tuple of 4 items"):
        normalise_result((1, 2, 3, 4))


def test_verls_gsm8k_tool_config_reads_without_importing_verl(tmp_path):
    p = tmp_path / "gsm8k_tool_config.yaml"
    p.write_text(GSM8K_TOOL_CONFIG)
    (spec,) = read_tool_config(p)
    assert spec.class_name == "verl.tools.gsm8k_tool.Gsm8kTool" and spec.config == {"type": "native"}
    assert spec.tool_schema["function"]["name"] == "calc_gsm8k_reward"
    assert spec.tool_schema["function"]["parameters"]["required"] == ["answer"]
    # its class loads megappo's where verl is absent (test_tool_runner.py runs it); verl's others do not
    p.write_text(GSM8K_TOOL_CONFIG.replace("gsm8k_tool.Gsm8kTool", "sandbox_fusion_tools.SandboxFusionTool"))
    with pytest.raises(ToolConfigError, match=r"gsm8k_tool_config.yaml: tools\[0\].class_name: cannot import module "
                                              r"'verl.tools.sandbox_fusion_tools'"):
        tools_from_config(p)


@pytest.mark.parametrize("text, fragment", [
    ("- a\n", "expected a mapping with a 'tools' list, got list"),
    ("tools: [\n", "not valid YAML"),
    ("tools:\n  - 3\n", "tools[0]: expected a mapping with class_name, config, tool_schema; got 3"),
    ("tools:\n  - class_name: Calc\n", "tools[0].class_name: expected a dotted path pkg.module.Class, got 'Calc'"),
    ("tools:\n  - class_name: a.B\n    config: {type: mcp}\n", "tools[0].config.type: only native tools are supported"),
    ("tools:\n  - class_name: a.B\n    config: [1]\n", "tools[0].config: expected a mapping, got [1]"),
    ("tools:\n  - class_name: a.B\n    tool_schema: {type: object}\n", "tools[0].tool_schema: expected {type: function"),
    ("tools:\n  - class_name: a.B\n    tool_schema: {type: function, function: {description: d}}\n",
     "tools[0].tool_schema.function.name: expected the tool's name (a string), got None"),
    ("tools:\n  - class_name: a.B\n    tool_schema: {type: function, function: {name: f, parameters: {type: object, "
     "properties: {x: {type: string}}, required: [y]}}}\n",
     "tools[0].tool_schema.function.parameters.required: expected a list of names from properties, got ['y']"),
    ("tools:\n  - class_name: a.B\n    tool_schema: {type: function, function: {name: f}}\n"
     "  - class_name: a.C\n    tool_schema: {type: function, function: {name: f}}\n",
     "tools[1].tool_schema.function.name: 'f' is already tools[0]'s"),
])
def test_bad_tool_configs_name_file_entry_and_field(tmp_path, text, fragment):
    p = tmp_path / "tools.yaml"
    p.write_text(text)
    with pytest.raises(ToolConfigError) as ei:
        read_tool_config(p)
    assert str(ei.value).startswith(f"{p}: ") and fragment in str(ei.value), str(ei.value)


@pytest.fixture
def user_tools(tmp_path, monkeypatch):
    """A user's tool module on sys.path: a megappo Tool, a verl-style async class, a broken one."""
    (tmp_path / "my_tools.py").write_text(textwrap.dedent('''
        from megappo.tools import Tool

        class Counter(Tool):
            def __init__(self, config, tool_schema):
                super().__init__(config, tool_schema)
                self.state = {}
            def create(self, instance_id=None, start=0, **kwargs):
                self.state[instance_id] = start
                return instance_id
            def execute(self, instance_id, parameters, **kwargs):
                self.state[instance_id] += parameters["by"]
                return str(self.state[instance_id]), 0.1, {}

        class Resp:
            def __init__(self, text): self.text = text

        class AsyncEcho:                     # verl's BaseTool shape: async methods, a ToolResponse-like result
            def __init__(self, config, tool_schema):
                self.config, self.tool_schema, self.name = config, tool_schema, tool_schema["function"]["name"]
            async def create(self, instance_id=None, **kwargs):
                return instance_id, Resp("")
            async def execute(self, instance_id, parameters, **kwargs):
                return Resp("echo " + parameters["s"]), 0.0, {}

        class Broken(Tool):
            def __init__(self, config, tool_schema):
                raise RuntimeError("no licence")
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for m in ("my_tools",):
        sys.modules.pop(m, None)


def _entry(cls, name, props="{by: {type: integer}}"):
    return (f"  - class_name: my_tools.{cls}\n    config: {{type: native, scale: 2}}\n    tool_schema: {{type: function, "
            f"function: {{name: {name}, description: d, parameters: {{type: object, properties: {props}}}}}}}\n")


def test_tool_classes_are_imported_by_dotted_path(user_tools):
    p = user_tools / "tools.yaml"
    p.write_text("tools:\n" + _entry("Counter", "count") + _entry("AsyncEcho", "echo", "{s: {type: string}}"))
    tools = load_tools(str(p))
    assert list(tools) == ["count", "echo"]
    count = tools["count"]
    assert isinstance(count, Tool) and count.config == {"type": "native", "scale": 2}
    iid = count.create("s0", start=5)
    assert count.execute(iid, {"by": 2}) == ("7", 0.1, {}) and count.execute(iid, {"by": 1})[0] == "8"
    assert normalise_result(tools["echo"].execute("i", {"s": "hi"})) == ("echo hi", 0.0, {})


@pytest.mark.parametrize("cls, fragment", [
    ("Missing", "tools[0].class_name: module 'my_tools' has no 'Missing'"),
    ("Broken", "tools[0]: my_tools.Broken(config=..., tool_schema=...) failed: RuntimeError: no licence"),
])
def test_tool_class_errors_name_the_entry(user_tools, cls, fragment):
    p = user_tools / "tools.yaml"
    p.write_text("tools:\n" + _entry(cls, "t"))
    with pytest.raises(ToolConfigError) as ei:
        tools_from_config(p)
    assert fragment in str(ei.value), str(ei.value)


def test_function_tool_files_and_name_collisions(user_tools):
    f = user_tools / "fn_tools.py"
    f.write_text(textwrap.dedent('''
        from megappo.tools import function_tool

        @function_tool
        def count(by: int) -> str:
            """Count up.

            Args:
                by: step
            """
            return str(by)

        def helper(x):
            return x
    '''))
    (tool,) = tools_from_file(f)
    assert isinstance(tool, FunctionTool) and tool.name == "count" and tool.execute("i", {"by": 3}) == ("3", 0.0, {})
    p = user_tools / "tools.yaml"
    p.write_text("tools:\n" + _entry("Counter", "count"))
    with pytest.raises(ToolConfigError, match="tool name 'count' is defined twice"):
        load_tools(str(p), str(f))
    empty = user_tools / "none.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ToolConfigError, match="no function is decorated with @megappo.tools.function_tool"):
        tools_from_file(empty)
    bad = user_tools / "bad.py"
    bad.write_text("import no_such_module_here\n")
    with pytest.raises(ToolConfigError, match="importing it failed: ModuleNotFoundError"):
        tools_from_file(bad)


def test_tools_kwargs_of_verl_rows_through_parquet(tmp_path):
    """verl's GSM8K tool rows (examples/data_preprocess/gsm8k_multiturn_w_tool.py), written and read
    back as parquet: rows naming different tools come back with the others as null."""
    import pandas as pd

    from megappo.tools import tools_kwargs_of

    rows = [{"extra_info": {"index": 0, "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}},
            {"extra_info": {"index": 1, "tools_kwargs": {"lookup": {"create_kwargs": {"table": "t1"}}}}},
            {"extra_info": {"index": 2}}]
    pd.DataFrame(rows).to_parquet(tmp_path / "t.parquet")
    back = pd.read_parquet(tmp_path / "t.parquet").to_dict("records")
    assert back[0]["extra_info"]["tools_kwargs"]["lookup"] is None          # what parquet does
    got = [tools_kwargs_of(r["extra_info"]) for r in back]
    assert got == [{"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}},
                   {"lookup": {"create_kwargs": {"table": "t1"}}}, {}]
    assert tools_kwargs_of(None) == {}
    with pytest.raises(ToolConfigError, match=r"row 3: extra_info.tools_kwargs.calc.create_kwargs: expected a mapping"):
        tools_kwargs_of({"tools_kwargs": {"calc": {"create_kwargs": [1]}}}, "row 3")
    with pytest.raises(ToolConfigError, match=r"row: extra_info.tools_kwargs: expected a mapping tool"):
        tools_kwargs_of({"tools_kwargs": "calc"})
    with pytest.raises(ToolConfigError, match=r"extra_info.tools_kwargs.calc: expected a mapping with create_kwargs"):
        tools_kwargs_of({"tools_kwargs": {"calc": 3}})

