"""The sandbox's launcher: run as a script by the base interpreter (``python -I -S sandbox_init.py JOB.json``).

It imports only the standard library (it runs outside any virtual environment) and builds one sandbox:

1. it forks a child, which enters a new user namespace; the launcher maps one uid and gid into it: the child's
   own ids, or nobody's (65534) when the launcher is root, so that a program never acts as the real root;
2. the child enters new mount, network, pid, IPC and UTS namespaces and forks the sandbox's pid 1;
3. pid 1 builds a root of its own (a small tmpfs: ``/usr``, ``/bin``, ``/lib*`` and the interpreter's prefix bound
   read-only, ``/dev/null``, ``/dev/zero``, ``/dev/urandom``, a small ``/dev/shm``, and a writable size-bounded
   tmpfs ``/sandbox`` that holds the program's files), pivots into it and detaches the host's tree, sets the
   resource limits, no-new-privileges and a seccomp filter (x86_64), and executes the interpreter on the program
   with a clean environment.

pid 1 dies with its parent (``PR_SET_PDEATHSIG``), and every process of a pid namespace dies with its pid 1, so
killing the launcher's process group leaves nothing running. A failure of the set-up itself exits with
:data:`SETUP_FAILED` after one line on stderr that starts with ``tidal-sandbox:``.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import sys

SETUP_FAILED = 125
NOBODY = 65534
INNER_ID = 1000  # the program's uid and gid inside the sandbox: never 0, so execve drops every capability

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
# statvfs flags a bind's read-only remount must keep (the kernel refuses to clear flags locked by a parent namespace)
KEPT_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(message: str) -> None:
    os.write(2, f"tidal-sandbox: {message}\n".encode())
    os._exit(SETUP_FAILED)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {source} on {target}")


def _bind_read_only(fd: int, target: str) -> None:
    source = f"/proc/self/fd/{fd}"  # opened before the uid change: the path may cross folders nobody may enter
    _mount(source, target, None, MS_BIND | MS_REC)
    kept = sum(ms for st, ms in KEPT_FLAGS if os.statvfs(target).f_flag & st)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | kept)


def _open_sources(job: dict) -> list[tuple[str, str | int]]:
    """Each bound path: a link to copy, or a file descriptor of the folder or device to bind."""
    sources: list[tuple[str, str | int]] = []
    for path in job["binds"]:
        if os.path.islink(path):
            sources.append((path, os.readlink(path)))
        elif os.path.exists(path):
            sources.append((path, os.open(path, os.O_PATH)))
    return sources


def _build_root(job: dict, sources: list[tuple[str, str | int]]) -> None:
    root, limits = job["root"], job["limits"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    for path, source in sources:
        target = root + path
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if isinstance(source, str):
            os.symlink(source, target)
            continue
        if os.path.isdir(f"/proc/self/fd/{source}"):
            os.makedirs(target, mode=0o755, exist_ok=True)
        else:
            open(target, "w").close()  # a mount point for a device
        _bind_read_only(source, target)
        os.close(source)
    os.makedirs(root + "/dev/shm", mode=0o755, exist_ok=True)  # multiprocessing's semaphores
    _mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=16m,mode=1777")
    work = root + "/sandbox"
    os.mkdir(work, 0o700)
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={limits['disk_bytes']},mode=0700")
    for name, text in job["files"].items():
        with open(os.path.join(work, name), "w") as f:
            f.write(text)
    os.mkdir(root + "/.old")
    _check(_libc.syscall(SYS_PIVOT_ROOT[platform.machine()], root.encode(), (root + "/.old").encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.old", MNT_DETACH), "umount the host's tree")
    os.rmdir("/.old")
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir("/sandbox")


def _limit(limits: dict) -> None:
    cpu = max(1, int(limits["cpu_s"]))
    for kind, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
        (resource.RLIMIT_NPROC, (limits["processes"],) * 2),
        (resource.RLIMIT_FSIZE, (limits["disk_bytes"],) * 2),
        (resource.RLIMIT_NOFILE, (64, 64)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(kind, value)


# seccomp: system calls a program never needs that reach kernel code namespaces leave exposed (x86_64 numbers)
AUDIT_ARCH_X86_64, X32_SYSCALL_BIT = 0xC000003E, 0x40000000
SECCOMP_SET_MODE_FILTER_PRCTL, SECCOMP_MODE_FILTER = 22, 2
RET_ALLOW, RET_KILL, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
EPERM, ENOSYS = 1, 38
SYS_CLONE, SYS_CLONE3 = 56, 435
NEW_NAMESPACES = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | 0x02000000
DENIED = {
    "ptrace": 101, "syslog": 103, "personality": 135, "pivot_root": 155, "chroot": 161, "acct": 163, "mount": 165,
    "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "init_module": 175, "delete_module": 176,
    "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310,
    "process_vm_writev": 311, "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
}  # fmt: skip


def _bpf(code: int, jt: int, jf: int, k: int) -> bytes:
    return code.to_bytes(2, "little") + bytes((jt, jf)) + k.to_bytes(4, "little")


def _seccomp_filter() -> bytes | None:
    """The seccomp filter as BPF, or None off x86_64 (the namespaces and limits still hold there).

    EPERM for :data:`DENIED` and for a clone into new namespaces, ENOSYS for clone3 (glibc then uses clone),
    everything else allowed.
    """
    if platform.machine() != "x86_64":
        return None
    ld_w_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    deny = [_bpf(jeq, 0, 1, nr) + _bpf(ret, 0, 0, RET_ERRNO | EPERM) for nr in DENIED.values()]
    program = [
        _bpf(ld_w_abs, 0, 0, 4),  # arch
        _bpf(jeq, 1, 0, AUDIT_ARCH_X86_64),
        _bpf(ret, 0, 0, RET_KILL),
        _bpf(ld_w_abs, 0, 0, 0),  # syscall number
        _bpf(jge, 0, 1, X32_SYSCALL_BIT),
        _bpf(ret, 0, 0, RET_ERRNO | ENOSYS),
        _bpf(jeq, 0, 1, SYS_CLONE3),
        _bpf(ret, 0, 0, RET_ERRNO | ENOSYS),
        *deny,
        _bpf(jeq, 0, 3, SYS_CLONE),
        _bpf(ld_w_abs, 0, 0, 16),  # clone's flags (the low half of args[0])
        _bpf(jset, 0, 1, NEW_NAMESPACES),
        _bpf(ret, 0, 0, RET_ERRNO | EPERM),
        _bpf(ret, 0, 0, RET_ALLOW),
    ]
    return b"".join(program)


def _install_seccomp() -> None:
    program = _seccomp_filter()
    if program is None:
        return
    buffer = ctypes.create_string_buffer(program, len(program))

    class Fprog(ctypes.Structure):
        _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))

    fprog = Fprog(len(program) // 8, ctypes.addressof(buffer))
    _check(_libc.prctl(SECCOMP_SET_MODE_FILTER_PRCTL, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")


def _pid_one(job: dict, sources: list, alive_fd: int) -> None:
    """The sandbox's pid 1: its own root, limits, then the program."""
    try:
        os.setresgid(INNER_ID, INNER_ID, INNER_ID)
        os.setresuid(INNER_ID, INNER_ID, INNER_ID)
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        os.set_blocking(alive_fd, False)
        try:
            if os.read(alive_fd, 1) == b"":
                _fail("the launcher died before the program started")
        except BlockingIOError:
            pass  # the launcher's child holds the pipe open: alive
        os.close(alive_fd)
        _build_root(job, sources)
        _limit(job["limits"])
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        _install_seccomp()
    except OSError as e:
        _fail(f"{e}")
    argv = job["argv"]
    try:
        os.execve(argv[0], argv, job["env"])
    except OSError as e:
        _fail(f"cannot start {argv[0]}: {e}")


