"""An arithmetic grader served over HTTP: the nemo_like HTTP environment protocol
(docs/reference/http_environments.md) in Python, with the standard library only (it imports
nothing from nemo_like: the service could be in any language, on any machine).

    python examples/http_environment/math_server.py            # port from $PORT, else 8000
    python examples/http_environment/math_server.py --port 0   # any free port (printed)

GET /health -> {"status": "ok", "protocol": 1}
POST /step  -> one result per sample: reward 1 when the last \\boxed{...} of the last assistant
               message equals the sample's metadata.ground_truth (as a number when both are one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY = 32 << 20
_NUMBER = re.compile(r"-?\d+(\.\d+)?|-?\d+/\d+")
_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (balanced braces), or None. The last box decides even when
    it is never closed: falling back to an earlier one would reward boxing several candidates."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + 7
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 7 : i]
        i += 1
    return None


def normalize(answer: str) -> str:
    s = re.sub(r"\$|\s+", "", answer).removesuffix(".")
    return s.replace(",", "") if _THOUSANDS.fullmatch(s) else s


def equivalent(answer: str, truth: str) -> bool:
    a, t = normalize(answer), normalize(truth)
    if not a or not t:
        return False
    if a == t:
        return True
    if _NUMBER.fullmatch(a) and _NUMBER.fullmatch(t):
        try:
            return Fraction(a) == Fraction(t)
        except (ValueError, ZeroDivisionError):
            return False
    return False


def grade(sample: dict) -> dict:
    messages = sample.get("messages") if isinstance(sample, dict) else None
    meta = sample.get("metadata") if isinstance(sample, dict) else None
    truth = meta.get("ground_truth") if isinstance(meta, dict) else None
    if not isinstance(truth, (str, int, float)) or isinstance(truth, bool):
        return {"reward": None, "error": "metadata has no ground_truth"}
    replies = [m["content"] for m in messages or [] if isinstance(m, dict) and m.get("role") == "assistant"
               and isinstance(m.get("content"), str)]
    answer = last_boxed(replies[-1]) if replies else None
    correct = answer is not None and equivalent(answer, str(truth))
    return {"reward": 1.0 if correct else 0.0, "terminated": True,
            "observation": {"role": "environment", "content": f"Environment: {'correct' if correct else 'incorrect'}"}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        if self.path == "/health":
            self._send(200, {"status": "ok", "protocol": 1})
        else:
            self._send(404, {"error": f"no GET {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/step":
            self._send(404, {"error": f"no POST {self.path}"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.close_connection = True
            self._send(413, {"error": "request too large"})
            return
        try:
            body = json.loads(self.rfile.read(length))
            samples = body["samples"]
            assert isinstance(samples, list)
        except Exception as e:
            self._send(400, {"error": f"request is not JSON with a \"samples\" list: {e}"})
            return
        results = [grade(s) for s in samples]
        scored = [r["reward"] for r in results if r["reward"] is not None]
        self._send(200, {"results": results, "metrics": {"accuracy": sum(scored) / len(scored) if scored else 0.0}})

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet: one line per request is noise
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", 8000)))
    parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stopped by the trainer: exit cleanly
    print(f"math grader listening on http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
