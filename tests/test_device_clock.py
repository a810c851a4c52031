"""The course's one device-aware clock (course_lib.clock) and every timer built on it, checked on
the CPU with stand-ins for a GPU: torch.cuda.synchronize is replaced by a counter, the device is
torch.device("cuda", 0) (a plain value: no GPU is touched), and where a tensor must live on it,
an object with a tensor's attributes stands in.

    on a CUDA device each timer waits for the device at its span boundaries (so a span is the
    work, not its launch); on the CPU none does, and CPU times stay plain perf_counter readings
    the profiler records CUDA activity when the ranks run on CUDA, only the CPU otherwise
    the capstone quotes MFU against a GPU's peak only for ranks that ran on that GPU
"""

from __future__ import annotations

import json
import pathlib
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import ProfilerActivity

from course_lib import clock
from course_lib.observe.timeline import Timeline
from course_lib.observe.tracer import _TRACE_LAYER, CommTracer

CUDA = torch.device("cuda", 0)


@pytest.fixture
def syncs(monkeypatch):
    """Every torch.cuda.synchronize call's device, in order (the stand-in never touches a GPU)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    return calls


@pytest.fixture
def cuda_started(monkeypatch):
    """This process 'has started CUDA' on GPU 0: what a GPU rank's process looks like."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.fixture
