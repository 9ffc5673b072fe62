"""Tool calling: the tool registry, the strict tool-call parser, ToolEnvironment in-process and as a
Ray actor, and the procedurally generated tool tasks (whose reference conversations must replay
through the environment to reward 1.0)."""

from __future__ import annotations

import json
import threading
import time
from typing import Optional

import pytest

from nemo_like.environments import tools as tools_mod
from nemo_like.environments.tool_environment import (
    ToolEnvironment,
    answers_match,
    extract_tool_answer,
    format_tool_call,
    parse_tool_calls,
)
from nemo_like.environments.tools import (
    TOOL_REGISTRY,
    derive_parameters,
    get_tool,
    register_tool,
    registered_tools,
    tool,
    tool_schemas,
    unregister_tool,
    validate_arguments,
)


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content) -> dict:
    return {"role": "assistant", "content": content}


def call(name: str, **arguments) -> str:
    return format_tool_call(name, arguments)


# =============================================================================== parser
def test_no_tool_call_is_a_final_answer() -> None:
    assert parse_tool_calls("\\boxed{148}") == ([], None)
    assert parse_tool_calls("") == ([], None)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name":"mul","arguments":{"a":37,"b":4}}</tool_call>',
        'let me compute <tool_call>\n{"name": "mul", "arguments": {"a": 37, "b": 4}}\n</tool_call> ok',
    ],
)
def test_parse_valid_call(text: str) -> None:
    assert parse_tool_calls(text) == ([{"name": "mul", "arguments": {"a": 37, "b": 4}}], None)


def test_parse_multiple_calls_and_nested_braces() -> None:
    text = (
        '<tool_call>{"name":"a","arguments":{"x":{"y":{"z":[1,{"w":"}{"}]}}}}</tool_call>'
        ' and <tool_call>{"name":"b","arguments":{}}</tool_call>'
    )
    calls, err = parse_tool_calls(text)
    assert err is None
    assert calls == [{"name": "a", "arguments": {"x": {"y": {"z": [1, {"w": "}{"}]}}}},
                     {"name": "b", "arguments": {}}]


@pytest.mark.parametrize(
    "text, match",
    [
        ('<tool_call>{"name":"mul","arguments":{"a":1,"b":2}}', "not closed"),
        ('{"name":"mul","arguments":{}}</tool_call>', "without a matching"),
        ('<tool_call>{"name":"a","arguments":{}}</tool_call></tool_call>', "without a matching"),
        ('<tool_call><tool_call>{"name":"a","arguments":{}}</tool_call>', "not closed before"),
        ('<tool_call>{"name":"mul","arguments":{"a":1,}}</tool_call>', "not valid JSON"),
        ("<tool_call>{'name':'mul','arguments':{}}</tool_call>", "not valid JSON"),
        ('<tool_call>{"name":"mul","arguments":[1,2]}</tool_call>', "'arguments' must be a JSON object"),
        ('<tool_call>{"name":"mul","arguments":"{\\"a\\":1}"}</tool_call>', "'arguments' must be a JSON object"),
        ('<tool_call>{"name":5,"arguments":{}}</tool_call>', "'name' must be a non-empty string"),
        ('<tool_call>{"name":"mul"}</tool_call>', "missing 'arguments'"),
        ('<tool_call>{"name":"a","arguments":{},"id":1}</tool_call>', "unexpected keys"),
        ('<tool_call>{"name":"a","arguments":{"x":1,"x":2}}</tool_call>', "duplicate key"),
        ('<tool_call>{"name":"a","arguments":{"x":NaN}}</tool_call>', "NaN"),
        ('<tool_call>["mul",{"a":1}]</tool_call>', "must be a JSON object"),
        ("<tool_call>  </tool_call>", "empty"),
        ('<tool_call>{"name":"a","arguments":{"x":' + "9" * 5000 + "}}</tool_call>", "not valid JSON"),
    ],
)
def test_parse_malformed(text: str, match: str) -> None:
    calls, err = parse_tool_calls(text)
    assert calls == [] and err is not None
    assert match in err


def test_parse_non_string_never_raises() -> None:
    for bad in (None, 5, b"<tool_call>", ["<tool_call>"]):
        calls, err = parse_tool_calls(bad)
        assert calls == [] and "not a string" in err


def test_parse_too_many_calls() -> None:
    one = '<tool_call>{"name":"a","arguments":{}}</tool_call>'
    assert len(parse_tool_calls(one * 3, max_calls=3)[0]) == 3
    calls, err = parse_tool_calls(one * 4, max_calls=3)
    assert calls == [] and "more than 3" in err


def test_parse_hostile_input_is_fast() -> None:
    mb = 1 << 20
    cases = [
        "x" * mb,  # no tags at all: a final answer
        "<tool_call>" + "{" * mb,  # unclosed
        "<tool_call>" * (mb // 11),  # a megabyte of openers
        "</tool_call>" * (mb // 12),
        '<tool_call>{"name":"a","arguments":' + "[" * mb + "]" * mb + "}</tool_call>",
    ]
    for text in cases:
        t0 = time.perf_counter()
        calls, err = parse_tool_calls(text, max_chars=10 * mb)
        assert time.perf_counter() - t0 < 2.0
        assert calls == []
        assert (err is None) == (text == cases[0])
    # Deep nesting within the size limits is refused before json.loads can recurse.
    def nested(depth: int) -> str:
        return '<tool_call>{"name":"a","arguments":{"x":' + "[" * depth + "]" * depth + "}}</tool_call>"

    assert "nests deeper than 32" in parse_tool_calls(nested(3000))[1]
    assert parse_tool_calls(nested(30)) == ([{"name": "a", "arguments": {"x": json.loads("[" * 30 + "]" * 30)}}], None)
    assert "is longer than 8192" in parse_tool_calls(nested(5000))[1]
    # Default size limit: a megabyte message with a tag is refused outright.
    assert "longer than" in parse_tool_calls("<tool_call>" + "a" * mb)[1]
    big_block = '<tool_call>{"name":"a","arguments":{"s":"' + "a" * 20_000 + '"}}</tool_call>'
    assert "longer than" in parse_tool_calls(big_block)[1]


# ===================================================================== answer extraction
@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{148}", "148"),
        ("so \\boxed{1} no wait \\boxed{ 148 }", " 148 "),
        ("  148\n", "148"),
        ("148<|im_end|>\n", "148"),
        ("\\boxed{148", None),  # the last box decides, even unclosed
        ("\\boxed{{1}{2}}", "{1}{2}"),
        ("\\boxed{" + "1" * 300 + "}", None),
    ],
)
def test_extract_tool_answer(text: str, expected) -> None:
    assert extract_tool_answer(text) == expected


