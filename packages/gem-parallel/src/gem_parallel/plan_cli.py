"""The ``gem plan`` command (see :mod:`gem_parallel.plan`)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from gem_core.cli.options import config_options
from gem_parallel.plan import GIB, Layout, plan

if TYPE_CHECKING:
    from gem_core.config import GemConfig


@click.command(name="plan")
@config_options(set_help="Override a key, e.g. --set model.num_layers=8 (repeatable).")
@click.option("--gpus", type=click.IntRange(min=1), required=True, help="Data-parallel ranks.")
@click.option("--gpu-memory", "gpu_memory", type=click.FloatRange(min=0, min_open=True),
              required=True, help="GiB per GPU.")
@click.option("--sharding", default="fsdp2", show_default=True,
              help="Dense sharding strategy (any registered one; see gem plugins).")
@click.option("--embedding-sharding", default="torchrec", show_default=True,
              help="Embedding sharding strategy (any registered one).")
@click.option("--hsdp-shard", type=click.IntRange(min=1), default=None,
              help="HSDP: ranks per shard group (the dense option dp_shard).")
@click.option("--ep-size", type=click.IntRange(min=1), default=None,
              help="Expert parallelism (the ep dense sharding, deepspeed-moe's too): ranks per "
                   "expert-parallel group (default: all).")
@click.option("--expert-fsdp", is_flag=True,
              help="ep: experts FSDP-sharded over their copies.")
@click.option("--sharding-group-size", type=click.IntRange(min=1), default=None,
              help="torchrec: the 2D sparse layout (parallel.embedding.layout=2d), tables "
                   "sharded over groups of this many ranks and replicated across the groups.")
@click.option("--activation-checkpointing", default="none", show_default=True,
              help="Activation-checkpointing policy (none, full, selective or another "
                   "registered one).")
@click.option("--bf16/--fp32", "bf16", default=False, show_default=True,
              help="Activations in bf16 (parameters and optimizer stay fp32).")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.pass_context
def plan_command(click_ctx: click.Context, preset: str | None, config_file: str | None,
                 overrides: tuple[str, ...], gpus: int, gpu_memory: float, sharding: str,
                 embedding_sharding: str, hsdp_shard: int | None, ep_size: int | None,
                 expert_fsdp: bool, sharding_group_size: int | None,
                 activation_checkpointing: str, bf16: bool, as_json: bool) -> None:
    """Memory per rank and communication per step of a layout, computed on this machine."""
    from gem_core.config import load_config
    from gem_core.plugins import build_plugins

    config = load_config(preset=preset, path=config_file, overrides=overrides)
    layout = _layout(config, gpus=gpus, gpu_memory=gpu_memory, sharding=sharding,
                     embedding_sharding=embedding_sharding, hsdp_shard=hsdp_shard,
                     ep_size=ep_size, expert_fsdp=expert_fsdp,
                     sharding_group_size=sharding_group_size,
                     activation_checkpointing=activation_checkpointing, bf16=bf16)
    result = plan(config, layout, build_plugins())
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    _print_plan(result, config.name, layout)


def _layout(config: GemConfig, *, gpus: int, gpu_memory: float, sharding: str,
            embedding_sharding: str, hsdp_shard: int | None, ep_size: int | None,
            expert_fsdp: bool, sharding_group_size: int | None, activation_checkpointing: str,
            bf16: bool) -> Layout:
    """The layout the options describe."""
    # The config's own strategy options apply when the layout uses its strategy.
    embedding_options = dict(config.parallel.embedding
                             if embedding_sharding == config.backends.embedding_sharding else {})
    if sharding_group_size is not None:
        embedding_options.update(layout="2d", sharding_group_size=sharding_group_size)
    return Layout(gpus=gpus, gpu_memory_gib=gpu_memory, dense=sharding,
                  embedding=embedding_sharding, hsdp_shard=hsdp_shard, ep_size=ep_size,
                  expert_fsdp=expert_fsdp,
                  dense_options=(config.parallel.dense
                                 if sharding == config.backends.dense_sharding else {}),
                  embedding_options=embedding_options,
                  activation_checkpointing=activation_checkpointing,
                  activation_bytes=2 if bf16 else 4)


def _print_plan(result: dict[str, Any], config_name: str, layout: Layout) -> None:
    """The plan as text: parameters, per-rank memory, tables, the verdict, communication."""
    p = result["parameters"]
    click.echo(f"{config_name}: {p['embedding'] / 1e6:,.1f} M embedding + "
               f"{p['dense'] / 1e6:,.1f} M dense parameters on {layout.gpus} x "
               f"{layout.gpu_memory_gib:g} GiB ({layout.dense}, embeddings {layout.embedding}, "
               f"checkpointing {layout.activation_checkpointing})")
    if p["id_bias"]:
        click.echo(f"  of the dense parameters, {p['id_bias']:,} are model.id_bias's offsets "
                   "(held and reduced with the dense parameters, stepped by their own rule)")
    per_rank = result["per_rank"]
    click.echo(f"per rank: {per_rank['samples']:,.0f} requests with {per_rank['candidates']:,.0f} "
               f"candidates, {per_rank['tokens']:,.0f} history tokens (mean length "
               f"{per_rank['mean_history_length']:.0f})")
    for name, value in result["memory_bytes_per_rank"].items():
        click.echo(f"  {name:<20} {_size(value):>12}")
    click.echo("embedding tables:")
    for name, table in result["tables"].items():
        click.echo(f"  {name:<20} {table['num_embeddings']:>14,} x {table['dim']:<5} "
                   f"{_size(table['bytes']):>12}  {table['id_policy']:<7} "
                   f"features {', '.join(table['features'])}; per rank "
                   f"{_size(table['bytes_per_rank']) if 'bytes_per_rank' in table else '?'}")
    for missing in result["no_estimate"]:
        click.echo(f"  {missing}")
    verdict = "fits" if result["fits"] else "does NOT fit"
    if not result["complete"]:
        verdict = f"{'the estimated part fits' if result['fits'] else 'does NOT fit'}"
    click.echo(f"{verdict} in {result['budget_bytes'] / GIB:.1f} GiB "
               f"({layout.headroom:.0%} of each GPU)")
    sparse = result.get("sparse_layout")
    if sparse is not None:
        click.echo(f"2D sparse layout: {sparse['sharding_groups']} sharding group(s) of "
                   f"{sparse['sharding_group_size']} ranks; each rank averages "
                   f"{_size(sparse['sync_bytes_per_rank'])} with its replicas every "
                   f"{sparse['sync_every']} step(s)")
    comm = result["communication_bytes_per_rank_per_step"]
    click.echo("sent per rank per step: " + ", ".join(
        f"{name.replace('_', ' ')} {_size(value)}" for name, value in comm.items()))


def _size(value: float) -> str:
    for unit, factor in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= factor:
            return f"{value / factor:.2f} {unit}"
    return f"{value:.0f} B"
