"""Runtime behaviour switches for tests (``POST /sim/control``) and the hold/release gate."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SimControl:
    healthy: bool = True  # GET /health answers 503 when False
    fail_status: int | None = None  # answer every generation request with this status
    reset_prob: float = 0.0  # probability that a generation request's connection is reset mid-answer
    delay_first_token_ms: float = 0.0  # extra wait before a request enters the engine
    # Engine-side fault injection for callers that cannot set request headers (a gateway in front):
    reset_after_tokens: int | None = None  # like ``x-sim-reset-after-tokens`` on every request
    hold: bool = False  # hold every generation request like ``x-sim-hold: 1`` (until release)
    hold_next: int = 0  # hold the next N generation requests, like ``x-sim-hold: 1``
    _released: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a ``/sim/control`` body; raises ``ValueError`` (changing nothing) on a bad one."""
        new: dict[str, Any] = {}
        for key, value in changes.items():
            if key in ("healthy", "hold"):
                if not isinstance(value, bool):
                    raise ValueError(f"{key} must be a bool")
            elif key == "fail_status":
                if value is not None and not (isinstance(value, int) and 400 <= value <= 599):
                    raise ValueError("fail_status must be null or an HTTP error status")
            elif key == "reset_prob":
                if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                    raise ValueError("reset_prob must be in [0, 1]")
                value = float(value)
            elif key == "hold_next":
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError("hold_next must be an integer >= 0")
            elif key == "reset_after_tokens":
                if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                    raise ValueError("reset_after_tokens must be null or an integer >= 0")
            elif key == "delay_first_token_ms":
                if not isinstance(value, int | float) or value < 0:
                    raise ValueError("delay_first_token_ms must be >= 0")
                value = float(value)
            else:
                raise ValueError(f"unknown control field {key!r}")
            new[key] = value
        for key, value in new.items():
            setattr(self, key, value)

    def as_dict(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "fail_status": self.fail_status,
            "reset_prob": self.reset_prob,
            "delay_first_token_ms": self.delay_first_token_ms,
            "reset_after_tokens": self.reset_after_tokens,
            "hold": self.hold,
            "hold_next": self.hold_next,
        }

    def take_hold(self) -> bool:
        """Whether the arriving request is one of the next ``hold_next`` to hold (consumes one)."""
        if self.hold_next <= 0:
            return False
        self.hold_next -= 1
        return True

    async def wait_released(self) -> None:
        """Wait for the next ``release()``."""
        await self._released.wait()

    def release(self) -> None:
        """Let every currently held request go; later requests hold again."""
        self._released.set()
        self._released = asyncio.Event()