@pytest.mark.parametrize(
    "answer, truth, ok",
    [
        ("148", "148", True),
        ("148.0", "148", True),
        ("+148", "148", True),
        (" 1  2 ", "1 2", True),
        ("147", "148", False),
        ("1e2", "100", False),  # no exponents: plain decimals only
        ("Zorb", "zorb", False),
        ("", "", False),
        (None, "1", False),
        ("9" * 300, "9" * 300, False),
    ],
)
def test_answers_match(answer, truth, ok) -> None:
    assert answers_match(answer, truth) is ok


# ============================================================================== registry
def test_builtin_tools_and_schemas() -> None:
    assert {"add", "mul", "lookup"} <= set(registered_tools())
    assert get_tool("add").fn(a=2, b=3) == 5 and get_tool("mul").fn(a=37, b=4) == 148
    assert get_tool("lookup").fn(key="apple") == tools_mod.LOOKUP_TABLE["apple"]
    with pytest.raises(KeyError, match="no entry"):
        get_tool("lookup").fn(key="unobtainium")
    schemas = tool_schemas(["mul", "lookup"])
    assert [s["function"]["name"] for s in schemas] == ["mul", "lookup"]
    for s in schemas:
        assert s["type"] == "function" and set(s["function"]) == {"name", "description", "parameters"}
        assert s["function"]["description"]
        assert s["function"]["parameters"]["type"] == "object"
    assert schemas[1]["function"]["parameters"]["properties"]["key"]["type"] == "string"
    assert schemas[1]["function"]["parameters"]["required"] == ["key"]
    json.dumps(schemas)  # plain JSON
    with pytest.raises(KeyError, match=r"unknown tool 'nope'.*registered: \[.*'add'"):
        tool_schemas(["nope"])


def test_schema_derivation_from_hints_and_docstring() -> None:
    def fancy(n: int, x: float, s: str, flag: bool, items: list, ids: list[int], maybe: Optional[str] = None,  # noqa: UP045 - Optional[T] itself is under test
              scale: float = 1.0) -> str:
        """Do a fancy thing.

        More details that are not part of the description.

        Args:
            n: how many
            x (float): a number which has a
                long description
            s: the text
            flag: whether to

        Returns:
            something
        """
        return s

    desc, params = derive_parameters(fancy)
    assert desc == "Do a fancy thing."
    props = params["properties"]
    assert {k: v["type"] for k, v in props.items()} == {
        "n": "integer", "x": "number", "s": "string", "flag": "boolean", "items": "array", "ids": "array",
        "maybe": ["string", "null"], "scale": "number",
    }
    assert props["ids"]["items"] == {"type": "integer"}
    assert props["n"]["description"] == "how many"
    assert props["x"]["description"] == "a number which has a long description"
    assert "description" not in props["items"]
    assert params["required"] == ["n", "x", "s", "flag", "items", "ids"]
    assert params["additionalProperties"] is False

    def sphinx(a: int) -> int:
        """Sphinx style.

        :param a: the value
        :returns: it
        """
        return a

    assert derive_parameters(sphinx)[1]["properties"]["a"]["description"] == "the value"


def test_schema_derivation_errors() -> None:
    def no_hint(a):
        return a

    def bad_hint(a: set) -> None: ...

    def var(*args: int) -> None: ...

    with pytest.raises(TypeError, match="'a': missing type hint"):
        derive_parameters(no_hint)
    with pytest.raises(TypeError, match="unsupported type hint"):
        derive_parameters(bad_hint)
    with pytest.raises(TypeError, match=r"\*args"):
        derive_parameters(var)


@pytest.fixture
def scratch_tools():
    """Names registered by a test are removed afterwards."""
    before = set(registered_tools())
    yield
    for name in set(registered_tools()) - before:
        unregister_tool(name)


