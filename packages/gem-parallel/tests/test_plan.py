"""``gem plan``: the arithmetic of each layout, and the activation estimate against a measured
CPU batch of the same preset."""

import json

import pytest

from gem_core.config import load_config
from gem_core.plugins import build_plugins
from gem_parallel.bench_memory import saved_activation_bytes
from gem_parallel.plan import Layout, measure_activations, plan

TINY = ("train.batch_size=64",)


@pytest.fixture(scope="module")
def plugins():
    return build_plugins()


@pytest.fixture(scope="module")
def tiny():
    return load_config(preset="tiny", overrides=TINY)


def test_sharding_divides_what_each_strategy_shards(tiny, plugins):
    by_strategy = {s: plan(tiny, Layout(gpus=4, gpu_memory_gib=1, dense=s), plugins)
                   for s in ("ddp", "fsdp2", "deepspeed-zero1", "deepspeed-zero2")}
    mem = {s: r["memory_bytes_per_rank"] for s, r in by_strategy.items()}
    dense = by_strategy["ddp"]["parameters"]["dense"]
    assert mem["ddp"]["dense_params"] == dense * 4
    assert mem["fsdp2"]["dense_params"] == dense  # 4 bytes over 4 ranks
    assert mem["deepspeed-zero1"]["dense_optimizer"] == mem["fsdp2"]["dense_optimizer"]
    assert mem["deepspeed-zero1"]["dense_grads"] == dense * 4
    assert mem["deepspeed-zero2"]["dense_grads"] == dense
    ddp = by_strategy["ddp"]["communication_bytes_per_rank_per_step"]["dense"]
    fsdp = by_strategy["fsdp2"]["communication_bytes_per_rank_per_step"]["dense"]
    assert ddp == int(2 * 3 / 4 * dense * 4) and fsdp == int(3 * 3 / 4 * dense * 4)


def test_torchrec_spreads_tables_and_replicated_does_not(tiny, plugins):
    sharded = plan(tiny, Layout(gpus=4, gpu_memory_gib=1, embedding="torchrec"), plugins)
    replicated = plan(tiny, Layout(gpus=4, gpu_memory_gib=1, embedding="replicated"), plugins)
    emb = sharded["parameters"]["embedding"]
    assert sharded["memory_bytes_per_rank"]["embedding_params"] == emb
    assert replicated["memory_bytes_per_rank"]["embedding_params"] == emb * 4
    assert replicated["memory_bytes_per_rank"]["embedding_grads"] == emb * 4


def test_replicated_tables_are_planned_with_the_optimizer_that_trains_them(plugins):
    """AdamW keeps two moments per parameter; row-wise Adagrad one float per row, in the dense
    step (``dense_tables``) or fused into the backward (no gradients kept); SGD none. ``auto``
    and refusals follow the trainer's start-up rules for the layout."""
    from gem_core.errors import GemConfigError

    def memory(dense="fsdp2", gpus=4, **tables):
        backend = tables.pop("embedding", "auto")
        sets = [*TINY, f"backends.embedding={backend}",
                *(f"model.embedding_optimizer.{k}={v}" for k, v in tables.items())]
        result = plan(load_config(preset="tiny", overrides=sets),
                      Layout(gpus=gpus, gpu_memory_gib=1, dense=dense, embedding="replicated"),
                      plugins)
        rows = sum(t["num_embeddings"] for t in result["tables"].values())
        return result["memory_bytes_per_rank"], result["parameters"]["embedding"], rows, result

    adamw, emb, rows, _ = memory()
    assert adamw["embedding_optimizer"] == emb * 8 and adamw["embedding_grads"] == emb * 4
    row_wise, _, _, result = memory(dense_tables="same", lr=0.1)
    assert row_wise["embedding_optimizer"] == rows * 4 < emb * 8
    assert row_wise["embedding_grads"] == emb * 4 and row_wise["embedding_params"] == emb * 4
    name, table = next(iter(result["tables"].items()))
    assert table["bytes_per_rank"] == table["parameters"] * 8 + table["num_embeddings"] * 4
    assert memory(dense_tables="same", name="sgd")[0]["embedding_optimizer"] == 0
    # DeepSpeed flattens the tables into its partitions: auto keeps AdamW, same is refused.
    assert memory("deepspeed-zero1", dense_tables="auto")[0]["embedding_optimizer"] == emb * 8
    with pytest.raises(GemConfigError, match="does not declare table_optimizer"):
        memory("deepspeed-zero1", dense_tables="same")
    fused = memory("none", gpus=1, embedding="reference-fused")[0]
    assert fused["embedding_grads"] == 0 and fused["embedding_optimizer"] == rows * 4
    # In-backward updates on several ranks would let each replica drift: refused, as by
    # `gem train`, however the dense part is sharded.
    for dense in ("ddp", "fsdp2"):
        with pytest.raises(GemConfigError, match="on 4 ranks the replicas would drift"):
            memory(dense, gpus=4, embedding="reference-fused")


