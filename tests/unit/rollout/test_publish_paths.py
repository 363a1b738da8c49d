"""Adapter paths sent to an inference server never leave `lora_adapter_path`.

The server here is tests/fakes.py's FakeVLLM (a Python object, no HTTP): the point is which calls the publisher
makes, and that it makes none at all for a path outside the adapter directory. Loading real adapters is covered by
the integration tests against a real vLLM server.
"""

import os

import pytest
from fakes import FakeVLLM

from asyncgrpo.errors import AsyncGRPOError, SyncError
from asyncgrpo.rollout.publish import AdapterPublisher, contained_adapter_path


@pytest.fixture
def layout(tmp_path):
    root = tmp_path / "adapters"
    (root / "run1" / "v000001").mkdir(parents=True)
    outside = tmp_path / "elsewhere" / "v000001"
    outside.mkdir(parents=True)
    os.symlink(outside, root / "run1" / "v000002")  # a link inside the root that points out of it
    return root, outside


def test_a_path_inside_lora_adapter_path_is_sent_resolved(layout):
    root, _ = layout
    server = FakeVLLM()
    publisher = AdapterPublisher([server], "policy-run1", adapter_root=root)
    publisher.publish(1, root / "run1" / ".." / "run1" / "v000001")
    assert server.said() == ["load policy-run1-v1", "read"]  # loaded once, then read back
    assert server.served == {"policy-run1-v1": str((root / "run1" / "v000001").resolve())}
    assert publisher.current_name == "policy-run1-v1"


@pytest.mark.parametrize("where", ["dotdot", "symlink", "absolute"])
def test_a_path_outside_lora_adapter_path_is_refused_before_any_server_call(layout, where):
    root, outside = layout
    path = {"dotdot": root / "run1" / ".." / ".." / "elsewhere" / "v000001",
            "symlink": root / "run1" / "v000002",
            "absolute": outside}[where]
    server = FakeVLLM()
    publisher = AdapterPublisher([server], "policy-run1", adapter_root=root)
    with pytest.raises(SyncError) as err:
        publisher.publish(1, path)
    assert server.calls == [] and server.served == {}  # nothing reached the server
    assert publisher.current_name is None and publisher.loaded == {}
    message = str(err.value)
    assert str(outside.resolve()) in message and str(root.resolve()) in message and "lora_adapter_path" in message
    assert isinstance(err.value, AsyncGRPOError)  # the CLI prints it as `asyncgrpo: error: ...`, no traceback


def test_the_root_itself_counts_as_inside_and_a_sibling_prefix_does_not(tmp_path):
    root = (tmp_path / "adapters").resolve()
    assert contained_adapter_path(root, root) == root
    with pytest.raises(SyncError):  # "/x/adapters-evil" starts with "/x/adapters" as a string, not as a path
        contained_adapter_path(tmp_path / "adapters-evil" / "v1", root)


def test_a_refused_path_is_quoted_as_given_and_as_resolved(layout):
    root, outside = layout
    given = root / "run1" / "v000002"  # the symlink out of the root
    with pytest.raises(SyncError) as err:
        contained_adapter_path(given, root.resolve())
    assert str(err.value).startswith(f"adapter path {str(given)!r} resolves to {str(outside.resolve())!r}, outside "
                                     f"lora_adapter_path {str(root.resolve())!r}")