def test_decorator_and_explicit_registration(scratch_tools) -> None:
    @tool(name="nl_t_concat", description="Join two strings.")
    def concat(a: str, b: str = "") -> str:
        return a + b

    assert concat("x", "y") == "xy"  # still a plain function
    t = get_tool("nl_t_concat")
    assert t is concat.__tool__ and t.description == "Join two strings."
    assert t.parameters["required"] == ["a"]

    @tool
    def nl_t_bare(x: int) -> int:
        """Identity."""
        return x

    assert get_tool("nl_t_bare").description == "Identity."

    def shout(text):
        return text.upper()

    params = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 5}}, "required": ["text"]}
    register_tool(shout, "nl_t_shout", "Upper-case.", params)
    assert tool_schemas(["nl_t_shout"])[0]["function"]["parameters"] == params
    register_tool(shout, "nl_t_shout", "Upper-case.", params)  # same again: no-op
    with pytest.raises(ValueError, match="already registered"):  # same schema, another function
        register_tool(lambda text: text.upper(), "nl_t_shout", "Upper-case.", params)
    with TOOL_REGISTRY.isolated():
        with pytest.raises(TypeError, match="expected a Tool"):
            TOOL_REGISTRY.register("nl_t_raw", shout)
        with pytest.raises(ValueError, match="named 'add'"):
            TOOL_REGISTRY.register("nl_t_alias", get_tool("add"))
    with pytest.raises(ValueError, match="already registered"):
        register_tool(lambda text: text, "nl_t_shout", "Other.", params)
    register_tool(lambda text: text, "nl_t_shout", "Other.", params, overwrite=True)
    with pytest.raises(ValueError, match="not parameters of the function"):
        register_tool(shout, "nl_t_bad", "x", {"type": "object", "properties": {"nope": {"type": "string"}}})
    with pytest.raises(ValueError, match="missing from the schema"):
        register_tool(shout, "nl_t_bad", "x", {"type": "object", "properties": {}})
    with pytest.raises(ValueError, match="type"):
        register_tool(shout, "nl_t_bad", "x", {"type": "object", "properties": {"text": {"type": "str"}}})
    with pytest.raises(ValueError, match="tool name"):
        register_tool(shout, "bad name!", "x", params)


@pytest.mark.parametrize(
    "args, error",
    [
        ({"a": 1, "b": 2}, None),
        ({"a": 1}, "missing argument 'b'"),
        ({"a": 1, "b": 2, "c": 3}, "unexpected argument 'c'"),
        ({"a": "1", "b": 2}, "argument 'a' must be integer, got string"),
        ({"a": 1.0, "b": 2}, "argument 'a' must be integer, got number"),
        ({"a": True, "b": 2}, "argument 'a' must be integer, got boolean"),
        ({"a": 10**12, "b": 2}, "argument 'a' must be <="),
        ([1, 2], "arguments must be an object"),
    ],
)
def test_validate_arguments(args, error) -> None:
    err = validate_arguments(args, get_tool("add").parameters)
    assert err == error if error is None else error in err


def test_schemas_render_through_a_chat_template_with_tools() -> None:
    from nemo_like.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = (
        "{%- if tools -%}<tools>{%- for t in tools -%}{{ t['function']['name'] }};{%- endfor -%}</tools>{%- endif -%}"
        "{%- for m in messages -%}[{{ m['role'] }}]{{ m['content'] }}{%- endfor -%}"
    )
    text = tok.apply_chat_template([user("37*4=?")], tools=tool_schemas(["add", "mul"]), tokenize=False)
    assert text == "<tools>add;mul;</tools>[user]37*4=?"


# ============================================================================ environment
def nl_t_boom(x: int) -> int:
    """Always fails."""
    raise RuntimeError("kaboom")


def nl_t_sleep(seconds: float) -> float:
    """Sleeps."""
    time.sleep(seconds)
    return seconds


def nl_t_nan() -> float:
    """Not JSON."""
    return float("nan")


@pytest.fixture(scope="module")
def test_tools():
    for fn in (nl_t_boom, nl_t_sleep, nl_t_nan):
        register_tool(fn)
    yield
    for fn in (nl_t_boom, nl_t_sleep, nl_t_nan):
        unregister_tool(fn.__name__)


ENV_TOOLS = ["add", "mul", "lookup", "nl_t_boom", "nl_t_sleep", "nl_t_nan"]


@pytest.fixture(scope="module")
def env(test_tools):
    return ToolEnvironment({"tools": ENV_TOOLS, "timeout_s": 0.5, "max_turns": 3})


def step1(env: ToolEnvironment, log: list[dict], meta: dict | None):
    return env.step([log], [meta])


def test_full_conversation(env: ToolEnvironment) -> None:
    meta = {"ground_truth": "148"}
    log = [user("37*4=?"), assistant(call("mul", a=37, b=4))]
    ret = step1(env, log, meta)
    assert ret.observations == [{"role": "tool", "content": "<tool_response>148</tool_response>"}]
    assert ret.rewards.tolist() == [0.0] and ret.terminateds.tolist() == [False]
    assert ret.next_stop_strings == [["</tool_call>"]]
    assert ret.metadata[0]["tool_calls"] == [{"name": "mul", "arguments": {"a": 37, "b": 4}, "ok": True}]
    assert ret.metadata[0]["ground_truth"] == "148" and "tool_calls" not in meta  # input not mutated
    assert ret.metrics["num_tool_calls"] == 1 and ret.metrics["num_tool_errors"] == 0
    assert ret.metrics["num_terminated"] == 0 and "accuracy" not in ret.metrics
    log = log + [ret.observations[0]]
    for answer, reward in (("\\boxed{148}", 1.0), ("The answer is \\boxed{148.0}.", 1.0), ("148", 1.0),
                           ("\\boxed{147}", 0.0), ("I don't know", 0.0)):
        done = step1(env, log + [assistant(answer)], ret.metadata[0])
        assert done.rewards.tolist() == [reward], answer
        assert done.terminateds.tolist() == [True] and done.next_stop_strings == [None]
        assert done.metrics["accuracy"] == reward and done.metrics["num_terminated"] == 1


def test_lookup_and_multiple_calls(env: ToolEnvironment) -> None:
    text = call("lookup", key="apple") + call("add", a=1, b=2) + call("lookup", key="nowhere") + call("add", a=1)
    ret = step1(env, [user("q"), assistant(text)], {"ground_truth": "3"})
    price = tools_mod.LOOKUP_TABLE["apple"]
    parts = ret.observations[0]["content"].split("\n")
    assert parts[:2] == [f"<tool_response>{price}</tool_response>", "<tool_response>3</tool_response>"]
    assert parts[2].startswith('<tool_response>{"error":"KeyError: no entry for')
    assert parts[3] == '<tool_response>{"error":"missing argument \'b\'"}</tool_response>'
    assert ret.metrics["num_tool_calls"] == 4 and ret.metrics["num_tool_errors"] == 2
    assert [(c["name"], c["ok"]) for c in ret.metadata[0]["tool_calls"]] == [
        ("lookup", True), ("add", True), ("lookup", False), ("add", False)]


