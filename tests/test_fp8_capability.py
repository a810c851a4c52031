"""FP8Linear's hardware path (course_lib/techniques/fp8_hardware.py): torch._scaled_mm only on a
GPU of compute capability 8.9 or newer; an older GPU falls back to the emulation and warns once.

No GPU here: the capability queries are monkeypatched, and a tensor subclass that reports
`is_cuda` and a CUDA device (its values stay on the CPU) carries FP8Linear's forward into the
GPU branch, so the emulation it falls back to really runs."""

import warnings

import pytest
import torch

from course_lib.techniques import fp8_hardware
from course_lib.techniques.fp8 import FP8Linear
from course_lib.techniques.fp8_hardware import fp8_matmul_supported, scaled_mm_forward


class _OnGPU(torch.Tensor):
    """A CPU tensor that says it is on cuda:0 (torch ops keep the subclass on their results)."""

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", 0)


def _gpu(t):
    return torch.Tensor._make_subclass(_OnGPU, t, t.requires_grad)


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA machine whose capability the test sets: gpu(major, minor)."""
    monkeypatch.setattr(fp8_hardware, "_WARNED", set())  # each test starts with no device warned about
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)

    def set_capability(major, minor):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
    return set_capability


def test_the_cpu_and_other_devices_use_the_emulation():
    ok, reason = fp8_matmul_supported("cpu")
    assert not ok and "emulates" in reason
    assert fp8_matmul_supported("meta")[0] is False


@pytest.mark.parametrize("capability, ok", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                                            ((10, 0), True), ((12, 0), True)])
def test_fp8_matmuls_need_compute_capability_8_9(gpu, capability, ok):
    gpu(*capability)
    got, reason = fp8_matmul_supported("cuda:0")
    assert got is ok
    assert f"sm_{capability[0]}{capability[1]}" in reason


def test_without_cuda_a_cuda_device_is_not_supported(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fp8_matmul_supported("cuda") == (False, "CUDA is not available in this process")


def _layers():
    torch.manual_seed(0)
    ref = FP8Linear(32, 16, recipe="tensorwise")
    x = torch.randn(8, 32)
    return ref, x


def test_an_a100_falls_back_to_the_emulation_warns_once_and_gives_its_numbers(gpu, monkeypatch):
    gpu(8, 0)
    called = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: called.append(1), raising=False)
    layer, x = _layers()
    want = layer(x)  # the CPU: the emulation, no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = layer(_gpu(x)), layer(_gpu(x))
    assert called == []  # torch._scaled_mm never called on sm_80
    assert torch.equal(first.as_subclass(torch.Tensor), want) and torch.equal(second.as_subclass(torch.Tensor), want)
    fp8_warnings = [w for w in caught if issubclass(w.category, RuntimeWarning) and "FP8Linear" in str(w.message)]
    assert len(fp8_warnings) == 1  # once per device, not per call
    assert "cuda:0" in str(fp8_warnings[0].message) and "sm_80 < sm_89" in str(fp8_warnings[0].message)


def test_an_h100_calls_scaled_mm_without_a_warning(gpu, monkeypatch):
    gpu(9, 0)
    calls = []

    def fake_scaled_mm(a, b, scale_a, scale_b, out_dtype):
        calls.append((tuple(a.shape), tuple(b.shape), out_dtype))
        return torch.full((a.shape[0], b.shape[1]), 7.0)

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm, raising=False)
    layer, x = _layers()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        out = layer.forward(_gpu(x))
    assert calls == [((8, 32), (32, 16), torch.float32)]  # per-tensor scales: one fp32-output call
    assert torch.equal(out.as_subclass(torch.Tensor), torch.full((8, 16), 7.0) + layer.bias.detach())


def test_a_refused_call_falls_back_and_quotes_the_kernel(gpu, monkeypatch):
    gpu(9, 0)

    def refuses(*a, **k):
        raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0")

    monkeypatch.setattr(torch, "_scaled_mm", refuses, raising=False)
    layer, x = _layers()
    with pytest.warns(RuntimeWarning, match="refused the call .*compute capability >= 9.0"):
        out = layer(_gpu(x))
    assert torch.equal(out.as_subclass(torch.Tensor), layer(x))


def test_recipes_the_kernel_does_not_take_are_emulated_silently(gpu):
    gpu(8, 0)  # even on a GPU without FP8 matmuls: a property of the recipe, no warning
    q = torch.zeros(4, 32)
    recipe = type("R", (), {"activation": "block128", "weight": "block128"})()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert scaled_mm_forward(_gpu(q), None, _gpu(torch.zeros(16, 32)), None, recipe) is None
