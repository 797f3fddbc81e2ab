"""`admin_api.summed`: the workers' de-duplication statistics added up for `GET /admin/flights` under `--workers`."""

from __future__ import annotations

from lockgate.admin_api import summed


def test_counts_are_summed_key_by_key_and_other_values_kept_from_the_first() -> None:
    """An outside run read the answering worker's statistics, then named `statistics`, as the gateway's."""
    zero = {"flights": {"started": 2, "in_flight": 1}, "cache": {"hits": 3}, "semantic": {"m": {"threshold": 0.9}}}
    one = {"flights": {"started": 5, "in_flight": 0, "splits": 1}, "cache": {"hits": 4}, "semantic": {"m": {}}}
    assert summed([zero, one]) == {
        "flights": {"started": 7, "in_flight": 1, "splits": 1},
        "cache": {"hits": 7},
        "semantic": {"m": {"threshold": 0.9}},
    }
    assert summed([{"shadow": True, "n": 1}, {"shadow": False, "n": 2}]) == {"shadow": True, "n": 3}
