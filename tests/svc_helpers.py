"""Helpers for tests over real HTTP: a ``docqa serve`` subprocess, a per-run Postgres
database, metrics parsing, and small documents (PDF, HTML) built in memory."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PG_ADMIN_URL = os.environ.get("DOCQA_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("DOCQA_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
# every key this test run writes to Redis starts with this (removed at the end of the run)
RUN_REDIS_PREFIX = f"docqa-test-{uuid.uuid4().hex[:10]}:"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A free port for a Redis Cluster node: its cluster bus takes the port 10,000 above, so at
    most 55535, with that one free too."""
    import random

    for _ in range(1000):
        port = random.randint(20000, 55535)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


async def _pg_exec(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(PG_ADMIN_URL, timeout=10)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def create_pg_database() -> str:
    """A fresh database for this test run; returns its SQLAlchemy URL. Fails (never skips)
    when Postgres is unreachable."""
    name = f"docqa_test_{uuid.uuid4().hex[:12]}"
    try:
        asyncio.run(_pg_exec(f'CREATE DATABASE "{name}"'))
    except (OSError, ConnectionError) as e:
        raise RuntimeError(f"Postgres at {PG_ADMIN_URL} is required for these tests: {e}") from e
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    return f"{base}/{name}".replace("postgresql://", "postgresql+asyncpg://", 1)


def drop_pg_database(url: str) -> None:
    name = url.rsplit("/", 1)[1]
    asyncio.run(_pg_exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def stop_process(proc: subprocess.Popen | None, grace_s: float = 20) -> None:
    """Terminate a child process, killing it when it outlives ``grace_s``."""
    if proc and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Server:
    """``docqa serve`` in a subprocess on a free port."""

    def __init__(
        self,
        log_dir: Path,
        database_url: str,
        api_keys: str | None = None,
        args: tuple[str, ...] = (),
        name: str = "server",
    ):
        self.log_path = log_dir / f"{name}.log"
        self.database_url = database_url
        self.api_keys = api_keys
        self.args = args
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.extra_env: dict[str, str] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> Server:
        self.port = free_port()
        env = dict(os.environ)
        env["DOCQA_DATABASE_URL"] = self.database_url
        env.pop("DOCQA_API_KEYS", None)
        env.pop("DOCQA_REDIS_URL", None)
        env["DOCQA_REDIS_PREFIX"] = RUN_REDIS_PREFIX
        if self.api_keys:
            env["DOCQA_API_KEYS"] = self.api_keys
        env.update(self.extra_env)
        cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(self.port)]
        cmd += ["--kv-cache-gib", "0.25", *self.args]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docqa serve exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"docqa serve not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        stop_process(self.proc)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def client(self, key: str | None = None, timeout: float = 300.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


_METRIC_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN|\+Inf)$")


