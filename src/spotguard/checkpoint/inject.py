"""A few system calls run inside another process, through ``ptrace`` (x86-64 Linux).

A restore that overlaps the write-back of the staged GPU memory with the driver's restore
(:mod:`.placing`) needs what only the restored process can make or do for itself: a
``userfaultfd`` (it serves faults of the mm that created it), a scratch mapping in its own
address space, and the ``UFFDIO_MOVE`` calls (the kernel moves pages only for a caller of the
same mm). :class:`Injector` stops the process's main thread, runs each call on a ``syscall``
instruction of the process's own code with the thread's registers borrowed, and puts every
register back before letting it go — the mechanism CRIU's parasite code uses, kept to plain
system calls. :meth:`Injector.spawn` clones a :class:`Puppet`: a thread of the process that
never runs code of its own, for the many calls a restore makes while the job runs.

Why ``ptrace`` through ``ctypes``: Python has no binding of it; CRIU's compel library does
this in C for a whole parasite blob, far more than a handful of system calls need. The thread
is taken with ``PTRACE_SEIZE`` + ``PTRACE_INTERRUPT``, so a system call it was blocked in is
restarted when its registers come back, as after any signal. Every ptrace request for a thread
must come from the OS thread that attached it (:mod:`.placing` keeps one for that).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal
from types import TracebackType

from spotguard.errors import InjectError

#: x86-64 system call numbers used through :meth:`Injector.call`
NR_MMAP, NR_MUNMAP, NR_CLOSE, NR_IOCTL, NR_MADVISE, NR_USERFAULTFD = 9, 11, 3, 16, 28, 323
_NR_CLONE, _NR_EXIT, _NR_SIGPROCMASK = 56, 60, 14
_SEIZE, _INTERRUPT, _GETREGS, _SETREGS, _SINGLESTEP, _DETACH = 0x4206, 0x4207, 12, 13, 9, 17
_SETOPTIONS, _GETEVENTMSG, _O_TRACECLONE, _EVENT_CLONE, _EVENT_STOP = 0x4200, 0x4201, 0x8, 3, 128
#: a thread sharing everything with its process (what pthread_create asks of clone)
_THREAD = 0x100 | 0x200 | 0x400 | 0x800 | 0x10000 | 0x40000
_WALL = 0x40000000
_SYSCALL = b"\x0f\x05"


class _Regs(ctypes.Structure):
    """``struct user_regs_struct`` of x86-64."""

    _NAMES = (
        "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx",
        "rdx", "rsi", "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base",
        "gs_base", "ds", "es", "fs", "gs",
    )  # fmt: skip
    _fields_ = [(n, ctypes.c_ulonglong) for n in _NAMES]


_libc = ctypes.CDLL(None, use_errno=True)
_ptrace = _libc.ptrace
_ptrace.restype = ctypes.c_long
_ptrace.argtypes = (ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


def supported() -> bool:
    """Whether this machine's system calls are the ones :class:`Injector` knows."""
    return platform.machine() in ("x86_64", "AMD64")


def _pt(req: int, pid: int, addr: int = 0, data: object = None) -> None:
    arg = ctypes.cast(ctypes.byref(data), ctypes.c_void_p) if isinstance(data, _Regs) else data
    if _ptrace(req, pid, ctypes.c_void_p(addr), arg) == -1:
        e = ctypes.get_errno()
        raise InjectError(f"ptrace({req:#x}) of pid {pid}: {os.strerror(e)}")


def _wait_stop(pid: int) -> int:
    """Wait for ``pid``'s next stop; its status (raises if it exited instead)."""
    while True:
        try:
            _, status = os.waitpid(pid, _WALL)
        except InterruptedError:
            continue
        except ChildProcessError as exc:
            raise InjectError(f"pid {pid} is not traced: {exc}") from exc
        if os.WIFSTOPPED(status):
            return status
        raise InjectError(f"pid {pid} ended while being injected (status {status:#x})")


def syscall_address(pid: int) -> int:
    """The address of a ``syscall`` instruction in ``pid``'s executable memory (its C
    library's code first, then the vDSO)."""
    maps: list[tuple[int, int, str]] = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "x" in parts[1] and parts[5] != "[vsyscall]":
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                maps.append((lo, hi, parts[5]))
    maps.sort(key=lambda m: 0 if "libc" in m[2] else 1 if m[2] == "[vdso]" else 2)
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for lo, hi, _name in maps[:8]:
            for off in range(lo, hi, 1 << 20):
                try:
                    mem.seek(off)
                    data = mem.read(min(1 << 20, hi - off) + 1)
                except (OSError, OverflowError):  # unreadable, or an offset past the file's range
                    break
                at = data.find(_SYSCALL)
                if at >= 0:
                    return off + at
    raise InjectError(f"no syscall instruction found in pid {pid}'s code")


