"""The seccomp filter the sandbox hands to bubblewrap (``bwrap --seccomp FD``).

Why: as root, bwrap runs without a user namespace and the prelude drops to a fresh unprivileged
uid, so the program holds no capabilities. But an unprivileged process may still create a *user*
namespace (where it is root again, with every capability over new mount, pid and net namespaces
it creates there) and reach kernel surfaces that need no capability: keyrings, BPF, ptrace of its
own processes, perf events, io_uring. None of that is needed to run a Python program and each is
a recurring source of kernel exploits, so the filter refuses them with EPERM.

The filter is a classic-BPF program built here with ``struct`` (no libseccomp). It checks the
audit architecture first (a process could otherwise switch ABIs, e.g. the i386 ``int 0x80``
entry on x86_64, to reach syscalls by other numbers: any foreign architecture is killed), then:

* ``unshare``, ``setns``, ``mount`` and the new mount API, ``umount2``, ``pivot_root``, ``chroot``,
  ``keyctl``/``add_key``/``request_key``, ``bpf``, ``ptrace``, ``process_vm_readv/writev``,
  ``perf_event_open``, ``userfaultfd``, ``io_uring_*``, module and kexec loading, swap, reboot,
  accounting, quotas, ``syslog`` and ``open_by_handle_at``: EPERM;
* ``clone`` whose flags (its first argument on both supported architectures) ask for a new
  namespace (``CLONE_NEWNS``/``NEWUTS``/``NEWIPC``/``NEWUSER``/``NEWPID``/``NEWNET``/``NEWCGROUP``):
  EPERM; a plain fork or thread passes;
* ``clone3``: ENOSYS. Its flags live in a struct in memory, which seccomp cannot read, so it
  cannot be filtered by flags; ENOSYS makes glibc (threads, ``posix_spawn``) fall back to ``clone``;
* x32 syscalls on x86_64 (numbers with bit 30 set, same audit arch): ENOSYS, so the x32 aliases
  of the calls above cannot slip past the number checks;
* everything else: allowed.

Supported: x86_64 and aarch64. On other architectures :func:`seccomp_filter` raises
:class:`UnsupportedArchError`, and the sandbox refuses to start rather than run without it.
"""

from __future__ import annotations

import errno
import platform
import struct

__all__ = ["UnsupportedArchError", "seccomp_filter", "AUDIT_ARCH", "DENIED_SYSCALLS", "SYSCALL_NUMBERS"]


class UnsupportedArchError(RuntimeError):
    """No syscall table for this machine's architecture."""


# AUDIT_ARCH_* of <linux/audit.h>: EM_X86_64 (62) / EM_AARCH64 (183) | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

# Syscall numbers: x86_64 from asm/unistd_64.h, aarch64 from the generic table (asm-generic/unistd.h);
# tests compare them with the kernel headers where those are installed.
SYSCALL_NUMBERS: dict[str, dict[str, int]] = {
    "x86_64": {
        "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "perf_event_open": 298,
        "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "swapon": 167, "swapoff": 168, "reboot": 169, "acct": 163,
        "quotactl": 179, "syslog": 103, "open_by_handle_at": 304, "clone": 56, "clone3": 435,
    },
    "aarch64": {
        "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280,
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "perf_event_open": 241,
        "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "swapon": 224, "swapoff": 225, "reboot": 142, "acct": 89,
        "quotactl": 60, "syslog": 116, "open_by_handle_at": 265, "clone": 220, "clone3": 435,
    },
}
DENIED_SYSCALLS = tuple(n for n in SYSCALL_NUMBERS["x86_64"] if n not in ("clone", "clone3"))

# <linux/sched.h>: the namespace flags a plain clone may carry (CLONE_NEWTIME is clone3/unshare-only:
# in clone's first argument that bit belongs to the exit signal)
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
CLONE_NAMESPACE_FLAGS = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
X32_SYSCALL_BIT = 0x40000000

# classic BPF opcodes (<linux/bpf_common.h>) and seccomp return values (<linux/seccomp.h>)
_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K, _JGE_K, _JSET_K = 0x05 | 0x10, 0x05 | 0x30, 0x05 | 0x40  # BPF_JMP | BPF_J* | BPF_K
_RET_K = 0x06
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_OFF_NR, _OFF_ARCH, _OFF_ARG0_LOW = 0, 4, 16  # the low half of args[0] (both arches are little-endian)


def machine_arch(machine: str | None = None) -> str:
    m = (machine or platform.machine()).lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def seccomp_filter(arch: str | None = None) -> bytes:
    """The compiled filter (an array of ``struct sock_filter``) for ``arch`` (default: this machine)."""
    arch = machine_arch(arch)
    if arch not in AUDIT_ARCH:
        raise UnsupportedArchError(
            f"the sandbox's seccomp filter supports {sorted(AUDIT_ARCH)}, not {arch!r}: without it a sandboxed "
            "program could create user and mount namespaces, so the sandbox refuses to run here"
        )
    nr = SYSCALL_NUMBERS[arch]
    # (opcode, jump-if-true label, jump-if-false label, k); None as a label means the next instruction
    prog: list[tuple[int, str | None, str | None, int]] = [
        (_LD_W_ABS, None, None, _OFF_ARCH),
        (_JEQ_K, None, "kill", AUDIT_ARCH[arch]),
        (_LD_W_ABS, None, None, _OFF_NR),
    ]
    if arch == "x86_64":
        prog.append((_JGE_K, "enosys", None, X32_SYSCALL_BIT))
    prog += [(_JEQ_K, "eperm", None, nr[name]) for name in DENIED_SYSCALLS]
    prog += [
        (_JEQ_K, "enosys", None, nr["clone3"]),
        (_JEQ_K, None, "allow", nr["clone"]),
        (_LD_W_ABS, None, None, _OFF_ARG0_LOW),
        (_JSET_K, "eperm", "allow", CLONE_NAMESPACE_FLAGS),
    ]
    labels = {"allow": len(prog), "eperm": len(prog) + 1, "enosys": len(prog) + 2, "kill": len(prog) + 3}
    prog += [
        (_RET_K, None, None, RET_ALLOW),
        (_RET_K, None, None, RET_ERRNO | errno.EPERM),
        (_RET_K, None, None, RET_ERRNO | errno.ENOSYS),
        (_RET_K, None, None, RET_KILL_PROCESS),
    ]
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(prog):
        offsets = [0 if label is None else labels[label] - i - 1 for label in (jt, jf)]
        assert all(0 <= o <= 255 for o in offsets), "BPF jump out of range"
        out += struct.pack("=HBBI", code, offsets[0], offsets[1], k)
    return bytes(out)
