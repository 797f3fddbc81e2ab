"""Which engine a central reports for a call answered by a sidecar (`upstream.served_by`)."""

from __future__ import annotations

from lockgate.upstream import MAX_ENGINE_NAME, served_by


def test_the_sidecars_engine_is_named_under_its_node() -> None:
    assert served_by("gpu-1/engine-0", "gpu-1", {"x-lockgate-instance": "engine-1"}) == "gpu-1/engine-1"


def test_without_a_usable_name_the_instance_called_stands() -> None:
    for headers in (
        {},
        {"x-lockgate-instance": ""},
        {"x-lockgate-instance": "e" * (MAX_ENGINE_NAME + 1)},
        {"x-lockgate-instance": "engine\x1b[2J"},
    ):
        assert served_by("gpu-1/engine-0", "gpu-1", headers) == "gpu-1/engine-0"
    assert served_by("n/x", "n", {"x-lockgate-instance": "e" * MAX_ENGINE_NAME}) == "n/" + "e" * MAX_ENGINE_NAME
