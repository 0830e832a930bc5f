"""Exit non-zero when the engine core dies, so the platform restarts the server.

vLLM 0.32.0 notices a dead engine core (``MPClient``'s monitor thread marks it dead, ``/health``
answers 503) and its own ``watchdog_loop`` stops uvicorn within ~5 s. But the API server then
returns from ``main()`` normally, so the process exits with status 0: to a supervisor that is a
clean stop, not a crash, and a platform that restarts failed containers leaves it down. PLATFORM.md
lists "a dead engine (every later request fails)" among the replay's failure classes.

``install_engine_watchdog(app)`` starts one daemon thread that polls the engine client vLLM stores
on ``app.state`` (its output handler, see ``_engine_dead``). Once the engine is dead it

1. logs why the server is going down,
2. makes the interpreter's final exit status ``EXIT_CODE`` (an ``atexit`` hook, registered at
   install time so that it runs after vLLM's own shutdown has had its turn), and
3. if the process is still alive ``exit_deadline_s`` later (vLLM's shutdown hung, or the
   server has no watchdog of its own), ends it with ``os._exit(EXIT_CODE)``.

It leaves the server alone when ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`` is set, vLLM's switch for
"keep serving after engine death".
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import Any

# A child of vLLM's "vllm" logger, so in the server the lines carry vLLM's format and handler.
logger = logging.getLogger("vllm.overrides.engine_watchdog")

EXIT_CODE = 3  # distinct from 1 (Python error) and 2 (usage), so a supervisor log says why
_state: dict[str, Any] = {"dead_since": None, "apps": []}
_clients: dict[int, Any] = {}  # id(app) -> the engine client last seen on app.state
_lock = threading.Lock()


def _keep_alive_requested() -> bool:
    return os.environ.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "0").lower() in ("1", "true")


def _engine_dead(app: Any) -> bool:
    """True once vLLM's output handler has ended on its own: the engine died or failed.

    ``AsyncLLM.errored`` cannot tell a death from a requested shutdown (the client's cleanup
    marks the engine dead in both). The output handler can: it is started with the server and
    runs until the engine dies or fails - then it logs "AsyncLLM output_handler failed" and
    returns - or until ``AsyncLLM.shutdown`` (SIGTERM/SIGINT) cancels it.
    """
    state = getattr(app, "state", None)
    client = getattr(state, "engine_client", None)
    if client is not None:
        _clients[id(app)] = client
    else:
        # vLLM's shutdown can drop ``app.state`` before the exit hook looks: use the client
        # seen while the server ran (found when a replay's server was stopped with SIGTERM).
        client = _clients.get(id(app))
    handler = getattr(client, "output_handler", None)
    if handler is None:  # before init_app_state, a render-only server, or not an AsyncLLM
        return False
    try:
        return bool(handler.done() and not handler.cancelled())
    except Exception:  # noqa: BLE001 - a handler that cannot answer is not a live engine
        return True


def _exit_status_hook() -> None:
    # The server can finish its own shutdown before the watchdog's next poll (in one CI run it
    # exited 0.8 s after the engine core was killed, against a 1 s poll): look once more here.
    if _state["dead_since"] is None and any(_engine_dead(app) for app in _state["apps"]):
        _state["dead_since"] = time.monotonic()
        logger.error("engine core is dead; the API server exits with status %d", EXIT_CODE)
    if _state["dead_since"] is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_CODE)


def _watch(app: Any, poll_s: float, exit_deadline_s: float) -> None:
    while True:
        time.sleep(poll_s)
        if _engine_dead(app):
            break
    _state["dead_since"] = time.monotonic()
    logger.error(
        "engine core is dead; the API server exits with status %d so that it is restarted "
        "(hard exit in %.0f s if the shutdown does not finish)",
        EXIT_CODE,
        exit_deadline_s,
    )
    time.sleep(exit_deadline_s)
    logger.error("shutdown did not finish in %.0f s; exiting now", exit_deadline_s)
    _exit_status_hook()


def install_engine_watchdog(
    app: Any, *, poll_s: float = 1.0, exit_deadline_s: float = 30.0
) -> threading.Thread | None:
    """Start the watchdog for ``app`` (a FastAPI app whose state gets ``engine_client``).

    Returns the thread, or None when ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`` is set. Installing twice
    (a second ``build_app``) starts a second thread; both converge on the same exit.
    """
    if _keep_alive_requested():
        logger.info("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH set: engine watchdog not installed")
        return None
    with _lock:
        _state["apps"].append(app)
        if not _state.get("hooked"):
            atexit.register(_exit_status_hook)
            _state["hooked"] = True
    thread = threading.Thread(
        target=_watch, args=(app, poll_s, exit_deadline_s), name="EngineWatchdog", daemon=True
    )
    thread.start()
    return thread
