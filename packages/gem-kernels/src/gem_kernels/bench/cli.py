"""``gem bench attention``: the click command registered as ``bench.attention`` by the plugin."""

from __future__ import annotations

import json
import platform
from typing import Any

import click
import torch

from gem_core.errors import GemPluginError
from gem_core.plugins import build_plugins
from gem_kernels.bench.attention import BenchConfig, run_attention_bench

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _available_backends(device: str, names: tuple[str, ...]) -> tuple[dict[str, Any], dict]:
    """Load the named (or every registered) attention backend that runs on ``device``.

    A backend named with ``--backend`` that cannot run here is an error; one merely registered
    is listed under ``skipped_backends`` with the reason.
    """
    registry = build_plugins().registry("attention")
    loaded: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name in dict.fromkeys(names or registry.names()):
        spec = registry.get(name)  # unknown names raise, listing what is installed
        missing = spec.missing_requirements()
        reason = None
        if device not in spec.devices:
            reason = f"does not run on {device} (runs on {', '.join(spec.devices)})"
        elif missing:
            reason = f"needs {', '.join(missing)}, which is not installed"
        if reason is None:
            loaded[name] = registry.load(name)
        elif names:
            raise GemPluginError(f"attention backend {name!r} {reason}")
        else:
            skipped[name] = reason
    return loaded, skipped


@click.command("attention")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True)
@click.option("--dtype", type=click.Choice(["auto", *DTYPES]), default="auto", show_default=True,
              help="auto: bfloat16 on cuda, float32 on cpu")
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option("--max-len", type=int, default=None,
              help="length cap; default 4096 on cuda, 512 on cpu")
@click.option("--distribution", type=click.Choice(["zipf", "lognormal"]), default="zipf",
              show_default=True)
@click.option("--zipf-a", type=float, default=1.2, show_default=True)
@click.option("--heads", type=int, default=2, show_default=True)
@click.option("--head-dim", type=int, default=64, show_default=True)
@click.option("--window", type=int, default=None, help="local window of self-attention")
@click.option("--short-len", type=int, default=8, show_default=True,
              help="K/V per sample for cross-attention, queries per sample for PMA")
@click.option("--shape", "shapes", multiple=True, type=click.Choice(["self", "cross", "pma"]),
              help="shapes to run (repeatable); default all three")
@click.option("--backend", "backends", multiple=True,
              help="attention backends to time (repeatable); default every one that runs here")
@click.option("--repeats", type=int, default=5, show_default=True)
@click.option("--warmup", type=int, default=1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_attention(device, dtype, batch_size, max_len, distribution, zipf_a, heads, head_dim,
                    window, short_len, shapes, backends, repeats, warmup, seed, as_json):
    """Time jagged attention backends (forward+backward) next to padded SDPA at heavy-tailed
    lengths, with counted jagged and padded FLOPs."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    if max_len is None:
        max_len = 4096 if device == "cuda" else 512
    cfg = BenchConfig(
        device=device, dtype=DTYPES[dtype], batch_size=batch_size, max_len=max_len, heads=heads,
        head_dim=head_dim, window=window, short_len=short_len, distribution=distribution,
        zipf_a=zipf_a, repeats=repeats, warmup=warmup, seed=seed,
        shapes=tuple(shapes) or ("self", "cross", "pma"),
    )
    loaded, skipped = _available_backends(device, tuple(backends))
    shapes_result = run_attention_bench(cfg, loaded)
    result = {
        "benchmark": "attention",
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor()
        or "cpu",
        "device_type": device,
        "torch": torch.__version__,
        "dtype": dtype,
        "length_distribution": (f"zipf(a={zipf_a})" if distribution == "zipf"
                                else "lognormal(median=max_len/8, sigma=1)"),
        "max_len": max_len,
        "batch_size": batch_size,
        "heads": heads,
        "head_dim": head_dim,
        "repeats": repeats,
        "timed": "median seconds of forward + backward (grads of q, k, v)",
        "backends": sorted(loaded),
        "skipped_backends": skipped,
        "shapes": shapes_result,
    }
    if as_json:
        click.echo(json.dumps(result, indent=None, sort_keys=False))
        return
    for shape, r in shapes_result.items():
        click.echo(f"{shape}: padded/jagged FLOPs {r['padded_over_jagged_flops']:.2f}x")
        for name, seconds in r["fwd_bwd_median_s"].items():
            speedup = r["speedup_over_fastest_padded_sdpa"].get(name)
            masked = r["speedup_over_masked_padded_sdpa"].get(name)
            extra = (f"  {speedup:.2f}x vs fastest padded SDPA, {masked:.2f}x vs masked"
                     if speedup is not None else "")
            click.echo(f"  {name:24s} {seconds * 1e3:9.2f} ms{extra}")
        if r["best_backend"] is not None:
            click.echo(f"  best over masked / FLOP ratio: "
                       f"{r['best_speedup_over_masked_over_flop_ratio']:.2f} (CPU goal 0.8); "
                       f"best over fastest / FLOP ratio: {r['best_speedup_over_flop_ratio']:.2f}")


if __name__ == "__main__":  # ``python -m gem_kernels.bench.cli`` where the gem CLI is not set up
    bench_attention()