def test_ep_keeps_a_share_of_the_experts_and_counts_their_traffic(plugins):
    """``ep`` on 4 GPUs in groups of 2: the experts are split over a group (halves) and all-
    reduced over the 2 copies; with ``expert_fsdp`` every rank keeps a quarter and the copies
    all-gather and reduce-scatter; each MoE layer's rows are its tokens (sequence layers)."""
    from gem_parallel.plan import moe_all_to_all_bytes

    config = load_config(preset="tiny-moe", overrides=TINY)
    whole, shard = (plan(config, Layout(gpus=4, gpu_memory_gib=1, dense="ep", ep_size=2,
                                        expert_fsdp=fsdp), plugins) for fsdp in (False, True))
    experts = whole["experts"]["expert_parameters"]
    assert experts > 0 and whole["experts"]["copies"] == 2
    assert whole["memory_bytes_per_rank"]["expert_params"] == experts * 4 // 2
    assert shard["memory_bytes_per_rank"]["expert_params"] == experts * 4 // 4
    # Non-expert parameters are FSDP2-sharded over all 4 ranks.
    assert whole["memory_bytes_per_rank"]["dense_params"] == \
        (whole["parameters"]["dense"] - experts) * 4 // 4
    rows = whole["activation_fit"]["moe_rows"]
    assert set(rows) == {"tower.blocks.0.mlp", "tower.blocks.1.mlp"}
    assert all(fit == {"per_token": 1.0, "per_sample": 0.0} for fit in rows.values())
    tokens, dim = whole["per_rank"]["tokens"], config.model.embedding_dim
    assert whole["communication_bytes_per_rank_per_step"]["moe_all_to_all"] == int(
        2 * moe_all_to_all_bytes(tokens, top_k=2, in_dim=dim, out_dim=dim, ep_size=2))
    with pytest.raises(ValueError, match="needs a model with MoE layers"):
        plan(load_config(preset="tiny", overrides=TINY),
             Layout(gpus=2, gpu_memory_gib=1, dense="ep"), plugins)


def test_deepspeed_moe_gives_its_own_estimate(plugins):
    """``deepspeed-moe`` on 4 GPUs, ``ep_size`` 2, ZeRO-1: half the experts per rank, their
    moments partitioned over the 2 copies, the rest ZeRO-1 over all ranks; DeepSpeed's
    all-to-all sends every capacity slot (capacity factor 1.25 of the routed rows)."""
    from gem_parallel.plan import moe_all_to_all_bytes

    config = load_config(preset="tiny-moe", overrides=TINY)
    result = plan(config, Layout(gpus=4, gpu_memory_gib=1, dense="deepspeed-moe", ep_size=2),
                  plugins)
    experts = result["experts"]["expert_parameters"]
    dense = result["parameters"]["dense"] - experts
    memory = result["memory_bytes_per_rank"]
    assert memory["expert_params"] == experts * 4 // 2
    assert memory["expert_optimizer"] == experts // 2 * 8 // 2
    assert memory["dense_params"] == dense * 4 and memory["dense_optimizer"] == dense * 8 // 4
    tokens, dim = result["per_rank"]["tokens"], config.model.embedding_dim
    assert result["communication_bytes_per_rank_per_step"]["moe_all_to_all"] == int(
        2 * moe_all_to_all_bytes(tokens * 1.25, top_k=2, in_dim=dim, out_dim=dim, ep_size=2))
    assert result["complete"] and result["no_estimate"] == []


def test_activation_fit_predicts_a_measured_batch(tiny, plugins):
    """The fit from two short batches predicts the bytes autograd keeps for a longer, real
    batch of tiny within 25 %."""
    fit = measure_activations(tiny, plugins, "none")
    source = plugins.data_source(tiny.data, seed=0)
    batch = next(iter(source.eval_batches(batch_size=16)))
    from gem_core.embedding import ReferenceEmbeddingBackend
    from gem_core.model.gem import build_model
    from gem_parallel.plan import _measuring_schema

    schema = _measuring_schema(source.schema)
    model = build_model(tiny.model, schema,
                        attention=plugins.resolve("attention", "reference", None).impl,
                        embedding_backend=ReferenceEmbeddingBackend())
    measured = saved_activation_bytes(model, batch, schema.tasks)
    predicted = fit["per_token"] * batch.num_events + fit["per_sample"] * batch.batch_size
    assert abs(predicted - measured) / measured < 0.25, (predicted, measured)


