"""Value types for the command lines' arguments (argparse `type=`): a bad value is a usage error naming the option."""

from __future__ import annotations

import argparse
import math


def tcp_port(text: str) -> int:
    """A TCP port, 0-65535 (0: the system picks a free one); a socket call would wrap 70000 to 4464."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {port}")
    return port


def _number(text: str, kind: type[int] | type[float]) -> float:
    """`text` as an int or a finite float; anything else (nan, inf, words) is a usage error."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1: a count of requests, rounds, connections (0 of them measures nothing, or never ends)."""
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (a warm-up, a slack, a limit where 0 means none)."""
    value = int(_number(text, int))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0: a duration, a rate, a factor (0 or less divides by zero or never ends)."""
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a delay, a tolerance, a factor where 0 leaves a part out)."""
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def share(text: str) -> float:
    """A share, 0-1."""
    value = _number(text, float)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"a share is 0-1, got {text}")
    return value
