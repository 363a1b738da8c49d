"""A tool's failures as the model and the run see them: an error the model reads (raise, hang, unknown name, bad
arguments), or a ToolError naming the tool that ended its worker thread; and TRL's environment contract."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import threading
import time

import agent_tools
import pytest
from liveness import returns_within

from asyncgrpo.errors import ConfigError, ToolError
from asyncgrpo.objects import reference
from asyncgrpo.rollout import tool_process
from asyncgrpo.rollout import tools as tools_module
from asyncgrpo.rollout.tool_guard import HungTools
from asyncgrpo.rollout.tools import (ToolResult, call_tool, environment_class, environment_tools,
                                     load_environment_factory, load_ref, load_tools, render_result, run_tool_calls,
                                     tool_schema)

TOOLS = {"lookup": agent_tools.lookup, "add": agent_tools.add, "hang": agent_tools.hang, "leave": agent_tools.leave,
         "spin": agent_tools.spin, "run_child": agent_tools.run_child, "loud": agent_tools.loud,
         "process_id": agent_tools.process_id, "meet": agent_tools.meet}


def tool_threads(name: str) -> list[threading.Thread]:
    """The threads of calls of tool `name` still alive (other tests leave `hang` calls blocked for a while)."""
    return [t for t in threading.enumerate() if t.name == f"tool-{name}" and t.is_alive()]


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_tool_result_is_its_text_and_a_non_text_result_is_json():
    assert call_tool(TOOLS, "lookup", {"key": "a"}, 5.0).content == "b"
    result = call_tool(TOOLS, "add", {"x": 2, "y": 3}, 5.0)  # async: run to completion on its worker thread
    assert json.loads(result.content) == {"sum": 5} and not result.error


def test_a_raising_tool_returns_its_error_to_the_model_and_is_counted_as_an_error():
    result = call_tool(TOOLS, "lookup", {"key": "zz"}, 5.0)
    assert result.error
    assert json.loads(result.content) == {"error": "KeyError: 'zz'"}


def test_a_hanging_tool_is_cut_off_at_the_timeout_and_the_message_says_so():
    agent_tools.RELEASE = threading.Event()  # unset: an earlier test may have released the last one
    try:
        t0 = time.monotonic()
        result = call_tool(TOOLS, "hang", {"seconds": 60}, 0.2)
        took = time.monotonic() - t0
        assert result.error and result.timed_out and result.name == "hang"
        # Event.wait blocks in C, where the exception that stops a tool cannot land: its thread goes on, and says so
        assert json.loads(result.content)["error"] == ("tool hang did not finish within tool_timeout=0.2 s and was "
                                                       "stopped but its thread is blocked and goes on")
        assert 0.2 <= result.seconds <= took
    finally:
        agent_tools.RELEASE.set()  # its abandoned thread ends now


def test_a_hung_tool_is_left_on_a_daemon_thread_that_cannot_keep_the_process_alive():
    agent_tools.RELEASE = threading.Event()
    before = set(threading.enumerate())
    try:
        assert call_tool(TOOLS, "hang", {"seconds": 60}, 0.05).error
        abandoned = set(threading.enumerate()) - before  # the hung call's thread, still waiting
        assert [(t.name, t.daemon) for t in abandoned] == [("tool-hang", True)]  # exits without waiting for it
    finally:
        agent_tools.RELEASE.set()


def test_a_tool_that_ends_its_worker_thread_stops_the_episode_naming_the_tool():
    with pytest.raises(ToolError, match=r"tool leave ended its worker thread with SystemExit: SystemExit\(3\)"):
        run_tool_calls(TOOLS, [("lookup", {"key": "a"}), ("leave", {"code": 3})], 5.0)


def test_an_unknown_tool_or_arguments_that_are_not_an_object_are_errors_the_model_reads():
    unknown = call_tool(TOOLS, "search", {}, 1.0)
    assert unknown.error and "no tool named 'search'" in unknown.content
    assert call_tool(TOOLS, "lookup", "a", 1.0).error


def test_several_calls_of_one_turn_come_back_in_call_order():
    results = run_tool_calls(TOOLS, [("lookup", {"key": "b"}), ("lookup", {"key": "a"})], 5.0)
    assert [r.content for r in results] == ["c", "b"]


def test_tools_load_by_reference_and_one_without_a_docstring_is_refused_naming_the_fix():
    assert load_tools(["agent_tools:lookup"]) == [agent_tools.lookup]
    with pytest.raises(ConfigError, match="Google docstring"):
        load_tools(["agent_tools:no_docstring"])
    with pytest.raises(ConfigError, match="has no 'nope'"):
        load_tools(["agent_tools:nope"])


def test_an_environments_tools_are_its_public_methods_but_reset_and_get_reward():
    factory = load_environment_factory("agent_tools:Counter")
    env = factory()
    tools = environment_tools(env)
    assert [t.__name__ for t in tools] == ["increment"]
    assert tools[0](2) == 2 and env.count == 2  # bound to that instance
    with pytest.raises(ConfigError, match="reset"):
        load_environment_factory("agent_tools:NoReset")
    assert load_environment_factory("agent_tools:make_counter") is agent_tools.make_counter  # any callable (TRL)


def test_an_environments_tools_are_the_public_methods_of_the_instance_as_trl_finds_them():
    env = agent_tools.Workshop()
    tools = {t.__name__: t for t in environment_tools(env)}
    assert sorted(tools) == ["catalogue", "measure", "saw"]  # not helper (static), reset, get_reward or close
    assert tools["measure"]("door") == "door: 3" and tools["catalogue"]() == "chairs"  # bound: no self to pass
    assert [tool_schema(t)["function"]["name"] for t in environment_tools(env)] == ["catalogue", "measure", "saw"]


def test_an_unknown_tool_and_arguments_that_are_not_an_object_answer_at_once_naming_what_is_wrong():
    tools = {"lookup": agent_tools.lookup, "add": agent_tools.add}
    assert call_tool(tools, "search", {}, 1.0) == ToolResult(
        "search", json.dumps({"error": "no tool named 'search'; tools: ['add', 'lookup']"}), True, 0.0)
    assert call_tool(tools, "lookup", ["a"], 1.0) == ToolResult(
        "lookup", json.dumps({"error": "arguments of lookup must be an object, got ['a']"}), True, 0.0)


def test_a_tool_result_names_its_tool_and_the_seconds_it_took_are_those_of_the_call():
    t0 = time.monotonic()
    ok = call_tool(TOOLS, "lookup", {"key": "b"}, 5.0)
    raised = call_tool(TOOLS, "lookup", {"key": "zz"}, 5.0)
    took = time.monotonic() - t0
    assert (ok.name, ok.content, ok.error) == ("lookup", "c", False)
    assert (raised.name, raised.error) == ("lookup", True)
    assert 0.0 < ok.seconds and 0.0 < raised.seconds and ok.seconds + raised.seconds <= took  # a thread: never 0


def test_a_non_text_result_keeps_its_unicode_and_one_json_cannot_write_is_its_str():
    assert render_result({"city": "Zürich"}) == '{"city": "Zürich"}'
    assert render_result({3}) == "{3}"
    assert render_result("as it is") == "as it is"


def test_a_reference_that_cannot_be_loaded_is_refused_naming_the_key_the_reference_and_the_fix():
    with pytest.raises(ConfigError) as error:
        load_tools(["no_such_module_for_tools:f"])
    assert error.value.field == "tools"
    assert "cannot import module 'no_such_module_for_tools'" in str(error.value)
    assert str(error.value).endswith(". Fix: make the module importable (installed, or on PYTHONPATH)")
    with pytest.raises(ConfigError) as error:
        load_tools(["agent_tools"])  # no ':' and no name after it
    assert error.value.field == "tools" and "'agent_tools' has no ''" in str(error.value)
    assert "check the name after ':' in 'agent_tools'" in str(error.value)
    with pytest.raises(ConfigError) as error:
        load_environment_factory("agent_tools:Nope")
    assert error.value.field == "environment_factory" and "'agent_tools' has no 'Nope'" in str(error.value)


def test_a_tool_that_is_not_a_function_or_has_no_schema_is_refused_under_tools():
    with pytest.raises(ConfigError) as error:
        load_tools(["agent_tools:TABLE"])
    assert error.value.field == "tools"
    assert "agent_tools:TABLE is dict, not a function. Fix: name a function" in str(error.value)
    with pytest.raises(ConfigError) as error:
        load_tools(["agent_tools:no_docstring"])
    assert error.value.field == "tools" and "no schema for tool 'no_docstring'" in str(error.value)
    assert str(error.value).endswith(". Fix: give every argument a type hint and a Google docstring with an `Args:` "
                                     "entry each (transformers.utils.get_json_schema)")


def test_a_tool_without_a_qualified_name_whose_schema_fails_is_named_by_its_repr():
    tool = functools.partial(agent_tools.no_docstring)  # a partial has no __qualname__
    with pytest.raises(ConfigError) as error:
        tool_schema(tool)
    assert error.value.field == "tools" and f"no schema for tool {tool!r}: " in str(error.value)


def test_an_environment_factory_without_reset_is_refused_naming_the_contract():
    for ref in ("agent_tools:NoReset", "agent_tools:TABLE"):
        with pytest.raises(ConfigError) as error:
            load_environment_factory(ref)
        assert error.value.field == "environment_factory"
        assert f"{ref} is neither a class with a reset(**row) method nor a function returning an instance" in \
            str(error.value)
        assert str(error.value).endswith(". Fix: name a class whose instances have reset(**row) and public tool "
                                         "methods, or a function taking no argument that returns one")


def test_a_hung_call_among_several_of_one_turn_is_cut_at_the_timeout_and_the_others_answer():
    agent_tools.RELEASE = threading.Event()
    try:
        results = returns_within(lambda: run_tool_calls(TOOLS, [("hang", {"seconds": 60}), ("lookup", {"key": "a"})],
                                                        0.2), 20.0, "two calls, one hanging")
    finally:
        agent_tools.RELEASE.set()
    assert results[0].error and "hang did not finish within tool_timeout=0.2 s" in results[0].content
    assert (results[1].content, results[1].error) == ("b", False)


def test_an_environments_tools_are_found_as_trl_finds_them_its_public_bound_methods():
    class Shop:
        def reset(self, **row):
            return None

        def buy(self, item: str) -> str:
            """Buy.

            Args:
                item: what to buy
            """
            return item

        @classmethod
        def catalogue(cls) -> str:
            """The catalogue."""
            return "all"

        @staticmethod
        def helper(x: int) -> int:
            """Not a tool in TRL: a staticmethod is no bound method.

            Args:
                x: a number
            """
            return x

        def _private(self) -> None:
            return None

    assert [t.__name__ for t in environment_tools(Shop())] == ["buy", "catalogue"]


def test_hung_calls_are_stopped_at_the_timeout_and_leave_no_thread_behind():
    for _ in range(20):
        result = call_tool(TOOLS, "spin", {"seconds": 60}, 0.05)
        assert result.timed_out and json.loads(result.content) == {
            "error": "tool spin did not finish within tool_timeout=0.05 s and was stopped"}
    assert tool_threads("spin") == []  # today's code left 20 threads looping


def test_a_hung_call_is_stopped_with_the_process_it_started():
    agent_tools.STARTED.clear()
    result = call_tool(TOOLS, "run_child", {"seconds": 300}, 0.3)
    assert result.timed_out and "was stopped" in result.content
    (pid,) = agent_tools.STARTED
    assert not running(pid) and tool_threads("run_child") == []


def test_arguments_that_do_not_match_the_schema_are_an_error_the_model_reads_and_the_tool_is_not_called():
    env = agent_tools.Workshop()
    tools = {t.__name__: t for t in environment_tools(env)}
    schemas = {name: tool_schema(t) for name, t in tools.items()}
    assert call_tool(tools, "saw", {"length": 3}, 5.0, schemas=schemas).content == "sawn 3"
    for arguments, problem in [({"length": "long"}, "length must be integer, got str 'long'"),
                               ({"length": True}, "length must be integer, got bool True"),
                               ({}, "arguments misses 'length' (required)"),
                               ({"length": 3, "width": 2}, "'width' is not an argument; the arguments are ['length']")]:
        result = call_tool(tools, "saw", arguments, 5.0, schemas=schemas)
        assert result.error and json.loads(result.content) == {"error": f"saw was not called: {problem}"}
    assert call_tool(tools, "saw", {"length": 3.0}, 5.0, schemas=schemas).content == "sawn 3.0"  # JSON's integer


def test_a_long_result_is_cut_at_max_chars_and_the_cut_says_so():
    result = call_tool(TOOLS, "loud", {"length": 1000}, 5.0, max_chars=100)
    assert result.content == "ab" * 50 + "\n[output cut: 1000 characters, the first 100 shown]" and not result.error
    assert call_tool(TOOLS, "loud", {"length": 100}, 5.0, max_chars=100).content == "ab" * 50  # at the cap: whole


def test_calls_past_max_calls_of_one_turn_are_not_run_and_each_says_why():
    agent_tools.STARTED.clear()
    calls = [("lookup", {"key": "a"}), ("lookup", {"key": "b"}), ("run_child", {"seconds": 0})]
    results = run_tool_calls(TOOLS, calls, 5.0, max_calls=2)
    assert [r.content for r in results[:2]] == ["b", "c"]
    assert results[2].error and results[2].name == "run_child" and json.loads(results[2].content) == {
        "error": "run_child was not called: at most 2 tool calls are run per turn (max_tool_calls_per_turn)"}
    assert agent_tools.STARTED == []


def test_a_tool_process_answers_like_the_tool_and_an_exception_is_an_error_the_model_reads():
    if tool_process.probe() is not None:
        pytest.skip(f"no user namespaces here: {tool_process.probe()}")
    refs = {"lookup": "agent_tools:lookup", "add": "agent_tools:add"}
    assert call_tool(TOOLS, "lookup", {"key": "a"}, 30.0, process_refs=refs).content == "b"
    assert json.loads(call_tool(TOOLS, "add", {"x": 2, "y": 3}, 30.0, process_refs=refs).content) == {"sum": 5}
    raised = call_tool(TOOLS, "lookup", {"key": "zz"}, 30.0, process_refs=refs)
    assert raised.error and json.loads(raised.content) == {"error": "KeyError: 'zz'"}


def test_an_error_a_tool_raises_is_cut_at_max_chars_as_a_result_is():
    raised = call_tool(TOOLS, "lookup", {"key": "z" * 500}, 5.0, max_chars=50)
    assert raised.error and json.loads(raised.content) == {
        "error": "KeyError: '" + "z" * 39 + "\n[output cut: 512 characters, the first 50 shown]"}


def test_too_many_hung_threads_stop_the_run_before_another_call_starts(monkeypatch):
    # a stopper of its own: the process's one may still count a `hang` thread an earlier test has just released
    monkeypatch.setattr(tools_module, "HUNG", HungTools(limit=0))  # at the limit (0 >= 0) with nothing hung
    with pytest.raises(ToolError, match=r"^0 tool calls are still running after tool_timeout in threads that could "
                       r"not be stopped \(blocked in C code: a sleep, a lock, a socket read without a timeout\); "
                       r"the last call was lookup\(\{'key': 'a'\}\)\. Fix the tool: give its blocking calls a "
                       r"timeout$"):
        call_tool(TOOLS, "lookup", {"key": "a"}, 5.0)


def test_the_calls_of_one_turn_run_at_the_same_time():
    agent_tools.MEETING = threading.Barrier(2)
    results = run_tool_calls(TOOLS, [("meet", {}), ("meet", {})], 20.0)
    assert [(r.content, r.error) for r in results] == [("met", False), ("met", False)]  # one at a time: neither meets


@pytest.mark.parametrize("calls", [1, 2], ids=["one call", "two calls"])
def test_a_turns_calls_keep_their_schemas_cap_and_tool_processes_however_many_there_are(calls):
    if tool_process.probe() is not None:
        pytest.skip(f"no user namespaces here: {tool_process.probe()}")
    schemas = {"lookup": tool_schema(agent_tools.lookup)}
    options = {"schemas": schemas, "max_chars": 10, "process_refs": {"process_id": "agent_tools:process_id"}}
    turn = [("process_id", {}), ("lookup", {"key": 3}), ("loud", {"length": 20})]
    results = [run_tool_calls(TOOLS, [c], 30.0, **options)[0] for c in turn] if calls == 1 else \
        run_tool_calls(TOOLS, turn, 30.0, **options)
    assert int(results[0].content) != os.getpid()  # ran in a process of its own
    assert json.loads(results[1].content) == {"error": "lookup was not called: key must be string, got int 3"}
    assert results[2].content == "ab" * 5 + "\n[output cut: 20 characters, the first 10 shown]"


def test_a_reference_handed_in_from_python_loads_back_as_that_very_object():
    def local_tool(x: int) -> int:
        """Not importable by its name: defined inside this test.

        Args:
            x: a number
        """
        return x

    assert load_ref(reference(local_tool, "tools"), "tools") is local_tool


def test_the_environment_class_is_the_factory_itself_or_the_type_of_one_probe_it_closes_again():
    before = agent_tools.Counter.instances
    assert environment_class(agent_tools.Counter, "agent_tools:Counter") is agent_tools.Counter
    assert agent_tools.Counter.instances == before  # a class is not built to see its type
    closed = []

    class Closing:
        def reset(self, **row) -> None:
            return None

        def close(self) -> None:
            closed.append(self)

    assert environment_class(Closing, "here:Closing") is Closing and closed == []
    assert environment_class(lambda: Closing(), "here:make") is Closing and len(closed) == 1  # the probe, closed
    with pytest.raises(ConfigError, match=r"^config `environment_factory`: agent_tools:make_nothing returned a object"):
        environment_class(agent_tools.make_nothing, "agent_tools:make_nothing")
