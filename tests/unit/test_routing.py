from lockgate.routing.policies import InstanceView, LeastLoad, Policy, PoolSnapshot, RoundRobin, RouteRequest


def snap(*loads, healthy=None):
    healthy = healthy or [True] * len(loads)
    return PoolSnapshot(
        "m",
        tuple(
            InstanceView(f"i{n}", f"i{n}", h, load, 10) for n, (load, h) in enumerate(zip(loads, healthy, strict=False))
        ),
    )


def pick(policy: Policy, request: RouteRequest, snapshot: PoolSnapshot) -> str:
    """The key of the instance `policy` chooses (the test fails if it chooses none)."""
    chosen = policy.choose(request, snapshot)
    assert chosen is not None
    return chosen.key


def test_round_robin_cycles_over_healthy():
    policy = RoundRobin()
    s = snap(0, 0, 0, healthy=[True, False, True])
    picks = [pick(policy, RouteRequest("m"), s) for _ in range(4)]
    assert picks == ["i0", "i2", "i0", "i2"]


def test_least_load_picks_lowest_and_spreads_ties():
    policy = LeastLoad()
    assert pick(policy, RouteRequest("m"), snap(5, 1, 3)) == "i1"
    ties = {pick(policy, RouteRequest("m"), snap(0, 0)) for _ in range(2)}
    assert ties == {"i0", "i1"}


def test_excluded_and_unhealthy_are_never_chosen():
    policy = LeastLoad()
    s = snap(9, 0, 0, healthy=[True, True, False])
    assert pick(policy, RouteRequest("m", exclude=frozenset({"i1"})), s) == "i0"
    assert policy.choose(RouteRequest("m", exclude=frozenset({"i0", "i1"})), s) is None
