"""A pool: the instances serving one model, and the routing policy that picks among them.

One engine process and a request's slot on it are `instance.py`; an instance's load state (own accounting, scraped
engine metrics) is in `state.py`, its outlier ejection in `ejection.py`; `Pool.snapshot()` merges them into what the
routing policy sees, with the prefix index's view of each instance's cache. An instance serving several models is
one `Instance` (keyed by URL) shared by those pools, so its load is counted once. The `Fleet` (`fleet.py`) builds
the pools and keeps the instances' health.

Passive ejection never empties a pool (`health.ejection.max_ejection_percent`, checked over every pool of a shared
instance), and if a pool has no routable instance left while some pass their health checks (ejected, then the
others failed their checks), it panics: it routes over those, ignoring ejection, rather than answering 503.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from ..config import ModelConfig
from ..dedup.eligibility import is_deterministic
from ..errors import Unavailable
from ..metrics import GatewayMetrics
from ..routing.placement import anchor_depth, rendezvous_spread
from ..routing.policies import Policy, PoolSnapshot, RouteRequest
from ..routing.prefix import PrefixIndex, prompt_blocks
from ..routing.residency import Residency
from ..wire import ApiRequest, Endpoint
from .ejection import ejection_allowed
from .instance import Instance
from .state import Ewma


class HeaderLookup(Protocol):
    """Request headers, looked up by name (case-insensitively)."""

    def get(self, name: str, /) -> str | None: ...


log = logging.getLogger(__name__)


#: How long a member that left the pool is expected back (a sidecar restarting, its lease renewed): follow-ups to its
#: responses are 503 meanwhile.
DEPARTED_GRACE_S = 60.0


class LongPrefillBusy(Exception):
    """A long prompt (`Pool.is_long`) while every candidate instance is prefilling one: the request waits for a
    turn (`Fleet.prefills`, `Pool.long_turn`), then routes again."""


class Held(Exception):
    """A request of a class that is not strict (`RouteRequest.yields`) whose prompt takes longer than a step to
    prefill, while a strict request holds every candidate instance (`OwnAccounting.held`): it waits until one is no
    longer held (`Fleet.prefills`, `Pool.unheld`), then routes again (`attempt._route`: at most `HOLD_MAX_S` in all)."""


#: Responses whose instance a pool remembers for their follow-ups (`previous_response_id`): ~200 bytes each.
MAX_RESPONSE_HOMES = 65_536

#: Routed prompts before a pool's measured reuse replaces the assumption that caches are reused (1.0).
_REUSE_SAMPLES = 32


class Pool:
    """The instances serving one model, and the policy that picks among them."""

    def __init__(
        self,
        config: ModelConfig,
        instances: list[Instance],
        served: dict[str, str],
        policy: Policy,
        *,
        stale_after: float = 1.0,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.config = config
        for instance in instances:
            instance.own.default_tps = config.routing.predicted_ttft.default_prefill_tps
        self.model = config.name
        self.instances = instances
        self._by_key = {i.key: i for i in instances}
        #: Instance key -> the model name that engine knows.
        self.served = served
        self.policy = policy
        self.stale_after = stale_after
        #: Per instance: its routing-decisions counter (looked up once, not per request).
        self._decisions = (
            {i.key: metrics.routing_decisions.labels(self.model, policy.name, i.name) for i in instances}
            if metrics is not None
            else None
        )
        self._metrics = metrics
        self._panics = metrics.routing_panics.labels(self.model) if metrics is not None else None
        options = config.routing.prefix_index
        self.index = PrefixIndex(options.max_bytes, options.block_chars)
        #: Sidecars only: the request header naming the engine a central gateway chose (preferred when
        #: it can take the request).
        self.pin_header: str | None = None
        #: The instance that made each recent response (the Responses API), by response id: a follow-up naming one
        #: in `previous_response_id` is pinned there (the engine that may have stored it). The oldest are forgotten.
        self._response_homes: OrderedDict[str, tuple[str, str]] = OrderedDict()
        #: Members that left lately (a sidecar restarting, a reload), by key, with when: a follow-up to a response
        #: made there is told to retry while they may come back (`DEPARTED_GRACE_S`), not sent elsewhere.
        self._departed: dict[str, tuple[float, str]] = {}
        #: Created for instances discovered at run time (cluster mode), not configured.
        self.discovered = False
        #: Central replicas (cluster mode): the anchor depth of the shared default placement
        #: (`routing/placement.py`), 0 = off; and over how many nodes it spreads a prefix.
        self.placement_blocks = 0
        self.placement_choices = 1
        #: Central replicas: what the sidecars report their engines hold (`routing/residency.py`).
        self.residency: Residency | None = None
        #: The share of routed prompts' tokens found cached on some instance (`PoolSnapshot.reuse`).
        self.reuse = Ewma(alpha=0.05)
        #: Sidecars: told of every routing decision (instance key, prompt blocks), to report residency.
        self.report_routed: Callable[[str, tuple[int, ...]], None] | None = None
        #: `routing.long_prefill_ms`, in seconds (0: off): see `is_long`.
        self.long_prefill_s = config.routing.long_prefill_ms / 1000
        #: Members a reload (or a node leaving) retired while they still run this pool's requests, on engines no member
        #: shares: those requests hold slots of the pool's scheduler that are not the new members' to wait for
        #: (`lent`).
        self.lenders: list[Instance] = []
        for spec in config.instances:
            if spec.cache_tokens is not None:
                self.set_cache_tokens(spec.key, spec.cache_tokens)

    def set_cache_tokens(self, key: str, tokens: int | None, ratio: float = 1.0) -> bool:
        """An instance's prefix-cache size (engine tokens) became known: the index models its evictions.
        `ratio`: engine tokens per estimated token (the index's blocks are characters, 4 to a token).
        Returns whether it changed."""
        per_block = max(1, self.index.block_chars // 4) * (round(ratio, 2) or 1.0)
        blocks = None if tokens is None else max(1, int(tokens / per_block))
        if self.index.capacity(key) == blocks:
            return False
        self.index.set_capacity(key, blocks)
        return True

    def lent(self) -> int:
        """This pool's requests still running on retired members' engines: slots its scheduler counts on top of its
        members' capacity until they end (else they would hold back requests the new members could take)."""
        return sum(lender.leased.get(self.model, 0) for lender in self.lenders)

    def lend_from(self, retired: Instance) -> None:
        """`retired` left this pool with requests in flight: count them as lent unless a member shares its engine (an
        instance replaced at the same URL: the engine's slots are the same, its requests do hold them)."""
        if retired.leased.get(self.model) and all(i.url != retired.url for i in self.instances):
            self.lenders.append(retired)

    def add(self, instance: Instance, served_model: str) -> None:
        """Add an instance discovered at run time (a no-op if it is a member)."""
        if instance.key in self._by_key:
            return
        self.instances = [*self.instances, instance]
        self._by_key[instance.key] = instance
        instance.own.default_tps = self.config.routing.predicted_ttft.default_prefill_tps
        self.served[instance.key] = served_model
        if self._decisions is not None and self._metrics is not None:
            self._decisions[instance.key] = self._metrics.routing_decisions.labels(
                self.model, self.policy.name, instance.name
            )

    def renamed(self, instance: Instance) -> None:
        """A member's name changed (`Fleet.rename`): its routing counter goes by the new one."""
        if instance.key in self._by_key and self._decisions is not None and self._metrics is not None:
            self._decisions[instance.key] = self._metrics.routing_decisions.labels(
                self.model, self.policy.name, instance.name
            )

    def holds(self, key: str) -> bool:
        """Whether the instance `key` is a member now (`served` also keeps the names of instances discarded, for
        the requests still on them)."""
        return key in self._by_key

    def discard(self, key: str) -> None:
        """Remove an instance (requests already on it keep their lease, and its served name); its prefix index
        entries age out by LRU."""
        gone = self._by_key.pop(key, None)
        if gone is not None:
            self.instances = [i for i in self.instances if i.key != key]
            now = time.monotonic()
            self._departed = {k: left for k, left in self._departed.items() if now - left[0] < DEPARTED_GRACE_S}
            self._departed[key] = (now, gone.name)

    def left_lately(self, key: str) -> bool:
        """Whether the instance `key` left the pool less than `DEPARTED_GRACE_S` ago (and is not back)."""
        left = self._departed.get(key)
        return left is not None and key not in self._by_key and time.monotonic() - left[0] < DEPARTED_GRACE_S

    def name_of(self, key: str) -> str:
        """The name of the member `key`, or of one that left (a sidecar's engine: `<node>/<engine>`, not its URLs)."""
        home = self._by_key.get(key)
        if home is not None:
            return home.name
        left = self._departed.get(key)
        return left[1] if left is not None else key

    def left_lately_keys(self) -> list[str]:
        """The keys of the instances that left the pool less than `DEPARTED_GRACE_S` ago (and are not back)."""
        return [key for key in self._departed if self.left_lately(key)]

    def route_request(
        self,
        api: ApiRequest,
        headers: HeaderLookup | None = None,
        urgent: bool = False,
        yields: bool = False,
        resent: bool = False,
    ) -> RouteRequest:
        """What routing needs to know about a request, computed once for all its attempts."""
        text = api.prompt_text()
        key = headers.get(self.config.routing.consistent_hash.header) if headers is not None else None
        user = api.body.get("user")
        if key is None and isinstance(user, str) and user:
            key = user
        blocks: tuple[int, ...] = ()
        if self.policy.uses_prefix:
            salt = api.engine_cache_salt()
            # The index keeps salted prompts apart where the engines do (`cache_salt`), not where they share a cache.
            if salt is not None and not any(_takes_salt(i) for i in self.instances):
                salt = None
            blocks = prompt_blocks(text, self.index.block_chars, salt)
        pin = headers.get(self.pin_header) if self.pin_header is not None and headers is not None else None
        pin_only = False
        if pin is None and api.endpoint is Endpoint.RESPONSES:
            previous = api.body.get("previous_response_id")
            if isinstance(previous, str):
                home = self._response_homes.get(previous)
                if home is not None:
                    pin, pin_only = home[0], True
        prompt_tokens = api.estimated_prompt_tokens()
        return RouteRequest(
            api.model,
            "",
            prompt_tokens=prompt_tokens,
            affinity_key=key,
            blocks=blocks,
            pin=pin,
            pin_only=pin_only,
            repeat_tokens=self._cached_tokens(prompt_tokens, len(blocks)) if is_deterministic(api.body) else 0,
            stream=api.stream,
            urgent=urgent,
            yields=yields,
            resent=resent,
        )

    def snapshot(self, request: RouteRequest | None = None, *, panic: bool = False) -> PoolSnapshot:
        now = time.monotonic()
        matched = self.index.match(request.blocks) if request is not None and request.blocks else {}
        if self.residency is not None and request is not None and request.blocks:
            for key, depth in self.residency.match(request.blocks).items():
                if depth > matched.get(key, 0):
                    matched[key] = depth
        if self.placement_blocks and request is not None and request.blocks:
            self._place(request, matched)
        views = []
        index = self.index
        tokens_per_block = max(1, index.block_chars // 4)
        for i in self.instances:
            cached = self._cached_tokens(request.prompt_tokens, matched.get(i.key)) if request is not None else 0
            room = index.room(i.key)
            views.append(
                i.view(now, self.stale_after, cached, None if room is None else room * tokens_per_block, panic=panic)
            )
        reuse = self.reuse.value if self.reuse.samples >= _REUSE_SAMPLES else 1.0
        return PoolSnapshot(self.model, tuple(views), reuse)

    def _place(self, request: RouteRequest, matched: dict[str, int]) -> None:
        """Unless this replica's own index knows the prompt beyond its anchor, count the whole prompt as
        cached on the anchor's rendezvous winners (`placement_choices` of them, on distinct nodes) among
        the routable instances: what every replica computes alike, and where earlier turns of the
        conversation went from any replica that also knew nothing better. The cost policy weighs them
        against their load: with two, a prefix whose first home is busy takes its second (the power of
        two choices), where one home per prefix left some nodes with more hot prefixes than others."""
        depth = anchor_depth(request.blocks, self.placement_blocks)
        if max(matched.values(), default=0) > depth:
            return
        keys = ((i.key, i.published.node if i.published is not None else i.key) for i in self.instances if i.routable)
        for key in rendezvous_spread(request.blocks[depth - 1], keys, self.placement_choices):
            matched[key] = len(request.blocks)

    def _cached_tokens(self, prompt_tokens: int, blocks: int | None) -> int:
        """Blocks are characters: the share of a prompt of `prompt_tokens` they cover, in tokens."""
        return min(prompt_tokens, blocks * self.index.block_chars // 4) if blocks else 0

    def is_long(self, instance: Instance, uncached_tokens: int) -> bool:
        """Whether `uncached_tokens` of prompt take `instance` at least `routing.long_prefill_ms` to prefill, at its
        measured rate. At most one such prompt (streamed) is outstanding per instance: a short request sent there
        then waits, inside the engine, for the step in progress and at most one long prefill, not for a queue of
        them (`bench hol`). An instance behind a sidecar (a node of several engines) is never held."""
        limit = self.long_prefill_s
        return limit > 0 and instance.published is None and uncached_tokens >= limit * instance.own.rate

    def long_turn(self, request: RouteRequest) -> bool:
        """Whether a long request waiting for its turn may be routed now: some candidate has no long prefill
        outstanding (or none is routable: `choose` then says why)."""
        candidates = [i for i in self.instances if i.routable and i.key not in request.exclude]
        return not candidates or any(not i.own.long_pending for i in candidates)

    def _long_elsewhere(self, request: RouteRequest, snapshot: PoolSnapshot | None) -> tuple[Instance, int]:
        """A long prompt was chosen for an instance already prefilling one: the policy's choice among the others
        that are not, or `LongPrefillBusy` when there is none (the request waits for a turn)."""
        busy = frozenset(i.key for i in self.instances if i.own.long_pending)
        others = replace(request, exclude=request.exclude | busy)
        view = self.policy.choose(others, snapshot if snapshot is not None else self.snapshot(others))
        if view is None:
            raise LongPrefillBusy
        return self._by_key[view.key], view.cached_tokens

    def _holds(self, instance: Instance, request: RouteRequest, cached: int) -> bool:
        """Whether `instance` is held (`OwnAccounting.held`) for `request`, of a class that is not strict: a strict
        request waits for its first token there and the request's prompt takes longer than a step to prefill there
        (all of it once it was stopped before its first token, `RouteRequest.resent`: the prefix index took its prompt
        where it went first, which the engine may have prefilled only in part). Not behind a sidecar, which holds its
        node's engines itself."""
        own = instance.own
        if not own.urgent_pending or instance.published is not None or not own.held(time.monotonic()):
            return False
        return own.exceeds_step(request.prompt_tokens if request.resent else request.prompt_tokens - cached)

    def _held_keys(self, request: RouteRequest) -> frozenset[str]:
        """The candidate instances held for `request` (`_holds`)."""
        matched = self.index.match(request.blocks) if request.blocks else {}
        return frozenset(
            i.key
            for i in self.instances
            if i.routable
            and i.key not in request.exclude
            and self._holds(i, request, self._cached_tokens(request.prompt_tokens, matched.get(i.key)))
        )

    def _unheld_choice(self, request: RouteRequest) -> tuple[Instance, int]:
        """The policy's choice among the candidates no strict request holds for `request` (an idle instance next to a
        held one takes it), or `Held` when every one is held."""
        others = replace(request, exclude=request.exclude | self._held_keys(request))
        view = self.policy.choose(others, self.snapshot(others))
        if view is None:
            raise Held
        return self._by_key[view.key], view.cached_tokens

    def unheld(self, request: RouteRequest) -> bool:
        """Whether some candidate instance is not held for `request` (`_holds`), or none is routable (`choose` then
        says why)."""
        candidates = sum(1 for i in self.instances if i.routable and i.key not in request.exclude)
        return not candidates or len(self._held_keys(request)) < candidates

    def hold_left(self, request: RouteRequest) -> float:
        """How long the holds on `request`'s candidates last at most (`OwnAccounting.held`), in seconds."""
        now = time.monotonic()
        return max((i.own.held(now) for i in self.instances if i.key not in request.exclude), default=0.0)

    def home_unavailable(self, key: str) -> Unavailable:
        """The 503 for a follow-up whose previous response's engine (`key`) cannot take it now: to retry shortly."""
        return Unavailable(
            f"The engine that holds the previous response ({self.name_of(key)}) cannot take "
            "requests right now; retry shortly.",
            code="previous_response_unavailable",
            retry_after=2,
        )

    def choose(self, request: RouteRequest) -> tuple[Instance, int]:
        """The instance to try, and how many of the request's prompt tokens it likely has cached (which
        sizes its lease). With a single candidate every policy would pick it: no snapshot is built. Raises
        `LongPrefillBusy` for a long streamed prompt (`is_long`) while every candidate is prefilling one. A request of a
        class that is not strict whose choice a strict request holds (`_holds`) goes to the policy's choice among the
        others (`Held` when every one is held; never for a pinned request)."""
        sole = self._pinned(request.pin, request) if request.pin is not None else None
        pin = request.pin
        if sole is None and request.pin_only and pin is not None and (pin in self._by_key or self.left_lately(pin)):
            # (A sidecar briefly gone, an engine ejected or restarting: its responses come back with it. Another
            # engine would answer 404, which no client retries.)
            raise self.home_unavailable(pin)
        if sole is None:
            sole = self._sole_candidate(request)
        snapshot: PoolSnapshot | None = None
        if sole is not None:
            instance = sole
            matched = self.index.match(request.blocks).get(sole.key) if request.blocks else None
            cached = self._cached_tokens(request.prompt_tokens, matched)
        else:
            snapshot = self.snapshot(request)
            view = self.policy.choose(request, snapshot)
            if view is None and self.panicking():
                view = self.policy.choose(request, self.snapshot(request, panic=True))
                if view is not None and self._panics is not None:
                    self._panics.inc()
            if view is None:
                raise Unavailable(f"No healthy instance can serve model '{self.model}' right now.", retry_after=1)
            instance, cached = self._by_key[view.key], view.cached_tokens
        if (
            request.stream
            and not request.pin_only  # (elsewhere, no engine holds the response a follow-up continues)
            and instance.own.long_pending
            and self.is_long(instance, request.prompt_tokens - cached)
        ):
            instance, cached = self._long_elsewhere(request, snapshot)
        if request.yields and pin is None and self._holds(instance, request, cached):
            instance, cached = self._unheld_choice(request)
        if request.blocks:
            if request.prompt_tokens > 0:
                # Found cached anywhere (not only where it went): how much the caches' content is reused.
                best = cached if snapshot is None else max(v.cached_tokens for v in snapshot.instances)
                self.reuse.add(min(1.0, best / request.prompt_tokens), time.monotonic())
            self.index.insert(instance.key, request.blocks)
            instance.predicted_queries += request.prompt_tokens
            instance.predicted_hits += cached
            if self.report_routed is not None:
                self.report_routed(instance.key, request.blocks)
        if self._decisions is not None:
            self._decisions[instance.key].inc()
        return instance, cached

    def remember_response(self, response_id: str, instance_key: str, tenant: str) -> None:
        """`instance_key` made the response `response_id` for `tenant`: its follow-ups go there while it can take
        them, and its stored copy is asked for there (`stored.py`)."""
        homes = self._response_homes
        homes[response_id] = (instance_key, tenant)
        if len(homes) > MAX_RESPONSE_HOMES:
            homes.popitem(last=False)

    def response_home(self, response_id: str) -> tuple[str, str] | None:
        """The instance key and tenant of a response made here (`remember_response`), if remembered."""
        return self._response_homes.get(response_id)

    def member(self, key: str) -> Instance | None:
        """The member instance with this key, if any."""
        return self._by_key.get(key)

    def named(self, name: str) -> Instance | None:
        """The member instance called `name` (a sidecar's engine is `<node>/<engine>`), if any."""
        for instance in self.instances:
            if instance.name == name:
                return instance
        return None

    def _pinned(self, key: str, request: RouteRequest) -> Instance | None:
        """The engine a central gateway chose for this request, if it can take it here."""
        instance = self._by_key.get(key)
        if instance is not None and instance.routable and key not in request.exclude:
            return instance
        return None

    def _sole_candidate(self, request: RouteRequest) -> Instance | None:
        """The one routable instance not yet tried, if there is exactly one (what `candidates()` would
        return to a policy)."""
        sole = None
        for i in self.instances:
            if i.routable and i.key not in request.exclude:
                if sole is not None:
                    return None
                sole = i
        return sole

    def panicking(self) -> bool:
        """No instance is routable, yet some pass their health checks (they are only ejected): route over
        those rather than over nothing."""
        return not any(i.routable for i in self.instances) and any(i.in_service for i in self.instances)

    def ready(self) -> bool:
        return any(i.in_service for i in self.instances)

    def may_eject(self, instance: Instance, max_percent: int) -> bool:
        """Whether passive signals may take `instance` out of this pool now (see `ejection_allowed`)."""
        ejected = routable_others = 0
        for i in self.instances:
            ejected += i.ejection.ejected
            routable_others += i is not instance and i.routable
        return ejection_allowed(len(self.instances), ejected, routable_others, max_percent)


def _takes_salt(instance: Instance) -> bool:
    """Whether the engine keeps prefix-cache blocks apart by `cache_salt` (vLLM); behind a sidecar, the sidecar
    passes the salt on to its engine."""
    return instance.dialect.cache_salt or instance.published is not None
