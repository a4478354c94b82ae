"""Compiling the forward in a process of its own while the engine serves eagerly
(`EngineConfig(compile_in_background=True)`, `lifeline serve`'s default).

A first start on a machine finds no compiled graphs in the on-disk cache
(lifeline.model.compiled) and would trace and compile for a minute or more per model before
`/ready`. Instead the engine starts eager, ready as soon as its weights are, and a child
process (`python -m lifeline.engine.background_compile SPEC`) loads the same model with the
same weight format and thread count, compiles its two graphs and saves them under the same key.
When it exits, a thread here loads them (a second or two) and the engine's next step runs
compiled. A later start finds the graphs in the cache and only loads them, in that thread,
also after `/ready` (state `loading`), once no other engine of the process is still being
built (a server's backends start at once): loading needs Dynamo and Inductor imported, ~3 s of
a ~10 s start on a 2-core machine (docs/performance.md); if they do not load, a child compiles
them again. The child's work is the same a foreground compile would do, so for that minute the
two share the CPU: requests are served, eagerly and slower (docs/performance.md measures it).
Nothing in this process compiles: `lifeline:compiles_after_ready_total` stays at zero.

The child runs at the lowest priority (nice 19) with one compiler thread, so the server's
threads take the cores whenever they have work: at the same priority, the server's spinning
OpenMP threads and the compiler shared two cores so badly that a request took ~10x longer than
eagerly alone. A child that fails, or whose graphs do not load, leaves the engine eager (a
warning); the child dies with this process (Linux's parent-death signal) and is stopped by
`close`.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("lifeline.engine")

STATES = ("eager", "loading", "compiling", "compiled", "failed")
"""How the forward runs: eager (not asked to compile, or the model cannot), eager while the
cached graphs load, eager while a child compiles, compiled, eager after the child failed."""


_builds = 0
_builds_done = threading.Condition()
"""Engines this process is building (`engine_building`): cached graphs load once none is, so
that one backend's load does not slow another's start (`make serve` builds two at once)."""


def engine_building() -> None:
    """An engine's load and build begin (call `engine_built` when they end, either way)."""
    global _builds
    with _builds_done:
        _builds += 1


def engine_built() -> None:
    global _builds
    with _builds_done:
        _builds -= 1
        _builds_done.notify_all()


def _wait_for_builds() -> None:
    with _builds_done:
        _builds_done.wait_for(lambda: _builds <= 0)


def _child_setup() -> None:  # runs in the child between fork and exec
    os.nice(19)  # the server's threads first: spinning OpenMP threads sharing two cores with a
    # compiler at the same priority made a request ~10x slower (docs/performance.md)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


