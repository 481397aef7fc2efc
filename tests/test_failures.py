"""The failure beacon (megatron/distributed/failures.py) on a store of its own: the first
post wins, a wait raises the posted line, a stage's failed job carries it (issue 36, item 4).
The whole path on 4 gloo ranks is tests/test_rank_failure.py."""

from __future__ import annotations

import threading
from typing import Dict

import pytest

from megatron.distributed import failures
from megatron.distributed.quant.streams import CommStreams


class DictStore:
    """``compare_set`` / ``check`` / ``get`` of a c10d store."""

    def __init__(self) -> None:
        self.data: Dict[str, bytes] = {}
        self.lock = threading.Lock()

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with self.lock:
            if key not in self.data and expected == "":
                self.data[key] = desired.encode()
            return self.data[key]

    def check(self, keys) -> bool:  # noqa: ANN001
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            return value


@pytest.fixture
def beacon(monkeypatch):
    monkeypatch.setattr(failures, "POLL_S", 0.01)
    store = DictStore()
    failures.install(store, rank=3)
    yield store
    failures.uninstall()


def test_the_first_post_wins_and_names_rank_place_and_cause(beacon, capsys) -> None:
    first = failures.report("bucket 7, intra-node hop", MemoryError("CUDA out of memory"))
    assert isinstance(first, failures.CommunicationFailure)
    assert str(first) == "rank 3: bucket 7, intra-node hop: MemoryError: CUDA out of memory"
    assert "MemoryError: CUDA out of memory" in capsys.readouterr().err   # the traceback, here
    later = failures.report("bucket 8", RuntimeError("Connection closed by peer"))
    assert str(later) == str(first) and isinstance(later.__cause__, RuntimeError)
    assert "Connection closed" not in capsys.readouterr().err            # a follow-up: no trace
    assert failures.report("x", first) is first


def test_a_wait_raises_another_ranks_posted_failure(beacon) -> None:
    beacon.data[failures.KEY] = b"rank 0: bucket 1, inter-node hop: RuntimeError: boom"
    failures._BEACON.seen = beacon.data[failures.KEY].decode()  # what the watcher does
    never = threading.Event()
    with pytest.raises(failures.CommunicationFailure, match="rank 0: bucket 1"):
        failures.wait_until(never, None)
    done = threading.Event()
    done.set()
    assert failures.wait_until(done, None) is True


def test_a_failed_stage_job_is_posted_with_its_label(beacon) -> None:
    streams = CommStreams("thread")

    def fail() -> None:
        raise ValueError("injected")
    job = streams.submit("intra", fail, label="gradient reduce-scatter of chunk0/bucket2, hop")
    after = streams.submit("intra", lambda: None, label="next bucket")
    for j in (job, after):
        with pytest.raises(failures.CommunicationFailure,
                           match="rank 3: gradient reduce-scatter of chunk0/bucket2, hop: "
                                 "ValueError: injected"):
            j.wait()


def test_nothing_changes_without_an_installation() -> None:
    failures.uninstall()
    err = ValueError("plain")
    assert failures.report("x", err) is err and failures.posted() is None
    job = CommStreams("thread").submit("intra", lambda: (_ for _ in ()).throw(err))
    with pytest.raises(ValueError, match="plain"):
        job.wait()


def test_a_lost_connection_names_the_peer_that_stopped_beating(monkeypatch) -> None:
    """Issue 46, item 4: rank 2 died without a word; rank 0's collective fails with gloo's
    "Connection closed by peer". The posted line names rank 2 (its heartbeat stopped; rank 1's
    goes on), then where rank 0 saw it and gloo's text. With every peer beating, or for a
    failure that is not a lost connection, the line is the plain one."""
    monkeypatch.setattr(failures, "POLL_S", 0.02)
    store = DictStore()
    failures.install(store, rank=0, world_size=3)
    for r in (1, 2):
        store.add(f"{failures.ALIVE_KEY}{r}", 1)
    stop = threading.Event()

    def peers_beat(ranks) -> threading.Thread:  # noqa: ANN001
        def run() -> None:
            while not stop.wait(0.02):
                for r in ranks:
                    store.add(f"{failures.ALIVE_KEY}{r}", 1)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                        "closed by peer [127.0.0.1]:2947")
    try:
        beating = peers_beat([1])
        failure = failures.report("weight all-gather of chunk0/bucket0", gloo)
        assert str(failure) == ("rank 2 stopped answering: rank 0 at weight all-gather of "
                                "chunk0/bucket0: RuntimeError: [../third_party/gloo/gloo/"
                                "transport/tcp/pair.cc:553] Connection closed by peer "
                                "[127.0.0.1]:2947")
        stop.set()
        beating.join()
        # every peer alive: nobody to name
        store.data.pop(failures.KEY)
        stop.clear()
        beating = peers_beat([1, 2])
        failure = failures.report("bucket 3", gloo)
        assert str(failure).startswith("rank 0: bucket 3: RuntimeError: [../third_party"), failure
    finally:
        stop.set()
        failures.uninstall()
