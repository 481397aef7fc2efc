"""The failure beacon (megatron/distributed/quant/failures.py) on a store of its own: the first
post wins, a wait raises the posted line, a stage's failed job carries it (issue 36, item 4).
The whole path on 4 gloo ranks is tests/test_rank_failure.py."""

from __future__ import annotations

import threading
from typing import Dict

import pytest

from megatron.distributed.quant import failures
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
