"""Build hook for the opt-in compiled build: `LOCKGATE_COMPILE=1 pip install --no-build-isolation .` (with mypy
installed) compiles the modules of the request path listed in `COMPILED` with mypyc; without the variable this is
the plain pure-Python package (metadata: pyproject.toml). `make test-compiled` builds it into `.venv-compiled` and
runs the test suite against it. Keep `COMPILED` in step with `lockgate.bench.machine.HOT_MODULES`."""

import os

from setuptools import setup

#: Mypyc compiles these. None of them may `await` inside an `except` or `finally` block (a compiled coroutine
#: suspended there keeps the exception as the thread's handled one: tests/unit/test_compiled_modules.py), nor
#: define async generators (mypyc has none: the stream readers are async-iterator classes). Their classes are native,
#: so tests cannot patch their methods: the awaits tests cancel or hold at call `lockgate.awaitpoints.hook`. No
#: attribute may share a name with a C macro of the compiler (`self._unix` became `->__unix`, and gcc defines `unix`).
COMPILED = [
    "src/lockgate/sse.py",
    "src/lockgate/assemble.py",
    "src/lockgate/chunkshape.py",
    "src/lockgate/responses.py",
    "src/lockgate/respond.py",
    "src/lockgate/relay.py",
    "src/lockgate/answer.py",
    "src/lockgate/upstream.py",
    "src/lockgate/attempt.py",
    "src/lockgate/wire.py",
    "src/lockgate/header_lines.py",
    "src/lockgate/admission/scheduler.py",
    "src/lockgate/admission/gate.py",
    "src/lockgate/admission/tenants.py",
    "src/lockgate/admission/ratelimit.py",
    "src/lockgate/fleet/state.py",
    "src/lockgate/fleet/ejection.py",
    "src/lockgate/dedup/eligibility.py",
    "src/lockgate/http/connection.py",
    "src/lockgate/http/pool.py",
    "src/lockgate/edge/protocol.py",
    "src/lockgate/edge/request.py",
    "src/lockgate/edge/response.py",
    "src/lockgate/fleet/pool.py",
    "src/lockgate/fleet/fleet.py",
    "src/lockgate/fleet/instance.py",
    "src/lockgate/metrics.py",
    "src/lockgate/dedup/coalescer.py",
    "src/lockgate/changes.py",
    "src/lockgate/dedup/flight.py",
    "src/lockgate/dedup/flights.py",
    "src/lockgate/dedup/waiting.py",
    "src/lockgate/dedup/cache.py",
    "src/lockgate/dedup/fingerprint.py",
]

if os.environ.get("LOCKGATE_COMPILE") == "1":
    from mypyc.build import mypycify

    setup(ext_modules=mypycify(COMPILED, opt_level="3"))
else:
    setup()
