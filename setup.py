"""Build hook for the opt-in compiled build: `LOCKGATE_COMPILE=1 pip install --no-build-isolation .` (with mypy
installed) compiles the modules of the request path listed in `COMPILED` with mypyc; without the variable this is
the plain pure-Python package (metadata: pyproject.toml). `make test-compiled` builds it into `.venv-compiled` and
runs the test suite against it. Keep `COMPILED` in step with `lockgate.bench.machine.HOT_MODULES`."""

import os

from setuptools import setup

#: Mypyc compiles these (not `upstream.py` / `attempt.py`: mypyc has no async generators yet).
COMPILED = ["src/lockgate/sse.py", "src/lockgate/assemble.py", "src/lockgate/respond.py", "src/lockgate/relay.py"]

if os.environ.get("LOCKGATE_COMPILE") == "1":
    from mypyc.build import mypycify

    setup(ext_modules=mypycify(COMPILED, opt_level="3"))
else:
    setup()
