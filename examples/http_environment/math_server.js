// An arithmetic grader served over HTTP: the nemo_like HTTP environment protocol
// (docs/reference/http_environments.md) in Node, with nothing but its built-in `http` module.
//
//   node examples/http_environment/math_server.js            # port from $PORT, else 8000
//   node examples/http_environment/math_server.js --port 0   # any free port (printed)
//
// GET /health -> {"status": "ok", "protocol": 1}
// POST /step  -> one result per sample: reward 1 when the last \boxed{...} of the last assistant
//                message equals the sample's metadata.ground_truth (as a number when both are one).
"use strict";

const http = require("http");

const MAX_BODY = 32 * 1024 * 1024;

// The content of the last \boxed{...} (balanced braces), or null. The last box decides even when it
// is never closed: falling back to an earlier one would reward boxing several candidates.
function lastBoxed(text) {
  const start = text.lastIndexOf("\\boxed{");
  if (start < 0) return null;
  let depth = 1;
  for (let i = start + 7; i < text.length; i++) {
    const c = text[i];
    if (c === "\\") { i++; continue; }
    if (c === "{") depth++;
    else if (c === "}" && --depth === 0) return text.slice(start + 7, i);
  }
  return null;
}

function normalize(answer) {
  let s = answer.replace(/\$|\s+/g, "").replace(/\.$/, "");
  if (/^-?\d{1,3}(,\d{3})+(\.\d+)?$/.test(s)) s = s.replace(/,/g, ""); // 1,000 -> 1000
  return s;
}

// An exact number (integer, decimal or a/b) as [numerator, denominator] BigInts, or null.
function rational(s) {
  let m = /^(-?)(\d+)(?:\.(\d+))?$/.exec(s);
  if (m) {
    const frac = m[3] || "";
    const num = BigInt(m[2] + frac) * (m[1] ? -1n : 1n);
    return [num, 10n ** BigInt(frac.length)];
  }
  m = /^(-?\d+)\/(\d+)$/.exec(s);
  if (m && BigInt(m[2]) !== 0n) return [BigInt(m[1]), BigInt(m[2])];
  return null;
}

function equivalent(answer, truth) {
  const a = normalize(answer), t = normalize(truth);
  if (!a || !t) return false;
  if (a === t) return true;
  const ra = rational(a), rt = rational(t);
  return ra !== null && rt !== null && ra[0] * rt[1] === rt[0] * ra[1];
}

function grade(sample) {
  const messages = Array.isArray(sample && sample.messages) ? sample.messages : [];
  const meta = sample && sample.metadata;
  const truth = meta && meta.ground_truth;
  if (typeof truth !== "string" && typeof truth !== "number") {
    return { reward: null, error: "metadata has no ground_truth" };
  }
  const replies = messages.filter((m) => m && m.role === "assistant" && typeof m.content === "string");
  const answer = replies.length ? lastBoxed(replies[replies.length - 1].content) : null;
  const correct = answer !== null && equivalent(answer, String(truth));
  return {
    reward: correct ? 1.0 : 0.0,
    terminated: true,
    observation: { role: "environment", content: correct ? "Environment: correct" : "Environment: incorrect" },
  };
}

function send(res, status, body) {
  const data = JSON.stringify(body);
  res.writeHead(status, { "Content-Type": "application/json", "Content-Length": Buffer.byteLength(data) });
  res.end(data);
}

const server = http.createServer((req, res) => {
  if (req.method === "GET" && req.url === "/health") return send(res, 200, { status: "ok", protocol: 1 });
  if (req.method !== "POST" || req.url !== "/step") return send(res, 404, { error: `no ${req.method} ${req.url}` });
  const chunks = [];
  let size = 0;
  req.on("data", (c) => {
    size += c.length;
    if (size > MAX_BODY) { send(res, 413, { error: "request too large" }); req.destroy(); }
    else chunks.push(c);
  });
  req.on("end", () => {
    if (res.writableEnded) return;
    let body;
    try { body = JSON.parse(Buffer.concat(chunks).toString("utf8")); } catch (e) {
      return send(res, 400, { error: `request is not JSON: ${e.message}` });
    }
    if (!body || !Array.isArray(body.samples)) return send(res, 400, { error: "request has no \"samples\" list" });
    const results = body.samples.map(grade);
    const scored = results.filter((r) => r.reward !== null);
    const accuracy = scored.length ? scored.reduce((s, r) => s + r.reward, 0) / scored.length : 0;
    send(res, 200, { results, metrics: { accuracy } });
  });
});

const flag = process.argv.indexOf("--port");
const port = Number(flag >= 0 ? process.argv[flag + 1] : process.env.PORT || 8000);
const host = process.env.HOST || "127.0.0.1";
server.listen(port, host, () => {
  console.log(`math grader listening on http://${host}:${server.address().port}`);
});
// Stopped by the trainer with SIGTERM: close cleanly.
process.on("SIGTERM", () => server.close(() => process.exit(0)));