@pytest.mark.parametrize(
    "text, match",
    [
        (call("divide", a=1, b=2), "unknown tool 'divide'; available: add, lookup, mul"),
        (call("mul", a="37", b=4), "argument 'a' must be integer, got string"),
        (call("mul", a=37), "missing argument 'b'"),
        (call("mul", a=37, b=4, c=1), "unexpected argument 'c'"),
        (call("nl_t_boom", x=1), "RuntimeError: kaboom"),
        (call("nl_t_nan"), "ValueError"),
    ],
)
def test_tool_errors_become_observations(env: ToolEnvironment, text: str, match: str) -> None:
    ret = step1(env, [user("q"), assistant(text)], {"ground_truth": "1"})
    content = ret.observations[0]["content"]
    assert ret.observations[0]["role"] == "tool"
    assert content.startswith("<tool_response>") and content.endswith("</tool_response>")
    assert match in json.loads(content[len("<tool_response>"): -len("</tool_response>")])["error"]
    assert ret.terminateds.tolist() == [False] and ret.rewards.tolist() == [0.0]
    assert ret.metrics["num_tool_errors"] == 1 and ret.metrics["num_failures"] == 0
    assert ret.metadata[0]["tool_calls"][0]["ok"] is False


def test_malformed_call_is_an_error_observation(env: ToolEnvironment) -> None:
    ret = step1(env, [user("q"), assistant('<tool_call>{"name":"mul","arguments":[37,4]}</tool_call>')],
                {"ground_truth": "148"})
    assert "malformed tool call" in ret.observations[0]["content"]
    assert ret.terminateds.tolist() == [False] and ret.next_stop_strings == [["</tool_call>"]]
    assert ret.metrics["num_malformed_calls"] == 1 and ret.metrics["num_tool_calls"] == 0


def test_hanging_tool_times_out_and_is_counted(test_tools) -> None:
    env = ToolEnvironment({"tools": ENV_TOOLS, "timeout_s": 0.3, "max_stuck_calls": 1})
    logs = [[user("q"), assistant(call("nl_t_sleep", seconds=1.5))], [user("q"), assistant(call("add", a=1, b=1))]]
    t0 = time.perf_counter()
    ret = env.step(logs, [{"ground_truth": "1"}, {"ground_truth": "2"}])
    assert time.perf_counter() - t0 < 1.2
    assert "timed out after 0.3 s" in ret.observations[0]["content"]
    assert ret.observations[1]["content"] == "<tool_response>2</tool_response>"
    assert ret.metrics["num_timeouts"] == 1 and ret.metrics["num_tool_errors"] == 1
    assert ret.terminateds.tolist() == [False, False]
    # The abandoned call is still running: the tool is unavailable until it returns.
    t0 = time.perf_counter()
    ret = env.step([[user("q"), assistant(call("nl_t_sleep", seconds=0.0))]], [None])
    assert time.perf_counter() - t0 < 0.2 and "unavailable" in ret.observations[0]["content"]
    time.sleep(1.4)
    ret = env.step([[user("q"), assistant(call("nl_t_sleep", seconds=0.0))]], [None])
    assert ret.observations[0]["content"] == "<tool_response>0.0</tool_response>"


@pytest.fixture
def hanging_tool():
    """A tool ``nl_t_hang(x)`` that blocks until the test ends (then its threads all return)."""
    release = threading.Event()

    def nl_t_hang(x: int) -> int:
        """Hangs."""
        release.wait(60)
        return x

    register_tool(nl_t_hang, overwrite=True)
    yield "nl_t_hang"
    release.set()
    for t in _tool_threads("nl_t_hang"):
        t.join(5)
    unregister_tool("nl_t_hang")


def _tool_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"tool-{name}" and t.is_alive()]


def test_a_tool_that_always_hangs_leaves_at_most_max_concurrent_calls_threads(hanging_tool) -> None:
    """Item 13: 32 samples x 2 calls to a tool that never returns, 4 steps: at most 8 threads are
    ever alive, and every step ends within 2 x timeout_s."""
    timeout = 0.3
    env = ToolEnvironment({"tools": ["nl_t_hang", "add"], "timeout_s": timeout, "max_concurrent_calls": 8,
                           "max_stuck_calls": 8})
    logs = [[user("q"), assistant(call("nl_t_hang", x=i) + call("nl_t_hang", x=-i))] for i in range(32)]
    for step in range(4):
        t0 = time.perf_counter()
        ret = env.step(logs, [{"ground_truth": "1"}] * 32)
        elapsed = time.perf_counter() - t0
        assert elapsed < 2 * timeout + 0.4, (step, elapsed)
        assert len(_tool_threads("nl_t_hang")) <= 8
        assert ret.metrics["num_tool_calls"] == 64 and ret.metrics["num_tool_errors"] == 64
        assert ret.metrics["num_timeouts"] == (8 if step == 0 else 0)
        assert ret.metrics["num_failures"] == 0 and ret.terminateds.tolist() == [False] * 32
        text = "".join(o["content"] for o in ret.observations)
        if step == 0:  # 8 ran and timed out; the other 56 waited for a slot, then found the tool stuck
            assert text.count("timed out after 0.3 s") == 8 and text.count("is unavailable: 8 earlier calls") == 56
        else:  # all 8 slots are held by the abandoned calls: failing at once, not waiting
            assert text.count("is unavailable: 8 earlier calls") == 64 and elapsed < timeout
    assert len(_tool_threads("nl_t_hang")) == 8


