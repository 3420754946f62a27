"""Expert parallelism (``ep``) on 2 and 4 CPU ranks over gloo: the MoE layer with its experts
spread over ranks and all-to-all dispatch gives the outputs and gradients of the same layer in
one process with every expert (float64, generous capacity so nothing is dropped).

Run as a test, this file launches itself under torchrun; ``python -m torch.distributed.run
--nproc-per-node N THIS_FILE EP_SIZE:IMPL ...`` runs the worker, which checks each layout in turn
in one process group (starting the ranks costs more than the checks) and exits non-zero on a
mismatch.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gem_core.testing.processes import run_process_group

HERE = Path(__file__).resolve()


def _check_layout(ep_size: int, impl: str) -> None:
    import torch.distributed as dist

    from gem_core.model.moe import MixtureOfExperts
    from gem_parallel.expert_parallel import (
        Traffic,
        expert_parameters,
        reduce_expert_grads,
        shard_experts,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    experts = 8
    reference = MixtureOfExperts("swiglu", 12, 20, 12, num_experts=experts, top_k=2,
                                 capacity_factor=8.0, shared_expert=True, aux_loss_weight=0.01,
                                 impl=impl).double()
    with torch.no_grad():  # one expert nobody routes to (inputs are positive)
        reference.router.weight[experts - 1] = -5.0
    rows = [5, 11, 0, 7][:world]  # uneven, one rank with no rows at all when there are 4
    x = torch.rand(sum(rows), 12, dtype=torch.float64) + 0.05
    grad_out = torch.randn(sum(rows), 12, dtype=torch.float64)
    layer = copy.deepcopy(reference)

    x_ref = x.clone().requires_grad_(True)
    out_ref = reference(x_ref)
    (out_ref * grad_out).sum().backward()

    # Mesh (edp, ep): rank = edp_index * ep_size + ep_index.
    groups_ep = [dist.new_group(list(range(i * ep_size, (i + 1) * ep_size)))
                 for i in range(world // ep_size)]
    groups_edp = [dist.new_group(list(range(j, world, ep_size))) for j in range(ep_size)]
    ep_group, edp_group = groups_ep[rank // ep_size], groups_edp[rank % ep_size]
    traffic = shard_experts(layer, group=ep_group, ep_rank=rank % ep_size, ep_size=ep_size,
                            traffic=Traffic())
    local = experts // ep_size
    lo = (rank % ep_size) * local
    assert layer.experts.gate.shape[0] == local

    start = sum(rows[:rank])
    mine = slice(start, start + rows[rank])
    x_ep = x[mine].clone().requires_grad_(True)
    out = layer(x_ep)
    (out * grad_out[mine]).sum().backward()
    assert int(layer.last_stats["dropped"]) == 0
    assert traffic.calls == 4  # dispatch + combine, forward + backward
    torch.testing.assert_close(out, out_ref[mine].detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x_ep.grad, x_ref.grad[mine], rtol=1e-12, atol=1e-12)
    # Experts: owners got every source's contribution; copies across edp add up to the total.
    reduce_expert_grads(layer, edp_group, divide_by=1)
    ref_params = dict(reference.named_parameters())
    for name, param in layer.named_parameters():
        if any(param is p for p in expert_parameters(layer)):
            want = ref_params[name].grad[lo:lo + local]
        else:  # router and shared expert: replicated, the sum over ranks is the total
            dist.all_reduce(param.grad)
            want = ref_params[name].grad
        torch.testing.assert_close(param.grad, want, rtol=1e-12, atol=1e-12, msg=name)
    assert ref_params["experts.gate"].grad[experts - 1].abs().sum() == 0


def _worker(layouts: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for layout in layouts:
        ep_size, impl = layout.split(":")
        _check_layout(int(ep_size), impl)
    dist.barrier()
    dist.destroy_process_group()


def _launch(ranks: int, layouts: list[str]) -> subprocess.CompletedProcess:
    # The timeout is for a hang: a loaded CI machine takes minutes to start 4 ranks.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_process_group(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), str(HERE), *layouts], timeout=600, env=env)


@pytest.mark.distributed
@pytest.mark.parametrize("ranks, layouts", [
    (2, ["2:grouped"]),
    # ep over all 4 ranks; then two copies of the experts (ep 2 x edp 2): gradients summed over
    # edp.
    (4, ["4:reference", "2:grouped"]),
])
def test_expert_parallel_layer_matches_one_process(ranks, layouts):
    result = _launch(ranks, layouts)
    assert result.returncode == 0, result.stderr[-4000:]


if __name__ == "__main__":
    _worker(sys.argv[1:])
