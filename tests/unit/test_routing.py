from lockgate.routing.policies import InstanceView, LeastLoad, PoolSnapshot, RoundRobin, RouteRequest


def snap(*loads, healthy=None):
    healthy = healthy or [True] * len(loads)
    return PoolSnapshot(
        "m",
        tuple(
            InstanceView(f"i{n}", f"i{n}", h, load, 10) for n, (load, h) in enumerate(zip(loads, healthy, strict=False))
        ),
    )


def test_round_robin_cycles_over_healthy():
    policy = RoundRobin()
    s = snap(0, 0, 0, healthy=[True, False, True])
    picks = [policy.choose(RouteRequest("m"), s).key for _ in range(4)]
    assert picks == ["i0", "i2", "i0", "i2"]


def test_least_load_picks_lowest_and_spreads_ties():
    policy = LeastLoad()
    assert policy.choose(RouteRequest("m"), snap(5, 1, 3)).key == "i1"
    ties = {policy.choose(RouteRequest("m"), snap(0, 0)).key for _ in range(2)}
    assert ties == {"i0", "i1"}


def test_excluded_and_unhealthy_are_never_chosen():
    policy = LeastLoad()
    s = snap(9, 0, 0, healthy=[True, True, False])
    assert policy.choose(RouteRequest("m", exclude=frozenset({"i1"})), s).key == "i0"
    assert policy.choose(RouteRequest("m", exclude=frozenset({"i0", "i1"})), s) is None
