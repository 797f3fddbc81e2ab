"""Value types for the command lines' arguments (argparse `type=`): a bad value is a usage error naming the option."""

from __future__ import annotations

import argparse


def tcp_port(text: str) -> int:
    """A TCP port, 0-65535 (0: the system picks a free one); a socket call would wrap 70000 to 4464."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {port}")
    return port
