"""The communication stages (megatron/distributed/quant/streams.py) and the timing they report.

Why: the overlapped collectives rely on three properties of a stage -- jobs run in submission
order (so every rank issues a process group's collectives in the same order), a job starts only
after the jobs it depends on (the inter hop of chunk y after its intra hop), and a failure reaches
the waiter instead of vanishing in a worker thread (a peer would hang). The per-iteration timing
(``comm_*_ms`` in the log) is arithmetic on the stages' busy time and the waits.
"""

from __future__ import annotations

import threading

import pytest

from fake_cuda import FakeCuda
from megatron.distributed.quant.streams import CommStreams, CommTiming


@pytest.mark.parametrize("kind", ["inline", "thread"])
def test_jobs_run_in_order_after_their_dependencies(kind: str) -> None:
    streams = CommStreams(kind)
    order = []
    gate = threading.Event()
    if kind == "thread":  # hold the intra stage so the inter jobs are queued before it runs
        streams.submit("intra", gate.wait)
    intra = [streams.submit("intra", lambda i=i: order.append(("intra", i))) for i in range(3)]
    inter = [streams.submit("inter", lambda i=i: order.append(("inter", i)), after=[intra[i]])
             for i in range(3)]
    gate.set()
    for job in inter:
        job.wait()
    assert all(j.is_completed() for j in intra + inter)
    for i in range(3):
        assert order.index(("intra", i)) < order.index(("inter", i))
    assert [x for x in order if x[0] == "intra"] == [("intra", i) for i in range(3)]
    assert [x for x in order if x[0] == "inter"] == [("inter", i) for i in range(3)]
    if kind == "thread":
        assert streams.stage("intra")._thread.is_alive()


@pytest.mark.parametrize("kind", ["inline", "thread"])
def test_a_failure_reaches_the_waiter_and_its_dependents(kind: str) -> None:
    streams = CommStreams(kind)

    def boom() -> None:
        raise ValueError("gloo said no")

    first = streams.submit("intra", boom)
    second = streams.submit("inter", lambda: None, after=[first])
    for job in (first, second):
        with pytest.raises(ValueError, match="gloo said no"):
            job.wait()
    # An inline job's error reaches its caller at once: the stage goes on. A worker stage
    # (asynchronous) stops at its first error: a later job's collective would pair with the
    # peers' exchange of the failed one (see streams._Stage); its worker thread still answers.
    ran = []
    later = streams.submit("intra", lambda: ran.append("later"))
    if kind == "inline":
        later.wait()
        assert ran == ["later"]
    else:
        with pytest.raises(ValueError, match="gloo said no"):
            later.wait()
        assert ran == []


def test_unknown_stage_and_kind_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown stage"):
        CommStreams("inline").submit("pcie", lambda: None)
    with pytest.raises(ValueError, match="unknown stream kind"):
        CommStreams("mpi")


def test_timing_splits_total_and_exposed_per_iteration() -> None:
    inline = CommStreams("inline")
    timing = CommTiming(inline)
    timing.overlapped = CommStreams("inline")   # stands in for the worker stages
    inline.stage("intra").busy_s = 0.010        # synchronous work: total and exposed
    inline.stage("weights").busy_s = 0.002
    timing.overlapped.stage("intra").busy_s = 0.030
    timing.overlapped.stage("inter").busy_s = 0.050
    timing.overlapped.stage("weights").busy_s = 0.006
    timing.waited["grad"] = 0.004              # what the training thread waited for
    timing.waited["weight"] = 0.001
    timing.iterations = 2
    rep = timing.interval_report()
    assert rep == pytest.approx({
        "comm_grad_intra_ms": 20.0, "comm_grad_inter_ms": 25.0, "comm_grad_exposed_ms": 7.0,
        "comm_weight_ms": 4.0, "comm_weight_exposed_ms": 1.5})
    # the next interval only sees what happened after the reset
    timing.overlapped.stage("inter").busy_s += 0.010
    timing.iterations += 1
    assert timing.interval_report()["comm_grad_inter_ms"] == pytest.approx(10.0)
    assert timing.interval_report() == {}  # no iteration since


