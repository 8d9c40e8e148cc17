"""Real Redis servers for tests and benchmarks: standalone, a 3-master cluster, a latency proxy.

Every server is a `redis-server` process (the Debian package) on 127.0.0.1 and a free port, with
persistence off (`save ""`, `appendonly no`), a password, and its own temporary folder; it is
stopped (SIGTERM, then SIGKILL) when the owner is done. No mocks: the stores under test talk
RESP over TCP to the real thing.

`LatencyProxy` forwards a loopback TCP port to a server and holds every chunk `delay_s` in each
direction (order kept, bandwidth not limited), so "a server 5 ms away" can be had on one
machine.

Without `redis-server` or redis-py the tests skip, except under CI (`CI` set), where they fail:
a green CI must not hide a missing install step.

Import with `from tests.redis_servers import ...` (pytest's importlib mode, like tests.helpers).
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

PASSWORD = "tc-test-pw"
READY_TIMEOUT_S = 20.0


def missing() -> str | None:
    """Why real-server tests cannot run here, or None."""
    if shutil.which("redis-server") is None:
        return "redis-server not installed (apt-get install -y redis-server)"
    if shutil.which("redis-cli") is None:
        return "redis-cli not installed (apt-get install -y redis-server)"
    if shutil.which("openssl") is None:
        return "openssl not installed (apt-get install -y openssl), needed for the TLS test"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "redis-py not installed (pip install 'redis[hiredis]')"
    return None


def require() -> None:
    """Skip the calling test module without a server or client; fail instead under CI."""
    import pytest

    why = missing()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must have real Redis: {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)


def make_tls_files(folder: str | os.PathLike) -> dict[str, str]:
    """A throwaway CA, a server certificate for IP 127.0.0.1 and a client certificate, made with
    the `openssl` CLI. Returns paths: ca, server_cert, server_key, client_cert, client_key."""
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60,
                       stdin=subprocess.DEVNULL)

    run("req", "-x509", *key, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"),
        "-days", "2", "-subj", "/CN=tiered-cache test CA")
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who in ("server", "client"):
        run("req", *key, "-keyout", str(d / f"{who}.key"), "-out", str(d / f"{who}.csr"),
            "-subj", f"/CN=tiered-cache test {who}")
        run("x509", "-req", "-in", str(d / f"{who}.csr"), "-CA", str(d / "ca.crt"),
            "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-out", str(d / f"{who}.crt"),
            "-days", "2", "-extfile", str(d / f"{who}.ext"))
    return {"ca": str(d / "ca.crt"), "server_cert": str(d / "server.crt"),
            "server_key": str(d / "server.key"), "client_cert": str(d / "client.crt"),
            "client_key": str(d / "client.key")}


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, bus: bool = False) -> int:
    """A free loopback port; with `bus`, port + 10000 (a cluster node's bus port) is free too."""
    if not bus:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(1000):
        port = random.randint(20000, 50000)
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One `redis-server` process. `extra` are more `--name value` settings, e.g.
    `("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")`. With `tls` (from
    `make_tls_files`) it listens for TLS only and requires a client certificate."""

    def __init__(self, *, password: str | None = PASSWORD, extra: tuple[str, ...] = (),
                 port: int | None = None, workdir: str | os.PathLike | None = None,
                 cluster: bool = False, tls: dict[str, str] | None = None) -> None:
        self.password = password
        self.tls = tls
        self.extra = tuple(extra)
        self.cluster = cluster
        self.port = port or free_port(bus=cluster)
        self._pick_port = port is None         # a port of our choosing may be re-picked
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="tc-redis-"))
        self.proc: subprocess.Popen | None = None

    # -------------------------------------------------------------- addresses

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def url(self) -> str:
        """`redis://:password@127.0.0.1:port/0` (the password inline)."""
        auth = f":{self.password}@" if self.password else ""
        return f"{self.scheme}://{auth}{self.host}:{self.port}/0"

    @property
    def url_no_auth(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}/0"

    @property
    def scheme(self) -> str:
        return "rediss" if self.tls else "redis"

    def raw(self, **kw):
        """A plain redis-py client of this server (for tests that write behind the store)."""
        import redis

        if self.tls:
            kw.update(ssl=True, ssl_ca_certs=self.tls["ca"], ssl_certfile=self.tls["client_cert"],
                      ssl_keyfile=self.tls["client_key"])
        return redis.Redis(host=self.host, port=self.port, password=self.password,
                           socket_timeout=5, **kw)

    # -------------------------------------------------------------- lifecycle

    def args(self) -> list[str]:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.dir),
                "--logfile", str(self.dir / f"redis-{self.port}.log"), "--daemonize", "no",
                "--protected-mode", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            args[2] = "0"                                   # no plain-text port
            args += ["--tls-port", str(self.port), "--tls-cert-file", self.tls["server_cert"],
                     "--tls-key-file", self.tls["server_key"],
                     "--tls-ca-cert-file", self.tls["ca"], "--tls-auth-clients", "yes"]
        if self.cluster:
            args += ["--cluster-enabled", "yes",
                     "--cluster-config-file", str(self.dir / f"nodes-{self.port}.conf"),
                     "--cluster-node-timeout", "5000"]
            if self.password:
                args += ["--masterauth", self.password]
        return args + list(self.extra)

    def start(self) -> RedisServer:
        if self.cluster:
            # NOTE: a restarted cluster node would rejoin from its nodes file; tests only
            # start cluster nodes once, so a stale file is always someone else's.
            with contextlib.suppress(FileNotFoundError):
                (self.dir / f"nodes-{self.port}.conf").unlink()
        for attempt in range(5):
            self.proc = subprocess.Popen(self.args(), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                self.wait_ready()
                break
            except RuntimeError as exc:
                # NOTE: a free port can be taken between free_port() and the bind (another
                # test process, an xdist worker): until a client knows this server's URL, a
                # port we picked is picked again.
                if not (self._pick_port and "in use" in str(exc) and attempt < 4):
                    raise
                self.port = free_port(bus=self.cluster)
        self._pick_port = False                 # clients know the URL from now on
        return self

    def wait_ready(self) -> None:
        import redis

        stop = time.monotonic() + READY_TIMEOUT_S
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server on {self.port} exited "
                                   f"{self.proc.returncode}: {err}{self.log_tail()}")
            try:
                with self.raw(socket_connect_timeout=0.5) as c:
                    # NOTE: the server on this port must be ours, not another test's that
                    # got the port first (same password): its pid says so.
                    if c.ping() and (self.proc is None
                                     or int(c.info("server")["process_id"]) == self.proc.pid):
                        return
            except redis.RedisError:
                pass
            if time.monotonic() > stop:
                raise RuntimeError(f"redis-server on {self.port} not ready: {self.log_tail()}")
            time.sleep(0.02)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.dir / f"redis-{self.port}.log").read_text()[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def restart(self) -> RedisServer:
        """Start again on the same port (empty: persistence is off)."""
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisClusterServers:
    """`n` masters (no replicas) joined with `redis-cli --cluster create`, all slots covered."""

    def __init__(self, n: int = 3, *, password: str | None = PASSWORD) -> None:
        self.password = password
        self.dir = Path(tempfile.mkdtemp(prefix="tc-redis-cluster-"))
        self.nodes = [RedisServer(password=password, cluster=True, workdir=self.dir)
                      for _ in range(n)]

    @property
    def url(self) -> str:
        """The first node's URL; a cluster client discovers the rest."""
        return self.nodes[0].url

    def start(self) -> RedisClusterServers:
        try:
            for node in self.nodes:
                node.start()
            cmd = ["redis-cli"]
            if self.password:
                cmd += ["-a", self.password, "--no-auth-warning"]
            cmd += ["--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                    "--cluster-replicas", "0", "--cluster-yes"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                                  stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}"
                                   f"{done.stderr}")
            self._wait_ok()
        except BaseException:
            self.close()
            raise
        return self

    def _wait_ok(self) -> None:
        stop = time.monotonic() + READY_TIMEOUT_S
        while True:
            states = []
            for node in self.nodes:
                with node.raw() as c:
                    info = c.execute_command("CLUSTER", "INFO")
                    if isinstance(info, bytes):
                        info = info.decode()
                    states.append("cluster_state:ok" in str(info))
            if all(states):
                return
            if time.monotonic() > stop:
                raise RuntimeError(f"cluster not ok: {states}")
            time.sleep(0.05)

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class LatencyProxy:
    """Loopback TCP proxy to `target_port` that delays every chunk `delay_s` in each direction.

    NOTE: one reader and one writer thread per direction and connection, with a queue between
    them: the reader stamps each chunk with its due time and never waits, so the delay adds
    latency without capping bandwidth (a chunk in flight does not hold the next one back).
    """

    def __init__(self, target_port: int, delay_s: float, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.delay_s = delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="latency-proxy", daemon=True)
        self._thread.start()

    def url(self, password: str | None = PASSWORD) -> str:
        auth = f":{password}@" if password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks += [client, upstream]
            self._pipe(client, upstream)
            self._pipe(upstream, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        chunks: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

        def read() -> None:
            while True:
                try:
                    data = src.recv(1 << 20)
                except OSError:
                    data = b""
                chunks.put((time.monotonic() + self.delay_s, data))
                if not data:
                    return

        def write() -> None:
            while True:
                due, data = chunks.get()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    if not data:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    dst.sendall(data)
                except OSError:
                    return

        for fn in (read, write):
            threading.Thread(target=fn, name="latency-proxy-pipe", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)     # wakes the blocked accept()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.close()
            self._socks.clear()

    def __enter__(self) -> LatencyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sample_record(namespace: bytes, root: bytes, index: int, *, payload_bytes: int = 4096,
                  seed: int = 0, num_tokens: int = 16) -> tuple[bytes, bytes]:
    """(key, record) of block `index` of a deterministic prompt: the same arguments give the
    same bytes in any process, so two processes can check each other's reads."""
    import hashlib

    import numpy as np

    from tiered_cache import records

    def key_of(i: int) -> bytes:
        return hashlib.blake2b(b"%d:%d" % (seed, i), key=root, digest_size=16).digest()

    rng = np.random.default_rng([seed, index])
    tokens = rng.integers(0, 2**31 - 1, num_tokens, dtype=np.int64)
    payload = rng.integers(0, 256, payload_bytes, dtype=np.uint8).tobytes()
    key = key_of(index)
    parent = key_of(index - 1) if index else root
    return key, records.encode(namespace, key, parent, root, index,
                               records.tokens_bytes(tokens), 0, payload)
