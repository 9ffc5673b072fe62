"""The http environment against real servers on 127.0.0.1: the example graders in Python and in Node
(the protocol is the same in both), a server of this module that misbehaves on purpose (timeouts,
garbage, dropped connections, 503s: each costs only its samples, counted), services started by the
environment itself (``command``), and start-up failures (one line naming the URL)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from nemo_like.environments.env_config import validate_env_config
from nemo_like.environments.http_environment import HttpEnvConfig, HttpEnvironment

ROOT = Path(__file__).resolve().parents[3]
SERVERS = {"python": [sys.executable, str(ROOT / "examples/http_environment/math_server.py"), "--port", "0"],
           "node": ["node", str(ROOT / "examples/http_environment/math_server.js"), "--port", "0"]}
FAST = {"max_retries": 2, "retry_backoff_s": 0.01}


def _answer(text: str, truth=None, *, meta: bool = True) -> tuple[list[dict], dict | None]:
    log = [{"role": "user", "content": "What is 2+3?"},
           {"role": "assistant", "content": text, "token_ids": [1, 2, 3]}]  # token ids never go out
    return log, ({"ground_truth": truth} if meta else {"other": 1})


@pytest.fixture(scope="module", params=sorted(SERVERS))
def grader_url(request):
    """An example grader started as its README says, on a port of its choosing."""
    proc = subprocess.Popen(SERVERS[request.param], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"listening on (http://\S+)", line)
        assert m, f"{request.param} server said {line!r}"
        yield m.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_example_graders_speak_the_same_protocol(grader_url):
    env = HttpEnvironment({"url": grader_url, "max_batch_size": 2, **FAST})
    try:
        samples = [_answer(r"5 so \boxed{5}", "5"), _answer(r"\boxed{6}", "5"), _answer(r"\boxed{1,000}", "1000"),
                   _answer(r"\boxed{0.5}", "1/2"), _answer("5, no box", "5"), _answer(r"\boxed{5}", meta=False),
                   _answer(r"\boxed{5} then \boxed{7}", "5")]
        logs, meta = zip(*samples)
        ret = env.step(list(logs), list(meta))
        r = ret.rewards.tolist()
        assert r[:5] == [1.0, 0.0, 1.0, 1.0, 0.0] and math.isnan(r[5]) and r[6] == 0.0  # the last box decides
        assert ret.terminateds.tolist() == [True] * 7
        assert ret.observations[0] == {"role": "environment", "content": "Environment: correct"}
        assert ret.metadata[0] == {"ground_truth": "5"}  # not sent back: the sample's own
        m = ret.metrics
        # the one without a ground truth is the service's own refusal; the rest went through
        assert m["num_service_errors"] == 1 and m["num_unscorable"] == 1 and m["num_bad_responses"] == 0
        # the service's accuracy per request of 2 (1, 1/2, 0 of 0, 0), averaged by the samples sent
        assert m["accuracy"] == pytest.approx((1.0 * 2 + 0.5 * 2 + 0.0 * 2 + 0.0 * 1) / 7)
    finally:
        env.shutdown()


class _Faulty(BaseHTTPRequestHandler):
    """/<mode>/health and /<mode>/step: the URL's path prefix picks the fault."""

    protocol_version = "HTTP/1.1"
    calls: dict[str, int] = {}
    in_flight = 0
    max_in_flight = 0
    lock = threading.Lock()

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        mode = self.path.split("/")[1]
        if mode == "oldproto":
            self._send(200, b'{"status": "ok", "protocol": 7}')
        elif mode == "nohealth":
            self._send(404, b'{"error": "no such path"}')
        else:
            self._send(200, b"")  # any 2xx is healthy, a body is optional

    def do_POST(self) -> None:  # noqa: N802
        mode = self.path.split("/")[1]
        samples = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["samples"]
        cls = type(self)
        with cls.lock:
            cls.calls[mode] = cls.calls.get(mode, 0) + 1
            call = cls.calls[mode]
        ok = [{"reward": 1.0} for _ in samples]
        if mode == "slow" and samples[0]["metadata"].get("slow"):
            time.sleep(1.5)
        if mode == "count":
            with cls.lock:
                cls.in_flight += 1
                cls.max_in_flight = max(cls.max_in_flight, cls.in_flight)
            time.sleep(0.15)
            with cls.lock:
                cls.in_flight -= 1
        if mode == "drop" and call == 1:  # the first request: connection closed, no answer
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if (mode == "unavailable" and call <= 2) or mode == "busy":
            return self._send(503, b'{"error": "warming up"}')
        body: object = {"results": ok, "metrics": {"num_graded": len(samples), "mean_len": 2.0}}
        if mode == "notjson":
            return self._send(200, b"<html>Internal Server Error</html>")
        if mode == "short":
            body = {"results": ok[:-1]}
        if mode == "status":
            return self._send(500, b'{"error": "grader crashed: KeyError"}')
        if mode == "nan":  # what Python's json.dumps writes for float("nan"): not JSON
            return self._send(200, json.dumps({"results": [{"reward": math.nan}] * len(samples)}).encode())
        if mode == "items":  # one good result, then one garbage result of each kind
            raw = b'{"results": [{"reward": 0.5}, {"reward": 1e400}, {"reward": "1"}, {"reward": true}, ' \
                  b'{"reward": null}, {"reward": 1, "terminated": "no"}, 3, {"reward": 1, "next_stop_strings": [1]}, ' \
                  b'{"reward": 1, "observation": {"content": 5}}, {"reward": 1, "metadata": [1]}]}'
            return self._send(200, raw)
        if mode == "turns":  # a multi-turn answer: keep going, with a message and new state
            body = {"results": [{"reward": 0.25, "terminated": False, "observation": "try again",
                                 "next_stop_strings": ["</answer>"], "metadata": {"turn": s["metadata"]["turn"] + 1}}
                                for s in samples]}
        self._send(200, json.dumps(body).encode())


