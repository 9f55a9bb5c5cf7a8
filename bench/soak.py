"""A soak: N minutes of 16 concurrent clients doing everything users do, then a check of what
the service stored and held.

    .venv/bin/python bench/soak.py [--minutes 10] [--clients 16] [--url URL] [--out FILE]

Each client picks, at random and by weight, one of: upload a new manual; upload one of a few
fixed texts again (the stored manual comes back); ask about a manual (plain or streamed); a
conversation's next turn (plain or streamed); a streamed answer cancelled with
``POST /v1/requests/{id}/cancel``; a streamed answer whose client disconnects mid-stream;
a manual deleted while a question about it runs; reading a conversation back. Without
``--url`` it starts its own ``docqa serve`` on a temporary SQLite file.

At the end, with the clients stopped and the engine idle, it checks and prints (a line each,
PASS or FAIL, exit 1 on any FAIL):

- server errors: no 5xx response;
- answered: every request got a response (a 2xx, or the 4xx its race explains: a manual or
  conversation deleted under it);
- messages: every answer given in a conversation is stored once, whole (a user message, then
  its answer), and readable; turns the client cancelled or dropped are stored at most once;
- conversations: none points at a missing manual;
- KV blocks: every block free or cached (none held with no request running);
- memory: the server's resident memory at the end within 5% of its value after the warm-up
  (the first minute, or a tenth of the run).

Results go to bench/results/soak-DATE.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from svc_helpers import Server, sse_events  # noqa: E402

SAMPLE = (ROOT / "app" / "samples" / "tarx-manual.md").read_text()
QUESTIONS = [
    "Which option compresses the archive?",
    "How do I keep existing files?",
    "What does -C do?",
    "Which exit status is fatal?",
    "How do I list an archive?",
]
# what a client does, and how often
ACTIONS = {
    "upload": 2,
    "upload_again": 2,
    "ask": 6,
    "ask_streamed": 4,
    "turn": 6,
    "turn_streamed": 4,
    "cancel": 2,
    "disconnect": 2,
    "delete_while_asking": 1,
    "read_conversation": 3,
}
# 4xx a race explains: the manual or conversation was deleted by another client meanwhile
RACE_CODES = {"manual_not_found", "conversation_not_found", "request_not_found"}


def manual_text(tag: str, paragraphs: int = 3) -> str:
    return f"Edition {tag}\n\n" + "\n\n".join(SAMPLE.split("\n\n")[: paragraphs * 4])


class Soak:
    def __init__(self, url: str, clients: int, seconds: float, seed: int):
        self.url = url
        self.clients = clients
        self.seconds = seconds
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.manuals: list[str] = []  # live manual ids
        self.conversations: dict[str, str] = {}  # conversation id -> manual id
        self.deleted_manuals: set[str] = set()
        self.fixed_texts = [manual_text(f"fixed-{i}", 2) for i in range(3)]
        self.fixed_ids: dict[int, str] = {}
        self.statuses: Counter = Counter()
        self.unexplained: list[str] = []  # responses no race explains
        self.answered_turns: dict[str, str] = {}  # answer id -> conversation id (finished)
        self.partial_turns: dict[str, str] = {}  # cancelled or dropped turns
        self.errors: list[str] = []  # transport errors, exceptions in a client

    # -- bookkeeping -------------------------------------------------------------------------
    def record(self, r: httpx.Response, what: str) -> dict:
        with self.lock:
            self.statuses[r.status_code] += 1
        body = {}
        if r.headers.get("content-type", "").startswith("application/json"):
            body = r.json()
        if r.status_code >= 400:
            code = body.get("error", {}).get("code", "")
            if r.status_code >= 500 or code not in RACE_CODES:
                with self.lock:
                    self.unexplained.append(f"{what}: {r.status_code} {r.text[:200]}")
        return body

    def pick_manual(self, rng) -> str | None:
        with self.lock:
            return rng.choice(self.manuals) if self.manuals else None

    def pick_conversation(self, rng) -> tuple[str, str] | None:
        with self.lock:
            if not self.conversations:
                return None
            cid = rng.choice(list(self.conversations))
            return cid, self.conversations[cid]

    # -- actions -----------------------------------------------------------------------------
    def upload(self, c, rng, text: str | None = None) -> str | None:
        text = text or manual_text(uuid.uuid4().hex, rng.randint(1, 4))
        body = self.record(c.post("/v1/manuals", json={"title": "soak", "text": text}), "upload")
        mid = body.get("id")
        if mid:
            with self.lock:
                if mid not in self.manuals:
                    self.manuals.append(mid)
        return mid

    def upload_again(self, c, rng) -> None:
        i = rng.randrange(len(self.fixed_texts))
        mid = self.upload(c, rng, self.fixed_texts[i])
        with self.lock:
            known = self.fixed_ids.get(i)
            if known is None or known in self.deleted_manuals:
                self.fixed_ids[i] = mid
            elif mid != known:
                self.unexplained.append(f"upload_again: {mid} for text {i} stored as {known}")

    def question(self, rng) -> dict:
        return {"question": rng.choice(QUESTIONS), "max_tokens": rng.randint(4, 24)}

    def ask(self, c, rng, stream: bool = False) -> None:
        mid = self.pick_manual(rng)
        if mid is None:
            return
        body = {"manual_id": mid, **self.question(rng)}
        if stream:
            self.stream(c, "/v1/ask", body)
        else:
            self.record(c.post("/v1/ask", json=body), "ask")

    def turn(self, c, rng, stream: bool = False) -> None:
        conv = self.pick_conversation(rng)
        if conv is None or rng.random() < 0.2:
            mid = self.pick_manual(rng)
            if mid is None:
                return
            body = self.record(c.post("/v1/conversations", json={"manual_id": mid}), "create")
            if "id" not in body:
                return
            with self.lock:
                self.conversations[body["id"]] = mid
            conv = (body["id"], mid)
        cid = conv[0]
        q = self.question(rng)
        body = {"content": q["question"], "max_tokens": q["max_tokens"]}
        path = f"/v1/conversations/{cid}/messages"
        answer = (
            self.stream(c, path, body) if stream else self.record(c.post(path, json=body), "turn")
        )
        if answer and answer.get("id"):
            with self.lock:
                target = (
                    self.answered_turns
                    if answer.get("finish_reason") in ("stop", "length")
                    else self.partial_turns
                )
                target[answer["id"]] = cid

    def stream(self, c, path: str, body: dict, stop_after: str | None = None) -> dict:
        """A streamed answer; ``stop_after``: "disconnect" drops the connection at the first
        token, "cancel" cancels through the API there. Returns the answer object, if one came."""
        answer: dict = {}
        with c.stream("POST", path, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                r.read()
                self.record(r, f"stream {path}")
                return answer
            with self.lock:
                self.statuses[200] += 1
            for event, data in sse_events(r):
                if event == "token" and stop_after == "disconnect":
                    return {"id": r.headers.get("x-request-id"), "finish_reason": "dropped"}
                if event == "token" and stop_after == "cancel":
                    stop_after = None
                    rid = r.headers["x-request-id"]
                    self.record(c.post(f"/v1/requests/{rid}/cancel"), "cancel")
                elif event == "answer":
                    answer = data
                elif event == "error":
                    with self.lock:
                        self.unexplained.append(f"stream error {path}: {json.dumps(data)[:200]}")
        return answer

    def cancel(self, c, rng) -> None:
        self.stop_a_turn(c, rng, "cancel")

    def disconnect(self, c, rng) -> None:
        self.stop_a_turn(c, rng, "disconnect")

    def stop_a_turn(self, c, rng, how: str) -> None:
        """A long streamed turn stopped at its first token (``stream``'s ``stop_after``)."""
        conv = self.pick_conversation(rng)
        if conv is None:
            return
        path = f"/v1/conversations/{conv[0]}/messages"
        body = {"content": "Describe everything.", "max_tokens": 200, "ignore_eos": True}
        answer = self.stream(c, path, body, stop_after=how)
        if answer.get("id"):
            with self.lock:
                self.partial_turns[answer["id"]] = conv[0]

    def delete_while_asking(self, c, rng) -> None:
        mid = self.upload(c, rng)
        if mid is None:
            return
        conv = self.record(c.post("/v1/conversations", json={"manual_id": mid}), "create")
        asking = threading.Thread(
            target=self._ask_quietly, args=(mid, conv.get("id")), name="soak-asking"
        )
        asking.start()
        time.sleep(rng.uniform(0.0, 0.3))
        with self.lock:
            if mid in self.manuals:
                self.manuals.remove(mid)
            self.deleted_manuals.add(mid)
            self.conversations = {k: v for k, v in self.conversations.items() if v != mid}
        self.record(c.delete(f"/v1/manuals/{mid}"), "delete")
        asking.join(120)

    def _ask_quietly(self, mid: str, cid: str | None) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as c:
            body = {"content": "What does -k do?", "max_tokens": 16}
            if cid:
                self.record(c.post(f"/v1/conversations/{cid}/messages", json=body), "turn")
            self.record(
                c.post("/v1/ask", json={"manual_id": mid, "question": "What?", "max_tokens": 8}),
                "ask",
            )

    def read_conversation(self, c, rng) -> None:
        conv = self.pick_conversation(rng)
        if conv is not None:
            self.record(c.get(f"/v1/conversations/{conv[0]}"), "read")

    # -- the run -----------------------------------------------------------------------------
    def client(self, i: int, deadline: float) -> None:
        rng = random.Random(self.rng.random() + i)
        names, weights = zip(*ACTIONS.items(), strict=True)
        with httpx.Client(base_url=self.url, timeout=120) as c:
            while time.monotonic() < deadline:
                action = rng.choices(names, weights)[0]
                try:
                    if action in ("ask_streamed", "turn_streamed"):
                        getattr(self, action.removesuffix("_streamed"))(c, rng, stream=True)
                    else:
                        getattr(self, action)(c, rng)
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    with self.lock:
                        self.errors.append(f"{action}: {type(e).__name__}: {e}")

    def run(self, rss) -> dict:
        with httpx.Client(base_url=self.url, timeout=120) as c:
            for _ in range(3):
                self.upload(c, self.rng)
        deadline = time.monotonic() + self.seconds
        warm_at = min(60.0, self.seconds / 10)
        threads = [
            threading.Thread(target=self.client, args=(i, deadline), name=f"soak-{i}")
            for i in range(self.clients)
        ]
        for t in threads:
            t.start()
        time.sleep(warm_at)
        rss_warm = rss()
        for t in threads:
            t.join()
        return {"rss_after_warmup": rss_warm, "warmup_s": warm_at}


def check(url: str, soak: Soak, rss_warm: int | None, rss_end: int | None) -> list[tuple]:
    """(name, passed, detail) for each check of the module docstring."""
    lines = []
    fives = sum(n for s, n in soak.statuses.items() if s >= 500)
    lines.append(("server errors", fives == 0, f"{fives} responses 5xx"))
    total = sum(soak.statuses.values())
    ok = not soak.unexplained and not soak.errors
    detail = f"{total} responses {dict(sorted(soak.statuses.items()))}"
    if not ok:
        detail += f"; unexplained: {(soak.unexplained + soak.errors)[:5]}"
    lines.append(("answered", ok, detail))
    with httpx.Client(base_url=url, timeout=120) as c:
        deadline = time.monotonic() + 120
        while True:  # the engine idle: the last answers stored
            e = c.get("/v1/engine").json()
            if e["requests_running"] == 0 and e["requests_waiting"] == 0:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        time.sleep(1.0)
        stored: dict[str, list] = {}
        for cid in set(soak.answered_turns.values()) | set(soak.partial_turns.values()):
            r = c.get(f"/v1/conversations/{cid}")
            if r.status_code == 200:
                stored[cid] = r.json()["messages"]
        manual_of = {}
        offset = 0
        while True:
            page = c.get("/v1/conversations", params={"limit": 1000, "offset": offset}).json()
            for conv in page["items"]:
                manual_of[conv["id"]] = conv["manual_id"]
            if len(page["items"]) < 1000:
                break
            offset += 1000
        missing = [
            cid for cid, mid in manual_of.items() if c.get(f"/v1/manuals/{mid}").status_code != 200
        ]
        e = c.get("/v1/engine").json()
    answers = Counter()
    malformed = []
    for cid, messages in stored.items():
        roles = [m["role"] for m in messages]
        if roles != ["user", "assistant"] * (len(roles) // 2) or any(
            not m["content"] and m["role"] == "user" for m in messages
        ):
            malformed.append(cid)
        for m in messages:
            if m["role"] == "assistant":
                answers[m["id"]] += 1
    lost = [a for a, cid in soak.answered_turns.items() if cid in stored and answers[a] != 1]
    twice = [a for a, n in answers.items() if n > 1]
    lines.append(
        (
            "messages",
            not (lost or twice or malformed),
            f"{len(soak.answered_turns)} answered turns, {len(soak.partial_turns)} cancelled "
            f"or dropped; {len(lost)} lost, {len(twice)} stored twice, {len(malformed)} "
            "conversations out of order",
        )
    )
    lines.append(
        (
            "conversations",
            not missing,
            f"{len(manual_of)} conversations, {len(missing)} pointing at a missing manual",
        )
    )
    held = e["blocks_in_use"] - e["pinned_blocks"]
    lines.append(
        (
            "KV blocks",
            held == 0,
            f"{e['blocks_free']} free ({e['blocks_cached']} cached), {held} held, "
            f"{e['pinned_blocks']} pinned, {e['kv_capacity_blocks']} in all",
        )
    )
    if rss_warm and rss_end:
        growth = rss_end / rss_warm - 1
        lines.append(
            (
                "memory",
                abs(growth) <= 0.05,
                f"{rss_warm / 2**20:.0f} MiB after warm-up, {rss_end / 2**20:.0f} MiB at the "
                f"end ({growth:+.1%})",
            )
        )
    return lines


def rss_of(pid: int):
    def read() -> int | None:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    return read


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--url", help="a running server (default: start one on a temporary SQLite)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="JSON path (default: bench/results/soak-DATE.json)")
    args = ap.parse_args()
    srv = None
    if args.url:
        url, rss = args.url, (lambda: None)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="docqa-soak-"))
        srv = Server(tmp, f"sqlite:///{tmp / 'soak.db'}", name="soak").start()
        url, rss = srv.url, rss_of(srv.proc.pid)
    try:
        soak = Soak(url, args.clients, args.minutes * 60, args.seed)
        t0 = time.monotonic()
        print(f"soak: {args.clients} clients for {args.minutes:g} min against {url}", flush=True)
        run = soak.run(rss)
        wall = time.monotonic() - t0
        rss_end = rss()
        lines = check(url, soak, run["rss_after_warmup"], rss_end)
    finally:
        if srv is not None:
            srv.stop()
    failed = False
    for name, passed, detail in lines:
        failed |= not passed
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}")
    out = (
        Path(args.out)
        if args.out
        else ROOT / "bench" / "results" / f"soak-{dt.datetime.now():%Y-%m-%d-%H%M}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": dt.datetime.now().isoformat(timespec="seconds"),
                "clients": args.clients,
                "minutes": args.minutes,
                "wall_s": round(wall, 1),
                "statuses": dict(soak.statuses),
                "answered_turns": len(soak.answered_turns),
                "partial_turns": len(soak.partial_turns),
                "rss_after_warmup": run["rss_after_warmup"],
                "rss_end": rss_end,
                "checks": [{"name": n, "passed": p, "detail": d} for n, p, d in lines],
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
