"""The code sandbox's per-run memory cap, tmpfs caps, seccomp filter and file-system allowlist.

Real sandboxed runs, as in test_sandbox.py (bubblewrap needed: without it these skip, unless
NEMO_LIKE_REQUIRE_BWRAP=1 makes that a failure). The seccomp filter's logic is also checked
instruction by instruction for both supported architectures, and its syscall numbers against the
kernel headers where they are installed.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import struct
import textwrap
import time
from pathlib import Path

import pytest

from nemo_like.environments.sandbox import Sandbox, SandboxConfig, SandboxUnavailableError
from nemo_like.environments.sandbox import seccomp as sc
from nemo_like.environments.sandbox.memory import find_cgroup_parent

TIMEOUT = 5.0
HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(
    not HAVE_BWRAP and os.environ.get("NEMO_LIKE_REQUIRE_BWRAP") != "1",
    reason="bubblewrap is not installed (apt-get install -y bubblewrap)",
)


def src(code: str) -> str:
    return textwrap.dedent(code).strip() + "\n"


def harness_processes() -> list[int]:
    """Pids of live processes running the sandbox prelude (leftovers of a run)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes() if entry.isdigit() else b""
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0] if cmdline else "Z"
        except OSError:
            continue
        if b"_nemo_like_sandbox_harness" in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    if not HAVE_BWRAP and os.environ.get("NEMO_LIKE_REQUIRE_BWRAP") != "1":
        pytest.skip("bubblewrap is not installed (apt-get install -y bubblewrap)")
    return Sandbox(SandboxConfig(timeout_s=TIMEOUT))


@pytest.fixture
def host_dir():
    """Make a uniquely named dir under a host path (e.g. /opt); removed afterwards."""
    made: list[Path] = []

    def make(parent: str) -> Path:
        d = Path(parent) / f"nl_sbx_{secrets.token_hex(4)}"
        d.mkdir(parents=True)
        made.append(d)
        return d

    yield make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------ 14: memory per run
@needs_bwrap
def test_memory_mode_is_decided_and_exposed(sb):
    cgroup_v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    assert sb.memory_mode in (("cgroup", "rlimit") if cgroup_v2 else ("rlimit",)), sb.memory_mode_reason
    assert sb.memory_mode_reason
    assert Sandbox(SandboxConfig(memory_limit_mb=0)).memory_mode == "none"


# 6 processes share 192 MiB: 32 MiB each in the rlimit mode
SPLIT = {"memory_limit_mb": 192, "max_processes": 6}
CHILDREN = """
import os, time
r, w = os.pipe()
children = 0
for i in range({n}):
    try:
        pid = os.fork()
    except OSError as e:
        print("fork refused:", type(e).__name__, flush=True)
        break
    if pid == 0:
        try:
            block = bytearray({mb} << 20)
            block[::4096] = b"x" * len(range(0, {mb} << 20, 4096))  # touch every page
            os.write(w, b"1")
        except MemoryError:
            print("child MemoryError", flush=True)
            os.write(w, b"0")
        time.sleep(30)  # hold it until the run ends
        os._exit(0)
    children += 1
os.close(w)
got = b""
while len(got) < children:
    chunk = os.read(r, 16)
    if not chunk:
        break
    got += chunk
held_mb = got.count(b"1") * {mb}
print("children", children, "held", held_mb, "MiB", flush=True)
assert held_mb > 192, "the children did not get their memory"
"""


