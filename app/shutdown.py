"""Shutting down without losing answers: on SIGTERM the service drains, then exits.

Draining: ``/ready`` answers 503 (a load balancer stops sending), every new ``/v1`` request
gets 503 with ``Retry-After`` while the listener stays open, and the answers in flight run on
for up to the grace period (``DOCQA_SHUTDOWN_GRACE_S``). Those still running then are
cancelled, and a conversation turn is stored with finish reason ``cancelled`` as for any
cancellation. Then uvicorn shuts down as usual and the process exits 0. A second signal (or
SIGINT) stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import uvicorn

log = logging.getLogger("docqa.shutdown")

# how long the cancelled answers' turns may take to be stored before the process exits anyway
STORE_WAIT_S = 10.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM (module docstring)."""

    def __init__(self, config: uvicorn.Config, state, grace_s: float):
        super().__init__(config)
        self.state = state  # the app's state: its runner, its question service, ``draining``
        self.grace_s = grace_s
        self._drain: threading.Thread | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM or self._drain is not None:
            super().handle_exit(sig, frame)
            return
        self.state.draining = True
        self._drain = threading.Thread(target=self._run_drain, name="docqa-drain", daemon=True)
        self._drain.start()

    def _run_drain(self) -> None:
        runner, qa = self.state.runner, self.state.qa
        log.info(
            "draining: %d answers in flight, %.0f s to finish", runner.num_active, self.grace_s
        )
        deadline = time.monotonic() + self.grace_s
        while runner.num_active and time.monotonic() < deadline:
            time.sleep(0.05)
        if runner.num_active:
            log.info("cancelling the %d answers still running", runner.num_active)
            runner.cancel_all()
        deadline = time.monotonic() + STORE_WAIT_S
        while (runner.num_active or qa.num_pending) and time.monotonic() < deadline:
            time.sleep(0.05)
        log.info("drained; shutting down")
        self.should_exit = True
