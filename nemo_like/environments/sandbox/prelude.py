"""The trusted harness that runs inside the sandbox, before and around the untrusted program.

It is sent to ``python -I -S -B -c`` as source text; the parent (:mod:`nemo_like.environments.sandbox`)
sends it ``{nonce, program, tests, limits, thread_stack, uid}`` as JSON on stdin and reads result lines, each
prefixed by the nonce, from the private channel that was stderr.
"""

RESULT_LINE_CAP = 512  # bytes per result line the parent keeps (the prelude writes at most ~350)

# Everything it needs after the program has run is bound to locals first, so a program that
# replaces builtins or module attributes (os.write, enumerate...) cannot change how results are
# reported. Marker for tests: _nemo_like_sandbox_harness.
PRELUDE = r'''
import os, sys
def _nemo_like_sandbox_harness():
    import builtins, json, resource
    _write, _exit, _exec, _compile, _len = os.write, os._exit, exec, compile, len
    _type, _str, _base = type, str, BaseException
    p = json.loads(sys.stdin.buffer.read())
    nonce = p.pop("nonce").encode()
    res = os.dup(2)                 # private result channel: the original stderr pipe
    os.dup2(1, 2)                   # the program's stderr goes to stdout with its prints
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)

    def emit(kind, i=-1, info=""):
        try:
            text = info.encode("utf-8", "replace")[:300].replace(b"\n", b" ").replace(b"\r", b" ")
        except _base:
            text = b""
        _write(res, b"%s %s %d %s\n" % (nonce, kind, i, text))

    def describe(e):
        try:
            return "%s: %s" % (_type(e).__name__, _str(e))
        except _base:
            return "exception"

    for name, value in p["limits"]:
        resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
    if p["thread_stack"]:           # small thread stacks where the address space is split thin
        import _thread
        _thread.stack_size(p["thread_stack"])
    uid = p["uid"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid):
            _exit(121)
    program, tests = p["program"], p["tests"]
    n = _len(tests)
    del p
    emit(b"ready")
    g = {"__name__": "__solution__", "__builtins__": builtins}
    try:
        _exec(_compile(program, "<program>", "exec", dont_inherit=True), g)
    except _base as e:
        emit(b"program_error", -1, describe(e))
        _exit(1)
    emit(b"program_ok")
    i = 0
    while i < n:
        try:
            _exec(_compile(tests[i], "<test %d>" % i, "exec", dont_inherit=True), g)
        except _base as e:
            emit(b"fail", i, describe(e))
        else:
            emit(b"pass", i)
        i += 1
    emit(b"done")
    try:
        sys.stdout.flush()
    except _base:
        pass
    _exit(0)
_nemo_like_sandbox_harness()
'''
