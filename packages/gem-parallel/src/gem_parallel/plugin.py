"""gem-parallel's plugin module, named by its ``gem`` entry point. Registration only: every
``load`` imports its implementation when a run selects it."""

from __future__ import annotations

from gem_core import hookimpl
from gem_core.capabilities import MANAGED_IDS, TABLE_OPTIMIZER
from gem_core.registry import AutoContext, ImplementationSpec, lazy


def _ddp():
    from gem_parallel.ddp import DistributedDataParallelStrategy

    return DistributedDataParallelStrategy()


def _fsdp2():
    from gem_parallel.fsdp import FullyShardedStrategy

    return FullyShardedStrategy(hybrid=False)


def _hsdp():
    from gem_parallel.fsdp import FullyShardedStrategy

    return FullyShardedStrategy(hybrid=True)


def _deepspeed(stage: int):
    def load():
        from gem_parallel.deepspeed_zero import DeepSpeedZeroStrategy

        return DeepSpeedZeroStrategy(stage)

    return load


def _expert_parallel():
    from gem_parallel.expert_parallel import ExpertParallelStrategy

    return ExpertParallelStrategy()


def _deepspeed_moe():
    from gem_parallel.deepspeed_moe import DeepSpeedMoeStrategy

    return DeepSpeedMoeStrategy()


def _full_checkpointing():
    from gem_parallel.checkpointing import FullCheckpointing

    return FullCheckpointing()


def _selective_checkpointing():
    from gem_parallel.checkpointing import SelectiveCheckpointing

    return SelectiveCheckpointing()


def _budget_checkpointing():
    from gem_parallel.auto_ac import BudgetCheckpointing

    return BudgetCheckpointing()


def _lpt():
    from gem_parallel.balance import lpt_balancer

    return lpt_balancer


def _kk():
    from gem_parallel.balance import karmarkar_karp_balancer

    return karmarkar_karp_balancer


@hookimpl
def gem_register_dense_sharding(register) -> None:
    register(ImplementationSpec(
        name="ddp", load=_ddp,
        capabilities=(TABLE_OPTIMIZER,),
        description="torch DistributedDataParallel: replicated dense parameters, all-reduced grads",
    ))
    register(ImplementationSpec(
        name="fsdp2", load=_fsdp2, options=lazy("gem_parallel.fsdp", "FsdpOptions"),
        capabilities=(TABLE_OPTIMIZER,),
        description="FSDP2 fully_shard per sequence block + root over a 1-D mesh (ZeRO-3 like)",
    ))
    register(ImplementationSpec(
        name="hsdp", load=_hsdp, options=lazy("gem_parallel.fsdp", "HsdpOptions"),
        capabilities=(TABLE_OPTIMIZER,),
        description="FSDP2 hybrid: 2-D mesh (dp_replicate, dp_shard) from [parallel.dense]",
    ))
    for stage, what in ((1, "optimizer state"), (2, "optimizer state and gradients"),
                        (3, "optimizer state, gradients and parameters")):
        register(ImplementationSpec(
            name=f"deepspeed-zero{stage}", load=_deepspeed(stage), requires=("deepspeed",),
            dtypes=("float32", "bfloat16"),
            description=f"DeepSpeed ZeRO stage {stage}: {what} partitioned across ranks",
        ))
    register(ImplementationSpec(
        name="ep", load=_expert_parallel,
        options=lazy("gem_parallel.expert_parallel", "EpOptions"),
        capabilities=(TABLE_OPTIMIZER,),
        description="expert parallelism: MoE experts spread over an ep mesh dimension with "
                    "all-to-all dispatch; other parameters FSDP2-sharded",
    ))
    register(ImplementationSpec(
        name="deepspeed-moe", load=_deepspeed_moe, requires=("deepspeed",),
        options=lazy("gem_parallel.deepspeed_moe", "DeepSpeedMoeOptions"),
        dtypes=("float32", "bfloat16"),
        description="DeepSpeed's MoE layer and expert groups under ZeRO 0-2 (options: ep_size, "
                    "zero_stage)",
    ))


