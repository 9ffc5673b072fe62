"""Environments served over HTTP: the ``http`` environment, a client of a service in any language.

The service implements two endpoints (docs/reference/http_environments.md): ``GET <url>/health``
answers 2xx when it can grade, and ``POST <url>/step`` takes a batch of samples (their messages,
role and content, and their metadata) and returns one result per sample (reward, terminated,
observation, next stop strings, metadata) plus optional metrics: the ``step`` contract of
:class:`~nemo_like.environments.interfaces.EnvironmentInterface`, as JSON.

Once the run has started, a service costs only samples: a request that times out, cannot
connect after its retries, or answers something that is not a valid response (not JSON, too few
results, a reward that is not a finite number) leaves only the samples it carried unscorable (NaN
reward: advantage 0, out of every baseline), counted in the step's metrics with the first error of
each kind printed once (a task none of whose samples can be scored for grpo.max_consecutive_env_failures
steps stops the run, as any failing grader does). A service that does not answer its health check when the run starts is a
one-line start error naming the URL. With ``command`` the run starts the service itself on a free
port, starts it again if it exits, and stops it with the environment.

Standard library only, no torch at import time (config validation imports this module).
"""

from __future__ import annotations

import http.client
import json
import math
import subprocess
import threading
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from nemo_like.environments.env_config import TRAINER_SIDE_KEYS, EnvConfig, validate_env_config
from nemo_like.environments.http_service import free_port, split_command, start_service, stop_service
from nemo_like.environments.interfaces import EnvironmentInterface, EnvironmentReturn, normalize_step_inputs

if TYPE_CHECKING:
    from nemo_like.data.interfaces import LLMMessageLogType

__all__ = ["HttpEnvConfig", "HttpEnvironment", "PROTOCOL_VERSION"]

PROTOCOL_VERSION = 1
MAX_RESPONSE_BYTES = 64 << 20  # a bigger answer is garbage, not something to hold in memory
_FLOAT32_MAX = 3.4028234663852886e38
_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")
# Failure kinds: each counts the samples it cost as num_<kind>, and its first error is printed once.
_KINDS = ("timeouts", "connection_errors", "bad_responses", "service_errors", "bad_inputs")
_RETRY_STATUSES = (502, 503, 504)  # a proxy or a service that is (re)starting: worth another try