def test_a_hanging_tool_holds_only_its_share_and_other_tools_still_run(hanging_tool) -> None:
    env = ToolEnvironment({"tools": ["nl_t_hang", "add"], "timeout_s": 0.3, "max_concurrent_calls": 4,
                           "max_stuck_calls": 2})
    logs = [[user("q"), assistant(call("nl_t_hang", x=i) if i % 2 else call("add", a=i, b=1))] for i in range(32)]
    for _ in range(3):
        ret = env.step(logs, [{"ground_truth": "1"}] * 32)
        assert len(_tool_threads("nl_t_hang")) <= 2
        assert [o["content"] for o in ret.observations[::2]] == [f"<tool_response>{i + 1}</tool_response>"
                                                                 for i in range(0, 32, 2)]
        assert ret.metrics["num_tool_errors"] == 16
    # When abandoned calls hold every slot, another tool's call fails at once, saying how to get more.
    env = ToolEnvironment({"tools": ["nl_t_hang", "add"], "timeout_s": 0.3, "max_concurrent_calls": 2})
    env.step([[user("q"), assistant(call("nl_t_hang", x=1) + call("nl_t_hang", x=2))]], [None])
    t0 = time.perf_counter()
    ret = env.step([[user("q"), assistant(call("add", a=1, b=1))]], [None])
    assert time.perf_counter() - t0 < 0.2
    assert "tool call not run: 2 tool calls already running" in ret.observations[0]["content"]
    assert "max_concurrent_calls" in ret.observations[0]["content"]


def test_many_slow_calls_share_the_slots_and_all_finish() -> None:
    lock, state = threading.Lock(), {"now": 0, "peak": 0}

    def nl_t_slow(x: int) -> int:
        """Takes a while."""
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        time.sleep(0.05)
        with lock:
            state["now"] -= 1
        return x

    register_tool(nl_t_slow, overwrite=True)
    try:
        env = ToolEnvironment({"tools": ["nl_t_slow"], "timeout_s": 3.0, "max_concurrent_calls": 4})
        logs = [[user("q"), assistant(call("nl_t_slow", x=i))] for i in range(32)]
        ret = env.step(logs, [None] * 32)
        assert [o["content"] for o in ret.observations] == [f"<tool_response>{i}</tool_response>" for i in range(32)]
        assert ret.metrics["num_tool_errors"] == 0 and 1 <= state["peak"] <= 4
    finally:
        unregister_tool("nl_t_slow")


def test_turn_limit_terminates(env: ToolEnvironment) -> None:
    c = call("add", a=1, b=1)
    obs = {"role": "tool", "content": "<tool_response>2</tool_response>"}
    log = [user("q"), assistant(c), obs, assistant(c), obs]
    ret = step1(env, log, {"ground_truth": "2"})  # 2 assistant turns < max_turns 3
    assert ret.terminateds.tolist() == [False]
    ret = step1(env, log + [assistant(c)], {"ground_truth": "2"})  # the 3rd turn is a call again
    assert ret.terminateds.tolist() == [True] and ret.rewards.tolist() == [0.0]
    assert ret.metrics["num_turn_limit"] == 1 and ret.metrics["num_tool_calls"] == 0
    ret = step1(env, log + [assistant("\\boxed{2}")], {"ground_truth": "2"})  # a final answer still counts
    assert ret.rewards.tolist() == [1.0]


def test_require_tool_calls_gate() -> None:
    env = ToolEnvironment({"require_tool_calls": True})
    expected = json.dumps([{"name": "mul", "arguments": {"a": 37, "b": 4}}])
    answer = [user("37*4=?"), assistant("\\boxed{148}")]

    def final(made: list[dict], exp=expected, truth="148"):
        return env.step([answer], [{"ground_truth": truth, "expected_calls": exp, "tool_calls": made}])

    ok = {"name": "mul", "arguments": {"b": 4, "a": 37}, "ok": True}
    assert final([]).rewards.tolist() == [0.0]  # right answer, guessed without the tool
    assert final([ok]).rewards.tolist() == [1.0]
    assert final([{**ok, "arguments": {"a": 37, "b": 5}}, ok]).rewards.tolist() == [1.0]  # extra calls allowed
    assert final([{**ok, "ok": False}]).rewards.tolist() == [0.0]  # a failed call does not count
    assert final([{**ok, "arguments": {"a": 37.0, "b": 4}}]).rewards.tolist() == [0.0]  # exact JSON types
    assert final([ok], truth="149").rewards.tolist() == [0.0]  # a gate, not a bonus
    assert final([ok], exp=json.loads(expected)).rewards.tolist() == [1.0]  # a list works too
    bad = final([ok], exp="not json")
    assert bad.rewards.tolist() == [0.0] and bad.metrics["num_failures"] == 1
    # Through the environment: the call made in turn 1 is recorded in the metadata that flows to turn 2.
    meta = {"ground_truth": "148", "expected_calls": expected}
    ret = env.step([[user("37*4=?"), assistant(call("mul", a=37, b=4))]], [meta])
    log = [user("37*4=?"), assistant(call("mul", a=37, b=4)), ret.observations[0], assistant("\\boxed{148}")]
    assert env.step([log], ret.metadata).rewards.tolist() == [1.0]