@needs_bwrap
@pytest.mark.parametrize(
    "n, mb, rlimit_outcome",
    [
        # each below the 32 MiB per-process cap (with Python's ~16 MiB), 16 x 14 = 224 MiB together:
        # the 6th process is refused, the 5 children hold their 14 MiB each
        (16, 14, "fork refused: BlockingIOError\nchildren 5 held 70 MiB"),
        # each below the 192 MiB per-run cap, 300 MiB together: every child gets a MemoryError
        (3, 100, "child MemoryError\n" * 3 + "children 3 held 0 MiB"),
    ],
    ids=["many_small", "few_big"],
)
def test_children_together_cannot_exceed_the_run_cap(n, mb, rlimit_outcome):
    sandbox = Sandbox(SandboxConfig(timeout_s=TIMEOUT, **SPLIT))
    start = time.monotonic()
    r = sandbox.run(src(CHILDREN.format(n=n, mb=mb)), ["assert True"])
    # killed by the OOM killer (cgroup mode) or refused memory/processes (rlimit mode)
    assert r.status in ("program_error", "crashed") and not r.all_passed, (r.status, r.error, r.output)
    assert time.monotonic() - start < TIMEOUT + 3
    if sandbox.memory_mode == "rlimit":
        assert "AssertionError" in r.error and r.output.endswith(rlimit_outcome + "\n"), r.output
    time.sleep(0.2)
    assert harness_processes() == []  # every child died with the run; the host is untouched


def test_memory_split_too_thin_for_python_is_refused():
    with pytest.raises(ValueError, match=r"memory_limit_mb / SandboxConfig.max_processes = 256 / 16 = 16 MiB") as info:
        SandboxConfig(memory_limit_mb=256, max_processes=16)
    assert "raise SandboxConfig.memory_limit_mb to at least 384" in str(info.value)
    SandboxConfig(memory_limit_mb=0, max_processes=1000)  # no cap at all: nothing to split


@needs_bwrap
def test_tmpfs_and_file_sizes_are_capped():
    sandbox = Sandbox(SandboxConfig(timeout_s=TIMEOUT, tmp_size_mb=8, max_file_size_mb=4))
    program = src(
        """
        import errno

        def fill(directory, files, mb):
            try:
                for i in range(files):
                    with open(f"{directory}/f{i}", "wb") as f:
                        f.write(b"x" * (mb << 20))
            except OSError as e:
                return e.errno
            return 0

        too_big = fill("/tmp", 1, 5)  # one 5 MiB file > the 4 MiB file cap
        tmp_full = fill("/tmp", 3, 3)  # 3 x 3 MiB files > the 8 MiB /tmp
        shm_full = fill("/dev/shm", 3, 3)
        """
    )
    tests = [f"assert too_big == {errno.EFBIG}", f"assert tmp_full == {errno.ENOSPC}", f"assert shm_full == {errno.ENOSPC}"]
    r = sandbox.run(program, tests)
    assert r.status == "ok" and r.tests_passed == [True] * 3, (r.error, r.test_errors)


@needs_bwrap
def test_bwrap_without_tmpfs_size_is_refused(tmp_path):
    # a bwrap whose --help lacks --size (as before bubblewrap 0.7) but runs otherwise
    fake = tmp_path / "bwrap"
    real = shutil.which("bwrap") or "/usr/bin/bwrap"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = --help ]; then {real} --help | grep -v -- --size; exit 0; fi\nexec {real} "$@"\n')
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailableError, match="lacks --size"):
        Sandbox(SandboxConfig(bwrap_path=str(fake)))


def test_cgroup_v2_detection(tmp_path):
    # this machine's kind (cgroup v1, or v2 without delegation) falls back to the rlimit split
    parent, why = find_cgroup_parent()
    if not Path("/sys/fs/cgroup/cgroup.controllers").exists():
        assert parent is None and "no cgroup v2" in why
    # a v2 tree whose own cgroup does not give the memory controller to its children
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "cgroup.subtree_control").write_text("pids\n")
    (tmp_path / "self").write_text("0::/job\n")
    parent, why = find_cgroup_parent(mount=str(tmp_path), proc_self_cgroup=str(tmp_path / "self"))
    assert parent is None and "memory controller is not enabled" in why
    # a configured cgroup_parent that cannot work is an error, not a silent fallback
    with pytest.raises(ValueError, match="cgroup_parent: .* is not a cgroup v2 directory"):
        find_cgroup_parent(str(tmp_path / "nowhere"))


