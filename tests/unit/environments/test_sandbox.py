"""The code sandbox: hostile programs score 0, are contained and end in bounded time; correct programs pass.

Each hostile program does its damage unguarded, so a sandbox that let it through would not only change
the host (checked directly) but also let the program finish. Needs bubblewrap (``apt-get install -y
bubblewrap``): without it these tests skip, unless NEMO_LIKE_REQUIRE_BWRAP=1 makes that a failure. The
missing-bwrap error is tested with a nonexistent ``bwrap_path`` whatever the machine has.
"""

from __future__ import annotations

import os
import resource
import secrets
import shutil
import socket
import subprocess
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from nemo_like.environments.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError, run_many
from nemo_like.environments.sandbox import core as sandbox_module

REPO = Path(__file__).resolve().parents[3]
TIMEOUT = 2.0
HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(
    not HAVE_BWRAP and os.environ.get("NEMO_LIKE_REQUIRE_BWRAP") != "1",
    reason="bubblewrap is not installed (apt-get install -y bubblewrap)",
)


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    if not HAVE_BWRAP and os.environ.get("NEMO_LIKE_REQUIRE_BWRAP") != "1":
        pytest.skip("bubblewrap is not installed (apt-get install -y bubblewrap)")
    return Sandbox(SandboxConfig(timeout_s=TIMEOUT, max_concurrency=2))


def src(code: str) -> str:
    return textwrap.dedent(code).strip() + "\n"