def test_call_match_reward_is_partial_credit_that_never_makes_a_wrong_answer_accurate() -> None:
    env = ToolEnvironment({"call_match_reward": 0.25})
    expected = json.dumps([{"name": "mul", "arguments": {"a": 37, "b": 4}}])
    ok = {"name": "mul", "arguments": {"a": 37, "b": 4}, "ok": True}

    def final(answer: str, made: list[dict]):
        return env.step([[user("37*4=?"), assistant(answer)]],
                        [{"ground_truth": "148", "expected_calls": expected, "tool_calls": made}])

    rets = [final("\\boxed{148}", [ok]), final("\\boxed{149}", [ok]), final("\\boxed{148}", []),
            final("\\boxed{149}", [{**ok, "arguments": {"a": 37, "b": 5}}])]
    assert [r.rewards.item() for r in rets] == [1.25, 0.25, 1.0, 0.0]
    assert [r.metrics["num_correct"] for r in rets] == [1.0, 0.0, 1.0, 0.0]  # answers, not reward sums
    assert [r.observations[0]["content"] for r in rets[:2]] == ["Environment: correct", "Environment: incorrect"]
    gated = ToolEnvironment({"call_match_reward": 0.25, "require_tool_calls": True})
    ret = gated.step([[user("37*4=?"), assistant("\\boxed{148}")]],
                     [{"ground_truth": "148", "expected_calls": expected, "tool_calls": []}])
    assert ret.rewards.tolist() == [0.0] and ret.metrics["accuracy"] == 0.0


@pytest.mark.parametrize(
    "log, meta",
    [
        ("not a list", {"ground_truth": "1"}),
        ([user("q")], {"ground_truth": "1"}),  # no assistant message
        ([user("q"), "not a dict"], {"ground_truth": "1"}),
        ([user("q"), assistant(None)], {"ground_truth": "1"}),
        ([user("q"), assistant("\\boxed{1}")], None),  # no ground truth for a final answer
        ([user("q"), assistant("\\boxed{1}")], {"ground_truth": [1]}),
        ([user("q"), assistant(call("add", a=1, b=1))], "not a dict"),
    ],
)
def test_malformed_items_score_zero_and_count(env: ToolEnvironment, log, meta) -> None:
    good = [user("q"), assistant("\\boxed{2}")]
    ret = env.step([log, good], [meta, {"ground_truth": 2}])
    assert ret.rewards.tolist() == [0.0, 1.0] and ret.terminateds.tolist() == [True, True]
    assert ret.metrics["num_failures"] == 1 and ret.metrics["accuracy"] == 0.5


@pytest.mark.parametrize("logs, meta", [([], []), (None, None), ([], None), (5, 5)])
def test_degenerate_batches_never_raise(env: ToolEnvironment, logs, meta) -> None:
    ret = env.step(logs, meta)
    assert len(ret.rewards) == 0 and ret.metrics["num_terminated"] == 0
    assert "accuracy" not in ret.metrics  # undefined: no episode ended


def test_metadata_shorter_than_batch(env: ToolEnvironment) -> None:
    logs = [[user("q"), assistant(call("add", a=1, b=1))], [user("q"), assistant(call("add", a=2, b=2))]]
    ret = env.step(logs, [])  # tool calls need no ground truth
    assert [o["content"] for o in ret.observations] == ["<tool_response>2</tool_response>",
                                                        "<tool_response>4</tool_response>"]


