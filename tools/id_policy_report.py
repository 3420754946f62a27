"""How the ids of a finished run's table shared rows: ``python tools/id_policy_report.py RUN_DIR
[--table ad]`` prints one JSON object.

The run's training batches are generated again (a generated source: ``synthetic-ads``, one
process, so the batches are the run's) and the table's raw ids (every feature of the table, in
the order the model looks them up) are passed through its id policy:

- ``hash``/``modulo``: the distinct ids of training that share a row with another (the rows are
  fixed), and the eval lookups whose row some other id (of training or eval) also maps to;
- ``managed``: a fresh TorchRec remapper with the table's settings replays the run's lookups, one
  call per step as training made them; reported are the lookups that got the shared row (ids
  that held none) in training, the distinct ids that ever did, the insertions past the table's
  capacity (evictions), and, in evaluation against the final checkpoint's remapper, the lookups
  of ids not live. The replay must end in the checkpoint's remapper state (it is checked), which
  shows that the figures are the run's own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch


def _table_ids(batch, schema, table: str) -> torch.Tensor:
    parts = []
    for kind, features in (("event", schema.event_features),
                           ("candidate", schema.candidate_features)):
        store = batch.event_ids if kind == "event" else batch.candidate_ids
        for feature in features:
            if feature.table == table:
                ids = store[feature.name]
                parts.append(ids.values if feature.multi_valued else ids)
    return torch.cat(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--table", default="ad")
    args = parser.parse_args()

    from gem_core.ids import collision_report, map_ids
    from gem_core.trained_run import load_run

    run = load_run(args.run_dir)
    schema, config = run.schema, run.config
    table = schema.table(args.table)
    generator = run.source.generator
    steps = run.step
    train = [_table_ids(generator.chunk(config.train.batch_size, split="train", index=i),
                        schema, table.name) for i in range(steps)]
    evaluation = torch.cat([_table_ids(batch, schema, table.name) for batch in
                            run.source.eval_batches(batch_size=config.train.eval_batch_size)])
    seen = np.unique(torch.cat(train).numpy())
    out: dict = {"run": str(args.run_dir), "table": table.name, "policy": table.id_policy,
                 "rows": table.num_embeddings, "steps": steps,
                 "train_lookups": int(sum(t.numel() for t in train)),
                 "train_distinct_ids": int(seen.size), "eval_lookups": int(evaluation.numel()),
                 "eval_distinct_ids": int(np.unique(evaluation.numpy()).size)}
    if table.id_policy != "managed":
        report = collision_report(seen, table)
        out["train_ids_sharing_a_row"] = report["colliding_ids"]
        out["train_ids_sharing_a_row_rate"] = report["collision_rate"]
        seen_rows = map_ids(torch.from_numpy(seen), table)
        seen_counts = torch.bincount(seen_rows, minlength=table.num_embeddings)
        out["train_lookups_on_a_shared_row_rate"] = float(
            (seen_counts[map_ids(torch.cat(train), table)] > 1).double().mean())
        everyone = torch.from_numpy(np.union1d(seen, evaluation.numpy()))
        rows = map_ids(everyone, table)
        counts = torch.bincount(rows, minlength=table.num_embeddings)
        eval_rows = map_ids(evaluation, table)
        out["eval_lookups_on_a_shared_row_rate"] = float((counts[eval_rows] > 1).double().mean())
    else:
        from gem_parallel.torchrec.managed import IdRemapper

        replay = IdRemapper(table).train()
        shared = replay.shared_row()
        on_shared, ever_shared, insertions, live_before = 0, set(), 0, set()
        for ids in train:
            rows = replay(ids)
            miss = rows == shared
            on_shared += int(miss.sum())
            ever_shared.update(ids[miss].tolist())
            live_now = set(replay.live_ids().tolist())
            insertions += len(live_now - live_before)
            live_before = live_now
        final = run.model.embeddings.remappers[table.name].mch.state_dict()
        same = all(torch.equal(final[k], v) for k, v in replay.mch.state_dict().items())
        if not same:
            sys.exit("the replayed remapper does not end in the checkpoint's state: the batches "
                     "replayed are not the run's")
        live = run.model.embeddings.remappers[table.name]
        eval_rows = live(evaluation)  # eval mode (load_run): inserts nothing
        out.update({
            "train_lookups_on_shared_row_rate": on_shared / out["train_lookups"],
            "train_distinct_ids_ever_on_shared_row": len(ever_shared),
            "insertions": insertions,
            "evictions": insertions - len(live_before),
            "live_ids_at_end": int(live.live_ids().numel()),
            "eval_lookups_on_the_shared_row_rate": float((eval_rows == shared).double().mean()),
            "replay_matches_checkpoint": same})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
