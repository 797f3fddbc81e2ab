"""An instance's concurrency limit, discovered from the engine instead of guessed (sync, no I/O).

Theory of operation: the gateway admits at most `limit` requests to an instance at once; the rest wait
in the gateway's priority queues, where they can be reordered (P0 first) and preempted. A limit above
what the engine runs in parallel moves that queue into the engine, where it is first come, first served
and priorities are lost; a limit below it leaves the engine idle. So the limit should sit at the
engine's real parallelism, and that differs per engine (vLLM's `max_num_seqs` or its KV cache, SGLang's
`max_running_requests`, llama.cpp's slots) and may change with the workload (longer prompts fit fewer
sequences in the KV cache).

`ConcurrencyLimit.observe()` is fed each scrape of the engine's own queue signals:
- **saturation**: requests have waited inside the engine in two scrapes in a row while the number it
  runs stayed put (within 10%): the engine is at its parallelism, which is what it runs. The limit drops
  to that number (at once: each scrape interval at a too-high limit costs priority order). The wait must
  be a backlog, not the step a request just arrived in: at least two requests and a quarter of those
  running, or the gateway holding its whole limit there. A busy engine below its parallelism has one
  request waiting for the next step most of the time. The new limit is the most it ran at once in the
  last 25 scrapes, not the count of the moment, which dips whenever a slot has just been freed;
- **headroom**: the gateway holds the limit's worth of requests there and the engine queues none: the
  limit grows by an eighth (at least one) per scrape, up to the ceiling, so a bigger engine (or a
  lighter workload) is found again. After a saturation it first waits `cooldown` scrapes (60 s at the
  default interval): each probe above the engine's parallelism puts a request in the engine's own
  queue, where a P0 arriving then waits behind it. Probing every 10 s showed as P0 TTFT p99 7.0x its
  value alone under a P2 flood (`bench priority --duration 60`, two 4-slot engines), every minute 1.07x
  (30 s phases). A probe that finds the same limit again doubles the wait before the next (up to ten
  minutes): one probe a minute still cost 5.9x in the last phase of a 60 s-per-phase run. The price is that a
  bigger engine is found minutes later;
- no queue signal (the dialect exports none, or scrapes fail): the limit stays where it is;
- **prefill-bound**: requests also wait inside an engine whose slots are free, for its per-step token
  budget, behind long prompts being prefilled (chunked prefill admits at most `max_num_batched_tokens`
  a step). That queue says nothing about the engine's parallelism: cutting the limit to what runs then
  (often 1-2 sequences, one of them a long prefill) would hold every short request in the gateway behind
  the long ones and leave the engine's slots idle (`lockgate bench hol` measured short TTFT p50 x21
  from exactly this). So a queue counts as saturation only if it is not explained by prefill work: the
  gateway's own count of uncached prompt tokens sent there and not yet answered, at the instance's
  measured prefill rate, must stay below half the mean time a request holds its slot decoding (`decode_s`;
  a slot-bound queue waits about that long, a prefill-bound one about the backlog). Before the instance
  has answered a request (no `decode_s` yet) no queue counts: the first long prompts of a run are
  exactly when a prefill-bound queue looks like saturation.

It starts at the ceiling: the configured `max_concurrency`, or else `upstream.max_connections` (no
more requests can be open to one instance anyway). Starting high costs one scrape interval of engine
queueing on a small engine; starting low would queue every request of a large one in the gateway
while the limit climbs (256 streams to an engine that runs 256 would wait ~1 s for a limit that
doubles per scrape).
"""

from __future__ import annotations

from collections import deque

#: Consecutive scrapes with requests waiting in the engine before it counts as saturated.
_SATURATED_SCRAPES = 2
#: Scrapes over which the most the engine ran at once is remembered (5 s at the default interval).
_PEAK_SCRAPES = 25