def metrics(client: httpx.Client) -> dict[str, float]:
    """/metrics as {name{labels}: value}."""
    r = client.get("/metrics")
    r.raise_for_status()
    out = {}
    for line in r.text.splitlines():
        m = _METRIC_RE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def redis_client(url: str = REDIS_URL):
    """A client of the machine's Redis; fails (never skips) when it is unreachable."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        client.ping()
    except (redis.RedisError, OSError) as e:
        raise RuntimeError(f"Redis at {url} is required for these tests: {e}") from e
    return client


def delete_prefix(client, prefix: str) -> int:
    n = 0
    for key in client.scan_iter(match=prefix + "*", count=1000):
        n += client.delete(key)
    return n


class RedisServer:
    """A ``redis-server`` of one test on a free port (never the machine's shared one), so the
    test may stop and restart it."""

    def __init__(self, log_dir: Path):
        self.port = free_port()
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        cmd = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self.log_dir),
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                redis_client(self.url).close()
                return self
            except RuntimeError:
                time.sleep(0.1)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class RedisCluster:
    """A Redis Cluster of ``masters`` ``redis-server`` processes on free loopback ports, no
    replicas, whole slot coverage not required (a master gone leaves the others serving): what
    a test may kill a master of."""

    def __init__(self, log_dir: Path, masters: int = 3):
        self.log_dir = log_dir
        self.ports = [free_cluster_port() for _ in range(masters)]
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> RedisCluster:
        for port in self.ports:
            d = self.log_dir / f"redis-{port}"
            d.mkdir(parents=True, exist_ok=True)
            cmd = [
                "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(d), "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
                "--cluster-require-full-coverage", "no",
            ]  # fmt: skip
            log = open(d / "redis.log", "w")  # noqa: SIM115
            self.procs[port] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        for port in self.ports:
            _wait_redis(f"redis://127.0.0.1:{port}/0")
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0",
             "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        import redis

        while time.monotonic() < deadline:
            info = redis.Redis(port=self.ports[0]).cluster("info")
            if info.get("cluster_state") == "ok":
                return self
            time.sleep(0.2)
        raise RuntimeError("the Redis Cluster did not become ok")

    def master_of(self, key: bytes | str) -> int:
        """The port of the master holding ``key``'s slot."""
        import redis

        r = redis.Redis(port=self.ports[0])
        slot = r.cluster("keyslot", key)
        for lo, hi, master, *_ in r.cluster("slots"):
            if lo <= slot <= hi:
                return int(master[1])
        raise KeyError(key)

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        for port in list(self.procs):
            if self.procs[port].poll() is None:
                self.kill(port)


def _wait_redis(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            redis_client(url).close()
            return
        except RuntimeError:
            time.sleep(0.1)
    raise RuntimeError(f"redis-server at {url} did not start")


class HAProxy:
    """deploy/haproxy/haproxy.cfg in front of ``servers`` ((name, port) on loopback) instead of
    the compose stack's DNS-discovered replicas, on a free port; ``balance`` replaces the
    routing (roundrobin, for comparisons)."""

    def __init__(self, log_dir: Path, servers: list[tuple[str, int]], balance: str | None = None):
        self.port = free_port()
        self.log_dir = log_dir
        self.servers = servers
        self.balance = balance
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> str:
        cfg = (ROOT / "deploy" / "haproxy" / "haproxy.cfg").read_text()
        lines = []
        skip = False
        for line in cfg.splitlines():
            if line.startswith("resolvers "):
                skip = True  # no DNS here
            elif skip and not line.startswith(" "):
                skip = False
            if skip:
                continue
            if line.strip().startswith("server-template"):
                lines += [f"    server {n} 127.0.0.1:{p} check" for n, p in self.servers]
                continue
            if line.strip().startswith("bind :8000"):
                line = f"    bind 127.0.0.1:{self.port}"
            if self.balance and line.strip().startswith("balance "):
                line = f"    balance {self.balance}"
            lines.append(line)
        return "\n".join(lines) + "\n"

    def start(self) -> HAProxy:
        path = self.log_dir / f"haproxy-{self.port}.cfg"
        path.write_text(self.config())
        log = open(self.log_dir / f"haproxy-{self.port}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            ["haproxy", "-db", "-f", str(path)], stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"haproxy on port {self.port} did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def sse_events(response: httpx.Response):
    """The native server-sent events of a streamed response, as they arrive: (event name or
    None, its JSON data)."""
    event = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            yield event, json.loads(line[6:])


class BackgroundStream:
    """A streamed answer read on a thread of its own: ``request_id`` once its headers are in,
    ``events`` as they come, ``started`` set after ``after`` events."""

    def __init__(self, client: httpx.Client, path: str, body: dict, after: int = 3):
        import threading

        self.request_id = ""
        self.events: list[tuple[str | None, dict]] = []
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(client, path, body, after))
        self._thread.start()

    def _read(self, client: httpx.Client, path: str, body: dict, after: int) -> None:
        with client, client.stream("POST", path, json=body) as r:
            self.request_id = r.headers["x-request-id"]
            for ev in sse_events(r):
                self.events.append(ev)
                if len(self.events) >= after:
                    self.started.set()

    def join(self, timeout: float = 60) -> None:
        self._thread.join(timeout)


def computed_total(client: httpx.Client) -> float:
    return metrics(client)["docqa:prompt_tokens_computed_total"]


def make_pdf(lines: list[str]) -> bytes:
    """A one-page PDF with these lines of text (Helvetica), with a correct xref table."""

    def esc(s: str) -> str:
        return s.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")

    ops = ["BT", "/F1 12 Tf", "14 TL", "72 720 Td"]
    for ln in lines:
        ops.append(f"({esc(ln)}) Tj T*")
    ops.append("ET")
    stream = "\n".join(ops).encode("latin-1")
    objs = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    return _pdf_file(objs)


def _pdf_file(objs: list[bytes]) -> bytes:
    """A PDF of these objects (numbered from 1, the catalog first), with a correct xref."""
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    for off in offsets:
        out += b"%010d 00000 n \n" % off
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    return bytes(out)


def make_pdf_bomb(lines_per_page: int, pages: int = 1) -> bytes:
    """A PDF whose pages' compressed content streams each show ``lines_per_page`` lines of
    text: a few kilobytes that expand to megabytes of text."""
    import zlib

    ops = b"BT /F1 12 Tf 72 720 Td " + b"(Press START to run the washer.) Tj T* " * lines_per_page
    stream = zlib.compress(ops + b"ET", 9)
    font = 3 + 2 * pages
    objs = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [%s] /Count %d >>"
        % (b" ".join(b"%d 0 R" % (3 + 2 * i) for i in range(pages)), pages),
    ]
    for i in range(pages):
        objs.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
            b"/Resources << /Font << /F1 %d 0 R >> >> >>" % (4 + 2 * i, font)
        )
        objs.append(
            b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(stream)
            + stream
            + b"\nendstream"
        )
    objs.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    return _pdf_file(objs)


def _pg_bin(name: str) -> str:
    found = shutil.which(name) or next(
        iter(sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))), None
    )
    if found is None:
        raise RuntimeError(f"the PostgreSQL binary {name} is required for this test")
    return str(found)


class PostgresServer:
    """A PostgreSQL instance of one test (initdb in its folder, a free port, trust auth), so the
    test may stop and start it. Runs as the ``postgres`` user when the tests run as root."""

    def __init__(self):
        # its own folder, outside pytest's (which other users cannot enter)
        self.base = Path(tempfile.mkdtemp(prefix="docqa-pg-"))
        self.base.chmod(0o755)
        self.port = free_port()
        self.data = self.base / "pgdata"
        self.sockets = self.base / "pgsock"
        self.log = self.base / "postgres.log"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *cmd: str) -> None:
        if os.geteuid() == 0:
            cmd = ("runuser", "-u", "postgres", "--", *cmd)
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def start(self) -> PostgresServer:
        if not self.data.exists():
            for d in (self.data, self.sockets):
                d.mkdir(parents=True)
                if os.geteuid() == 0:
                    shutil.chown(d, "postgres", "postgres")
            self.log.touch()
            if os.geteuid() == 0:
                shutil.chown(self.log, "postgres", "postgres")
            self._run(_pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust")
        opts = f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1"
        self._run(
            _pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "start"
        )
        return self

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def close(self) -> None:
        """Stop it and remove its folder."""
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)
