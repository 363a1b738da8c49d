"""The tool guards on their own: which arguments a schema refuses and how it says so, how output is cut, and which
processes a thread started."""

from __future__ import annotations

import subprocess
import threading
from typing import Literal, Optional

import pytest

from asyncgrpo.rollout.tool_guard import arguments_problem, cut_text, cut_tokens, schema_problem, started_processes
from asyncgrpo.rollout.tools import tool_schema


def book(city: str, nights: int, rate: float, tags: list[str], room: Literal["single", "double"],
         note: Optional[str] = None) -> str:
    """Book a room.

    Args:
        city: where
        nights: how many nights
        rate: the nightly rate
        tags: labels
        room: which room
        note: anything else
    """
    return "booked"


GOOD = {"city": "Oslo", "nights": 2, "rate": 99, "tags": ["a"], "room": "double"}


@pytest.mark.parametrize("change,problem", [
    ({}, None),
    ({"note": None}, None),  # Optional: nullable
    ({"note": "late"}, None),
    ({"rate": 99.5}, None),
    ({"nights": 2.0}, None),  # an integral float is a JSON integer
    ({"nights": 2.5}, "nights must be integer, got float 2.5"),
    ({"rate": "99"}, "rate must be number, got str '99'"),
    ({"city": {"name": "Oslo"}}, "city must be string, got dict {'name': 'Oslo'}"),
    ({"tags": "a"}, "tags must be array, got str 'a'"),
    ({"tags": ["a", 3]}, "tags[1] must be string, got int 3"),
    ({"room": "suite"}, "room must be one of ['single', 'double'], got 'suite'"),
    ({"note": 3}, "note must be string, got int 3"),
    ({"guests": 2}, "'guests' is not an argument; the arguments are ['city', 'nights', 'note', 'rate', 'room', 'tags']"),
])
def test_arguments_are_checked_against_the_schema_transformers_writes(change, problem):
    assert arguments_problem(tool_schema(book), {**GOOD, **change}) == problem


def test_a_missing_required_argument_is_named_and_one_with_a_default_may_be_left_out():
    assert arguments_problem(tool_schema(book), {k: v for k, v in GOOD.items() if k != "nights"}) == \
        "arguments misses 'nights' (required)"
    assert "note" not in tool_schema(book)["function"]["parameters"]["required"]


def test_a_tool_without_parameters_in_its_schema_takes_anything_and_unknown_schema_words_are_allowed():
    assert arguments_problem(None, {"x": 1}) is None
    assert arguments_problem({"function": {"name": "f"}}, {"x": 1}) is None
    assert schema_problem({"type": "uuid"}, 3, "x") is None
    assert schema_problem({"type": ["integer", "string"]}, "3", "x") is None
    assert schema_problem({"type": "boolean"}, 1, "x") == "x must be boolean, got int 1"
    assert schema_problem({"type": "object", "additionalProperties": {"type": "integer"}}, {"a": "b"}, "x") == \
        "x['a'] must be integer, got str 'b'"


def test_output_is_cut_with_a_line_saying_how_much():
    assert cut_text("abcdef", None) == "abcdef" and cut_text("abcdef", 6) == "abcdef"
    assert cut_text("abcdef", 4) == "abcd\n[output cut: 6 characters, the first 4 shown]"

    class Chars:  # one token per character
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(map(chr, ids))

    assert cut_tokens("abcdef", Chars(), None) == "abcdef" and cut_tokens("abcdef", Chars(), 6) == "abcdef"
    assert cut_tokens("abcdef", Chars(), 2) == "ab\n[output cut: 6 tokens, the first 2 shown]"


def test_the_processes_a_thread_started_are_found_with_their_descendants_and_no_others():
    other = subprocess.Popen(["sleep", "30"])  # started by this thread, not the tool's
    started, ready, release = [], threading.Event(), threading.Event()

    def tool():
        shell = subprocess.Popen(["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
        started.extend([shell.pid, int(shell.stdout.readline())])  # the shell's child exists once it is printed
        ready.set()
        release.wait(30)
        subprocess.run(["kill", "-9", str(started[1])])
        shell.wait()

    thread = threading.Thread(target=tool)
    thread.start()
    try:
        assert ready.wait(30)
        assert started_processes(thread.native_id) == started and other.pid not in started
    finally:
        release.set()
        thread.join()
        other.kill()
        other.wait()


def test_a_fresh_stopper_has_the_documented_limit_and_grace_and_nothing_counted():
    from asyncgrpo.rollout.tool_guard import HUNG_TOOL_LIMIT, STOP_GRACE_S, HungTools

    guard = HungTools()
    assert (guard.limit, guard.grace_s, guard.hung()) == (HUNG_TOOL_LIMIT, STOP_GRACE_S, 0)
    assert (HUNG_TOOL_LIMIT, STOP_GRACE_S) == (32, 1.0)
    assert (HungTools(limit=3, grace_s=0.5).limit, HungTools(limit=3, grace_s=0.5).grace_s) == (3, 0.5)


def test_object_and_null_types_and_a_list_of_types_are_checked_and_named():
    assert schema_problem({"type": "object"}, {"a": 1}, "x") is None
    assert schema_problem({"type": "object"}, [1], "x") == "x must be object, got list [1]"
    assert schema_problem({"type": "null"}, None, "x") is None
    assert schema_problem({"type": "null"}, 0, "x") == "x must be null, got int 0"
    assert schema_problem({"type": ["integer", "null"]}, "3", "x") == "x must be integer or null, got str '3'"


def test_items_are_checked_only_in_an_array():
    assert schema_problem({"items": {"type": "integer"}}, "ab", "x") is None  # no type given: a string passes
    assert schema_problem({"items": {"type": "integer"}}, (1, "b"), "x") == "x[1] must be integer, got str 'b'"


def test_a_nested_object_names_its_path_and_takes_unknown_keys_unless_it_forbids_them():
    schema = {"function": {"name": "f", "parameters": {"type": "object", "properties": {"inner": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}}}}
    assert arguments_problem(schema, {"inner": {"n": "a"}}) == "inner.n must be integer, got str 'a'"
    assert arguments_problem(schema, {"inner": {"n": 1, "extra": True}}) is None  # only the top level is closed
    closed = {"type": "object", "properties": {"a": {}}, "additionalProperties": False}
    assert schema_problem(closed, {"b": 1}, "x") == "'b' is not an argument; the arguments are ['a']"
    assert schema_problem({**closed, "additionalProperties": True}, {"b": 1}, "x") is None
    assert arguments_problem({"function": {"parameters": {"type": "object", "properties": {},
                                                          "additionalProperties": True}}}, {"b": 1}) is None


def test_tokens_are_counted_without_the_special_tokens_a_tokenizer_adds_by_default():
    class Bos:  # one token per character, and a bos id first unless told not to (transformers' default)
        def encode(self, text, add_special_tokens=True):
            return [0] * add_special_tokens + [ord(c) for c in text]

        def decode(self, ids):
            return "".join(map(chr, ids))

    assert cut_tokens("abcdef", Bos(), 6) == "abcdef"
    assert cut_tokens("abcdef", Bos(), 2) == "ab\n[output cut: 6 tokens, the first 2 shown]"