def harness_processes() -> list[int]:
    """Pids of live processes running the sandbox prelude (leftovers of a run)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"_nemo_like_sandbox_harness" in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


def assert_zero(result, status: str | tuple[str, ...]) -> None:
    statuses = (status,) if isinstance(status, str) else status
    assert result.status in statuses, (result.status, result.error, result.output[:500])
    assert result.pass_fraction == 0.0 and not result.all_passed
    assert not any(result.tests_passed)


# ------------------------------------------------------------------------------ correct programs
@needs_bwrap
def test_correct_program_passes(sb):
    r = sb.run("def add(a, b):\n    return a + b\n", ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"])
    assert r.status == "ok" and r.tests_passed == [True, True]
    assert r.pass_fraction == 1.0 and r.all_passed and r.error == ""


@needs_bwrap
def test_partial_pass_fraction_each_test_independent(sb):
    program = src(
        """
        def add(a, b):
            if a > 10:
                return 0
            return a + b
        print("hello from the program")
        """
    )
    tests = [
        "assert add(1, 2) == 3",
        "assert add(20, 1) == 21",  # wrong
        "undefined_name()",  # NameError: does not stop the next tests
        "import sys; sys.exit(0)",  # SystemExit inside a test is a failed test, not the end of the run
        "assert add(2, 2) == 4",
    ]
    r = sb.run(program, tests)
    assert r.status == "ok"
    assert r.tests_passed == [True, False, False, False, True]
    assert r.pass_fraction == pytest.approx(2 / 5)
    assert "AssertionError" in r.test_errors[1] and "NameError" in r.test_errors[2]
    assert "hello from the program" in r.output


@needs_bwrap
def test_program_can_use_its_private_tmp(sb):
    name = f"nl_sbx_{secrets.token_hex(4)}"
    r = sb.run(f"import os\nopen('/tmp/{name}', 'w').write('hi')\ndata = open('{name}').read()\n", ["assert data == 'hi'"])
    assert r.pass_fraction == 1.0, r.error
    assert not Path("/tmp", name).exists()  # the private tmp is not the host's


@needs_bwrap
@pytest.mark.parametrize(
    "program, status",
    [
        ("def add(a, b) return a + b", "program_error"),  # SyntaxError
        ("raise ValueError('boom')", "program_error"),
        ("import sys\nsys.exit(0)", "program_error"),  # exiting early is not passing
        ("import os\nos._exit(0)", "crashed"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", "crashed"),
    ],
    ids=["syntax", "raise", "sys_exit", "os_exit", "segv"],
)
def test_failing_programs_score_zero(sb, program, status):
    assert_zero(sb.run(program, ["assert True"]), status)


@needs_bwrap
def test_forged_results_do_not_count(sb):
    # fake result lines on every fd the harness might use, then leave before the tests run
    program = src(
        """
        import os
        for fd in (1, 2, 3, 4):
            for kind in (b"ready", b"program_ok", b"pass", b"done"):
                try:
                    os.write(fd, b"0123 " + kind + b" 0 \\n")
                except OSError:
                    pass
        os._exit(0)
        """
    )
    assert_zero(sb.run(program, ["assert True"]), "crashed")


# ------------------------------------------------------------------------------ hostile programs
@needs_bwrap
def test_infinite_loop_times_out(sb):
    start = time.monotonic()
    r = sb.run("while True:\n    pass\n", ["assert True"])
    assert_zero(r, "timeout")
    assert time.monotonic() - start < TIMEOUT + 3
    assert harness_processes() == []


@needs_bwrap
def test_hanging_test_times_out_whole_run(sb):
    r = sb.run("x = 1\n", ["assert x == 1", "import time\ntime.sleep(60)"])
    assert_zero(r, "timeout")


@needs_bwrap
def test_fork_bomb_is_contained(sb):
    program = src(
        """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """
    )
    start = time.monotonic()
    r = sb.run(program, ["assert True"])
    assert_zero(r, ("timeout", "crashed", "program_error"))
    assert time.monotonic() - start < TIMEOUT + 3
    time.sleep(0.2)
    assert harness_processes() == []  # every forked process died with the sandbox


@needs_bwrap
@pytest.mark.parametrize(
    "program",
    ["x = bytearray(8 << 30)\n", "x = []\nwhile True:\n    x.append(bytearray(50 << 20))\n"],
    ids=["one_huge_alloc", "growing"],
)
def test_memory_bomb_is_contained(sb, program):
    start = time.monotonic()
    r = sb.run(program, ["assert True"])
    assert_zero(r, ("program_error", "crashed"))
    assert "MemoryError" in r.error or r.status == "crashed"
    assert time.monotonic() - start < TIMEOUT + 3


@needs_bwrap
def test_file_writes_and_deletes_outside_tmp_fail(sb, tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("alive")
    before = sorted(os.listdir(tmp_path))
    repo_evil = REPO / f"evil_{secrets.token_hex(4)}"
    attacks = [
        f"import os\nos.remove({str(canary)!r})",
        f"open({str(tmp_path / 'evil.txt')!r}, 'w').write('x')",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        f"open({str(repo_evil)!r}, 'w').write('x')",
        f"open({str(REPO / 'pyproject.toml')!r}, 'a').write('evil')",
        "open('/etc/evil_nemo_like', 'w').write('x')",
        "open('/usr/lib/evil_nemo_like', 'w').write('x')",
        f"import os\nos.makedirs({os.path.expanduser('~') + '/evil_nemo_like'!r})",  # the trainer's home
    ]
    pyproject = (REPO / "pyproject.toml").read_bytes()
    results = sb.run_many([(a, ["assert True"]) for a in attacks])
    for attack, r in zip(attacks, results):
        assert r.status == "program_error" and r.pass_fraction == 0.0, (attack, r.status, r.error)
    assert canary.read_text() == "alive"
    assert sorted(os.listdir(tmp_path)) == before
    assert not repo_evil.exists() and (REPO / "pyproject.toml").read_bytes() == pyproject
    assert not Path("/etc/evil_nemo_like").exists() and not Path("/usr/lib/evil_nemo_like").exists()
    assert not Path(os.path.expanduser("~"), "evil_nemo_like").exists()


@needs_bwrap
def test_project_files_and_homes_are_not_readable(sb):
    assert (REPO / "pyproject.toml").is_file()
    r = sb.run(f"data = open({str(REPO / 'pyproject.toml')!r}).read()\n", ["assert True"])
    assert_zero(r, "program_error")
    assert "FileNotFoundError" in r.error or "PermissionError" in r.error
    # what is left visible of the project dir and the homes is empty (or not listable at all), but
    # for the directories leading to the interpreter's own install, bound back read-only
    home = os.path.expanduser("~")
    probe = src(
        f"""
        import os
        allowed = set({list(Path(sb.python).parts)!r})
        seen = {{}}
        for d in ({str(REPO)!r}, '/work', '/root', '/home', {home!r}):
            try:
                seen[d] = os.listdir(d)
            except OSError as e:
                seen[d] = type(e).__name__
        print(seen)
        """
    )
    r = sb.run(probe, ["assert all(isinstance(v, str) or set(v) <= allowed for v in seen.values()), seen"])
    assert r.pass_fraction == 1.0, (r.error, r.test_errors, r.output)
    assert "pyproject" not in r.output


@needs_bwrap
def test_network_is_unreachable(sb):
    r = sb.run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\n", ["assert True"])
    assert_zero(r, "program_error")
    # a server on the host's loopback cannot be reached from the sandbox's own loopback
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.3)
    port = server.getsockname()[1]
    try:
        r = sb.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n", ["assert True"])
        assert_zero(r, "program_error")
        assert "Connection refused" in r.error or "ConnectionRefusedError" in r.error
        with pytest.raises(socket.timeout):
            server.accept()  # nobody ever connected
    finally:
        server.close()


@needs_bwrap
def test_cannot_kill_the_trainer_or_its_processes(sb):
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        program = src(
            f"""
            import os
            for pid in (os.getppid(), 1, {os.getpid()}, {bystander.pid}, -1):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            raise SystemExit("still here")
            """
        )
        r = sb.run(program, ["assert True"])
        assert_zero(r, ("program_error", "crashed"))
        assert bystander.poll() is None  # the bystander is alive (and so is this test process)
        os.kill(os.getpid(), 0)
    finally:
        bystander.kill()
        bystander.wait()


@needs_bwrap
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_printing_gigabytes_is_cut_quickly(sb, stream):
    program = f"import sys\nchunk = 'x' * (1 << 20)\nwhile True:\n    sys.{stream}.write(chunk)\n"
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    r = sb.run(program, ["assert True"])
    elapsed = time.monotonic() - start
    assert_zero(r, "output_limit")
    assert elapsed < TIMEOUT  # killed at the cap, not at the timeout
    assert len(r.output.encode()) <= sb.config.max_output_bytes
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 100 * 1024  # KiB


@needs_bwrap
def test_environment_secrets_are_not_visible(sb, monkeypatch):
    secret = secrets.token_hex(8)
    monkeypatch.setenv("NEMO_LIKE_SECRET", secret)
    program = src(
        """
        import os
        print(dict(os.environ))
        for pid in os.listdir('/proc'):
            if pid.isdigit():
                try:
                    print(open(f'/proc/{pid}/environ', 'rb').read())
                except OSError:
                    pass
        secret = os.environ.get('NEMO_LIKE_SECRET')
        """
    )
    r = sb.run(program, ["assert secret is None"])
    assert r.pass_fraction == 1.0, (r.error, r.output[:500])
    assert secret not in r.output and "NEMO_LIKE_SECRET" not in r.output
    assert "HOME" in r.output  # the program did print its (clean) environment


# ------------------------------------------------------------------------------ concurrency
@needs_bwrap
def test_concurrency_is_bounded(sb):
    bounded = Sandbox(SandboxConfig(timeout_s=5.0, max_concurrency=2))
    jobs = [("import time\ntime.sleep(0.4)\n", ["assert True"])] * 6
    start = time.monotonic()
    results = bounded.run_many(jobs)
    elapsed = time.monotonic() - start
    assert [r.pass_fraction for r in results] == [1.0] * 6
    assert bounded.peak_concurrency == 2
    assert elapsed >= 3 * 0.4  # 6 sleeps, 2 at a time
    # a smaller per-call bound is respected too, and results keep job order
    single = Sandbox(SandboxConfig(timeout_s=5.0, max_concurrency=4))
    out = single.run_many([(f"x = {i}\n", [f"assert x == {i}", "assert x == 1"]) for i in range(3)], max_concurrency=1)
    assert single.peak_concurrency == 1
    assert [r.tests_passed for r in out] == [[True, False], [True, True], [True, False]]
    # the module-level helper, sharing an existing sandbox
    assert [r.all_passed for r in run_many([("y = 2\n", ["assert y == 2"])] * 2, max_concurrency=2, sandbox=sb)] == [True, True]


@needs_bwrap
def test_no_leaked_fds_or_processes(sb):
    sb.run("x = 1\n", ["assert x == 1"])  # warm up anything lazily opened
    fds_before = len(os.listdir("/proc/self/fd"))
    jobs = [("x = 1\n", ["assert x == 1"]), ("while True:\n    pass\n", []), ("print('x' * 10**6)\n", [])]
    results = sb.run_many(jobs, timeout_s=1.0)
    assert [r.status for r in results] == ["ok", "timeout", "output_limit"]
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert harness_processes() == []


# ------------------------------------------------------------------------------ without bwrap
def test_missing_bwrap_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "no" / "bwrap")
    with pytest.raises(SandboxUnavailableError, match="apt-get install -y bubblewrap") as info:
        Sandbox(SandboxConfig(bwrap_path=missing))
    assert "allow_unsandboxed" in str(info.value) and missing in str(info.value)


def test_unusable_bwrap_is_detected_at_construction(monkeypatch):
    # an executable that is not a working bwrap: the construction self-test catches it
    with pytest.raises(SandboxUnavailableError, match="does not work here"):
        Sandbox(SandboxConfig(bwrap_path="/bin/false"))
    monkeypatch.setattr(sandbox_module, "_warned_unsandboxed", False)
    with pytest.warns(RuntimeWarning):
        assert Sandbox(SandboxConfig(bwrap_path="/bin/false", allow_unsandboxed=True)).mode == "unsandboxed"


def test_unsandboxed_mode_warns_once_and_still_limits_time(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox_module, "_warned_unsandboxed", False)
    config = SandboxConfig(bwrap_path=str(tmp_path / "missing"), allow_unsandboxed=True, timeout_s=TIMEOUT)
    with pytest.warns(RuntimeWarning, match="WITHOUT isolation"):
        weak = Sandbox(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second one must not warn again
        Sandbox(config)
    assert weak.mode == "unsandboxed"
    r = weak.run("def f(x):\n    return x + 7\n", ["assert f(3) == 10", "assert f(0) == 0"])
    assert r.status == "ok" and r.tests_passed == [True, False]
    start = time.monotonic()
    assert_zero(weak.run("while True:\n    pass\n", ["assert True"]), "timeout")
    assert time.monotonic() - start < TIMEOUT + 3


def test_config_validation():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        SandboxConfig(max_concurrency=0)
    with pytest.raises(ValueError, match="hidden_paths"):
        SandboxConfig(hidden_paths=("relative/dir",))