@pytest.mark.parametrize(
    "config, match",
    [
        ({"tools": ["add", "nope"]}, r"env\.tool\.tools: unknown tool 'nope'"),
        ({"tools": "add"}, r"env\.tool\.tools: must be a non-empty list of tool names"),
        ({"tools": []}, r"env\.tool\.tools: must be a non-empty list of tool names"),
        ({"tools": ["no_such_module_xyz.fn"]}, "not importable"),
        ({"max_turns": 0}, r"env\.tool\.max_turns: Input should be greater than or equal to 1"),
        ({"max_turns": 2.5}, r"env\.tool\.max_turns: Input should be a valid integer"),
        ({"timeout_s": 0}, r"env\.tool\.timeout_s: Input should be greater than 0"),
        ({"timeout_s": True}, r"env\.tool\.timeout_s"),
        ({"timeout_s": float("inf")}, r"env\.tool\.timeout_s: Input should be a finite number"),
        ({"require_tool_calls": "yes"}, r"env\.tool\.require_tool_calls: Input should be a valid boolean"),
        ({"call_match_reward": 1.0}, r"env\.tool\.call_match_reward: must be a number in \[0, 1\)"),
        ({"call_match_reward": "0.5"}, r"env\.tool\.call_match_reward"),
        ({"max_calls_per_turn": -1}, r"env\.tool\.max_calls_per_turn"),
        ({"max_concurrent_calls": 0}, r"env\.tool\.max_concurrent_calls: Input should be greater than or equal to 1"),
        ({"max_concurrent_calls": "8"}, r"env\.tool\.max_concurrent_calls: Input should be a valid integer"),
        ({"call_latency_s": -1}, r"env\.tool\.call_latency_s: Input should be greater than or equal to 0"),
        ({"call_latency_s": 2.0}, r"call_latency_s \(2\) must be below timeout_s \(2\)"),
        ({"tool": ["add"]}, r"env\.tool\.tool: unknown config key \(did you mean env\.tool\.tools\?\)"),
    ],
)
def test_bad_config_raises_clear_error(config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ToolEnvironment(config)


def test_typed_config_keeps_the_defaults() -> None:
    from nemo_like.environments.tool_environment import ToolEnvConfig

    assert ToolEnvironment.config_model is ToolEnvConfig
    assert ToolEnvConfig().model_dump() == {
        "step_timeout_s": None, "tools": None, "max_turns": 4, "timeout_s": 2.0, "require_tool_calls": False,
        "call_match_reward": 0.0, "max_calls_per_turn": 4, "max_response_chars": 1000, "max_stuck_calls": 4,
        "max_concurrent_calls": 8, "call_latency_s": 0.0}
    env = ToolEnvironment({"timeout_s": 3, "step_timeout_s": 30.0})  # an int is a number; a trainer-side key
    assert env.timeout_s == 3.0 and "step_timeout_s" not in env.config


def test_config_defaults_and_import_path_tools() -> None:
    env = ToolEnvironment()
    assert sorted(env.tools) == ["add", "lookup", "mul"]
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["add", "mul", "lookup"]
    env = ToolEnvironment({"tools": ["nemo_like.environments.tools:mul"]})
    assert list(env.tools) == ["mul"]
    with pytest.raises(TypeError, match="dict"):
        ToolEnvironment(["add"])


# ================================================================================ tasks
@pytest.fixture(scope="module")
def task_splits():
    from nemo_like.data.tool_tasks import generate_tool_dataset

    return generate_tool_dataset("train", 600, seed=3), generate_tool_dataset("validation", 150, seed=3)


def test_task_generator_deterministic_and_disjoint(task_splits) -> None:
    from nemo_like.data.tool_tasks import generate_tool_dataset, tool_task_split_of

    train, val = task_splits
    assert generate_tool_dataset("train", 600, seed=3)[:] == train[:]
    assert generate_tool_dataset("train", 600, seed=4)["problem"] != train["problem"]
    assert set(train.column_names) >= {"problem", "ground_truth", "expected_calls", "task_name", "sft_messages"}
    assert set(train["task_name"]) == {"tool"} and set(train["kind"]) == {"add", "mul", "lookup"}
    assert not set(train["problem"]) & set(val["problem"])
    arith = [p for p, k in zip(train["problem"], train["kind"]) if k != "lookup"]
    assert len(set(arith)) == len(arith)  # no repeats while the split has unused questions

    def keys(ds):
        return {json.loads(c)[0]["arguments"]["key"] for c, k in zip(ds["expected_calls"], ds["kind"]) if k == "lookup"}

    assert keys(train) and keys(val) and not keys(train) & keys(val)
    assert {tool_task_split_of(p) for p in train["problem"]} == {"train"}
    assert {tool_task_split_of(p) for p in val["problem"]} == {"validation"}
    with pytest.raises(ValueError, match="kinds"):
        generate_tool_dataset("train", 5, seed=0, kinds=["div"])
    with pytest.raises(ValueError, match="split"):
        generate_tool_dataset("test", 5, seed=0)
    small = generate_tool_dataset("validation", 5, seed=0, kinds=["add"], max_value=9)
    assert all("+" in p for p in small["problem"])


def test_lookup_keys_are_many_and_generator_weights_reach_the_config() -> None:
    from nemo_like.data.datasets import DataError, DatasetConfig, load_dataset_from_config
    from nemo_like.data.tool_tasks import tool_task_split_of

    table = tools_mod.LOOKUP_TABLE
    assert len(table) == len(tools_mod.PRICES) + len(tools_mod.POPULATIONS) == 632  # no key in both
    assert all(k.isalpha() and k.islower() for k in table)
    assert all(1 <= tools_mod.PRICES[k] <= 99 for k in tools_mod.PRICES)
    # Enough held-out keys that validation measures copying an unseen key, not recall.
    held_out = [k for k in table if tool_task_split_of(f"price of {k}?") == "validation"]
    assert 100 < len(held_out) < 250
    cfg = DatasetConfig(task_name="tool", env_name="tool",
                        generator={"kind": "tool", "split": "train", "num_samples": 300, "seed": 0, "weights": [0, 1, 3]})
    kinds = load_dataset_from_config(cfg)["kind"]
    assert "add" not in kinds and 0.6 < kinds.count("lookup") / len(kinds) < 0.9
    bad = DatasetConfig(task_name="tool", env_name="tool",
                        generator={"kind": "tool", "split": "train", "num_samples": 3, "seed": 0, "weights": [1, 1]})
    with pytest.raises(DataError, match="weights must be 3"):
        load_dataset_from_config(bad)


def test_reference_conversations_replay_to_reward_one(task_splits) -> None:
    env = ToolEnvironment({"require_tool_calls": True})
    rows = list(task_splits[0].select(range(60))) + list(task_splits[1].select(range(30)))
    logs, metas = [], []
    for row in rows:
        msgs = json.loads(row["sft_messages"])
        assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
        assert msgs[0]["content"] == row["problem"]
        assert answers_match(extract_tool_answer(msgs[-1]["content"]), row["ground_truth"])
        assert parse_tool_calls(msgs[1]["content"]) == (json.loads(row["expected_calls"]), None)
        logs.append(msgs[:2])
        metas.append({"ground_truth": row["ground_truth"], "expected_calls": row["expected_calls"]})
    ret = env.step(logs, metas)
    assert ret.metrics["num_tool_errors"] == 0 and not ret.terminateds.any()
    for row, obs in zip(rows, ret.observations):
        assert obs == json.loads(row["sft_messages"])[2]  # exactly the reference tool message
    final_logs = [json.loads(row["sft_messages"]) for row in rows]
    done = env.step(final_logs, ret.metadata)
    assert done.rewards.tolist() == [1.0] * len(rows) and done.terminateds.all()


def test_tool_processors(task_splits) -> None:
    from nemo_like.data.interfaces import TaskDataSpec
    from nemo_like.data.tool_tasks import tool_data_processor, tool_sft_data_processor, tool_system_prompt
    from nemo_like.experience.rollouts import flatten_message_logs
    from nemo_like.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    assert tool_system_prompt() == "Tools: add(a:int,b:int) mul(a:int,b:int) lookup(key:str)"
    assert '"name": "lookup"' in tool_system_prompt(["lookup"], style="hermes")
    spec = TaskDataSpec(task_name="tool")
    rows = list(task_splits[0]) + list(task_splits[1])
    longest = 0
    for i, row in enumerate(rows):
        d = tool_sft_data_processor(row, spec, tok, 192, i)
        assert d["loss_multiplier"] == 1.0
        longest = max(longest, d["length"])
    assert longest <= 192
    d = tool_sft_data_processor(rows[0], spec, tok, 192, 0)
    msgs = json.loads(rows[0]["sft_messages"])
    assert [m["role"] for m in d["message_log"]] == ["user", "assistant", "tool", "assistant"]
    assert "".join(m["content"] for m in d["message_log"]) == tok.apply_chat_template(msgs, tokenize=False)
    assert d["message_log"][1]["content"] == msgs[1]["content"] + "<|im_end|>\n"
    assert d["message_log"][3]["content"] == msgs[3]["content"] + "<|im_end|>\n"
    flat = flatten_message_logs([d["message_log"]], tok.pad_token_id)
    trained = tok.decode(flat["input_ids"][0][flat["token_mask"][0].bool()].tolist())
    assert trained == msgs[1]["content"] + "<|im_end|>\n" + msgs[3]["content"] + "<|im_end|>\n"
    with_system = tool_sft_data_processor(rows[0], TaskDataSpec("tool", system_prompt=tool_system_prompt()), tok, 256, 0)
    assert with_system["message_log"][0]["content"].startswith("<|im_start|>system\nTools: add(")
    rl = tool_data_processor(rows[0], spec, tok, 192, 0)
    assert rl["stop_strings"] == ["</tool_call>"] and len(rl["message_log"]) == 1
    assert rl["message_log"][0]["content"].endswith("<|im_start|>assistant\n")
    assert rl["extra_env_info"] == {"ground_truth": rows[0]["ground_truth"],
                                    "expected_calls": json.loads(rows[0]["expected_calls"])}


# ================================================================================ on Ray
@pytest.fixture(scope="module")
def ray_cluster(ray_session):
    import ray

    return ray


def test_tool_env_as_ray_actor(ray_cluster) -> None:
    from nemo_like.environments.registry import create_env_actor

    ray = ray_cluster
    actor = create_env_actor("tool", {"timeout_s": 5.0, "max_turns": 3, "require_tool_calls": True})
    try:
        expected = json.dumps([{"name": "mul", "arguments": {"a": 37, "b": 4}}])
        metas = [{"ground_truth": "148", "expected_calls": expected}, {"ground_truth": "148", "expected_calls": expected}]
        logs = [[user("37*4=?"), assistant(call("mul", a=37, b=4))], [user("37*4=?"), assistant(call("div", a=1, b=1))]]
        ret = ray.get(actor.step.remote(logs, metas), timeout=120)
        assert ret.observations[0] == {"role": "tool", "content": "<tool_response>148</tool_response>"}
        assert "unknown tool 'div'" in ret.observations[1]["content"]
        assert ret.terminateds.tolist() == [False, False] and ret.next_stop_strings == [["</tool_call>"]] * 2
        assert ret.metrics["num_tool_calls"] == 2 and ret.metrics["num_tool_errors"] == 1
        logs = [log + [obs, assistant("\\boxed{148}")] for log, obs in zip(logs, ret.observations)]
        done = ray.get(actor.step.remote(logs, ret.metadata), timeout=120)
        # Both answers are right, but only the first made the expected call.
        assert done.rewards.tolist() == [1.0, 0.0] and done.terminateds.tolist() == [True, True]
        assert done.metrics["accuracy"] == 0.5
    finally:
        ray.kill(actor, no_restart=True)


def test_call_latency_delays_every_call_and_calls_wait_side_by_side() -> None:
    """A web API's round trip: every call waits call_latency_s, the calls of one step at once."""
    env = ToolEnvironment({"tools": ["add"], "timeout_s": 2.0, "call_latency_s": 0.4, "max_concurrent_calls": 16,
                           "max_stuck_calls": 16})
    logs = [[user(f"{i}+1=?"), assistant(call("add", a=i, b=1))] for i in range(12)]
    t0 = time.monotonic()
    ret = env.step(logs, [{"ground_truth": str(i + 1)} for i in range(12)])
    took = time.monotonic() - t0
    assert [o["content"] for o in ret.observations] == [f"<tool_response>{i + 1}</tool_response>" for i in range(12)]
    assert 0.4 <= took < 1.2, took  # one wait for all twelve, not twelve waits
    plain = ToolEnvironment({"tools": ["add"], "timeout_s": 2.0})
    t0 = time.monotonic()
    plain.step(logs[:1], [{"ground_truth": "1"}])
    assert time.monotonic() - t0 < 0.3


def test_steps_running_at_once_share_the_slots_instead_of_failing() -> None:
    """The actor runs max_concurrent_steps calls on threads: a step whose tool is busy with another
    step's (live, not abandoned) calls waits for a slot; the calls are not failed."""
    import threading

    assert ToolEnvironment.max_concurrent_steps > 1
    env = ToolEnvironment({"tools": ["add"], "timeout_s": 2.0, "call_latency_s": 0.3, "max_concurrent_calls": 8,
                           "max_stuck_calls": 4})
    logs = [[user(f"{i}+1=?"), assistant(call("add", a=i, b=1))] for i in range(4)]
    rets = [None, None]

    def run(j: int) -> None:
        rets[j] = env.step(logs, [{"ground_truth": str(i + 1)} for i in range(4)])

    threads = [threading.Thread(target=run, args=(j,)) for j in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - t0
    for ret in rets:  # 8 calls of one tool, 4 at a time: the second four waited for the first
        assert [o["content"] for o in ret.observations] == [f"<tool_response>{i + 1}</tool_response>" for i in range(4)]
        assert ret.metrics["num_tool_errors"] == 0
    assert 0.6 <= took < 1.5, took
