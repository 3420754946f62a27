"""The two backward launch settings measured wrong on the H200 are refused by name on CUDA and
still run in the interpreter, where they agree with the default launch."""

import pytest
import torch

from gem_core.attention.api import AttentionParams
from gem_kernels.attention import triton_op
from gem_kernels.attention.launch_settings import (
    WRONG_ON_CUDA,
    BackwardLaunch,
    check_backward_launch,
)
from gem_kernels.attention.triton_backend import TritonAttention

FIRST, SECOND = WRONG_ON_CUDA


@pytest.mark.parametrize("launch", [FIRST, SECOND], ids=["32x64-64x32", "32x128-128x32"])
def test_known_wrong_settings_are_refused_by_name_on_cuda(launch):
    with pytest.raises(ValueError) as refused:
        check_backward_launch(launch, device_type="cuda", interpreted=False)
    message = str(refused.value)
    (km, kn), (qm, qn) = launch.dkdv_blocks, launch.dq_blocks
    assert f"dK/dV tiles {km} x {kn} with dQ tiles {qm} x {qn}" in message
    assert f"{launch.num_warps} warps, {launch.num_stages} stages" in message
    assert "docs/perf.md" in message and "refused on CUDA" in message
    # where they agree (the interpreter, CPU) or when measuring the fault on purpose: allowed
    check_backward_launch(launch, device_type="cuda", interpreted=True)
    check_backward_launch(launch, device_type="cpu", interpreted=False)
    check_backward_launch(launch, device_type="cuda", interpreted=False, allow_known_wrong=True)


def test_other_settings_run_on_cuda():
    for launch in (BackwardLaunch(dkdv_blocks=(64, 64), dq_blocks=(64, 64)),
                   BackwardLaunch(dkdv_blocks=(32, 64), dq_blocks=(64, 32), num_warps=4),
                   BackwardLaunch(dkdv_blocks=(32, 128), dq_blocks=(128, 32), num_warps=4,
                                  num_stages=3)):
        check_backward_launch(launch, device_type="cuda", interpreted=False)
    with pytest.raises(ValueError, match="powers of two >= 16"):
        BackwardLaunch(dkdv_blocks=(24, 64), dq_blocks=(64, 32))


def test_refused_setting_agrees_with_the_default_in_the_interpreter(monkeypatch):
    launched = []
    kernels = triton_op._backward_kernels

    def spy(*args, **kwargs):
        launched.append({k: kwargs.get(k) for k in ("dkdv_blocks", "dq_blocks", "num_warps",
                                                    "num_stages")})
        return kernels(*args, **kwargs)

    monkeypatch.setattr(triton_op, "_backward_kernels", spy)
    gen = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 40, 40, 57])  # several 32-row tiles per sample, an empty one
    q, k, v = (torch.randn(57, 1, 16, generator=gen, requires_grad=True) for _ in range(3))
    upstream = torch.randn(57, 1, 16, generator=gen)
    params = AttentionParams(causal=True)
    grads = []
    for backend in (TritonAttention(), TritonAttention(backward=FIRST)):
        out = backend(q, k, v, offsets, offsets, params=params)
        grads.append(torch.autograd.grad((out * upstream).sum(), (q, k, v)))
    assert launched[1] == {"dkdv_blocks": (32, 64), "dq_blocks": (64, 32), "num_warps": 4,
                           "num_stages": 3} != launched[0]
    for got, want in zip(grads[1], grads[0]):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