class Injector:
    """``with Injector(pid) as inj: inj.call(nr, *args)`` — each call runs in ``pid``'s
    main thread; the thread's registers are put back and it runs on when the block ends."""

    def __init__(self, pid: int) -> None:
        if not supported():
            raise InjectError(f"system calls cannot be injected on {platform.machine()}")
        self.pid = pid
        self._saved = _Regs()
        self._site = 0
        self._attached = False

    def __enter__(self) -> Injector:
        self._site = syscall_address(self.pid)
        _pt(_SEIZE, self.pid)
        self._attached = True
        try:
            _pt(_INTERRUPT, self.pid)
            _wait_stop(self.pid)
            _pt(_GETREGS, self.pid, data=self._saved)
        except BaseException:
            self._detach()
            raise
        return self

    def call(self, nr: int, *args: int) -> int:
        """Run system call ``nr`` with ``args`` in the process; its return value (``-errno``
        on failure, as the kernel gives it)."""
        return _run(self.pid, self._saved, self._site, nr, args)

    def spawn(self, stack: int, sigset: int) -> Puppet:
        """A new thread of the process that never runs code of its own: it stays stopped
        under this tracer, with every signal blocked (``sigset``: 8 bytes of ones in the
        process), and runs only the calls :meth:`Puppet.call` gives it. Its stack pointer
        is ``stack``. Every later request for it must come from this OS thread."""
        _pt(_SETOPTIONS, self.pid, 0, _O_TRACECLONE)
        try:
            regs = _Regs.from_buffer_copy(self._saved)
            regs.rip, regs.rax, regs.orig_rax = self._site, _NR_CLONE, 2**64 - 1
            regs.rdi, regs.rsi, regs.rdx, regs.r10, regs.r8 = _THREAD, stack, 0, 0, 0
            _pt(_SETREGS, self.pid, data=regs)
            _pt(_SINGLESTEP, self.pid)
            status = _wait_stop(self.pid)
            if status >> 16 != _EVENT_CLONE:
                raise InjectError(f"clone in pid {self.pid} did not report a new thread")
            tid = ctypes.c_ulong()
            _pt(_GETEVENTMSG, self.pid, 0, ctypes.cast(ctypes.byref(tid), ctypes.c_void_p))
            _pt(_SINGLESTEP, self.pid)  # the clone returns in the process's thread
            _wait_stop(self.pid)
        finally:
            _pt(_SETOPTIONS, self.pid, 0, 0)
        puppet = Puppet(int(tid.value), self._site)
        puppet.call(_NR_SIGPROCMASK, 2, sigset, 0, 8)  # SIG_SETMASK: every signal blocked
        return puppet

    def _detach(self) -> None:
        if not self._attached:
            return
        self._attached = False
        try:
            _pt(_SETREGS, self.pid, data=self._saved)
        finally:
            try:
                _pt(_DETACH, self.pid)
            except InjectError as exc:
                if "No such process" not in str(exc):
                    raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._detach()


def _run(tid: int, saved: _Regs, site: int, nr: int, args: tuple[int, ...]) -> int:
    regs = _Regs.from_buffer_copy(saved)
    regs.rip, regs.rax, regs.orig_rax = site, nr, 2**64 - 1  # no restart
    for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args, strict=False):
        setattr(regs, name, value % 2**64)
    for _ in range(8):
        _pt(_SETREGS, tid, data=regs)
        _pt(_SINGLESTEP, tid)
        status = _wait_stop(tid)
        if status >> 16 == _EVENT_STOP:  # a group-stop or its end (SIGCONT): not our call's
            continue
        if os.WSTOPSIG(status) != signal.SIGTRAP:
            raise InjectError(
                f"thread {tid} stopped by signal {os.WSTOPSIG(status)} during an injected call"
            )
        break
    else:
        raise InjectError(f"thread {tid} kept stopping for its process before the call ran")
    _pt(_GETREGS, tid, data=regs)
    ret = int(regs.rax)
    return ret - 2**64 if ret >= 2**63 else ret


class Puppet:
    """A thread made by :meth:`Injector.spawn`: system calls that must come from inside the
    process (``UFFDIO_MOVE`` moves only within the caller's own memory) run on it."""

    def __init__(self, tid: int, site: int) -> None:
        self.tid = tid
        self._site = site
        _wait_stop(tid)  # its first stop, before it runs anything
        self._regs = _Regs()
        _pt(_GETREGS, tid, data=self._regs)
        self._alive = True

    def call(self, nr: int, *args: int) -> int:
        """Run system call ``nr`` on the thread; its return value (``-errno`` on failure)."""
        return _run(self.tid, self._regs, self._site, nr, args)

    def exit(self) -> None:
        """End the thread (``exit`` of the thread alone); its process runs on."""
        if not self._alive:
            return
        self._alive = False
        regs = _Regs.from_buffer_copy(self._regs)
        regs.rip, regs.rax, regs.orig_rax, regs.rdi = self._site, _NR_EXIT, 2**64 - 1, 0
        try:
            _pt(_SETREGS, self.tid, data=regs)
            _pt(_SINGLESTEP, self.tid)
            while True:
                _, status = os.waitpid(self.tid, _WALL)
                if not os.WIFSTOPPED(status):
                    return
                _pt(_SINGLESTEP, self.tid)
        except (InjectError, ChildProcessError):
            return


def check(ret: int, what: str, pid: int) -> int:
    """``ret`` of an injected call, or :class:`InjectError` naming ``what`` failed."""
    if ret < 0:
        name = errno.errorcode.get(-ret, str(-ret))
        raise InjectError(f"{what} in pid {pid} failed: {name} ({os.strerror(-ret)})")
    return ret
