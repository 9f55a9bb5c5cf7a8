"""docqa scaled out on what operators run: three replicas behind HAProxy
(deploy/haproxy/haproxy.cfg: consistent hashing on the manual, bounded loads) over one Postgres
and a three-master Redis Cluster, all on loopback; the same load with round-robin balancing
beside it, and the consistent run again with one replica killed half way.

    .venv/bin/python bench/scale_out.py [--manuals 12] [--clients 16] [--questions 24]
        [--balance consistent roundrobin] [--no-kill] [--cpus-per-replica 0.66]
        [--threads-per-replica N] [--kv-cache-gib G]

The manuals are uploaded cold: the load's first questions about a manual are what computes it.
The load: ``--clients`` clients, each asking ``--questions`` questions about manuals drawn at
random (a seeded draw), one-shot on ``/v1/manuals/{id}/ask`` and turns of a conversation on
``/v1/manuals/{id}/conversations/{cid}/messages`` in turn. Reported per balancing: the manual
prefills computed cluster-wide per manual (an answer that computed its manual's whole prefix
counts one; device and Redis hits count nothing), answers per replica and the busiest over the
mean, answers in flight per replica (averaged over the run: the load bounded loads compare) and
the most over the mean, the prompt tokens served from each tier, TTFT p50 and p90, and the
Redis tier's counters (writes dropped, lookups that ran out of time, waits on a claim). The
kill run reports the requests that failed (all in flight on the killed replica, or not), and
for the manuals the killed replica had answered, their answers after the kill: how many found
their prefix cached and the tokens read from Redis. Needs the Postgres at 127.0.0.1:5432 (a
database of its own, dropped at the end), redis-server, redis-cli and haproxy. Writes JSON
under bench/results/. The replicas share this machine's cores unless ``--cpus-per-replica``
holds each to a CPU quota of its own (cgroup v1, root), as replicas on machines of their own
are: then an idle replica's time is not lent to a busy one. Each replica runs the cores over
the replicas in torch threads (one on two cores), as an operator sharing a machine between
replicas would set ``--threads``: three replicas of two threads on two cores answered 4 times
slower. The run is 24 questions a client, so the balance measured is that of the load going
on, not only of the first questions, which wait on their manuals' cold prefills.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime as dt
import json
import math
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from svc_helpers import (  # noqa: E402
    HAProxy,
    RedisCluster,
    Server,
    create_pg_database,
    drop_pg_database,
)

RESULTS = Path(__file__).parent / "results"
REPLICAS = 3
QUESTIONS = [
    "Which mode keeps the water hottest?",
    "How do I reset it?",
    "What does error E2 mean?",
    "What does error E9 mean?",
    "How often should the filter be cleaned?",
    "Which mode keeps the tank above 10 degrees?",
]


def manual_text(name: str, n: int = 8) -> str:
    return (
        f"The {name} heat pump has three modes. Eco keeps the water at 45 degrees. Boost heats "
        f"to 60 degrees once and returns to Eco. Holiday keeps the tank above 10 degrees. To "
        f"reset the {name}, hold MODE and OK for five seconds. Error E2 means low refrigerant "
        f"pressure: call service. Error E9 means the inlet sensor is open. Clean the air filter "
        f"every three months. "
    ) * n


DETECTION_S = 5.0  # the balancer's health checks: a replica down within 2 checks 1 s apart


@dataclass
class Stack:
    redis: RedisCluster
    servers: list[Server]
    lb: HAProxy
    ids: list[str] = field(default_factory=list)  # each server's replica id (x-docqa-replica)

    def server(self, replica_id: str) -> Server:
        return self.servers[self.ids.index(replica_id)]

    def stop(self) -> None:
        self.lb.stop()
        for s in self.servers:
            s.stop()
        self.redis.stop()


def start_stack(
    tmp: Path,
    db_url: str,
    replicas: int = REPLICAS,
    balance: str | None = None,
    api_keys: str | None = None,
    server_args: tuple[str, ...] = (),
) -> Stack:
    """A Redis Cluster, ``replicas`` docqa servers on it and ``db_url`` (started side by side),
    HAProxy in front (``balance``: its routing instead of the manual's hash)."""
    redis = RedisCluster(tmp).start()
    servers = [Server(tmp, db_url, api_keys, name=f"replica-{i}") for i in range(replicas)]
    for i, s in enumerate(servers):
        s.args = server_args
        # the last one names the cluster outright, the others let docqa ask a node
        url = redis.url.replace("redis://", "redis+cluster://") if i == replicas - 1 else redis.url
        s.extra_env = {"DOCQA_REDIS_URL": url}
    with concurrent.futures.ThreadPoolExecutor(replicas) as pool:
        list(pool.map(lambda s: s.start(), servers))
    lb = HAProxy(tmp, [(f"api{i}", s.port) for i, s in enumerate(servers)], balance).start()
    ids = [httpx.get(s.url + "/ready", timeout=10).json()["replica"] for s in servers]
    _wait_all_up(lb, len(servers))
    return Stack(redis, servers, lb, ids)


class CpuQuotas:
    """Each replica's process held to ``cpus`` cores (a cgroup v1 CPU quota of its own), as a
    replica on a machine of its own is: without one, replicas sharing this machine's cores
    lend each other the time an idle one leaves, and a replica answering its own manuals from
    its pool runs on the others' share."""

    ROOT = Path("/sys/fs/cgroup/cpu")

    def __init__(self, pids: list[int], cpus: float):
        if not (self.ROOT / "cgroup.procs").exists() or not os.access(self.ROOT, os.W_OK):
            raise SystemExit(f"--cpus-per-replica: {self.ROOT} (cgroup v1 cpu) is not writable")
        self.groups: list[Path] = []
        for pid in pids:
            group = self.ROOT / f"docqa-bench-{pid}"
            group.mkdir(exist_ok=True)
            period = int((group / "cpu.cfs_period_us").read_text())
            (group / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
            (group / "cgroup.procs").write_text(str(pid))
            self.groups.append(group)

    def throttled_s(self) -> list[float]:
        """Seconds each replica waited for its quota."""
        out = []
        for group in self.groups:
            stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
            out.append(round(int(stat.get("throttled_time", 0)) / 1e9, 1))
        return out

    def release(self) -> None:
        for group in self.groups:
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):  # gone
                    (self.ROOT / "cgroup.procs").write_text(pid)
            group.rmdir()


def _wait_all_up(lb: HAProxy, replicas: int, timeout: float = 30.0) -> None:
    """Until the balancer has sent a request to every replica (its health checks have found
    them all)."""
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    with httpx.Client(base_url=lb.url, timeout=10) as c:
        while len(seen) < replicas:
            assert time.monotonic() < deadline, f"the balancer reached {len(seen)} replicas"
            r = c.get("/health")
            if r.status_code == 200:
                seen.add(r.headers["x-docqa-replica"])
            time.sleep(0.05)


@dataclass
class Result:
    client: int
    start: float
    end: float
    manual: str
    kind: str  # ask | turn
    status: int  # HTTP status, 0 for a connection that failed
    replica: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    redis_tokens: int = 0
    ttft_ms: float = 0.0
    answer_id: str = ""
    conversation: str = ""
    error: str = ""


@dataclass
class Load:
    """Clients asking at random about ``manuals`` until each has asked its questions (or
    ``stop`` is set); results as they finish."""

    url: str
    manuals: list[dict]
    clients: int
    questions: int
    seed: int = 0
    max_tokens: int = 4
    key: str | None = None  # an API key, where the replicas require one
    results: list[Result] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> list[Result]:
        threads = [threading.Thread(target=self._client, args=(i,)) for i in range(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self.results

    def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        convs: dict[str, str] = {}
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        with httpx.Client(base_url=self.url, headers=headers, timeout=120) as c:
            for q in range(self.questions):
                if self.stop.is_set():
                    return
                m = rng.choice(self.manuals)["id"]
                kind = "ask" if q % 2 == 0 else "turn"
                body = {"max_tokens": self.max_tokens}
                question = f"{rng.choice(QUESTIONS)} ({i}.{q})"
                t0 = time.monotonic()
                res = Result(i, t0, 0.0, m, kind, 0)
                try:
                    if kind == "ask":
                        r = c.post(f"/v1/manuals/{m}/ask", json={**body, "question": question})
                    else:
                        if m not in convs:
                            cr = c.post(f"/v1/manuals/{m}/conversations")
                            cr.raise_for_status()
                            convs[m] = cr.json()["id"]
                        res.conversation = convs[m]
                        path = f"/v1/manuals/{m}/conversations/{convs[m]}/messages"
                        r = c.post(path, json={**body, "content": question})
                    res.status = r.status_code
                    res.replica = r.headers.get("x-docqa-replica", "")
                    if r.status_code == 200:
                        a = r.json()
                        u = a["usage"]
                        res.prompt_tokens = u["prompt_tokens"]
                        res.cached_tokens = u["cached_tokens"]
                        res.redis_tokens = u["cached_tokens_by_tier"]["redis"]
                        res.ttft_ms = a["timings"]["ttft_ms"]
                        res.answer_id = a["id"]
                    else:
                        res.error = r.text[:200]
                except httpx.HTTPStatusError as e:  # the conversation was not created
                    res.status = e.response.status_code
                    res.error = e.response.text[:200]
                except httpx.HTTPError as e:
                    res.error = f"{type(e).__name__}: {e}"
                res.end = time.monotonic()
                with self.lock:
                    self.results.append(res)


def upload_manuals(url: str, n: int, key: str | None = None) -> list[dict]:
    """``n`` manuals of distinct text, uploaded cold, each with ``prefix``: its prompt's fixed
    part (system instructions and the manual) in tokens, from a warm of a probe manual."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
        probe = c.post("/v1/manuals", json={"title": "probe", "text": manual_text("PROBE", 1)})
        probe.raise_for_status()
        w = c.post(f"/v1/manuals/{probe.json()['id']}/warm").json()
        instructions = w["prompt_tokens"] - probe.json()["tokens"]
        out = []
        for i in range(n):
            text = f"Edition {uuid.uuid4().hex}\n" + manual_text(f"HX-{i}")
            r = c.post("/v1/manuals", json={"title": f"pump {i}", "text": text})
            r.raise_for_status()
            m = r.json()
            m["prefix"] = instructions + m["tokens"]
            out.append(m)
        return out


def prefills(results: list[Result], manuals: list[dict], block: int = 16) -> dict[str, float]:
    """Per manual, how many times its prefix was computed across the cluster: each answer adds
    the share of the prefix it did not find cached (a block's rounding forgiven)."""
    size = {m["id"]: m["prefix"] for m in manuals}
    out = dict.fromkeys(size, 0.0)
    for r in results:
        if r.status == 200:
            p = size[r.manual]
            out[r.manual] += max(0, p - r.cached_tokens - block) / p
    return out


TIER_COUNTERS = (
    "writes_dropped",
    "lookups_abandoned",
    "claim_waits",
    "claim_waits_expired",
    "relooks",
    "relooks_evicted",
    "errors",
)


def tier_counters(stack: Stack) -> dict[str, int]:
    """The Redis tier's counters summed over the live replicas: writes dropped, lookups that
    ran out of time (their request computed without a claim), waits on another's claim; a
    manual computed twice shows in one of them. And the requests preempted (a full pool)."""
    out = dict.fromkeys(TIER_COUNTERS, 0)
    for s in stack.servers:
        if s.proc is None or s.proc.poll() is not None:
            continue
        text = httpx.get(s.url + "/metrics", timeout=10).text
        for name in TIER_COUNTERS:
            m = re.search(rf"^docqa:redis_tier_{name}(?:_total)?(?:{{[^}}]*}})? (\S+)$", text, re.M)
            out[name] += int(float(m.group(1))) if m else 0
        m = re.search(r"^docqa:num_preemptions(?:_total)?(?:{[^}]*})? (\S+)$", text, re.M)
        out["preemptions"] = out.get("preemptions", 0) + (int(float(m.group(1))) if m else 0)
    return out


def in_flight(results: list[Result]) -> dict[str, float]:
    """Each replica's answers in flight, averaged over the run (from first start to last end):
    the load the balancer's bounded loads compare, where answers served count an answer from
    the replica's own pool the same as one loaded from Redis."""
    events = sorted(
        (t, d, r.replica)
        for r in results
        if r.status == 200
        for t, d in ((r.start, 1), (r.end, -1))
    )
    if not events:
        return {}
    area: dict[str, float] = {}
    now: dict[str, int] = {}
    last = events[0][0]
    for t, d, replica in events:
        for k, n in now.items():
            area[k] = area.get(k, 0.0) + n * (t - last)
        last = t
        now[replica] = now.get(replica, 0) + d
    span = (events[-1][0] - events[0][0]) or 1.0
    return {k: v / span for k, v in sorted(area.items())}


def summarize(results: list[Result], manuals: list[dict]) -> dict:
    ok = [r for r in results if r.status == 200]
    per_manual = prefills(results, manuals)
    replicas: dict[str, int] = {}
    for r in ok:
        replicas[r.replica] = replicas.get(r.replica, 0) + 1
    counts = list(replicas.values())
    prompt = sum(r.prompt_tokens for r in ok) or 1
    redis = sum(r.redis_tokens for r in ok)
    device = sum(r.cached_tokens for r in ok) - redis
    ttft = sorted(r.ttft_ms for r in ok)
    flight = in_flight(results)
    per_replica = []  # what each replica's answers cost it: the busiest first
    for rid in sorted(replicas, key=replicas.get, reverse=True):
        mine = [r for r in ok if r.replica == rid]
        per_replica.append(
            {
                "answers": len(mine),
                "manuals": len({r.manual for r in mine}),
                "seconds_per_answer": round(statistics.mean(r.end - r.start for r in mine), 3),
                "computed_tokens": sum(r.prompt_tokens - r.cached_tokens for r in mine),
                "redis_tokens": sum(r.redis_tokens for r in mine),
            }
        )
    return {
        "answers": len(ok),
        "failed": len(results) - len(ok),
        "prefills_per_manual": statistics.mean(per_manual.values()),
        "prefills_per_manual_max": max(per_manual.values()),
        "answers_per_replica": sorted(counts, reverse=True),
        "busiest_over_mean": max(counts) / statistics.mean(counts) if counts else 0.0,
        "in_flight_per_replica": sorted((round(v, 2) for v in flight.values()), reverse=True),
        "most_in_flight_over_mean": (
            max(flight.values()) / statistics.mean(flight.values()) if flight else 0.0
        ),
        "device_hit_share": device / prompt,
        "redis_hit_share": redis / prompt,
        "ttft_p50_ms": ttft[len(ttft) // 2] if ttft else 0.0,
        "ttft_p90_ms": ttft[int(len(ttft) * 0.9)] if ttft else 0.0,
        "per_replica": per_replica,
    }


@dataclass
class KillRun:
    """A load during which one replica was killed with SIGKILL."""

    results: list[Result]
    manuals: list[dict]
    killed: str  # its replica id
    at: float  # when it was gone (time.monotonic())


def run_with_kill(
    stack: Stack,
    manuals: list[dict],
    clients: int,
    questions: int,
    after: int,
    seed: int = 1,
    key: str | None = None,
) -> KillRun:
    """The load, with the replica that has served the most answers killed once ``after``
    answers are in."""
    load = Load(stack.lb.url, manuals, clients, questions, seed=seed, key=key)
    t = threading.Thread(target=load.run)
    t.start()
    deadline = time.monotonic() + 600
    while len(load.results) < after and t.is_alive():
        assert time.monotonic() < deadline, "the load stalled before the kill"
        time.sleep(0.05)
    with load.lock:
        served: dict[str, int] = {}
        for r in load.results:
            if r.status == 200:
                served[r.replica] = served.get(r.replica, 0) + 1
    victim = max(served, key=served.get)
    proc = stack.server(victim).proc
    proc.kill()
    proc.wait()  # gone: a request sent from now on cannot reach it
    at = time.monotonic()
    t.join()
    return KillRun(load.results, manuals, victim, at)


def moved_answers(run: KillRun, settle_s: float = 0.5) -> list[Result]:
    """The answers after the kill about the manuals the killed replica had answered (at least
    ``settle_s`` before the kill, so their blocks had reached Redis)."""
    moved = {
        r.manual
        for r in run.results
        if r.status == 200 and r.replica == run.killed and r.end < run.at - settle_s
    }
    return [r for r in run.results if r.status == 200 and r.manual in moved and r.start > run.at]


def first_on_replica(run: KillRun, answers: list[Result]) -> list[Result]:
    """Of ``answers`` (after the kill), the first on each replica about each manual, where that
    replica had not answered about the manual before the kill: what it could only have found
    in Redis (or computed)."""
    seen = {(r.manual, r.replica) for r in run.results if r.status == 200 and r.start < run.at}
    out = []
    for r in sorted(answers, key=lambda r: r.start):
        if (r.manual, r.replica) not in seen:
            seen.add((r.manual, r.replica))
            out.append(r)
    return out


def kill_summary(run: KillRun, block: int = 16) -> dict:
    failed = [r for r in run.results if r.status != 200]
    size = {m["id"]: m["prefix"] for m in run.manuals}
    after = moved_answers(run)
    firsts = first_on_replica(run, after)
    return {
        "answers": sum(r.status == 200 for r in run.results),
        "failed": len(failed),
        "failed_in_flight": sum(r.start < run.at for r in failed),
        "failed_in_window": sum(run.at <= r.start < run.at + DETECTION_S for r in failed),
        "failed_after_window": sum(r.start >= run.at + DETECTION_S for r in failed),
        "failure_statuses": sorted({r.status for r in failed}),
        "moved_manuals": len({r.manual for r in after}),
        "moved_answers": len(after),
        "moved_answers_cold": sum(size[r.manual] - r.cached_tokens > block for r in after),
        # each such answer's prefix tokens computed, of its prefix's
        "moved_cold_tokens": [
            (size[r.manual] - r.cached_tokens, size[r.manual])
            for r in after
            if size[r.manual] - r.cached_tokens > block
        ],
        "moved_redis_tokens": sum(r.redis_tokens for r in after),
        "moved_first_on_replica": len(firsts),
        "moved_first_redis_tokens": sum(r.redis_tokens for r in firsts),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manuals", type=int, default=12)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--questions", type=int, default=24, help="per client")
    ap.add_argument("--balance", nargs="+", default=["consistent", "roundrobin"])
    ap.add_argument("--no-kill", action="store_true", help="skip the run with a replica killed")
    ap.add_argument(
        "--cpus-per-replica",
        type=float,
        help="hold each replica to this many cores (a cgroup v1 CPU quota), as on machines of "
        "their own (default: the replicas share this machine's cores)",
    )
    ap.add_argument(
        "--kv-cache-gib",
        type=float,
        help="each replica's KV pool (default: the tests' 0.25 GiB, about 11,600 tokens)",
    )
    ap.add_argument(
        "--threads-per-replica",
        type=int,
        help="each replica's torch threads (default: the cores over the replicas, at least 1; "
        "with --cpus-per-replica, that quota rounded up): replicas sharing a machine, each with "
        "a thread a core, make OpenMP's threads wait on each other's time slices",
    )
    ap.add_argument("--out", help="JSON path (default: bench/results/scale-out-DATE.json)")
    args = ap.parse_args()
    rows = {}
    kill: dict = {}
    server_args: tuple[str, ...] = ()
    if args.kv_cache_gib is not None:
        server_args += ("--kv-cache-gib", str(args.kv_cache_gib))
    threads = args.threads_per_replica
    if threads is None:
        shared = max(1, (os.cpu_count() or 1) // REPLICAS)
        threads = math.ceil(args.cpus_per_replica) if args.cpus_per_replica else shared
    server_args += ("--threads", str(threads))
    for balance in args.balance:
        db = create_pg_database()
        tmp = Path(tempfile.mkdtemp(prefix="docqa-scale-"))
        stack = start_stack(
            tmp,
            db,
            balance=None if balance == "consistent" else balance,
            server_args=server_args,
        )
        quotas = None
        try:
            if args.cpus_per_replica:
                quotas = CpuQuotas([s.proc.pid for s in stack.servers], args.cpus_per_replica)
            manuals = upload_manuals(stack.lb.url, args.manuals)
            t0 = time.monotonic()
            results = Load(stack.lb.url, manuals, args.clients, args.questions).run()
            row = summarize(results, manuals)
            row["wall_s"] = time.monotonic() - t0
            row["tier"] = tier_counters(stack)
            if quotas is not None:
                row["cpus_per_replica"] = args.cpus_per_replica
                row["throttled_s"] = quotas.throttled_s()
            rows[balance] = row
            print(balance, json.dumps(row), flush=True)
            if balance == "consistent" and not args.no_kill:
                fresh = upload_manuals(stack.lb.url, args.manuals)
                run = run_with_kill(
                    stack, fresh, args.clients, args.questions, after=args.clients * 2
                )
                kill = kill_summary(run)
                print("kill", json.dumps(kill), flush=True)
        finally:
            if quotas is not None:
                quotas.release()
            stack.stop()
            drop_pg_database(db)
    print("\n| balancing | answers | prefills per manual (max) | answers per replica | busiest / "
          "mean | in flight per replica | most / mean | device hits | Redis hits | TTFT p50 ms "
          "| p90 ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for b, r in rows.items():
        print(
            f"| {b} | {r['answers']} ({r['failed']} failed) | {r['prefills_per_manual']:.2f} "
            f"({r['prefills_per_manual_max']:.2f}) | {r['answers_per_replica']} "
            f"| {r['busiest_over_mean']:.2f} | {r['in_flight_per_replica']} "
            f"| {r['most_in_flight_over_mean']:.2f} | {100 * r['device_hit_share']:.0f}% "
            f"| {100 * r['redis_hit_share']:.0f}% | {r['ttft_p50_ms']:.0f} "
            f"| {r['ttft_p90_ms']:.0f} |"
        )
    if kill:
        print(
            f"\none replica killed after {args.clients * 2} answers: {kill['answers']} answers, "
            f"{kill['failed']} failed ({kill['failed_in_flight']} in flight on it, "
            f"{kill['failed_in_window']} in the {DETECTION_S:.0f} s detection window, "
            f"{kill['failed_after_window']} after; statuses {kill['failure_statuses']}); "
            f"{kill['moved_manuals']} manuals moved, {kill['moved_answers']} answers about them "
            f"after the kill, {kill['moved_answers_cold']} computed their prefix again, "
            f"{kill['moved_redis_tokens']} tokens read from Redis "
            f"({kill['moved_first_redis_tokens']} by the {kill['moved_first_on_replica']} "
            f"first answers on a replica that had not held the manual)"
        )
    RESULTS.mkdir(exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / f"scale-out-{dt.date.today().isoformat()}.json"
    out.write_text(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "args": vars(args),
                "rows": rows,
                "kill": kill,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