@needs_bwrap
def test_unusable_cgroup_parent_is_refused(tmp_path):
    with pytest.raises(SandboxUnavailableError, match="cgroup_parent"):
        Sandbox(SandboxConfig(cgroup_parent=str(tmp_path)))


# ------------------------------------------------------------------------------ 15: seccomp
@needs_bwrap
def test_namespaces_mounts_and_kernel_surfaces_are_refused(sb):
    nr = sc.SYSCALL_NUMBERS[sc.machine_arch()]
    program = src(
        f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        nr = {nr!r}

        def err(ret):
            if ret == 0 and os.getpid() != 2:  # a clone that worked: this is the child
                os._exit(0)
            return ctypes.get_errno() if ret == -1 else 0

        def call(name, *args):
            ctypes.set_errno(0)
            return err(libc.syscall(nr[name], *args))

        if hasattr(os, "unshare"):  # Python >= 3.12
            try:
                os.unshare(os.CLONE_NEWUSER)
                py_unshare = 0
            except OSError as e:
                py_unshare = e.errno
        else:
            ctypes.set_errno(0)
            py_unshare = err(libc.unshare(0x10000000))
        got = {{
            "unshare_user": py_unshare,
            "unshare_user_mount": call("unshare", 0x10000000 | 0x00020000),
            "mount": err(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)),
            "umount2": call("umount2", b"/proc", 0),
            "pivot_root": call("pivot_root", b"/tmp", b"/tmp"),
            "setns": call("setns", 0, 0),
            "clone_newuser": call("clone", 0x10000000 | 17, 0, 0, 0, 0),
            "clone_newnet": call("clone", 0x40000000 | 17, 0, 0, 0, 0),
            "keyctl": call("keyctl", 0, -3, 0),
            "bpf": call("bpf", 0, None, 0),
            "ptrace": call("ptrace", 0, 0, 0, 0),
            "perf_event_open": call("perf_event_open", None, 0, -1, -1, 0),
            "io_uring_setup": call("io_uring_setup", 1, None),
        }}
        clone3 = call("clone3", None, 0)
        status = open("/proc/self/status").read()
        seccomp = re.search(r"Seccomp:\\s+(\\d+)", status).group(1)
        cap_eff = re.search(r"CapEff:\\s+(\\w+)", status).group(1)
        print(got, clone3, seccomp, cap_eff)
        """
    ).replace("import ctypes, os", "import ctypes, os, re")
    tests = ["assert all(v == 1 for v in got.values()), got", "assert clone3 == 38", "assert seccomp == '2'", "assert int(cap_eff, 16) == 0"]
    r = sb.run(program, tests)
    assert r.status == "ok" and r.tests_passed == [True] * 4, (r.error, r.test_errors, r.output)


@needs_bwrap
def test_threads_subprocesses_and_multiprocessing_still_work(sb):
    program = src(
        """
        import multiprocessing, os, subprocess, sys, threading
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(4) as ex:
            squares = list(ex.map(lambda x: x * x, range(8)))
        t = threading.Thread(target=squares.append, args=(-1,))
        t.start()
        t.join()
        child = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout.strip()
        shell = subprocess.run(["sh", "-c", "echo hi"], capture_output=True, text=True).stdout.strip()
        with multiprocessing.get_context("fork").Pool(2) as pool:
            pooled = pool.map(abs, [-1, -2, -3])
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        forked = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        """
    )
    tests = [
        "assert squares == [0, 1, 4, 9, 16, 25, 36, 49, -1]",
        "assert child == '42' and shell == 'hi'",
        "assert pooled == [1, 2, 3]",
        "assert forked == 7",
    ]
    r = sb.run(program, tests)
    assert r.status == "ok" and r.tests_passed == [True] * 4, (r.error, r.test_errors, r.output)


def _run_bpf(prog: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """Evaluate a classic-BPF seccomp program (the opcodes the sandbox uses) on one syscall."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0 & (2**64 - 1), 0, 0, 0, 0, 0)
    insns = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x06:
            return k
        elif code in (0x15, 0x35, 0x45):
            hit = acc == k if code == 0x15 else acc >= k if code == 0x35 else bool(acc & k)
            pc += jt if hit else jf
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
        pc += 1


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_seccomp_filter_verdicts(arch):
    prog, audit, nr = sc.seccomp_filter(arch), sc.AUDIT_ARCH[arch], sc.SYSCALL_NUMBERS[arch]
    eperm, enosys, allow = sc.RET_ERRNO | errno.EPERM, sc.RET_ERRNO | errno.ENOSYS, sc.RET_ALLOW
    for name in sc.DENIED_SYSCALLS:
        assert _run_bpf(prog, nr[name], audit) == eperm, name
    for flag in (sc.CLONE_NEWNS, sc.CLONE_NEWUSER, sc.CLONE_NEWPID, sc.CLONE_NEWNET, sc.CLONE_NEWUTS, sc.CLONE_NEWIPC, sc.CLONE_NEWCGROUP):
        assert _run_bpf(prog, nr["clone"], audit, flag | 17) == eperm, hex(flag)
    assert _run_bpf(prog, nr["clone"], audit, 17) == allow  # fork
    assert _run_bpf(prog, nr["clone"], audit, 0x3D0F00) == allow  # glibc's pthread_create flags
    assert _run_bpf(prog, nr["clone3"], audit) == enosys
    for harmless in (0, 1, 3, 60, 63, 200):  # read/write/... on either table
        if harmless not in nr.values():
            assert _run_bpf(prog, harmless, audit) == allow
    assert _run_bpf(prog, nr["mount"], 0x40000003) == sc.RET_KILL_PROCESS  # i386 ABI on x86_64
    if arch == "x86_64":
        assert _run_bpf(prog, sc.X32_SYSCALL_BIT | nr["unshare"], audit) == enosys