class ConcurrencyLimit:
    __slots__ = (
        "_calm",
        "_learned",
        "_prev_running",
        "_recent",
        "_streak",
        "_wait",
        "adaptive",
        "ceiling",
        "cooldown",
        "limit",
    )

    def __init__(self, ceiling: int, *, adaptive: bool = True, cooldown: int = 300) -> None:
        if ceiling < 1:
            raise ValueError("ceiling must be >= 1")
        self.ceiling = ceiling
        #: The current limit (1..ceiling).
        self.limit = ceiling
        #: False: the limit is the configured number, whatever the engine says.
        self.adaptive = adaptive
        #: Scrapes without saturation before the limit may grow again.
        self.cooldown = cooldown
        self._streak = 0
        self._prev_running: float | None = None
        self._calm = cooldown  # scrapes since the last saturation (none seen yet: may grow at once)
        #: Scrapes to wait before the next probe: `cooldown`, doubled (up to 10x) each time a probe only found
        #: the limit it started from again, so that a stable engine is probed ever more rarely.
        self._wait = cooldown
        #: The limit the last saturation set (None: none yet).
        self._learned: int | None = None
        #: What the engine ran at once in recent scrapes: it can run at least their maximum.
        self._recent: deque[float] = deque(maxlen=_PEAK_SCRAPES)

    def observe(
        self,
        running: float | None,
        waiting: float | None,
        in_flight: int,
        prefill_backlog_s: float = 0.0,
        decode_s: float | None = None,
    ) -> bool:
        """One scrape's signals and the gateway's requests there now; True if the limit changed.
        `prefill_backlog_s`: the prefill work the gateway has sent there and not seen answered, in seconds
        at its measured rate (0 when the rate is not measured); `decode_s`: the mean time a request holds
        its slot after its first token: 0.0 while not measured (no saturation is judged before the
        instance answered a request), None when the caller has no such signal (the queue alone counts)."""
        if not self.adaptive or running is None or waiting is None:
            self._streak = 0
            return False
        previous = self._prev_running
        self._prev_running = running
        self._recent.append(running)
        unexplained = decode_s is None or (decode_s > 0 and prefill_backlog_s < 0.5 * decode_s)
        if waiting >= 1 and running >= 1 and not unexplained:
            self._streak = 0
            return False
        if waiting >= 1 and running >= 1 and (waiting >= max(2.0, 0.25 * running) or in_flight >= self.limit):
            steady = previous is not None and abs(running - previous) <= max(1.0, 0.1 * running)
            self._streak = self._streak + 1 if steady or self._streak == 0 else 1
            if self._streak >= _SATURATED_SCRAPES:
                self._calm = 0
                found = max(1, min(self.ceiling, round(max(self._recent))))
                if self._learned is not None and found <= self._learned:
                    self._wait = min(self._wait * 2, 10 * self.cooldown)  # the probe found nothing new
                else:
                    self._wait = self.cooldown
                self._learned = found
                # Never below what it ran at once in the last few seconds: at a full limit a slot freed
                # a moment ago shows as one running fewer and one waiting, and cutting to that ratchets
                # the limit down to nothing (`bench overload --scrape`: 11 of 72 req/s served at 2.5x).
                return self._set(round(max(self._recent)))
            return False
        self._streak = 0
        self._calm += 1
        if waiting < 1 and in_flight >= self.limit and self._calm >= self._wait:
            return self._set(self.limit + max(1, self.limit // 8))
        return False

    def _set(self, value: int) -> bool:
        value = max(1, min(self.ceiling, value))
        if value == self.limit:
            return False
        self.limit = value
        return True


def prefill_backlog_s(queued_prompt_tokens: int, measured_tps: float, default_tps: float) -> float:
    """Seconds of prefill the gateway has sent to an instance and not seen answered: at its measured rate,
    or `default_tps` until that is measured (short prompts alone never measure it, and a long prompt sent
    to a fresh instance must count as prefill work from the start)."""
    return max(0, queued_prompt_tokens) / (measured_tps or default_tps)