@pytest.fixture(scope="module")
def faulty_base():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Faulty)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _batch(n: int, **meta) -> tuple[list, list]:
    return [_answer(r"\boxed{5}")[0] for _ in range(n)], [dict(meta, ground_truth="5") for _ in range(n)]


def test_faults_cost_only_their_samples_counted_and_shown_once(faulty_base, capsys):
    def run(mode: str, n: int = 4, **options):
        env = HttpEnvironment({"url": f"{faulty_base}/{mode}", **FAST, **options})
        try:
            return env.step(*_batch(n))
        finally:
            env.shutdown()

    for mode, kind in [("notjson", "bad_responses"), ("nan", "bad_responses"), ("short", "bad_responses"),
                       ("status", "service_errors")]:
        ret = run(mode)
        assert all(math.isnan(r) for r in ret.rewards.tolist()), mode
        assert ret.metrics[f"num_{kind}"] == 4 and ret.metrics["num_unscorable"] == 4, mode
    out = capsys.readouterr().out
    assert "the answer is not JSON: '<html>Internal Server Error</html>'" in out
    assert "the answer is not JSON: '{\"results\": [{\"reward\": NaN}" in out
    assert "3 results for 4 samples" in out and "HTTP 500: '{\"error\": \"grader crashed: KeyError\"}'" in out

    # Garbage in single results costs those results only.
    ret = run("items", n=10)
    r = ret.rewards.tolist()
    assert r[0] == 0.5 and all(math.isnan(x) for x in r[1:])
    assert ret.metrics["num_bad_responses"] == 9 and ret.metrics["num_unscorable"] == 9

    # Retried: a dropped connection and two 503s, then answers; both counted as retries, nothing lost.
    for mode, retries in [("drop", 1), ("unavailable", 2)]:
        ret = run(mode, max_batch_size=4)
        assert ret.rewards.tolist() == [1.0] * 4 and ret.metrics["num_retries"] == retries, mode
        assert ret.metrics["num_graded"] == 4 and ret.metrics["mean_len"] == 2.0  # the service's metrics
    # Out of retries: a 503 every time costs the samples.
    ret = run("busy")
    assert ret.metrics["num_service_errors"] == 4 and ret.metrics["num_retries"] == 0
    assert _Faulty.calls["busy"] == 1 + FAST["max_retries"]

    # A request past timeout_s costs its samples, not the other requests of the step.
    env = HttpEnvironment({"url": f"{faulty_base}/slow", "timeout_s": 0.5, "max_batch_size": 2, **FAST})
    try:
        logs, meta = _batch(6)
        meta[2]["slow"] = True  # the second request of 2
        for _ in range(2):  # the first error of a kind is printed once per environment
            t = time.monotonic()
            ret = env.step(logs, meta)
            assert time.monotonic() - t < 1.4
            r = ret.rewards.tolist()
            assert r[:2] == [1.0, 1.0] and math.isnan(r[2]) and math.isnan(r[3]) and r[4:] == [1.0, 1.0]
            assert ret.metrics["num_timeouts"] == 2 and ret.metrics["num_retries"] == 0  # timeouts are not retried
    finally:
        env.shutdown()
    assert capsys.readouterr().out.count("no complete answer within env.http.timeout_s=0.5 s") == 1