def test_seccomp_filter_refuses_unknown_arches():
    with pytest.raises(sc.UnsupportedArchError, match="supports .*aarch64.*x86_64.*not 'riscv64'"):
        sc.seccomp_filter("riscv64")


@pytest.mark.parametrize(
    "arch, header, pattern",
    [
        ("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", r"#define __NR_(\w+)\s+(\d+)"),
        ("aarch64", "/usr/include/asm-generic/unistd.h", r"#define __NR(?:3264)?_(\w+)\s+(\d+)"),
    ],
)
def test_syscall_numbers_match_the_kernel_headers(arch, header, pattern):
    if not os.path.exists(header):
        pytest.skip(f"{header} is not installed (linux-libc-dev)")
    table = {name: int(number) for name, number in re.findall(pattern, Path(header).read_text())}
    assert {n: table.get(n) for n in sc.SYSCALL_NUMBERS[arch]} == sc.SYSCALL_NUMBERS[arch]


# ------------------------------------------------------------------------------ 16: host files
@needs_bwrap
def test_host_data_dirs_and_caches_are_hidden(monkeypatch, host_dir):
    planted = []
    for parent in ("/opt", "/srv"):
        d = host_dir(parent)
        (d / "secret.txt").write_text("secret")
        planted.append(str(d / "secret.txt"))
    # the caches sit inside a visible system dir here, so only their masks hide them
    hf_home, cache = host_dir("/usr/local/share"), host_dir("/usr/local/share")
    for d in (hf_home, cache):
        (d / "weights.bin").write_text("weights")
        planted.append(str(d / "weights.bin"))
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("NEMO_LIKE_CACHE", str(cache))
    ray_dir = Path("/tmp/ray")
    made_ray_dir = not ray_dir.exists()
    ray_dir.mkdir(exist_ok=True)
    ray_file = ray_dir / f"nl_sbx_{secrets.token_hex(4)}"
    ray_file.write_text("socket")
    planted.append(str(ray_file))
    try:
        sandbox = Sandbox(SandboxConfig(timeout_s=TIMEOUT))
        program = src(
            f"""
            import os
            seen = [p for p in {planted!r} if os.path.exists(p)]
            caches = [os.listdir(d) for d in ({str(hf_home)!r}, {str(cache)!r})]
            top = sorted(os.listdir("/"))
            """
        )
        allowed_top = {"usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "dev", "proc", "tmp"}
        allowed_top.add(Path(sandbox.python).parts[1])
        tests = ["assert seen == [], seen", "assert caches == [[], []], caches", f"assert set(top) <= {allowed_top!r}, top"]
        r = sandbox.run(program, tests)
        assert r.status == "ok" and r.tests_passed == [True] * 3, (r.error, r.test_errors)
    finally:
        ray_file.unlink()
        if made_ray_dir:
            ray_dir.rmdir()


@needs_bwrap
def test_interpreter_install_shows_only_what_it_needs(sb):
    python = Path(sb.python)
    site = next((p for p in python.parent.parent.glob("lib/python3*/site-packages")), None)
    program = src(
        f"""
        import os
        bin_dir = sorted(os.listdir({str(python.parent)!r}))
        site = os.listdir({str(site)!r}) if {site is not None!r} else []
        """
    )
    expected_bin = [python.name] if not str(python).startswith(("/usr/", "/bin/")) else sorted(os.listdir(python.parent))
    r = sb.run(program, [f"assert bin_dir == {expected_bin!r}, bin_dir", "assert site == [], site[:5]"])
    assert r.status == "ok" and r.tests_passed == [True, True], (r.error, r.test_errors)


@needs_bwrap
def test_extra_ro_binds_are_visible_read_only(monkeypatch, host_dir):
    data = host_dir("/srv")
    data.chmod(0o777)  # writable by anyone on the host: only the read-only mount stops the program
    (data / "table.csv").write_text("a,b\n1,2\n")
    (data / "table.csv").chmod(0o666)
    (data / "hf").mkdir()
    (data / "hf" / "token").write_text("hf_secret")
    monkeypatch.setenv("HF_HOME", str(data / "hf"))  # a cache inside a listed dir stays hidden
    sandbox = Sandbox(SandboxConfig(timeout_s=TIMEOUT, extra_ro_binds=(str(data),)))
    program = src(
        f"""
        import os
        content = open({str(data / "table.csv")!r}).read()
        errors = []
        for attempt in (lambda: open({str(data / "table.csv")!r}, "a"), lambda: open({str(data / "new.txt")!r}, "w")):
            try:
                attempt()
            except OSError as e:
                errors.append(e.errno)
        hf = os.listdir({str(data / "hf")!r})
        """
    )
    tests = ["assert content == 'a,b\\n1,2\\n'", f"assert errors == [{errno.EROFS}, {errno.EROFS}], errors", "assert hf == []"]
    r = sandbox.run(program, tests)
    assert r.status == "ok" and r.tests_passed == [True] * 3, (r.error, r.test_errors)
    assert not (data / "new.txt").exists() and (data / "table.csv").read_text() == "a,b\n1,2\n"


def test_ray_dirs_can_never_be_listed(tmp_path):
    for path in ("/tmp/ray", "/tmp"):
        with pytest.raises(ValueError, match="Ray's temp dir"):
            SandboxConfig(extra_ro_binds=(path,))
    # a custom Ray temp dir is recognised by its session_latest link: itself, inside it, around it
    custom = tmp_path / "myray"
    (custom / "session_1" / "sockets").mkdir(parents=True)
    (custom / "session_latest").symlink_to(custom / "session_1")
    for path, message in ((custom, "inside a Ray temp dir"), (custom / "session_1" / "sockets", "inside a Ray temp dir"), (tmp_path, "contains a Ray temp dir")):
        with pytest.raises(ValueError, match=message):
            SandboxConfig(extra_ro_binds=(str(path),))
    with pytest.raises(ValueError, match="does not exist"):
        SandboxConfig(extra_ro_binds=(str(tmp_path / "missing"),))