def _setgroups_allowed() -> bool:
    """Whether this process may change its groups (not in a user namespace that denies it to everyone)."""
    try:
        with open("/proc/self/setgroups") as f:
            return f.read().strip() != "deny"
    except OSError:
        return True


def _exit_like(status: int) -> None:
    """Exit as the waited-for child did (a signal as 128 + its number)."""
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code)


def _child(job: dict, go_r: int, ready_w: int) -> None:
    """In a new user namespace (mapped by the launcher), then the others; forks the sandbox's pid 1."""
    if os.geteuid() == 0 and _setgroups_allowed():
        try:
            os.setgroups([])  # the program keeps no supplementary group of root's
        except OSError as e:
            _fail(f"cannot drop root's supplementary groups ({e})")
    try:
        os.unshare(CLONE_NEWUSER)
    except OSError as e:
        _fail(f"cannot create a user namespace ({e})")
    os.write(ready_w, b"u")
    if os.read(go_r, 1) != b"g":
        _fail("the launcher could not map the user namespace's ids")
    try:
        os.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS)
        sources = _open_sources(job)  # in the new mount namespace (a bind's source must be one of its mounts)
    except OSError as e:
        _fail(f"cannot create mount, network and pid namespaces ({e})")
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        _pid_one(job, sources, alive_r)
    os.close(alive_r)
    _exit_like(os.waitpid(pid, 0)[1])


def main() -> None:
    """Read the job, build the sandbox, run the program in it; exit with its status."""
    with open(sys.argv[1]) as f:
        job = json.load(f)
    go_r, go_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        os.close(ready_r)
        _child(job, go_r, ready_w)
    os.close(go_r)
    os.close(ready_w)
    if os.read(ready_r, 1) == b"u":
        outside_uid = NOBODY if os.geteuid() == 0 else os.geteuid()
        outside_gid = NOBODY if os.geteuid() == 0 else os.getegid()
        try:
            with open(f"/proc/{pid}/setgroups", "w") as f:
                f.write("deny")
            with open(f"/proc/{pid}/uid_map", "w") as f:
                f.write(f"{INNER_ID} {outside_uid} 1")
            with open(f"/proc/{pid}/gid_map", "w") as f:
                f.write(f"{INNER_ID} {outside_gid} 1")
            os.write(go_w, b"g")
        except OSError as e:
            os.write(2, f"tidal-sandbox: cannot map the user namespace's ids ({e})\n".encode())
    os.close(go_w)
    _exit_like(os.waitpid(pid, 0)[1])


if __name__ == "__main__":
    main()
