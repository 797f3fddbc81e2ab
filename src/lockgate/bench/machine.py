"""What a benchmark ran on: the machine, the interpreter and lockgate's build, one line each.

CPU per request depends on all three (a 2-core shared machine, an unoptimized CPython build, mypyc-compiled
modules or not), so every benchmark that prints CPU figures prints these lines with them.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import platform
import sys

#: The modules of the request path that the opt-in compiled build (`setup.py`, `make test-compiled`) compiles
#: with mypyc.
HOT_MODULES = (
    "lockgate.relay",
    "lockgate.answer",
    "lockgate.respond",
    "lockgate.assemble",
    "lockgate.chunkshape",
    "lockgate.responses",
    "lockgate.sse",
    "lockgate.upstream",
    "lockgate.attempt",
    "lockgate.wire",
    "lockgate.header_lines",
    "lockgate.admission.scheduler",
    "lockgate.admission.gate",
    "lockgate.admission.tenants",
    "lockgate.admission.ratelimit",
    "lockgate.fleet.state",
    "lockgate.fleet.ejection",
    "lockgate.dedup.eligibility",
    "lockgate.http.connection",
    "lockgate.http.pool",
    "lockgate.edge.protocol",
    "lockgate.edge.request",
    "lockgate.edge.response",
    "lockgate.fleet.pool",
    "lockgate.fleet.fleet",
    "lockgate.fleet.instance",
    "lockgate.metrics",
    "lockgate.dedup.coalescer",
    "lockgate.changes",
    "lockgate.dedup.flight",
    "lockgate.dedup.flights",
    "lockgate.dedup.waiting",
    "lockgate.dedup.cache",
    "lockgate.dedup.fingerprint",
)


def machine() -> str:
    """`machine: 2 cores, AMD EPYC, Linux 6.1 x86_64, load 4.1`."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:  # not Linux
        pass
    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    cores = os.cpu_count() or 0
    return f"machine: {cores} cores, {model}, {platform.system()} {platform.release()} {platform.machine()}{load}"


def interpreter() -> str:
    """The Python that runs the engine and the gateway (children started with this one's executable). Its
    build moves CPU per request by ~20%: see docs/decisions.md, "The interpreter"."""
    line = f"interpreter: {platform.python_implementation()} {platform.python_version()} at {sys.executable}"
    return line + (" (libpython loaded as a shared library)" if _shared_libpython() else "")


def build() -> str:
    """`build: pure Python` or `build: compiled (mypyc): N of the M hot-path modules`, as imported here (the
    children run the same installation)."""
    compiled = [name for name in HOT_MODULES if is_compiled(name)]
    if not compiled:
        return "build: pure Python"
    return f"build: compiled (mypyc): {len(compiled)} of the {len(HOT_MODULES)} hot-path modules"


def is_compiled(module: str) -> bool:
    """Whether `module` is loaded (or would be) from an extension module rather than a `.py` file."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        origin = getattr(loaded, "__file__", None) or ""
    else:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec is not None and spec.origin else ""
    return origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def _shared_libpython() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any("libpython" in line for line in maps)
    except OSError:  # not Linux
        return False