class BackgroundCompile:
    """The graphs of the forward `prepare()` gives (a `CachedForward` not yet in use) loaded
    from the cache where it has them, else compiled by a child for the model at `source` in
    `weights`; once they load, `executor` runs them. With `deferred` (`ModelExecutor.
    deferred_weights`), `prepare` first builds the weight format's copies for batches, in this
    thread after `/ready` (state `loading` until the graphs are found or not)."""

    def __init__(self, executor: Any, prepare: Callable[[], Any], source: str,
                 weights: str | None, deferred: Any = None):
        self.executor, self._deferred = executor, deferred
        self.started = time.perf_counter()
        self.seconds: float | None = None
        """From the start (of the load, else the child) to the graphs in use (or the
        failure)."""
        self.weights_seconds: float | None = None
        """The weight format's conversions this thread finished (`deferred`), in seconds."""
        self._spec = {"source": source, "weights": weights, "threads": _threads()}
        self._proc: subprocess.Popen[str] | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._prepare: Callable[[], Any] | None = prepare if deferred is not None else None
        self.forward: Any = None if deferred is not None else prepare()
        self.state = "loading"
        if self.forward is not None:
            self._found()
        else:
            log.info("serving eagerly while the weights for batches are built and the compiled "
                     "forward found")
        self._thread = threading.Thread(target=self._run, name="lifeline-background-compile",
                                        daemon=True)
        self._thread.start()

    def _found(self) -> None:
        """The forward known: load its graphs if the cache has them, else start a child."""
        self._spec["key"] = self.forward.directory.name
        self.state = "loading" if self.forward.cached() else "compiling"
        if self.state == "compiling":
            self._start_child()
        else:
            log.info("serving eagerly while the compiled forward loads from %s",
                     self.forward.directory)

    def _start_child(self) -> None:
        with self._lock:
            if self._closed:
                return
            env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # one compiler at a time
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "lifeline.engine.background_compile",
                 json.dumps(self._spec)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                preexec_fn=_child_setup if os.name == "posix" else None)
            log.info("serving eagerly while a child process (pid %d) compiles the forward "
                     "into %s", self._proc.pid, self.forward.directory)

    def _run(self) -> None:
        if self._prepare is not None:
            _wait_for_builds()  # the other backends' starts first, as for a load
            start = time.perf_counter()
            try:
                self.forward = self._prepare()
            except Exception as e:  # noqa: BLE001 (the forward stays eager, and says why)
                return self._fail(f"{type(e).__name__}: {e}")
            self.weights_seconds = time.perf_counter() - start
            if self._closed:
                return self._fail("stopped while the weights for batches were built")
            log.info("the weights for batches built in %.1f s", self.weights_seconds)
            self._found()
        if self.state == "loading":
            _wait_for_builds()
            if self._use():
                return
            log.warning("the cached compiled forward in %s did not load; compiling it again "
                        "in a child process", self.forward.directory)
            self.state = "compiling"
            self._start_child()
        if self._proc is None:  # closed first
            return self._fail("stopped before the child started")
        out, err = self._proc.communicate()
        if self._proc.returncode != 0:
            return self._fail(f"the compiling child exited with status {self._proc.returncode}"
                              f": {err.strip()[-2000:]}")
        try:
            report = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return self._fail(f"the compiling child reported nothing: {out[-500:]!r}")
        if report.get("key") != self.forward.directory.name:
            return self._fail(f"the child compiled another key ({report.get('key')}, not "
                              f"{self.forward.directory.name}): its model differs from ours")
        if not self._use():
            return self._fail("the child's graphs did not load")

    def _use(self) -> bool:
        """Load the graphs and run them from the engine's next step; False where they do not
        load."""
        try:
            loaded = self.forward.preload()
        except Exception as e:  # noqa: BLE001 (whatever stops the load leaves the forward eager)
            log.warning("compiled graphs not loaded from %s (%s: %s)", self.forward.directory,
                        type(e).__name__, e)
            return False
        if not loaded:
            return False
        self.executor.runner.forward = self.forward  # the next step runs compiled
        self.executor.compiled = True
        how = "compiled" if self.state == "compiling" else "loaded"
        self.state = "compiled"
        self.seconds = time.perf_counter() - self.started
        log.info("the forward runs compiled from now on (%s in the background in %.1f s)",
                 how, self.seconds)
        return True

    def _fail(self, why: str) -> None:
        self.state = "failed"
        self.seconds = time.perf_counter() - self.started
        log.warning("background compile failed, the forward stays eager: %s", why)

    def wait(self, timeout: float | None = None) -> str:
        """Block until the child has ended and its graphs are in use or refused; the state."""
        self._thread.join(timeout)
        return self.state

    def close(self) -> None:
        """Stop the child if it still runs (and any that a failed load would start), skip
        the weights' conversions not yet begun, and wait for this thread to end: an
        interpreter that exits under a conversion or a load aborts."""
        with self._lock:
            self._closed = True
        if self._deferred is not None:
            self._deferred.cancel()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if threading.current_thread() is not self._thread:
            self._thread.join(15)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def main(argv: list[str]) -> int:
    """The child: load the model as the parent did, compile (the engine's warm-up saves the
    graphs), report the key."""
    spec = json.loads(argv[0])
    import torch

    torch.set_num_threads(int(spec["threads"]))  # part of the key: Inductor bakes it in
    from lifeline.engine.engine import EngineConfig, LLMEngine
    from lifeline.model.compiled import CachedForward
    from lifeline.model.loader import load_model

    loaded = load_model(spec["source"])
    engine = LLMEngine(loaded, EngineConfig(weights=spec["weights"], compile=True,
                                            compile_in_background=False, max_num_seqs=2,
                                            max_model_len=256, step_log_size=0))
    forward = engine.executor.runner.forward
    if not isinstance(forward, CachedForward):
        print(json.dumps({"key": None}))
        return 1
    print(json.dumps({"key": forward.directory.name, "compiled": forward.compiled,
                      "loaded": forward.loaded}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