def test_a_service_that_closes_each_connection_is_served():
    # Python's BaseHTTPRequestHandler speaks HTTP/1.0 by default: it closes the connection with each
    # answer, and http.client closes the socket once the answer is read (setting its timeout then
    # failed every request as a connection error).
    class Closing(_Faulty):
        protocol_version = "HTTP/1.0"

    server = ThreadingHTTPServer(("127.0.0.1", 0), Closing)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = HttpEnvironment({"url": f"http://127.0.0.1:{server.server_address[1]}/ok", **FAST})
    try:
        ret = env.step(*_batch(3))
        assert ret.rewards.tolist() == [1.0, 1.0, 1.0] and ret.metrics["num_unscorable"] == 0
    finally:
        env.shutdown()
        server.shutdown()
        server.server_close()


def test_multi_turn_results_and_bounded_concurrency(faulty_base):
    env = HttpEnvironment({"url": f"{faulty_base}/turns/"})  # a trailing slash is fine
    try:
        logs, meta = _batch(2, turn=1)
        ret = env.step(logs, meta)
        assert ret.rewards.tolist() == [0.25, 0.25] and ret.terminateds.tolist() == [False, False]
        assert ret.observations[0] == {"role": "environment", "content": "try again"}
        assert ret.next_stop_strings == [["</answer>"]] * 2 and ret.metadata[0] == {"turn": 2}
    finally:
        env.shutdown()

    # Two step calls at once (a streaming rollout), 8 requests of 1: never more than 3 in flight.
    env = HttpEnvironment({"url": f"{faulty_base}/count", "max_batch_size": 1, "max_concurrency": 3})
    try:
        threads = [threading.Thread(target=env.step, args=_batch(4)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert _Faulty.calls["count"] == 8 and 2 <= _Faulty.max_in_flight <= 3  # never past the bound
    finally:
        env.shutdown()


def test_start_failures_are_one_line_naming_the_url(faulty_base):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(RuntimeError) as e:
        HttpEnvironment({"url": closed, **FAST})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"no HTTP environment answers at {closed}: GET {closed}/health failed")
    assert "ConnectionRefusedError" in msg and "env.http.url" in msg
    with pytest.raises(RuntimeError, match=r"/nohealth/health failed \(HTTP 404"):
        HttpEnvironment({"url": f"{faulty_base}/nohealth", **FAST})
    with pytest.raises(RuntimeError, match="the service speaks protocol 7; this trainer speaks 1"):
        HttpEnvironment({"url": f"{faulty_base}/oldproto", **FAST})

    # A command that dies before it serves: its exit code and last output line.
    cmd = [sys.executable, "-c", "import sys; print('cannot bind'); print('port taken', flush=True); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"env.http.command exited with code 3 before GET http://127.0.0.1:\d+/health "
                                           r"answered; its last output: port taken"):
        HttpEnvironment({"command": cmd})
    with pytest.raises(RuntimeError, match=r"env.http.command 'no-such-program-xyz --port \d+' could not start"):
        HttpEnvironment({"command": "no-such-program-xyz --port {port}"})
    # A started service that is up but has no /health (a plain file server): said at once, not after
    # the start-up time limit.
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"env.http.command: the service answered GET http://127.0.0.1:\d+/health "
                                           r"with HTTP 404"):
        HttpEnvironment({"command": f"{sys.executable} -m http.server {{port}} --bind 127.0.0.1",
                         "startup_timeout_s": 30})
    assert time.monotonic() - t0 < 15
    with pytest.raises(RuntimeError, match=r"did not answer within env.http.startup_timeout_s=0.5 s"):
        HttpEnvironment({"command": [sys.executable, "-c", "import time; time.sleep(30)"], "startup_timeout_s": 0.5})


