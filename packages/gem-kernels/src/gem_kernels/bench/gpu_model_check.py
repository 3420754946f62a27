"""The parts of the GPU check that run whole layers and models rather than one attention call.

1. ``check_moe``: the mixture-of-experts layer's ``grouped`` path (``torch._grouped_mm``, a real
   grouped GEMM on Hopper) against the one-expert-at-a-time ``reference`` path, bf16 autocast,
   forward + backward, same weights and tokens: tokens per second and the output difference.
2. ``check_model``: one training step (forward, multi-task loss, backward) of a GEM model built
   from a preset on the device, per attention backend, under bf16 autocast, against the same
   model and batch with the ``reference`` backend in float32: loss and gradient-norm agreement,
   milliseconds per step and samples per second.

Only gem-core and gem-kernels are needed (no gem-data, fbgemm or torchrec).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from gem_core.attention.reference import ReferenceAttention
from gem_core.config import load_config
from gem_core.embedding import ReferenceEmbeddingBackend
from gem_core.model import build_model
from gem_core.model.moe import MixtureOfExperts
from gem_core.plugins import build_plugins
from gem_core.train.applied import config_as_source_applies
from gem_core.train.loss import task_loss_sums
from gem_kernels.attention.blocked_backend import BlockedAttention
from gem_kernels.attention.triton_backend import TritonAttention

MOE_SIZES = {
    "full": {"dim": 1024, "hidden": 2048, "experts": 8, "tokens": (4096, 32768), "repeats": 10},
    "tiny": {"dim": 16, "hidden": 32, "experts": 4, "tokens": (64,), "repeats": 1},
}
MODEL_SIZES = {
    # preset, rows per step, overrides that fit the preset to the check's time budget
    "full": {"preset": "small", "rows": 256, "repeats": 5, "overrides": ()},
    "tiny": {"preset": "tiny", "rows": 4, "repeats": 1,
             "overrides": ("data.max_seq_len=24", "model.embedding_dim=16",
                           "data.options.num_items=500", "data.options.num_users=100")},
}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_seconds(step: Callable[[], Any], device: str, repeats: int) -> float:
    step()  # warm-up: kernel compilation and autotuning stay out of the timing
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_moe(device: str, size: str) -> list[dict[str, Any]]:
    spec = MOE_SIZES[size]
    rows = []
    for tokens in spec["tokens"]:
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, spec["dim"], generator=gen).to(device).requires_grad_(True)
        layers, outputs, seconds = {}, {}, {}
        for impl in ("reference", "grouped"):
            torch.manual_seed(0)  # the same weights for both paths
            layer = MixtureOfExperts("swiglu", spec["dim"], spec["hidden"], spec["dim"],
                                     num_experts=spec["experts"], top_k=2, capacity_factor=1.25,
                                     shared_expert=False, aux_loss_weight=0.01,
                                     impl=impl).to(device)

            def step(layer: MixtureOfExperts = layer, impl: str = impl, x: torch.Tensor = x,
                     outputs: dict[str, torch.Tensor] = outputs) -> None:
                layer.zero_grad(set_to_none=True)
                with torch.autocast(device, dtype=torch.bfloat16):
                    out = layer(x)
                outputs[impl] = out.detach().float()
                (out.float().square().mean() + layer.last_aux_loss).backward()

            layers[impl] = layer
            seconds[impl] = _median_seconds(step, device, spec["repeats"])
        difference = (outputs["grouped"] - outputs["reference"]).abs().max()
        scale = outputs["reference"].abs().max().clamp_min(1e-6)
        rows.append({
            "tokens": tokens, "dim": spec["dim"], "hidden": spec["hidden"],
            "experts": spec["experts"], "top_k": 2,
            "reference_ms": seconds["reference"] * 1e3, "grouped_ms": seconds["grouped"] * 1e3,
            "grouped_speedup": seconds["reference"] / seconds["grouped"],
            "grouped_tokens_per_s": tokens / seconds["grouped"],
            "grouped_backend": layers["grouped"].experts.last_grouped_backend,
            "relative_output_difference": float(difference / scale),
        })
    return rows


def _model_step(model: torch.nn.Module, batch, tasks, device: str, autocast: bool
                ) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        logits = model(batch)
    # Mean over impressions (candidates), as the trainer's loss: a request holds K of them.
    loss = task_loss_sums(logits, batch, tasks).sum() / max(batch.num_candidates, 1)
    loss.backward()
    grads = [p.grad.float().norm() for p in model.parameters() if p.grad is not None]
    return float(loss), float(torch.stack(grads).norm())


def check_model(device: str, size: str) -> list[dict[str, Any]]:
    spec = MODEL_SIZES[size]
    config = load_config(preset=spec["preset"], overrides=spec["overrides"])
    source = build_plugins().data_source(config.data, seed=0)
    config = config_as_source_applies(config, source)  # the model a run on this data builds
    batch = source.generate(spec["rows"], split=0, index=0).to(device)
    tasks = list(batch.labels)

    def build(attention) -> torch.nn.Module:
        torch.manual_seed(0)  # the same weights for every backend
        return build_model(config.model, source.schema, attention=attention,
                           embedding_backend=ReferenceEmbeddingBackend()).to(device)

    oracle_loss, oracle_grad = _model_step(build(ReferenceAttention()), batch, tasks, device,
                                           autocast=False)
    rows = [{"backend": "reference (float32)", "loss": oracle_loss, "grad_norm": oracle_grad}]
    for name, attention in (("triton", TritonAttention()), ("blocked", BlockedAttention()),
                            ("reference", ReferenceAttention())):
        model = build(attention)
        loss, grad = _model_step(model, batch, tasks, device, autocast=True)
        seconds = _median_seconds(
            lambda model=model: _model_step(model, batch, tasks, device, True),
            device, spec["repeats"])
        rows.append({
            "backend": f"{name} (bf16 autocast)", "loss": loss, "grad_norm": grad,
            "loss_relative_error": abs(loss - oracle_loss) / abs(oracle_loss),
            "grad_norm_relative_error": abs(grad - oracle_grad) / abs(oracle_grad),
            "step_ms": seconds * 1e3, "samples_per_s": spec["rows"] / seconds,
        })
    return [{"preset": spec["preset"], "rows": spec["rows"],
             "history_tokens": int(batch.seq_offsets[-1]), **row} for row in rows]


def model_lines(report: dict[str, Any]) -> list[str]:
    """The MoE and model rows of the printed table."""
    lines = []
    for r in report.get("moe", []):
        lines.append(
            f"moe {r['tokens']} tokens d={r['dim']} h={r['hidden']} E={r['experts']} top2: "
            f"reference {r['reference_ms']:.2f} ms, grouped ({r['grouped_backend']}) "
            f"{r['grouped_ms']:.2f} ms, {r['grouped_speedup']:.2f}x, rel diff "
            f"{r['relative_output_difference']:.1e}")
    for r in report.get("model", []):
        timing = (f"{r['step_ms']:.1f} ms/step {r['samples_per_s']:.0f} samples/s, loss rel err "
                  f"{r['loss_relative_error']:.1e}, grad-norm rel err "
                  f"{r['grad_norm_relative_error']:.1e}" if "step_ms" in r
                  else f"loss {r['loss']:.5f} grad norm {r['grad_norm']:.4f}")
        lines.append(f"model {r['preset']} {r['rows']} rows {r['history_tokens']} tokens "
                     f"{r['backend']}: {timing}")
    return lines