def one_rank():
    """A one-rank gloo process group in the test process (the tracer and DDP need one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class CudaTensor:
    """What the timers read of a CUDA tensor: its device, size and dtype."""

    device, dtype = CUDA, torch.float32

    def __init__(self, numel: int):
        self._numel = numel

    def numel(self):
        return self._numel

    def element_size(self):
        return 4

    def data_ptr(self):
        return 1


# ---------------------------------------------------------------------------- the clock itself
def test_the_clock_waits_for_a_cuda_device_and_never_for_the_cpu(syncs, monkeypatch):
    clock.synchronize("cpu")
    clock.synchronize(torch.device("cpu"))
    clock.synchronize(None)  # this process never started CUDA: nothing can be queued there
    assert syncs == []
    before = clock.now("cpu")
    assert isinstance(before, float) and syncs == []
    clock.synchronize(CUDA)
    clock.now("cuda:0")
    assert syncs == [CUDA, CUDA]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    clock.now(None)  # a GPU rank's process whose caller did not name the device: its current GPU
    clock.now("cpu")  # a device named CPU is never waited for
    assert syncs == [CUDA, CUDA, torch.device("cuda", 3)]


def test_the_comm_cost_model_uses_the_same_clock():
    from course_lib.comm import costmodel, measured

    assert costmodel.synchronize is clock.synchronize and measured.synchronize is clock.synchronize


def test_device_of_reads_the_first_tensor():
    assert clock.device_of([[CudaTensor(2)], torch.ones(1)]) == CUDA
    assert clock.device_of(torch.ones(1)) == torch.device("cpu")
    assert clock.device_of(None) is None and clock.device_of([]) is None


# ---------------------------------------------------------------------------- Timeline
def test_a_timeline_span_waits_for_the_gpu_at_both_ends(syncs):
    tl = Timeline(device=CUDA)
    with tl.span("forward", "forward"):
        assert len(syncs) == 1  # before the start was read
    assert syncs == [CUDA, CUDA]  # and before the end was read
    with tl.span("copy", device="cpu"):  # a span's own device overrides the timeline's
        pass
    assert len(syncs) == 2 and [e[0] for e in tl.events] == ["forward", "copy"]


def test_a_cpu_timeline_never_waits(syncs, cuda_started):
    tl = Timeline(device="cpu")
    with tl.span("forward"):
        pass
    assert syncs == [] and len(tl.events) == 1
    assert tl.events[0][1] <= tl.events[0][2]


def test_a_timeline_without_a_device_waits_only_in_a_process_that_started_cuda(syncs, monkeypatch):
    tl = Timeline()
    with tl.span("step"):
        pass
    assert syncs == []  # this test process never started CUDA
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with tl.span("step"):
        pass
    assert syncs == [CUDA, CUDA]


# ---------------------------------------------------------------------------- CommTracer
def test_the_tracer_times_a_blocking_gpu_call_between_two_waits(syncs, one_rank):
    seen_during = []
    args = {"tensor": CudaTensor(8), "group": None, "async_op": False}
    with CommTracer() as tracer:
        _TRACE_LAYER.around("all_reduce", args, lambda: seen_during.append(len(syncs)))
    assert seen_during == [1] and syncs == [CUDA, CUDA]  # one wait before the call, one after
    (rec,) = tracer.records
    assert (rec.op, rec.numel, rec.bytes_sent) == ("all_reduce", 8, 32) and rec.start <= rec.end


def test_the_tracer_times_async_calls_at_launch_without_waiting(syncs, one_rank):
    with CommTracer() as tracer:
        _TRACE_LAYER.around("all_reduce", {"tensor": CudaTensor(8), "group": None, "async_op": True}, lambda: None)
        _TRACE_LAYER.around("isend", {"tensor": CudaTensor(4), "dst": 0, "group": None, "tag": 0}, lambda: None)
    assert syncs == [] and [r.op for r in tracer.records] == ["all_reduce", "isend"]


def test_the_tracer_on_cpu_tensors_never_waits(syncs, one_rank, cuda_started):
    with CommTracer() as tracer:
        t = torch.ones(3)
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
    assert syncs == []  # the tensors' device is the CPU, even in a process that started CUDA
    assert tracer.summary()["all_reduce"] == {"calls": 1, "bytes_sent": 12, "bytes_recv": 12}
    with CommTracer():
        dist.barrier()  # no tensor: the process's device, here its (stand-in) GPU
    assert syncs == [CUDA, CUDA]


# ---------------------------------------------------------------------------- the pipeline executor
class _Storage:
    def data_ptr(self):
        return 1

    def nbytes(self):
        return 0


class _CudaParameter:
    device = CUDA

    def untyped_storage(self):
        return _Storage()


def _stage(params):
    return types.SimpleNamespace(parameters=lambda: iter(params), virtual_stages=1)


def test_the_pipeline_spans_wait_for_the_stage_device(syncs):
    from course_lib.parallel.pp.accounting import StepAccounting

    tl = Timeline(device="cpu")  # the caller did not say; the stage's parameters do
    acct = StepAccounting(_stage([_CudaParameter()]), timeline=tl)
    with acct.forward(0, "F0"):
        assert len(syncs) == 1
    with acct.comm("recv"):
        pass
    with acct.backward(0, "B0"):
        pass
    assert syncs == [CUDA] * 6  # two per span: F, the wait, B
    assert [(e[0], e[3]) for e in tl.events] == [("F0", "forward"), ("recv", "comm"), ("B0", "backward")]


def test_the_pipeline_spans_on_a_cpu_stage_never_wait(syncs, cuda_started):
    from course_lib.parallel.pp.accounting import StepAccounting

    tl = Timeline()
    acct = StepAccounting(_stage(list(nn.Linear(2, 2).parameters())), timeline=tl)
    with acct.forward(0, "F0"):
        pass
    with acct.backward(0, "B0"):
        pass
    assert syncs == [] and len(tl.events) == 2


# ---------------------------------------------------------------------------- DDP's buckets
class _Work:
    def __init__(self, done: bool):
        self.done, self.waited = done, 0

    def is_completed(self):
        return self.done

    def wait(self):
        self.waited += 1


def test_a_bucket_done_on_gpu_is_stamped_after_a_wait_and_a_poll_never_waits(syncs):
    from course_lib.parallel.dp.ddp import AllReduceHandle

    polled = AllReduceHandle(_Work(done=True), torch.ones(2), device=CUDA)
    polled.poll()  # the backend says it has finished on the device: no wait, backward goes on
    assert syncs == [] and polled.done_at is not None
    waited = AllReduceHandle(_Work(done=False), torch.ones(2), device=CUDA)
    waited.poll()
    assert waited.done_at is None and syncs == []
    waited.wait()
    assert syncs == [CUDA] and waited.done_at is not None and waited.work.waited == 1
    AllReduceHandle(_Work(done=False), torch.ones(2)).wait()  # the tensor's device: the CPU
    assert syncs == [CUDA]


def _ddp_step(device_override, monkeypatch):
    from course_lib.parallel.dp.ddp import DDP

    if device_override is not None:
        monkeypatch.setattr(DDP, "clock_device", property(lambda self: device_override))
    tl = Timeline(device="cpu")
    model = DDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), timeline=tl)
    model(torch.ones(2, 4)).sum().backward()
    return tl.events


def test_ddp_finish_ends_on_the_device_clock(syncs, one_rank, monkeypatch):
    events = _ddp_step(CUDA, monkeypatch)
    # the buckets' handles time their tensors' device (the CPU here); the finish's end waits
    # for the parameters' device once; the launches and the finish's start never wait
    assert syncs == [CUDA]
    assert [e[0] for e in events][-1] == "finish" and any(e[3] == "comm" for e in events)


def test_ddp_on_cpu_never_waits(syncs, one_rank, cuda_started, monkeypatch):
    events = _ddp_step(None, monkeypatch)
    assert syncs == [] and [e[0] for e in events][-1] == "finish"


# ---------------------------------------------------------------------------- the profiler
def test_the_profiler_records_cuda_activity_on_gpu_ranks():
    from course_lib.measure.profile import profiler_activities

    assert profiler_activities("cpu") == [ProfilerActivity.CPU]
    assert profiler_activities(CUDA) == [ProfilerActivity.CPU, ProfilerActivity.CUDA]


@pytest.mark.parametrize("device, expected", [(CUDA, [ProfilerActivity.CPU, ProfilerActivity.CUDA]),
                                              (torch.device("cpu"), [ProfilerActivity.CPU])])
def test_profile_on_ranks_rank_side_asks_for_the_ranks_device(device, expected, one_rank, monkeypatch, tmp_path):
    from course_lib.measure import profile as measure_profile

    made = []

    class Recorder:  # torch.profiler.profile, recording what it was asked for
        def __init__(self, activities, record_shapes):
            made.append(list(activities))

        def start(self):
            pass

        def stop(self):
            pass

        def export_chrome_trace(self, path):
            pathlib.Path(path).write_text("[]")

    monkeypatch.setattr(measure_profile, "rank_device", lambda: device)
    monkeypatch.setattr(measure_profile, "profile", Recorder)
    result, path = measure_profile._profiled(lambda x: x + 1, str(tmp_path), (41,), {})
    assert result == 42 and made == [expected] and path.endswith("rank0.json")


def test_a_gpu_trace_keeps_its_kernels_on_their_stream(tmp_path):
    from course_lib.observe.profile import trace_timeline

    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "ampere_sgemm_128x64_nn", "pid": 0, "tid": 7, "ts": 3, "dur": 40},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "pid": 0, "tid": 9,
         "ts": 10, "dur": 60},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 1, "dur": 2},
    ]}
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps(trace))
    events = trace_timeline(path)
    assert [(e[0], e[3]) for e in events] == [("aten::mm", "compute"), ("ampere_sgemm_128x64_nn", "compute"),
                                              ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication")]


# ---------------------------------------------------------------------------- the capstone's MFU
def _gpu(model: str):
    from course_lib.estimate.calculator import GPUS

    (gpu,) = [g for g in GPUS.values() if g.name.split()[0] == model]
    return gpu


@pytest.fixture
def h100_machine(monkeypatch):
    """The notebook's process sees an H100 (the ranks may still be CPU ranks)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")


