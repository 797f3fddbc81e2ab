# lockgate in a container: `docker build -t lockgate .`, then see README.md ("Docker").
# The official Python images are built with PGO + LTO, which the gateway's CPU per request benefits from
# (docs/decisions.md, "The interpreter").

# The build stage: lockgate's compiled build (setup.py: the request path compiled with mypyc) as a wheel. It needs a
# C compiler, which the image that runs it does not carry.
FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /build
COPY pyproject.toml setup.py README.md ./
COPY src ./src
# mypyc type-checks the package against its dependencies: they are installed first.
RUN pip install 'setuptools>=77' wheel 'mypy>=1.10' . \
    && LOCKGATE_COMPILE=1 pip wheel --no-build-isolation --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The compiled wheel; every dependency ships wheels of its own.
COPY --from=build /wheels /wheels
RUN pip install /wheels/*.whl && rm -rf /wheels

# A non-root user; its home is the working directory, where the usage database goes (lockgate-usage.sqlite3).
RUN useradd --system --uid 10001 --create-home --home-dir /var/lib/lockgate --shell /usr/sbin/nologin lockgate \
    && mkdir -p /etc/lockgate
USER lockgate
WORKDIR /var/lib/lockgate
VOLUME ["/var/lib/lockgate"]

# The configuration is mounted read-only at /etc/lockgate/lockgate.yaml and named with --config.
EXPOSE 8080
ENV LOCKGATE_HEALTH_URL=http://127.0.0.1:8080/health
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['LOCKGATE_HEALTH_URL'], timeout=2)"]

# SIGTERM drains (shutdown.drain_ms, 10 s by default: give `docker stop` a longer -t); SIGHUP reloads.
STOPSIGNAL SIGTERM
ENTRYPOINT ["lockgate", "serve", "--host", "0.0.0.0"]
CMD []