class HttpEnvConfig(EnvConfig):
    """``env.http``: a service that speaks the HTTP environment protocol (docs/reference/http_environments.md)."""

    # The service's base URL (http or https): its endpoints are <url>/health and <url>/step. May hold
    # {port} when env.http.command starts the service; with a command and no url: http://127.0.0.1:{port}.
    url: str | None = Field(default=None, strict=True)
    # A program that serves the protocol, started by the run on a free port and stopped at its end: a
    # command line (split like a shell's, run without one) or a list of arguments. {port} in it is
    # replaced by the port, which it also gets as the environment variable PORT.
    command: str | list[str] | None = None
    # Seconds a started command's service has to answer GET <url>/health.
    startup_timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    # Seconds one request may take (connect, send, answer); past it its samples are unscorable.
    timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    # At most this many samples per POST <url>/step: a step's samples go in requests of this size.
    max_batch_size: int = Field(default=32, ge=1, strict=True)
    # Requests in flight at once, over all of the environment's concurrent step calls.
    max_concurrency: int = Field(default=8, ge=1, strict=True)
    # Retries of a request that could not connect, was dropped before an answer or got 502/503/504.
    max_retries: int = Field(default=3, ge=0, strict=True)
    # Seconds before the first retry; each further retry waits twice as long.
    retry_backoff_s: float = Field(default=0.5, ge=0, allow_inf_nan=False)

    @field_validator("command")
    @classmethod
    def _argv(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None and not split_command(v):
            raise ValueError("an empty command: give the program to run, e.g. 'node server.js'")
        return v

    @model_validator(mode="after")
    def _where(self) -> HttpEnvConfig:
        if self.url is None and self.command is None:
            raise ValueError("set env.http.url (the service's base URL, e.g. http://127.0.0.1:8000) or "
                             "env.http.command (a program the run starts, e.g. 'node server.js')")
        if self.url is not None:
            if "{port}" in self.url and self.command is None:
                raise ValueError(f"env.http.url {self.url!r} holds {{port}}, which only env.http.command fills in")
            _parse_url(self.url.replace("{port}", "1"))
        return self


def _parse_url(url: str) -> tuple[bool, str, int, str]:
    """(https, host, port, path prefix without a trailing slash); ValueError saying what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"env.http.url {url!r} is not an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise ValueError(f"env.http.url {url!r}: a base URL takes no ?query or #fragment")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"env.http.url {url!r} has an invalid port") from None
    return parts.scheme == "https", parts.hostname, port, parts.path.rstrip("/")


class _CallError(Exception):
    """A request that cost its samples: ``kind`` is one of _KINDS (retryable: worth another try)."""

    def __init__(self, kind: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.kind, self.retryable = kind, retryable


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")  # NaN/Infinity: Python reads them, JSON has no such thing


def _plain(x: Any, depth: int = 0) -> Any:
    """``x`` as JSON can hold it: arrays and tensors as lists, non-finite floats as null, anything
    else JSON has no type for as its text (a row's metadata may hold numpy scalars or dates)."""
    if depth > 64:
        return str(x)
    if x is None or isinstance(x, (str, bool, int)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _plain(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v, depth + 1) for v in x]
    if callable(getattr(x, "tolist", None)):  # numpy arrays and scalars, torch tensors
        try:
            return _plain(x.tolist(), depth + 1)
        except Exception:
            pass
    return str(x)


def _sample_json(log: Any, meta: Any) -> dict:
    """One sample of the request; TypeError on a message log that is not a list of messages."""
    if not isinstance(log, (list, tuple)):
        raise TypeError(f"message log is a {type(log).__name__}, not a list")
    messages = []
    for m in log:
        if not isinstance(m, dict):
            raise TypeError(f"message is a {type(m).__name__}, not a dict")
        messages.append({k: _plain(m[k]) for k in _MESSAGE_KEYS if k in m})
    return {"messages": messages, "metadata": _plain(meta)}


def _finite_number(v: Any) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:  # a 400-digit JSON integer does not fit a float: garbage, not an OverflowError
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _result(item: Any, meta: Any) -> tuple[float, bool, dict, list[str] | None, Any]:
    """(reward, terminated, observation, next stop strings, metadata) of one result; _CallError when
    it is not a valid result (bad_responses) or the service says it could not grade (service_errors)."""
    if not isinstance(item, dict):
        raise _CallError("bad_responses", f"a result is a {type(item).__name__}, not an object")
    if item.get("error") is not None:
        raise _CallError("service_errors", f"the service could not grade a sample: {str(item['error'])[:300]}")
    reward = item.get("reward")
    if not _finite_number(reward) or abs(reward) > _FLOAT32_MAX:
        raise _CallError("bad_responses", f"reward {reward!r} is not a finite number")
    terminated = item.get("terminated", True)
    if not isinstance(terminated, bool):
        raise _CallError("bad_responses", f"terminated {terminated!r} is not true or false")
    obs = item.get("observation")
    if obs is None:
        obs = {"role": "environment", "content": ""}
    elif isinstance(obs, str):
        obs = {"role": "environment", "content": obs}
    elif not (isinstance(obs, dict) and isinstance(obs.get("content"), str)
              and isinstance(obs.get("role", "environment"), str)):
        raise _CallError("bad_responses", "observation is not a string or an object with a string content")
    else:
        obs = {"role": obs.get("role", "environment"), "content": obs["content"]}
    stops = item.get("next_stop_strings")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise _CallError("bad_responses", "next_stop_strings is not null or a list of strings")
    new_meta = item["metadata"] if "metadata" in item else meta  # absent: the sample's own, unchanged
    if new_meta is not None and not isinstance(new_meta, dict):
        raise _CallError("bad_responses", f"metadata is a {type(new_meta).__name__}, not an object or null")
    return float(reward), terminated, obs, stops, new_meta


class HttpEnvironment(EnvironmentInterface):
    """Grades by calling a service that implements the HTTP environment protocol (``env.http``).

    Never raises from :meth:`step`: what a request costs is counted per sample in ``num_timeouts``,
    ``num_connection_errors``, ``num_bad_responses``, ``num_service_errors`` (an HTTP error status, or a
    result that names an error) and ``num_bad_inputs`` (a message log that is not a list of messages),
    all of them in ``num_unscorable``; ``num_retries`` counts retried requests, ``num_service_restarts``
    the started services that had exited and were started again. The service's own metrics are passed
    through (counters named ``num_*`` add up over requests, others are averaged).
    """

    config_model: ClassVar[type[EnvConfig]] = HttpEnvConfig
    # step only waits on sockets: a streaming rollout's calls overlap, the pool bounds the requests.
    max_concurrent_steps: ClassVar[int] = 16

    def __init__(self, config: dict | None = None) -> None:
        cfg = validate_env_config("http", HttpEnvConfig, config)
        self.config = cfg.model_dump(exclude=set(TRAINER_SIDE_KEYS))
        self._cfg = cfg
        self._lock = threading.Lock()
        self._reported: set[str] = set()
        self._proc: subprocess.Popen | None = None
        self._output: deque[str] = deque(maxlen=20)
        self._pool: ThreadPoolExecutor | None = None
        self._restart_lock = threading.Lock()
        self._closed = False
        try:
            if cfg.command is not None:
                self._launch()
            else:
                assert cfg.url is not None
                self._set_url(cfg.url)
            self._health_check()
        except BaseException:
            self.shutdown()
            raise
        self._pool = ThreadPoolExecutor(max_workers=cfg.max_concurrency, thread_name_prefix="http-env")

    def _set_url(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._https, self._host, self._port, self._prefix = _parse_url(self.url)

    def _launch(self) -> None:
        """Start env.http.command on a free port and point the URL at it."""
        assert self._cfg.command is not None
        port = free_port()
        self._set_url((self._cfg.url or "http://127.0.0.1:{port}").replace("{port}", str(port)))
        self._proc = self._start(self._cfg.command, port)
        self._finalizer = weakref.finalize(self, stop_service, self._proc)

    def _revive(self) -> int:
        """A started service that exited is started again, as Ray restarts a dead actor: 1 if it was."""
        with self._restart_lock:  # the step calls that find it dead at once restart it once
            proc = self._proc
            if proc is None or proc.poll() is None or self._closed:
                return 0
            print(f"[nemo_like] http environment: env.http.command exited with code {proc.returncode} (its last "
                  f"output: {self._last_output()}); starting it again", flush=True)
            self._finalizer.detach()
            self._launch()
            self._health_check()
            return 1

    def _last_output(self) -> str:
        return next((line for line in reversed(self._output) if line.strip()), "none")

    def _start(self, command: str | list[str], port: int) -> subprocess.Popen:
        return start_service(split_command(command), port, self._output)

    def _health_check(self) -> None:
        cfg = self._cfg
        where = f"GET {self.url}/health"
        if self._proc is not None:  # our own service: wait for it to come up (or to die)
            deadline = time.monotonic() + cfg.startup_timeout_s
            while True:
                rc = self._proc.poll()
                if rc is not None:
                    raise RuntimeError(f"env.http.command exited with code {rc} before {where} answered; "
                                       f"its last output: {self._last_output()}")
                try:
                    self._check_health_once(min(cfg.timeout_s, max(deadline - time.monotonic(), 0.1)))
                    return
                except _CallError as e:
                    if not e.retryable:  # it is up and answered (a 404, another protocol): waiting cannot help
                        raise RuntimeError(f"env.http.command: the service answered {where} with {e}; it must "
                                           "serve /health and /step (docs/reference/http_environments.md)") from None
                    if time.monotonic() >= deadline:
                        raise RuntimeError(f"env.http.command: {where} did not answer within "
                                           f"env.http.startup_timeout_s={cfg.startup_timeout_s:g} s ({e})") from None
                time.sleep(0.1)
        for attempt in range(cfg.max_retries + 1):
            try:
                self._check_health_once(cfg.timeout_s)
                return
            except _CallError as e:
                if not e.retryable or attempt == cfg.max_retries:
                    raise RuntimeError(f"no HTTP environment answers at {self.url}: {where} failed ({e}); start "
                                       "the service, fix env.http.url, or set env.http.command so the run "
                                       "starts it") from None
                time.sleep(cfg.retry_backoff_s * 2**attempt)

    def _check_health_once(self, timeout: float) -> None:
        status, body = self._http("GET", "/health", None, timeout)
        if not 200 <= status < 300:
            raise _CallError("service_errors", f"HTTP {status}: {_snippet(body)}", retryable=status in _RETRY_STATUSES)
        try:
            info = json.loads(body) if body.strip() else {}
        except ValueError:
            return  # any 2xx is healthy; the body is optional
        version = info.get("protocol") if isinstance(info, dict) else None
        if version is not None and version != PROTOCOL_VERSION:
            raise _CallError("bad_responses", f"the service speaks protocol {version!r}; this trainer speaks "
                                              f"{PROTOCOL_VERSION}")

    # ---------------------------------------------------------------------------------- transport
    def _http(self, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, bytes]:
        """One request with a wall-clock limit over connect, send and the whole answer."""
        deadline = time.monotonic() + timeout

        def left() -> float:
            t = deadline - time.monotonic()
            if t <= 0:
                raise TimeoutError
            return t

        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=timeout)
        try:
            conn.connect()
            sock = conn.sock
            headers = {"Accept": "application/json"} | ({"Content-Type": "application/json"} if body else {})
            sock.settimeout(left())
            conn.request(method, self._prefix + path, body=body, headers=headers)
            sock.settimeout(left())
            resp = conn.getresponse()
            chunks, size = [], 0
            while not resp.isclosed():
                # A service that closes the connection with its answer (HTTP/1.0, "Connection: close")
                # has its socket closed by http.client once the answer is read: no timeout to set then.
                t = left()
                if sock.fileno() >= 0:
                    sock.settimeout(t)
                chunk = resp.read(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise _CallError("bad_responses", f"answer longer than {MAX_RESPONSE_BYTES >> 20} MiB")
                chunks.append(chunk)
            return resp.status, b"".join(chunks)
        except TimeoutError:
            raise _CallError("timeouts", f"no complete answer within env.http.timeout_s={self._cfg.timeout_s:g} s") from None
        except (OSError, http.client.IncompleteRead) as e:
            # refused, reset, dropped before the answer ended: the service may be (re)starting
            raise _CallError("connection_errors", f"{type(e).__name__}: {e}".rstrip(": "), retryable=True) from None
        except http.client.HTTPException as e:
            raise _CallError("bad_responses", f"not an HTTP answer ({type(e).__name__}: {e})") from None
        finally:
            conn.close()

    def _post_step(self, samples: list[dict]) -> tuple[list[Any], dict[str, float], int]:
        """POST <url>/step with retries: (results, the service's metrics, retries); _CallError when the
        whole request is lost."""
        cfg = self._cfg
        body = json.dumps({"protocol": PROTOCOL_VERSION, "samples": samples}, allow_nan=False).encode()
        for attempt in range(cfg.max_retries + 1):
            try:
                status, raw = self._http("POST", "/step", body, cfg.timeout_s)
                if status in _RETRY_STATUSES:
                    raise _CallError("service_errors", f"HTTP {status}: {_snippet(raw)}", retryable=True)
                break
            except _CallError as e:
                if not e.retryable or attempt == cfg.max_retries:
                    raise
                time.sleep(cfg.retry_backoff_s * 2**attempt)
        if not 200 <= status < 300:
            raise _CallError("service_errors", f"HTTP {status}: {_snippet(raw)}")
        try:
            data = json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            raise _CallError("bad_responses", f"the answer is not JSON: {_snippet(raw)}") from None
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, list):
            raise _CallError("bad_responses", "the answer is not an object with a \"results\" list")
        if len(results) != len(samples):
            raise _CallError("bad_responses", f"{len(results)} results for {len(samples)} samples")
        metrics = data.get("metrics") or {}
        if not isinstance(metrics, dict):
            raise _CallError("bad_responses", "\"metrics\" is not an object")
        return results, {str(k): float(v) for k, v in metrics.items() if _finite_number(v)}, attempt

    # ------------------------------------------------------------------------------------- step
    def step(self, message_log_batch: list[LLMMessageLogType], metadata: list[dict]) -> EnvironmentReturn:
        batch, meta = normalize_step_inputs(message_log_batch, metadata)
        n = len(batch)
        rewards, terminateds = [math.nan] * n, [True] * n
        observations = [{"role": "environment", "content": ""} for _ in range(n)]
        stops: list[list[str] | None] = [None] * n
        new_meta = list(meta)
        counts = dict.fromkeys(_KINDS, 0)
        service: dict[str, list[tuple[float, int]]] = {}
        retries = restarts = 0
        todo = range(n)
        try:
            restarts = self._revive()
        except Exception as e:  # it did not come back: this call's samples are lost, the next call tries again
            counts["connection_errors"], todo = n, range(0)
            self._report("connection_errors", n, str(e))
        try:
            rows, samples = [], []
            for i in todo:
                try:
                    samples.append(_sample_json(batch[i], meta[i]))
                    rows.append(i)
                except Exception as e:
                    counts["bad_inputs"] += 1
                    self._report("bad_inputs", 1, f"sample not sent: {e}")
            size = self._cfg.max_batch_size
            chunks = [(rows[k:k + size], samples[k:k + size]) for k in range(0, len(rows), size)]
            assert self._pool is not None
            futures = [self._pool.submit(self._post_step, s) for _, s in chunks]
            for (idx, _), fut in zip(chunks, futures):
                try:
                    results, metrics, tries = fut.result()
                except _CallError as e:
                    counts[e.kind] += len(idx)
                    self._report(e.kind, len(idx), str(e))
                    continue
                retries += tries
                for k, v in metrics.items():
                    service.setdefault(k, []).append((v, len(idx)))
                for i, item in zip(idx, results):
                    try:
                        rewards[i], terminateds[i], observations[i], stops[i], new_meta[i] = _result(item, meta[i])
                    except _CallError as e:
                        counts[e.kind] += 1
                        self._report(e.kind, 1, str(e))
        except Exception as e:  # last line of defence: step must never raise into the trainer
            rewards, terminateds = [math.nan] * n, [True] * n
            counts = dict.fromkeys(counts, 0)  # every sample is lost, once, whatever was counted before
            counts["bad_responses"] = n
            self._report("bad_responses", n, f"{type(e).__name__}: {e}")

        import torch  # lazily: config validation imports this module

        out: dict[str, float] = {}
        for k, vs in service.items():  # the service's own: counters add up, the rest is averaged
            out[k] = (sum(v for v, _ in vs) if k.startswith("num_")
                      else sum(v * w for v, w in vs) / max(sum(w for _, w in vs), 1))
        out |= {f"num_{k}": float(v) for k, v in counts.items()}
        out["num_unscorable"] = float(sum(math.isnan(r) for r in rewards))
        out["num_retries"] = float(retries)
        if self._proc is not None:
            out["num_service_restarts"] = float(restarts)
        return EnvironmentReturn(observations=observations, metadata=new_meta, next_stop_strings=stops,
                                 rewards=torch.tensor(rewards, dtype=torch.float32),
                                 terminateds=torch.tensor(terminateds, dtype=torch.bool), metrics=out)

    def _report(self, kind: str, n: int, message: str) -> None:
        """The first error of each kind, once; later ones only count."""
        with self._lock:
            if kind in self._reported:
                return
            self._reported.add(kind)
        print(f"[nemo_like] http environment {self.url}: {n} sample(s) unscorable: {message} (further "
              f"{kind.replace('_', ' ')} are counted in num_{kind}, not printed)", flush=True)

    def shutdown(self) -> None:
        with self._restart_lock:  # a restart under way finishes first, and none starts after this
            self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._proc is not None:
            stop_service(self._proc)


def _snippet(raw: bytes) -> str:
    text = raw[:200].decode("utf-8", "replace").replace("\n", " ").strip()
    return repr(text) + ("..." if len(raw) > 200 else "")