def test_wait_counts_as_exposed() -> None:
    timing = CommTiming(CommStreams("inline"))
    job = CommStreams("thread").submit("weights", lambda: sum(range(200000)))
    timing.wait("weight", job)
    assert job.is_completed() and timing.waited["weight"] > 0.0 and timing.waited["grad"] == 0.0


def test_cuda_stages_enqueue_in_order_and_wait_by_events(monkeypatch) -> None:
    """The GPU design without a GPU: a job runs at once on the host inside its stage's stream,
    after that stream waited on the submitting stream and on its dependencies' events; wait()
    makes the waiting stream wait on the job's event and only then drops the job's buffers."""
    fake = FakeCuda()
    fake.install(monkeypatch)
    streams = CommStreams("cuda", device="cuda:0")
    ran = []
    intra = streams.submit("intra", lambda: ran.append(("intra", fake.current.name)))
    inter = streams.submit("inter", lambda: ran.append(("inter", fake.current.name)),
                           after=[intra])
    assert ran == [("intra", "intra"), ("inter", "inter")]      # enqueued at once, on its stream
    assert fake.current is fake.default                          # the caller's stream is restored
    intra_start = streams.stage("intra")._timed[0][0].name   # device-time events (CommTiming)
    inter_start = streams.stage("inter")._timed[0][0].name
    assert fake.log == [
        ("wait_stream", "intra", "default"), ("record", intra_start, "intra"),
        ("record", intra.event.name, "intra"),
        ("wait_stream", "inter", "default"), ("wait_event", "inter", intra.event.name),
        ("record", inter_start, "inter"), ("record", inter.event.name, "inter")]
    assert inter.keepalive is not None
    fake.log.clear()
    inter.wait()
    assert fake.log == [("wait_event", "default", inter.event.name)]
    assert inter.keepalive is None and intra.keepalive is not None


def test_cuda_stage_time_is_device_time_and_completion_is_the_device_s(monkeypatch) -> None:
    """Issue 25 item 7: on CUDA ``busy_s`` was host enqueue time and ``is_completed`` was True as
    soon as a job was queued. Now: CUDA-event time of jobs the device finished, and a job is
    complete when its end event is."""
    import time

    fake = FakeCuda()
    fake.install(monkeypatch)
    streams = CommStreams("cuda", device="cuda:0")
    job = streams.submit("intra", lambda: time.sleep(0.01))   # host time that must not count
    job.event.done = False                                     # still running on the device
    assert not job.is_completed()
    assert streams.busy_seconds()["intra"] == 0.0
    job.event.done = True
    assert job.is_completed()
    assert streams.busy_seconds()["intra"] == pytest.approx(0.0025)   # the fake's 2.5 ms
    assert streams.busy_seconds()["intra"] == pytest.approx(0.0025)   # counted once


# -- issue 25, defect 6: one hardware queue serialises the communication stages with compute ------

def test_single_hardware_queue_is_warned_about_only_where_it_stalls_overlap() -> None:
    from megatron.distributed.quant.streams import single_hardware_queue_warning as warn

    one = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    kw = dict(device="cuda", overlap=True, tensor_parallel=1, sequence_parallel=False)
    msg = warn(one, **kw)
    assert msg and "CUDA_DEVICE_MAX_CONNECTIONS=1" in msg and "unset it" in msg
    assert "--overlap-grad-reduce" in msg
    # tensor-parallel communication overlap is why Megatron-LM recipes set it: no "unset it"
    tp = warn(one, **dict(kw, tensor_parallel=2, sequence_parallel=True))
    assert tp and "unset it" not in tp
    assert warn({}, **kw) is None
    assert warn({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, **kw) is None
    assert warn(one, **dict(kw, overlap=False)) is None
    assert warn(one, **dict(kw, device="cpu")) is None