def test_a_started_service_that_exits_is_started_again(tmp_path, capsys):
    """Once: the second start exits at once (code 5), which costs that step's samples, not the run."""
    marker, server = str(tmp_path / "started"), str(ROOT / "examples/http_environment/math_server.py")
    once = (f"import os, runpy, sys; m = {marker!r}; os.path.exists(m) and sys.exit(5); open(m, 'w').close(); "
            f"sys.argv = ['s', '--port', os.environ['PORT']]; runpy.run_path({server!r}, run_name='__main__')")
    env = HttpEnvironment({"command": [sys.executable, "-c", once], **FAST})
    try:
        logs, meta = zip(_answer(r"\boxed{5}", "5"), _answer(r"\boxed{4}", "5"))
        assert env.step(list(logs), list(meta)).metrics["num_service_restarts"] == 0
        os.remove(marker)
        env._proc.kill()
        env._proc.wait()
        ret = env.step(list(logs), list(meta))  # started again: graded
        assert ret.rewards.tolist() == [1.0, 0.0] and ret.metrics["num_service_restarts"] == 1
        env._proc.kill()
        env._proc.wait()
        for _ in range(2):  # and now it will not start: each call tries again, its samples are lost
            ret = env.step(list(logs), list(meta))
            assert all(math.isnan(r) for r in ret.rewards.tolist()) and ret.metrics["num_connection_errors"] == 2
    finally:
        env.shutdown()
    out = capsys.readouterr().out
    assert out.count("env.http.command exited with code -9 (its last output: math grader listening on") == 2
    assert out.count("exited with code 5 before GET http://127.0.0.1:") == 1  # printed once, then counted


def test_config_errors_name_the_key():
    def err(cfg) -> str:
        with pytest.raises(ValueError) as e:
            validate_env_config("http", HttpEnvConfig, cfg)
        return str(e.value)

    assert err({}).startswith("env.http: set env.http.url (the service's base URL")
    assert "env.http: env.http.url 'ftp://x' is not an http:// or https:// URL with a host" in err({"url": "ftp://x"})
    assert "holds {port}, which only env.http.command fills in" in err({"url": "http://h:{port}"})
    assert err({"url": "http://h", "timout_s": 1}) == "env.http.timout_s: unknown config key (did you mean env.http.timeout_s?)"
    assert err({"url": "http://h", "max_concurrency": 0}).startswith("env.http.max_concurrency: Input should be greater")
    assert "env.http.command: an empty command" in err({"command": "  "})
    ok = validate_env_config("http", HttpEnvConfig, {"command": "node s.js", "url": "http://127.0.0.1:{port}/v1"})
    assert ok.timeout_s == 30.0 and ok.max_retries == 3


def test_a_started_service_gets_its_port_and_dies_with_its_actor(ray_session):
    """``command`` through Ray, as a run starts it: the Node grader on a free port ({port} and PORT),
    grading; killing the actor (a restart, the run's end) stops the service too."""
    import ray

    from nemo_like.environments.registry import create_env_actor

    actor = create_env_actor("http", {"command": "node examples/http_environment/math_server.js",
                                      "url": "http://127.0.0.1:{port}/"})
    pid, url = ray.get(actor.__ray_call__.remote(lambda self: (self._proc.pid, self.url)), timeout=30)
    assert url.startswith("http://127.0.0.1:")
    os.kill(pid, 0)  # alive
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the service (pid {pid}) outlived its actor")


def test_a_service_down_at_start_stops_the_run_in_one_line(ray_session):
    from nemo_like.environments.registry import create_env_actor
    from nemo_like.environments.supervision import EnvironmentStartError, wait_for_env_actors

    actor = create_env_actor("http", {"url": "http://127.0.0.1:9/grader", **FAST})
    with pytest.raises(EnvironmentStartError) as e:
        wait_for_env_actors({"math": actor}, {"math": "http"}, timeout_s=60)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("environment 'http' (task 'math') failed to start: RuntimeError: no HTTP environment "
                          "answers at http://127.0.0.1:9/grader: GET http://127.0.0.1:9/grader/health failed")
