"""The attempt key space (megatron/training/attempt.py): every rank of a rendezvous round agrees
on one attempt, new for the round, whatever the dead attempt left in the store (issue 46).

The store here is one ``HashStore`` shared by threads standing in for the ranks; the real
launcher path (torchrun restarting into its agent's store) is tests/test_restart.py."""

from __future__ import annotations

import threading
from typing import Dict, List

import pytest
import torch.distributed as dist

from megatron.training import attempt


def _round(store, world: int, environ: Dict[str, str], start_first: List[int] = (),
           timeout_s: float = 30.0) -> Dict[int, object]:
    """Every rank of one round in a thread (``start_first`` ranks get going before the others,
    so they read whatever the store holds before rank 0 publishes); rank -> Attempt or error."""
    out: Dict[int, object] = {}

    def rank_main(rank: int) -> None:
        try:
            out[rank] = attempt.agree(store, rank, world, timeout_s, environ)
        except Exception as exc:  # noqa: BLE001 -- reported to the test
            out[rank] = exc

    first = [threading.Thread(target=rank_main, args=(r,)) for r in start_first]
    for t in first:
        t.start()
    if first:   # they read the current attempt (the stale one) and checked in under it
        deadline = threading.Event()
        for r in start_first:
            for _ in range(400):
                if store.check([f"megatron/attempt1/hello/{r}"]):
                    break
                deadline.wait(0.01)
    rest = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)
            if r not in start_first]
    for t in rest:
        t.start()
    for t in first + rest:
        t.join(timeout_s + 10)
    return out


def test_a_restarted_round_agrees_on_a_new_attempt_despite_the_dead_ones_keys() -> None:
    store = dist.HashStore()
    first = _round(store, 3, {})
    assert {r: a.number for r, a in first.items()} == {0: 1, 1: 1, 2: 1}
    assert first[0].prefix == "megatron/attempt1/pg/"
    # the dead attempt's keys stay; ranks 1 and 2 of the new round start before its rank 0
    # and read attempt 1 first: only a live rank 0 answers their nonce, so they move on
    second = _round(store, 3, {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "1",
                               "TORCHELASTIC_MAX_RESTARTS": "3"}, start_first=[1, 2])
    assert {r: getattr(a, "number", a) for r, a in second.items()} == {0: 2, 1: 2, 2: 2}
    assert second[1].describe() == ("attempt 2 of run job (this node's torchrun restart 1 of at "
                                    "most 3); process groups rendezvous under store keys "
                                    "'megatron/attempt2/pg/'")


def test_a_fresh_store_per_round_still_numbers_the_restart() -> None:
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each round has a new store; the number is at least
    rank 0's agent restart count + 1."""
    got = _round(dist.HashStore(), 2, {"TORCHELASTIC_RESTART_COUNT": "2"})
    assert [got[r].number for r in (0, 1)] == [3, 3]


def test_no_live_rank_0_is_an_error_naming_it(monkeypatch) -> None:
    monkeypatch.setattr(attempt, "POLL_S", 0.01)
    store = dist.HashStore()
    _round(store, 2, {})                       # attempt 1, then its ranks died
    with pytest.raises(attempt.AttemptAgreementError,
                       match="rank 1: rank 0 of attempt 1 did not answer within 0 s"):
        attempt.agree(store, 1, 2, 0.3, {})
    with pytest.raises(attempt.AttemptAgreementError,
                       match="rank 0, attempt 2: rank 1 did not check in within 0 s"):
        attempt.agree(store, 0, 2, 0.3, {"MASTER_ADDR": "h", "MASTER_PORT": "1"})