def test_plan_follows_the_declared_tables(tiny, plugins):
    """One entry per table the data declares, sized ``num_embeddings x dim``, with the feature
    keys that index it (the item table is shared by the event and the candidate feature); the
    embedding totals are the tables' sums; lookups count ids per request."""

    schema = build_plugins().data_source(tiny.data, seed=0).schema
    result = plan(tiny, Layout(gpus=2, gpu_memory_gib=1), plugins)
    tables = result["tables"]
    dim = tiny.model.embedding_dim
    assert list(tables) == [t.name for t in schema.tables]
    for declared in schema.tables:
        entry = tables[declared.name]
        assert entry["num_embeddings"] == declared.num_embeddings and entry["dim"] == dim
        assert entry["bytes"] == declared.num_embeddings * dim * 4
        assert entry["id_policy"] == declared.id_policy
    assert tables["item"]["features"] == ["event.item", "candidate.item"]
    assert tables["context"]["pooling"] == "sum" and tables["item"]["pooling"] == "none"
    assert sum(t["parameters"] for t in tables.values()) == result["parameters"]["embedding"]
    per_rank = result["per_rank"]
    # item: every event and every candidate; a context feature: one pooled bag per request.
    assert tables["item"]["lookups_per_request"] == pytest.approx(
        per_rank["mean_history_length"] + per_rank["candidates"] / per_rank["samples"])
    assert tables["context"]["lookups_per_request"] == 1.0
    assert result["communication_bytes_per_rank_per_step"]["embedding"] == pytest.approx(
        sum(t["comm_bytes_per_rank_per_step"] for t in tables.values()), abs=len(tables))


def test_candidates_per_request_raise_the_lookup_traffic(plugins):
    one, four = (plan(load_config(preset="tiny", overrides=(
        *TINY, f"data.options.candidates_per_request={k}")), Layout(gpus=2, gpu_memory_gib=1),
        plugins) for k in (1, 4))
    assert four["per_rank"]["candidates"] == 4 * four["per_rank"]["samples"]
    assert (four["tables"]["advertiser"]["comm_bytes_per_rank_per_step"]
            == pytest.approx(4 * one["tables"]["advertiser"]["comm_bytes_per_rank_per_step"],
                             rel=1e-6))


def test_full_checkpointing_plans_less_activation_memory(tiny, plugins):
    none = plan(tiny, Layout(gpus=2, gpu_memory_gib=1), plugins)
    full = plan(tiny, Layout(gpus=2, gpu_memory_gib=1, activation_checkpointing="full"),
                plugins)
    assert (full["memory_bytes_per_rank"]["activations"]
            < 0.8 * none["memory_bytes_per_rank"]["activations"])


def test_cli_json_and_verdict():
    from click.testing import CliRunner

    from gem_parallel.plan_cli import plan_command

    runner = CliRunner()
    out = runner.invoke(plan_command, ["--preset", "tiny", "--gpus", "2", "--gpu-memory",
                                       "0.001", "--json"], catch_exceptions=False)
    result = json.loads(out.output)
    assert result["fits"] is False and result["layout"]["gpus"] == 2
    text = runner.invoke(plan_command, ["--preset", "tiny", "--gpus", "2", "--gpu-memory",
                                        "16"], catch_exceptions=False).output
    assert "fits in" in text and "does NOT" not in text
    assert "embedding tables:" in text and "event.item, candidate.item" in text


def test_token_norm_is_refused_on_several_ranks_as_gem_train_refuses_it(plugins):
    """``model.token_norm = "batch"`` keeps running statistics per rank: one GPU is planned,
    four are refused with the trainer's message."""
    from gem_core.errors import GemConfigError

    config = load_config(preset="tiny", overrides=(*TINY, "model.token_norm=batch"))
    assert plan(config, Layout(gpus=1, gpu_memory_gib=1), plugins)["parameters"]["dense"] > 0
    with pytest.raises(GemConfigError, match="differ between the 4 ranks"):
        plan(config, Layout(gpus=4, gpu_memory_gib=1, dense="fsdp2"), plugins)


def test_id_bias_offsets_are_planned_with_their_own_state(plugins):
    """``model.id_bias``'s offsets are dense parameters (held, reduced and sharded with them)
    whose step keeps one float each under ``fisher`` and none under ``constant``, not AdamW's
    two moments; a dense sharding that cannot step them is refused as ``gem train`` refuses it."""
    from gem_core.errors import GemConfigError

    def planned(dense, gpus, *sets):
        config = load_config(preset="tiny", overrides=(*TINY, *sets))
        return plan(config, Layout(gpus=gpus, gpu_memory_gib=1, dense=dense), plugins)

    offsets = ('model.id_bias=["item"]',)
    for dense, gpus in (("ddp", 4), ("fsdp2", 4), ("none", 1)):
        over = gpus if dense == "fsdp2" else 1
        without = planned(dense, gpus)
        for step, state in (("fisher", 4), ("constant", 0)):
            result = planned(dense, gpus, *offsets, f"model.id_bias_step={step}")
            count = result["parameters"]["id_bias"]
            # one per item id and task (the synthetic source: click and conversion)
            assert count == 2 * without["tables"]["item"]["num_embeddings"] > 0
            assert result["parameters"]["dense"] == without["parameters"]["dense"] + count
            mem, base = result["memory_bytes_per_rank"], without["memory_bytes_per_rank"]
            assert mem["dense_params"] - base["dense_params"] == count * 4 / over
            assert mem["dense_grads"] - base["dense_grads"] == count * 4 / over
            assert mem["dense_optimizer"] - base["dense_optimizer"] == count * state / over
    with pytest.raises(GemConfigError, match="does not declare"):
        planned("deepspeed-zero1", 2, *offsets)
