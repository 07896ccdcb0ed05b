import socket
import threading

import pytest
import ray
from tidal.placement import PlacementError, PortAllocator
from tidal.placement.ports import PORT_SPAN, SGLANG_DERIVED_OFFSETS, _PortBook

NUM_ENGINES = 10


def _blocks(base):
    return {base + off + i for off in SGLANG_DERIVED_OFFSETS for i in range(PORT_SPAN)}


def _listen(port):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("", port))
    sock.listen()
    return sock


def test_concurrent_engines_on_one_node_get_distinct_bindable_ports(ray_cluster):
    ip = ray.util.get_node_ip_address()
    start = threading.Barrier(NUM_ENGINES)
    bound = threading.Barrier(NUM_ENGINES)
    results, errors = {}, []

    def engine(i):
        try:
            start.wait(timeout=60)  # all engines ask the node's allocator at once
            ports = PortAllocator(ip).engine_ports()
            socks = [_listen(p) for p in (ports.http_port, ports.nccl_port, ports.dist_init_port)]
            results[i] = ports
            bound.wait(timeout=60)  # every server holds its ports at the same time
            for s in socks:
                s.close()
        except Exception as e:
            errors.append(e)
            bound.abort()

    threads = [threading.Thread(target=engine, args=(i,)) for i in range(NUM_ENGINES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == NUM_ENGINES
    bases = [p for r in results.values() for p in (r.http_port, r.nccl_port, r.dist_init_port)]
    assert len(set(bases)) == 3 * NUM_ENGINES
    # SGLang's derived ranges (port+1..+6, port+233..) never overlap another server's ports.
    reserved = [_blocks(b) for b in bases]
    assert sum(map(len, reserved)) == len(set().union(*reserved))
    assert all(r.host == ip and r.url == f"http://{ip}:{r.http_port}" for r in results.values())


def test_allocator_is_shared_across_processes(ray_cluster):
    ip = ray.util.get_node_ip_address()
    mine = set(PortAllocator(ip).allocate(4))

    @ray.remote(num_cpus=0)
    def other_process():
        return PortAllocator(ip).allocate(4)

    theirs = set(ray.get(other_process.remote(), timeout=120))
    assert len(mine | theirs) == 8


def test_port_book_skips_busy_ports_and_never_repeats():
    with socket.socket() as probe:
        probe.bind(("", 0))
        low = probe.getsockname()[1] // PORT_SPAN * PORT_SPAN - 20 * PORT_SPAN
    busy = _listen(low + 3)  # inside the first block: the book must skip that whole block
    try:
        book = _PortBook(low, low + 20 * PORT_SPAN, PORT_SPAN, (0,))
        got = book.allocate(5) + book.allocate(5)
        assert low not in got and len(set(got)) == 10
        assert all(p % PORT_SPAN == low % PORT_SPAN for p in got)
        with pytest.raises(PlacementError, match="no free port block"):
            for _ in range(20):
                book.allocate(1)
    finally:
        busy.close()


def test_two_jobs_on_one_host_never_get_the_same_port(tmp_path):
    """Two allocators (two jobs, each with its own Ray) on one host: the lock files keep their blocks apart."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        low = probe.getsockname()[1] // PORT_SPAN * PORT_SPAN - 20 * PORT_SPAN
    first = _PortBook(low, low + 20 * PORT_SPAN, PORT_SPAN, (0,), lock_dir=tmp_path)
    second = _PortBook(low, low + 20 * PORT_SPAN, PORT_SPAN, (0,), lock_dir=tmp_path)
    mine = first.allocate(3)  # tested free, not bound yet: a bind test alone would hand them out again
    theirs = second.allocate(3)
    assert not set(mine) & set(theirs)
    # Ports in this range can be busy on a shared host (other processes' ephemeral ports), so which blocks
    # each job gets is not fixed; what is fixed is that the other job's lock files refuse them.
    assert all(low <= p < low + 20 * PORT_SPAN and (p - low) % PORT_SPAN == 0 for p in mine + theirs)
    third = _PortBook(low, low + 20 * PORT_SPAN, PORT_SPAN, (0,), lock_dir=tmp_path)
    assert not third._locks.take(first._block(mine[0]))  # held by the first job
    assert not set(third.allocate(2)) & set(mine + theirs)
    first._locks.release([p + i for p in mine for i in range(PORT_SPAN)])  # the first job ended
    assert third._locks.take(first._block(mine[0]))  # its ports are free for the next job again