def test_a_gpu_peak_is_refused_for_cpu_ranks(h100_machine):
    from course_lib.capstone.report import gpu_peak_flops

    assert gpu_peak_flops("bf16", "cpu") is None and gpu_peak_flops("fp32", torch.device("cpu")) is None
    assert gpu_peak_flops("bf16", CUDA) == _gpu("H100").peak_bf16
    assert gpu_peak_flops("fp32", "cuda") == _gpu("H100").peak_tf32


def test_the_gpu_is_matched_by_its_whole_model_name(monkeypatch):
    from course_lib.capstone.report import gpu_peak_flops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device_name, model in [("NVIDIA GB200", "GB200"), ("NVIDIA B200", "B200"), ("NVIDIA A100-SXM4-80GB", "A100")]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=device_name: n)
        assert gpu_peak_flops("bf16", CUDA) == _gpu(model).peak_bf16, device_name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX 9999")
    assert gpu_peak_flops("bf16", CUDA) is None  # not in the table: no peak to quote


def _stand_in_run():
    """What compare() reads of a CapstoneRun: the tiny config, rank 0's step seconds, each
    first-segment rank's memory (the numbers are arbitrary: only the MFU's denominator is checked)."""
    from course_lib.capstone import load_config

    config = load_config(pathlib.Path(__file__).resolve().parents[1] / "configs" / "capstone_tiny.toml")
    memory = {"total": 1, "activations": 1, "peak_rss": 1}
    ranks = [types.SimpleNamespace(memory=memory) for _ in range(config.layout.world_size)]
    return types.SimpleNamespace(config=config, first=types.SimpleNamespace(step_seconds=[0.5, 0.25, 0.25]),
                                 first_ranks=ranks)


def test_the_capstone_quotes_mfu_against_the_hardware_the_ranks_ran_on(h100_machine):
    from course_lib.capstone.report import compare
    from course_lib.measure.validation import load_validation

    cluster, run = load_validation()["cluster"], _stand_in_run()
    n = run.config.layout.world_size
    on_cpu = compare(run, cluster)  # run_capstone's ranks: gloo, on the CPU, though an H100 is here
    assert on_cpu["mfu_against"] == "calibrated CPU rate"
    # the same arithmetic as compare's, on the same floats: equal to the last bit
    assert on_cpu["mfu"] == on_cpu["flops"] / 0.25 / (n * cluster.achievable_flops)
    on_gpu = compare(run, cluster, device=CUDA)
    peak = _gpu("H100").peak_bf16 if run.config.precision == "bf16" else _gpu("H100").peak_tf32
    assert on_gpu["mfu_against"] == "gpu peak" and on_gpu["mfu"] == on_gpu["flops"] / 0.25 / (n * peak)