@hookimpl
def gem_register_activation_checkpointing(register) -> None:
    register(ImplementationSpec(
        name="full", load=_full_checkpointing,
        description="recompute every sequence-tower block in the backward (torch.utils.checkpoint)",
    ))
    register(ImplementationSpec(
        name="selective", load=_selective_checkpointing,
        options=lazy("gem_parallel.checkpointing", "SelectiveOptions"),
        description="recompute only attention and/or MLP of each block (options: modules)",
    ))
    register(ImplementationSpec(
        name="budget", load=_budget_checkpointing,
        options=lazy("gem_parallel.auto_ac", "BudgetOptions"),
        description="the compiler chooses what to recompute under an activation memory budget "
                    "(options: memory_budget; needs train.compile)",
    ))


def _torchrec():
    from gem_parallel.torchrec.sharding import TorchRecSharding

    return TorchRecSharding()


@hookimpl
def gem_register_embedding_sharding(register) -> None:
    register(ImplementationSpec(
        # Tables stay float32 under every recipe; lookups come out in the dense parameters' dtype.
        name="torchrec", load=_torchrec, requires=("torchrec", "fbgemm_gpu"),
        options=lazy("gem_parallel.torchrec.plan", "TorchRecOptions"),
        capabilities=(MANAGED_IDS,),
        description="TorchRec planner + sharded EmbeddingBagCollection/EmbeddingCollection, fused "
                    "sparse optimizer (options: plan, optimizer, lr); managed ids remapped "
                    "alike on every rank",
    ))


def _torchrec_managed():
    from gem_parallel.torchrec.managed import ManagedEmbeddingBackend

    return ManagedEmbeddingBackend()


@hookimpl
def gem_register_embedding_backends(register) -> None:
    register(ImplementationSpec(
        name="torchrec-managed", load=_torchrec_managed, requires=("torchrec", "fbgemm_gpu"),
        capabilities=(MANAGED_IDS,),
        description="reference tables + TorchRec MCHManagedCollisionModule per id_policy "
                    "'managed' table (zero-collision ids, LRU/LFU eviction)",
    ))


@hookimpl
def gem_register_batch_balancers(register) -> None:
    register(ImplementationSpec(
        name="lpt", load=_lpt,
        description="longest-processing-time greedy: evens out per-rank attention cost",
    ))
    register(ImplementationSpec(
        name="kk", load=_kk,
        description="Karmarkar-Karp largest differencing: evens out per-rank attention cost",
    ))




@hookimpl
def gem_register_cli_commands(register) -> None:
    register(ImplementationSpec(
        name="plan", load=lazy("gem_parallel.plan_cli", "plan_command"),
        description="memory per rank and communication per step of a layout, before renting GPUs",
    ))
    register(ImplementationSpec(
        name="bench.scaling", load=lazy("gem_parallel.bench_scaling", "scaling"),
        description="scaling ratio and E2E MFU of gem train on 1, 2 and 4 CPU ranks",
    ))
    register(ImplementationSpec(
        name="bench.pipeline", load=lazy("gem_parallel.bench_pipeline", "pipeline"),
        description="step time of TorchRec-sharded training with and without its train "
                    "pipelines",
    ))
    register(ImplementationSpec(
        name="bench.memory", load=lazy("gem_parallel.bench_memory", "memory"),
        description="Activation memory and recompute FLOPs with and without checkpointing.",
    ))
    register(ImplementationSpec(
        name="bench.balance", load=lazy("gem_parallel.bench_balance", "balance"),
        description="Per-rank max/mean cost of contiguous vs LPT vs Karmarkar-Karp balancing.",
    ))
    register(ImplementationSpec(
        name="bench.moe", load=lazy("gem_parallel.bench_moe", "moe"),
        description="MoE grouped vs reference path tokens/s (8 experts) and ep all-to-all bytes.",
    ))


@hookimpl
def gem_default_dense_sharding(context: AutoContext):
    if context.world_size > 1:
        return "ddp", f"{context.world_size} ranks: data parallel with replicated dense weights"
    return None


@hookimpl
def gem_default_balancer(context: AutoContext):
    if context.world_size > 1:
        return "lpt", "several ranks: balance attention cost so no rank straggles"
    return None
