"""Cancelling an answer that runs on another replica.

Replicas sit behind a load balancer that routes by manual (the README's "Scaling out"); they
do not know each other. A cancel (``POST /v1/requests/{id}/cancel``) names only the answer,
and even a manual-scoped one (``/v1/manuals/{id}/requests/{rid}/cancel``) can reach another
replica than the one running it, when bounded loads sent the question on to the next replica
of the ring. A balancer cannot know where an answer runs, so this is kept here: a replica that
does not run the request publishes its id on one Redis channel (a cluster carries a publish to
every node); the replica that runs it cancels it and pushes the outcome to a reply list the
asking replica waits on for ``WAIT_S``.

    {prefix}cancel                  channel: {"id", "tenant", "reply"}
    {prefix}cancel-reply:{nonce}    list: the outcome (CancelOut's fields), kept 30 s
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable

log = logging.getLogger("docqa.cancel")

WAIT_S = 1.5  # how long a replica waits for the one running a request to answer
_REPLY_TTL_S = 30


class CancelRelay:
    """Publishes cancels this replica cannot serve, and serves those others publish.

    ``cancel_local(request_id, tenant)`` is the replica's own cancel, awaited on the event loop:
    the outcome as a dict, or None where the request is not running here."""

    def __init__(
        self,
        redis_url: str,
        prefix: str,
        cancel_local: Callable[[str, str], Awaitable[dict | None]],
    ):
        self._url = redis_url
        self._client = None  # made on first use: Redis may be away when the replica starts
        self._client_lock = threading.Lock()
        self._channel = f"{prefix}cancel"
        self._reply_prefix = f"{prefix}cancel-reply:"
        self._cancel_local = cancel_local
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="docqa-cancel", daemon=True)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()

    def _redis(self):
        """The client (raises while Redis is away)."""
        from prefix_store.redis_client import redis_client

        with self._client_lock:
            if self._client is None:
                self._client = redis_client(self._url, timeout_s=2.0)
            return self._client

    async def cancel_elsewhere(self, request_id: str, tenant: str) -> dict | None:
        """The outcome of cancelling ``request_id`` on whichever replica runs it, or None where
        none answered within ``WAIT_S`` (no replica runs it, or Redis is away)."""
        reply = f"{self._reply_prefix}{uuid.uuid4().hex}"
        msg = json.dumps({"id": request_id, "tenant": tenant, "reply": reply})

        def ask() -> dict | None:
            # (a cluster node counts only its own subscribers: the count says nothing here)
            client = self._redis()
            client.publish(self._channel, msg)
            got = client.blpop([reply], timeout=WAIT_S)
            return json.loads(got[1]) if got else None

        try:
            return await asyncio.to_thread(ask)
        except Exception as e:  # noqa: BLE001 - Redis away: the cancel is simply not found
            log.warning("could not relay the cancel of %s: %s", request_id, e)
            return None

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                pubsub = self._redis().pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self._channel)
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=1.0)
                    if msg is not None:
                        self._serve(msg["data"])
            except Exception as e:  # noqa: BLE001 - Redis away: listen again when it is back
                if self._stop.is_set():
                    return
                log.debug("cancel relay: %s; listening again", e)
                self._stop.wait(1.0)

    def _serve(self, data: bytes) -> None:
        try:
            req = json.loads(data)
            fut = asyncio.run_coroutine_threadsafe(
                self._cancel_local(req["id"], req["tenant"]), self._loop
            )
            outcome = fut.result(timeout=WAIT_S)
        except Exception as e:  # noqa: BLE001 - a malformed or failed cancel answers nothing
            log.debug("cancel relay: %s", e)
            return
        if outcome is not None:
            pipe = self._redis().pipeline(transaction=False)
            pipe.rpush(req["reply"], json.dumps(outcome))
            pipe.expire(req["reply"], _REPLY_TTL_S)
            pipe.execute()
