"""Every preset on every bundled data source: the model builds from the source's declared
schema and takes a training step on one of its batches, with every trainable parameter in the
trainer's loss, and survives the deep copy evaluation replicas and embedding sharders make; or
the run refuses at start-up with a message naming the setting to change."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from gem_core.config import load_config
from gem_core.config.loading import preset_names
from gem_core.model import build_model
from gem_core.plugins import build_plugins
from gem_core.registry import AutoContext
from gem_core.train.loss import task_loss_sums
from gem_data.testing import write_movielens_sample

SOURCES = ["synthetic", "synthetic-ads", "movielens-100k", "parquet"]


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory) -> dict[str, Path]:
    from click.testing import CliRunner

    from gem_data.cli import data_group

    root = tmp_path_factory.mktemp("sources")
    write_movielens_sample(root / "ml-100k", users=40)
    result = CliRunner().invoke(data_group, ["synth", "--rows", "256", "--eval-rows", "64",
                                             "--out", str(root / "ads")])
    assert result.exit_code == 0, result.output
    return {"movielens-100k": root / "ml-100k", "parquet": root / "ads", "root": root}


def _overrides(preset: str, source: str, dirs: dict[str, Path]) -> list[str]:
    overrides = [f"data.source={source}", "data.max_seq_len=32", "data.eval_rows=64"]
    if preset == "large":
        # What is checked is compatibility, not scale: fewer layers and a smaller generated
        # world (2M items x 512 floats would take minutes to initialise on two cores).
        overrides.append("model.num_layers=2")
        if source == "synthetic":
            overrides += ["data.options.num_items=2000", "data.options.num_users=1000"]
    if source != "synthetic":
        # The presets' [data.options] are the gem-core generator's; other sources have their own.
        overrides.append("data.options={}")
        if source == "synthetic-ads" and preset == "large":
            overrides.append("data.options={num_items = 2000, num_users = 1000}")
    if source == "movielens-100k":
        overrides += [f"data.path={dirs[source]}",
                      f"data.options={{cache_dir = \"{dirs['root'] / 'cache'}\"}}"]
    if source == "parquet":
        overrides.append(f"data.path={dirs[source]}")
    return overrides


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_trains_on_every_source(preset, source, data_dirs):
    config = load_config(preset=preset, overrides=_overrides(preset, source, data_dirs))
    plugins = build_plugins()
    context = AutoContext(device="cpu")
    data = plugins.data_source(config.data, seed=0)
    try:
        torch.manual_seed(0)
        model = build_model(
            config.model, data.schema,
            attention=plugins.resolve("attention", config.backends.attention, context).impl,
            embedding_backend=plugins.resolve("embedding", "auto", context).impl,
            norm=plugins.resolve("norm", "auto", context).impl)
    except ValueError as refusal:
        # Allowed only with a message that names the setting to change.
        assert "model." in str(refusal) and "set" in str(refusal), str(refusal)
        return
    batch = next(iter(data.eval_batches(batch_size=4)))
    batch.validate(data.schema)
    model.train()
    logits = model(batch)
    # The loss as the trainer builds it: the tasks', the model's per-impression losses (the
    # learned path's), its auxiliary losses (MoE load balancing).
    loss = (task_loss_sums(logits, batch, data.schema.tasks).sum()
            + sum(model.impression_loss_sums().values())) / batch.num_candidates
    loss = loss + sum(model.auxiliary_losses().values())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(v.shape == (batch.num_candidates,) for v in logits.values())
    # Every trainable parameter takes part in that loss: DDP refuses one that does not.
    idle = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not idle, f"{preset} on {source}: parameters outside the loss: {idle}"
    # Evaluation replicas and embedding sharders deep-copy a model after training forwards:
    # the copy must work and predict as the model does.
    replica = copy.deepcopy(model)
    model.eval()
    replica.eval()
    with torch.no_grad():
        expected, copied = model(batch), replica(batch)
    for task in expected:
        torch.testing.assert_close(copied[task], expected[task])
