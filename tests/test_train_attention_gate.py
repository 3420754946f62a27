"""The attention gate trains through the ``norm`` backend kind; a named backend that cannot
run here fails with a clear error (no silent fallback)."""

import json

SMALL = ["--set", "train.steps=3", "--set", "train.batch_size=32", "--set", "train.eval_every=0",
         "--set", "data.eval_rows=128", "--set", "data.max_seq_len=32",
         "--set", "model.attention_gate=true"]


def test_gated_model_trains_with_the_reference_norm(gem, tmp_path):
    done = gem("train", "--out", str(tmp_path / "run"), "--no-progress", "--norm", "reference",
               *SMALL)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["backends"]["norm"]["name"] == "reference"
    assert summary["config"]["model"]["attention_gate"] is True


def test_triton_norm_on_cpu_is_refused_by_name(gem, tmp_path):
    done = gem("train", "--out", str(tmp_path / "run"), "--no-progress", "--norm", "triton",
               *SMALL, env={"TRITON_INTERPRET": "0"})
    assert done.returncode != 0
    assert "norm 'triton' does not run on cpu" in done.stderr
