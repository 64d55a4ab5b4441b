"""The freeze preflight reads real processes: io_uring, sockets and their peers, unknown
socket families, devices; rules are plain functions others can add; the network plan."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard.checkpoint import procfacts, proctree, scan, selftest_job, sockets
from spotguard.checkpoint.scan import FdFact, Finding, ProcFacts, TreeFacts
from spotguard.checkpoint.sockets import Endpoint, SocketFact, parse_endpoint
from spotguard.errors import PreflightError, UndumpableError

PROGS = Path(__file__).parent / "progs"


def _start(argv: list[str]) -> subprocess.Popen[str]:
    # a session of its own, as `spotguard run` (or `setsid`) gives a job
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    proc.stdout.readline()  # the first step: the program holds what it holds
    return proc


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def test_io_uring_of_a_real_process_is_refused_naming_pid_and_fix(
    procs: list[subprocess.Popen[str]],
) -> None:
    proc = _start([sys.executable, str(PROGS / "hold.py"), "uring", "1000", "0.05"])
    procs.append(proc)
    facts = scan.gather([proc.pid])
    found = scan.findings(facts)
    assert [(f.pid, f.resource) for f in found] == [(proc.pid, "an io_uring instance (fd 3, 4)")]
    with pytest.raises(UndumpableError) as err:
        scan.check("ring", facts)
    name = Path(f"/proc/{proc.pid}/comm").read_text().strip()
    assert str(err.value) == (
        f"cannot checkpoint job 'ring': pid {proc.pid} ({name}) holds an io_uring instance "
        "(fd 3, 4): CRIU cannot dump io_uring; PyTorch's TCPStore (torch.distributed "
        "rendezvous) holds one through libuv: start the job with 'spotguard run' (it sets "
        "USE_LIBUV=0) or set USE_LIBUV=0 yourself; other programs must not use io_uring "
        "(the job keeps running)"
    )
    assert isinstance(err.value, PreflightError) and err.value.retryable is False
    assert "\n" not in str(err.value)


def test_sockets_of_a_worker_pair_are_internal_and_plan_a_lock(
    procs: list[subprocess.Popen[str]],
) -> None:
    proc = _start([sys.executable, "-I", selftest_job.__file__, "1000", "0.05"])
    procs.append(proc)
    tree = proctree.tree(proc.pid)
    assert len(tree) == 2
    facts = scan.gather(tree)
    assert scan.findings(facts) == []
    kinds = sorted((sk.family, sk.proto, sk.state) for p in facts.procs for _fd, sk in p.sockets)
    assert ("inet", "tcp", "LISTEN") in kinds and ("unix", "", "") in kinds
    conns = facts.connections()
    # the established pair (fresh per-step connections may add more, all inside the job)
    assert len(conns) >= 2 and all(c.internal for c in conns)
    assert {c.local.host for c in conns} == {"127.0.0.1"}
    plan = scan.network_plan("pair", facts, available={"nftables", "iptables"})
    assert (plan.tcp_established, plan.lock) == (True, "nftables")
    assert scan.network_plan("pair", facts, available={"iptables"}).lock == "iptables"
    assert scan.network_plan("pair", facts, available=()).lock == "skip"
    assert scan.network_plan("pair", facts, available=(), setting="iptables").lock == "iptables"
    assert plan.to_json()["tcp_external"] == 0


def test_connection_outside_the_job_needs_a_real_lock(
    procs: list[subprocess.Popen[str]],
) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    proc = _start([sys.executable, str(PROGS / "hold.py"), "tcp", "1000", "0.05", str(port)])
    procs.append(proc)
    peer, _addr = server.accept()
    try:
        facts = scan.gather([proc.pid])
        (conn,) = facts.connections()
        assert not conn.internal and conn.remote == Endpoint("127.0.0.1", port)
        assert scan.network_plan("ext", facts, available={"nftables"}).lock == "nftables"
        with pytest.raises(UndumpableError, match=r"a TCP connection to 127\.0\.0\.1:\d+ outside"):
            scan.network_plan("ext", facts, available=())
        assert scan.network_plan("ext", facts, available=(), setting="skip").lock == "skip"
    finally:
        peer.close()
        server.close()


def test_no_connection_means_no_tcp_options_unless_forced() -> None:
    facts = TreeFacts(())
    assert scan.network_plan("none", facts, available={"nftables"}).tcp_established is False
    forced = scan.network_plan("none", facts, available={"nftables"}, force=True)
    assert (forced.tcp_established, forced.lock) == (True, "nftables")


def test_a_vsock_socket_is_an_unsupported_family(procs: list[subprocess.Popen[str]]) -> None:
    try:
        socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
    except OSError as exc:
        pytest.skip(f"no AF_VSOCK in this kernel: {exc}")
    proc = _start([sys.executable, str(PROGS / "hold.py"), "vsock", "1000", "0.05"])
    procs.append(proc)
    found = scan.findings(scan.gather([proc.pid]))
    assert len(found) == 1 and found[0].resource.startswith("a socket of an unsupported family")


def test_sockets_never_bound_are_inet_not_an_unsupported_family(
    procs: list[subprocess.Popen[str]],
) -> None:
    """A socket created and not yet bound or connected (a client between ``socket()`` and
    ``connect()``) is in no /proc/net table: it was reported as "an unsupported family" and
    the freeze refused, though CRIU dumps it."""
    proc = _start([sys.executable, str(PROGS / "hold.py"), "unbound", "1000", "0.05"])
    procs.append(proc)
    facts = scan.gather([proc.pid])
    assert scan.findings(facts) == []
    socks = [f.socket for p in facts.procs for f in p.fds if f.socket is not None]
    assert sorted((s.family, s.proto) for s in socks) == [("inet", "tcp"), ("inet6", "udp")]


def _proc(**kw: object) -> ProcFacts:
    return ProcFacts(pid=7, name="job", **kw)  # type: ignore[arg-type]


def test_rules_on_facts_anon_inodes_and_devices() -> None:
    facts = _proc(
        fds=(
            FdFact(3, "anon_inode:[eventfd]"),
            FdFact(4, "anon_inode:[perf_event]"),
            FdFact(5, "anon_inode:[perf_event]"),
            FdFact(6, "anon_inode:inotify"),
            FdFact(7, "/dev/infiniband/uverbs0"),
            FdFact(8, "/dev/null"),
            FdFact(9, "/dev/nvidiactl"),
        ),
        maps=("/usr/lib/libc.so.6", "[heap]", "/dev/zero (deleted)", "/dev/mem"),
    )
    found = [str(f) for r in scan.RULES for f in r(facts)]
    assert found == [
        "pid 7 (job) holds anon_inode:[perf_event] (fd 4, 5): CRIU cannot dump this kind of "
        "descriptor; close it before a checkpoint (e.g. stop profilers using perf events)",
        "pid 7 (job) holds an RDMA device (InfiniBand/RoCE verbs) (/dev/infiniband/uverbs0, "
        "fd 7): CRIU cannot save the device's state; use TCP instead (for NCCL: "
        "NCCL_IB_DISABLE=1)",
        "pid 7 (job) holds a mapping of the device /dev/mem: CRIU cannot dump device memory "
        "mappings; unmap it before a checkpoint",
    ]


def test_nvidia_mappings_belong_to_gpu_processes_or_the_plugin() -> None:
    maps = ("/dev/nvidia0", "/dev/nvidiactl")
    assert scan.devices(_proc(maps=maps, gpu=True)) == []
    assert scan.devices(_proc(maps=maps, plugin_devices=("/dev/nvidia",))) == []
    leftover = scan.devices(_proc(maps=maps))
    assert [f.resource.split(" (")[0] for f in leftover] == [
        "a leftover mapping of /dev/nvidia0",
        "a leftover mapping of /dev/nvidiactl",
    ]
    assert "scripts/install-criu" in leftover[0].fix
    # any device the plugin is told to carry (tests point it at a loop device)
    assert scan.devices(_proc(maps=("/dev/loop1",), plugin_devices=("/dev/loop",))) == []
    assert len(scan.devices(_proc(maps=("/dev/loop1",)))) == 1


def test_cuda_managed_memory_is_refused_in_a_gpu_process() -> None:
    # measured on an H100 (driver 580): a context maps 2 MiB of /dev/nvidia-uvm; a 32 MiB
    # cudaMallocManaged adds one more mapping; cudaMalloc and cudaMallocHost add none
    context = {"/dev/nvidia-uvm": (2 << 20,), "/dev/nvidiactl": (4096,)}
    managed = {"/dev/nvidia-uvm": (2 << 20, 32 << 20)}
    assert scan.managed_memory(_proc(gpu=True, device_maps=context)) == []
    assert scan.managed_memory(_proc(gpu=False, device_maps=managed)) == []  # a forked worker
    (found,) = scan.managed_memory(_proc(gpu=True, device_maps=managed))
    assert found.resource == "CUDA managed memory (32 MiB mapped through /dev/nvidia-uvm)"
    assert "cudaMallocManaged" in found.fix


def test_a_rank_mapping_a_peer_gpu_may_hold_one_uvm_range_per_gpu_it_opened() -> None:
    # measured on 2 x H100 (driver 580, NCCL 2.28 with P2P over NVLink): after its
    # communicator is destroyed, the rank holding /dev/nvidia0 and /dev/nvidia1 keeps a second
    # 2 MiB /dev/nvidia-uvm range, and the driver checkpoints it; managed memory beyond one
    # range per GPU is still refused here (and anything else the driver refuses, it says so)
    two_gpus = (FdFact(3, "/dev/nvidiactl"), FdFact(4, "/dev/nvidia0"), FdFact(5, "/dev/nvidia1"))
    peer = {"/dev/nvidia-uvm": (2 << 20, 2 << 20)}
    assert scan.managed_memory(_proc(gpu=True, device_maps=peer, fds=two_gpus)) == []
    one_gpu = (FdFact(3, "/dev/nvidiactl"), FdFact(4, "/dev/nvidia0"), FdFact(6, "/dev/nvidia0"))
    (found,) = scan.managed_memory(_proc(gpu=True, device_maps=peer, fds=one_gpu))
    assert found.resource == "CUDA managed memory (2 MiB mapped through /dev/nvidia-uvm)"
    big = {"/dev/nvidia-uvm": (2 << 20, 2 << 20, 64 << 20)}
    (found,) = scan.managed_memory(_proc(gpu=True, device_maps=big, fds=two_gpus))
    assert found.resource == "CUDA managed memory (64 MiB mapped through /dev/nvidia-uvm)"


def test_device_mapping_sizes_are_read_from_proc(procs: list[subprocess.Popen[str]]) -> None:
    code = (
        "import mmap, time\n"
        "f = open('/dev/zero', 'rb')\n"
        "m = mmap.mmap(f.fileno(), 3 * 4096, mmap.MAP_SHARED, mmap.PROT_READ)\n"
        "print('mapped', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = _start([sys.executable, "-c", code])
    procs.append(proc)
    (facts,) = scan.gather([proc.pid]).procs
    zero = [k for k in facts.device_maps if k.startswith("/dev/zero")]
    assert zero and 3 * 4096 in facts.device_maps[zero[0]]
    assert scan.findings(scan.TreeFacts((facts,))) == []


def test_other_parts_add_rules_and_see_the_environment() -> None:
    def needs_flag(proc: ProcFacts) -> list[Finding]:
        if proc.environ.get("NEEDS") == "x":
            return [Finding(proc.pid, proc.name, "NEEDS=x", "not allowed", "unset NEEDS")]
        return []

    facts = TreeFacts((_proc(environ={"NEEDS": "x"}), _proc()))
    with pytest.raises(UndumpableError, match=r"pid 7 \(job\) holds NEEDS=x: not allowed"):
        scan.check("env", facts, rules=[needs_flag])
    before = list(scan.RULES)
    try:
        assert scan.rule(needs_flag) is needs_flag and scan.RULES[-1] is needs_flag
        assert len(scan.findings(facts)) == 1
    finally:
        scan.RULES[:] = before


def test_job_environment_turns_libuv_off_unless_set() -> None:
    assert scan.job_environment({"PATH": "/bin"}) == {"PATH": "/bin", "USE_LIBUV": "0"}
    assert scan.job_environment({"USE_LIBUV": "1"})["USE_LIBUV"] == "1"


def test_socket_fact_states() -> None:
    listen = SocketFact(1, "inet", "tcp", "LISTEN")
    est = SocketFact(2, "inet6", "tcp", "ESTABLISHED", Endpoint("::1", 5), Endpoint("::1", 6))
    assert not listen.connected_tcp and est.connected_tcp
    assert str(est.local) == "[::1]:5"
    assert not SocketFact(3, "inet", "udp", "").connected_tcp
    # /proc/net/tcp6 writes an address as four little-endian words
    assert parse_endpoint("00000000000000000000000001000000:0016") == Endpoint("::1", 22)
    assert parse_endpoint("0100007F:1F90") == Endpoint("127.0.0.1", 8080)


def test_a_session_begun_outside_the_pid_namespace_is_found() -> None:
    """The session rule on facts, and the fact read from real processes: one in a session of
    its own, one whose session leader is outside its new PID namespace."""
    p = ProcFacts(9, "sleep", session_outside=True)
    (found,) = scan.findings(TreeFacts((p,)))
    assert found.resource.startswith("a session whose session leader is outside")
    assert "setsid" in found.fix
    own = _start([sys.executable, "-c", "print('up', flush=True); import time; time.sleep(60)"])
    inner_argv = ["unshare", "--pid", "--fork", "--kill-child", "sleep", "60"]  # dies with it
    outer = subprocess.Popen(inner_argv, start_new_session=True)
    try:
        assert not procfacts.session_outside(own.pid)
        for _ in range(100):
            if len(proctree.tree(outer.pid)) == 2:
                break
            time.sleep(0.05)
        inner = proctree.tree(outer.pid)[1]
        assert procfacts.session_outside(inner)
        assert not procfacts.session_outside(outer.pid)
    finally:
        for proc in (own, outer):
            proc.kill()
            proc.wait()


def test_a_socket_closed_or_made_while_the_tables_are_read_is_no_unsupported_family() -> None:
    """The freeze's scan lists a process's fds, then looks each socket up in /proc/net: a unix
    socket made after the table was read, or one closed in between (the NCCL shim answers
    the agent's query on a connection it closes at once), was taken for "a socket of an
    unsupported family" and the freeze refused (CI, the NCCL drain test). A unix, netlink or
    packet socket is told by its inode's protocol name; a socket gone is no socket."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)
    try:
        pid = os.getpid()
        for sk, family in ((a, "unix"), (nl, "netlink")):
            fact = sockets.unlisted(pid, sk.fileno(), os.fstat(sk.fileno()).st_ino)
            assert fact is not None and fact.family == family
        gone = a.fileno()
        inode = os.fstat(gone).st_ino
        a.close()
        assert sockets.unlisted(pid, gone, inode) is None
    finally:
        a.close()
        b.close()
        nl.close()
