"""Tensor parallelism's processes and sockets: the rendezvous is private to the host, engines
start one after another in one process, a failed start leaves nothing behind, and workers die
with their driver (read from /proc, so Linux only)."""

from __future__ import annotations

import errno
import gc
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from qwenserve import LLM, SamplingParams
from qwenserve.distributed.init import rendezvous
from qwenserve.engine import mp_executor
from qwenserve.worker.worker import Worker

pytestmark = [pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc"),
              pytest.mark.usefixtures("one_thread_per_rank")]

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": list(range(10, 40))}]


def make_llm(path: str) -> LLM:
    return LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20,
               tensor_parallel_size=2)


def children(pid: int) -> set[int]:
    """Live (not zombie) processes whose parent is ``pid``."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == str(pid) and fields[0] != "Z":
            found.add(int(entry))
    return found


def gone(pids: set[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = set()
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        alive.add(pid)
            except OSError:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


def listening(pids: list[int]) -> dict[int, str]:
    """Socket inode -> local address of every TCP socket these processes listen on."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and int(cols[9]) in inodes:  # 0A: LISTEN
                    found[int(cols[9])] = _address(cols[1])
    return found


def _address(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"{ip}:{int(port, 16)}"


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.rsplit(":", 1)[0]).is_loopback


def test_one_node_rendezvous_holds_a_loopback_port(monkeypatch):
    for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    rdzv, listener = rendezvous(2)
    with listener:
        assert listener.getsockname() == ("127.0.0.1", rdzv.port) and rdzv.host == "127.0.0.1"
        for host in ("127.0.0.1", "0.0.0.0"):  # nobody can take the port while it is chosen
            with socket.socket() as other, pytest.raises(OSError) as raised:
                other.bind((host, rdzv.port))
            assert raised.value.errno == errno.EADDRINUSE
        with socket.create_connection(("127.0.0.1", rdzv.port), timeout=5):
            pass  # already listening: ranks that come early wait in the backlog


def test_several_nodes_listen_on_master_addr(monkeypatch, caplog):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("NODE_RANK", "1")
    assert rendezvous(4)[1] is None  # only node 0 serves the store
    monkeypatch.setenv("NODE_RANK", "0")
    rdzv, listener = rendezvous(4)
    with listener:
        assert listener.getsockname() == ("127.0.0.1", port) and rdzv.local_ranks == range(2)
        with pytest.raises(OSError, match=f"MASTER_PORT={port} is already in use"):
            rendezvous(4)
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # TEST-NET-1: never this host's address
    _, listener = rendezvous(4)
    with listener:
        assert listener.getsockname()[0] == "0.0.0.0"
    assert "listens on every interface" in caplog.text


def test_sequential_engines_in_one_process_listen_on_loopback(tiny_model):
    """``del llm; gc.collect()`` stops the workers and frees the process group, so the next
    tensor-parallel LLM starts; neither rank listens on anything but loopback."""
    path = tiny_model("qwen2")
    llm = make_llm(path)
    workers = {proc.pid for proc in llm.llm_engine.executor.procs.values()}
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    del llm
    gc.collect()
    assert gone(workers, within_s=1)  # shutdown waited for them
    before = set(listening([os.getpid()]))
    llm = make_llm(path)
    workers = {proc.pid for proc in llm.llm_engine.executor.procs.values()}
    sockets = {k: v for k, v in listening([os.getpid(), *workers]).items() if k not in before}
    assert sockets and all(map(is_loopback, sockets.values())), sockets
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == first
    llm.llm_engine.shutdown()
    assert gone(workers, within_s=1)


def _injected(*args, **kwargs):
    raise RuntimeError("injected start-up failure")


@pytest.mark.parametrize("target,name", [(mp_executor, "init_parallel_group"),
                                         (Worker, "load_model"), (Worker, "plan_cache")],
                         ids=["rendezvous", "load", "cache-plan"])
def test_a_failed_start_leaves_nothing_behind(tiny_model, monkeypatch, target, name):
    """The failure is injected in the driver only (workers are fresh interpreters): the
    executor stops its workers, leaves no process group, and raises the error itself."""
    import torch.distributed as dist

    path = tiny_model("qwen2")
    before = children(os.getpid())
    monkeypatch.setattr(target, name, _injected)
    with pytest.raises(RuntimeError, match="injected start-up failure"):
        make_llm(path)
    assert not dist.is_initialized()
    assert gone(children(os.getpid()) - before, within_s=1)


def test_workers_exit_when_their_driver_is_killed_during_start(tiny_model):
    """The driver (a child of this test, as under an API server) is SIGKILLed while its worker
    waits for the rendezvous; the worker must not wait out the store's timeout."""
    script = textwrap.dedent(f"""
        import sys, time
        from qwenserve import LLM
        from qwenserve.engine import mp_executor

        def stall(*args, **kwargs):
            print("SPAWNED", flush=True)
            time.sleep(600)

        mp_executor.init_parallel_group = stall
        LLM({tiny_model("qwen2")!r}, dtype="float32", tensor_parallel_size=2)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "SPAWNED", driver.stderr.read()[-2000:]
        workers = children(driver.pid)
        assert len(workers) == 1
        time.sleep(1.0)  # let the worker get under way
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
        assert gone(workers, within_s=10)
    finally:
        driver.kill()
        driver.wait()
        for pid in children(driver.pid) | locals().get("workers", set()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
