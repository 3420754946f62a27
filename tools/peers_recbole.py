"""Trains one RecBole peer model on an export of ``gem_data.peer_export`` and writes its eval
predictions. Runs in the peers venv (``tools/peers-requirements.txt``), started by
``tools/peers.py``; it imports RecBole, torch and numpy only, nothing of this repository.

    python tools/peers_recbole.py --data EXPORT_DIR --model DIN --task click --epochs 1 \
        --out OUT_DIR

``EXPORT_DIR`` is named after the export (``manifest.json``'s ``name``: RecBole reads
``<data_path>/<dataset>/<dataset>.<part>.inter``). The model keeps RecBole's published defaults
(its ``properties/model/<MODEL>.yaml``: sizes, dropout; ``overall.yaml``: Adam at
``learning_rate`` 0.001, ``train_batch_size`` 2048, shuffled training data), trains
``--epochs`` passes over the training impressions (benchmark mode: the export's files are the
split, nothing is filtered or re-ordered), and scores the eval impressions in file order. It
writes ``OUT_DIR/predictions.npy`` (float64 probabilities, one per eval impression, in the
export's order, checked against the export's labels and users) and ``OUT_DIR/run.json``.

Nothing here names a data source's columns: the user, item and history fields
(``user_field``, ``item_field``, ``item_list_field``), the tasks, the ``.inter`` and ``.item``
columns all come from the export's manifest; ``--task`` defaults to its first task. The item
is the source's item feature (``item_feature``: ``ad_id`` on ``synthetic-ads``, ``movie`` on
``movielens-100k``).

What each model reads:

- DeepFM, DCNV2 (RecBole's context-aware models): every ``.inter`` column but the other tasks'
  labels and the history columns: the user and item ids, the candidate's other attributes
  (multi-valued ones as a token_seq, mean-pooled), the request's context features (token_seq)
  and the dense floats (as ``numerical_features``: value times a learned vector). On
  ``synthetic-ads``: advertiser, category, topics; user_segment, context; 4 dense. On
  MovieLens: genres (token_seq), decade; age_bucket, gender, occupation; the 2 dense history
  statistics. On a Taobao-shaped log the candidate's price (``candidate_numeric_0``),
  through RecBole's logarithm discretization (``discretization`` ``LD``: one learned vector
  per bucket ``floor(ln(x)^2 + 1)``; values up to 2 keep a bucket each), as its authors offer
  it for heavy-tailed numbers (the raw value times a vector swamps the model: prices run to
  thousands). With ``--history-bags`` also the history columns (``item_id_list``, where the
  history has item ids, and each ``<event feature>_list``: on MovieLens ``rating_list``,
  ``genres_list``, ``decade_list``; on a Taobao-shaped log ``cate_list``, ``brand_list``,
  ``btag_list`` alone), each a bag of ids: mean-pooled in the embeddings, but *summed* in
  RecBole's first-order term (``FMFirstOrderLinear``), where a bag of 64 events over a
  3-token vocabulary (actions; on MovieLens the 5 ratings) with xavier-initialised weights
  starts at logits of +-60, which one pass at RecBole's learning rate does not undo; so by
  default they are left out.
- DIN, DIEN (RecBole's sequential CTR models): the user id, the candidate's item id and the
  history ``item_id_list``; an item's attributes (the ``.item`` columns: advertiser,
  category, topics on ``synthetic-ads``; genres, decade on MovieLens) come from
  ``<name>.item`` for the candidate and every history event alike. RecBole's DIN feeds the
  DNN only the attention-pooled history and the candidate (its ``user_feat_list`` is unused);
  DIEN adds the user's features (here: the user id). Neither reads the request's context
  features (on MovieLens: age_bucket, gender, occupation), the dense floats, or the
  per-event attributes that are not the item's (``action_list``; on MovieLens
  ``rating_list``, the user's rating of each history movie): RecBole's DIN and DIEN take the
  history as item ids only, every other history feature looked up per item in the ``.item``
  file, and a rating belongs to the event, not to the movie. So they need an export whose
  history has item ids (``history_item_ids`` in its manifest): on one without (a
  Taobao-shaped log, whose events carry a category, a brand and an action but no ad id) they
  are refused before RecBole starts (:func:`model_refusal`), naming the event features the
  history has.
- ``--history-keep FEATURE=ID,...`` (DIN, DIEN): the history keeps only the events whose
  ``FEATURE`` (an event feature with a ``<FEATURE>_list`` column: ``action`` on
  ``synthetic-ads``, ``rating`` on MovieLens) has one of these raw ids, in their order: DIN's
  paper feeds it the user's behaviours (clicked goods), not every impression, and a per-event
  action is otherwise out of these models' reach. The filter runs on the loaded data before
  training; ``run.json`` counts the events kept.
- DIEN: RecBole builds its negative history (``neg_item_id_list``, for the auxiliary loss) only
  in its own sequence augmentation, which benchmark mode skips; it is sampled here the same way
  (uniform over the items, not the positive one) for the padded positions of
  ``item_id_list``. RecBole's GRU cannot pack an empty history, so a request without history
  gets length 1 over the padding item (DIN takes length 0 as it is).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import warnings
from pathlib import Path

SEQUENTIAL = ("DIN", "DIEN")
CONTEXT = ("DeepFM", "DCNV2")


def model_refusal(manifest: dict, model: str) -> str | None:
    """Why ``model`` cannot run on the export of ``manifest``, or None where it can: DIN and
    DIEN read the history as item ids (``item_id_list``), which an export whose history has
    no item ids (``history_item_ids`` false) does not have. A manifest without the field is
    of an export that had them (see ``gem_data.peer_export.FORMAT``)."""
    if model not in SEQUENTIAL or manifest.get("history_item_ids", True):
        return None
    events = manifest.get("event_features", [])
    return (f"{model} reads the history as item ids (RecBole's item_id_list), and this data's "
            f"history has none: its item feature {manifest['item_feature']!r} (the first "
            f"candidate feature) is not an event feature; the history's event features are "
            f"{', '.join(events) or 'none'}. Models that read the candidate and the request "
            f"only ({', '.join(CONTEXT)}) can run on it")


def _config_dict(manifest: dict, export: Path, model: str, task: str, epochs: int,
                 seed: int, out: Path, history_bags: bool = False,
                 train_batch_size: int | None = None, keep_field: str | None = None) -> dict:
    user, item = manifest["user_field"], manifest["item_field"]
    item_list = manifest["item_list_field"]
    columns = [c.split(":")[0] for c in manifest["columns"]]
    # absent from the manifests of exports that wrote no candidate numeric columns
    candidate_numeric = list(manifest.get("candidate_numeric_columns", []))
    other_tasks = set(manifest["tasks"]) - {task}
    if not history_bags:
        other_tasks |= {c for c in columns if c.endswith("_list")}
    if model in SEQUENTIAL:
        inter = [user, item, item_list, task] + ([keep_field] if keep_field else [])
        load_col = {"inter": inter,
                    "item": [c.split(":")[0] for c in manifest["item_columns"]]}
        numerical = []
    else:
        load_col = {"inter": [c for c in columns if c not in other_tasks]}
        numerical = [c for c in columns if c.startswith("dense_")] + candidate_numeric
    return {
        "data_path": str(export.parent),
        "checkpoint_dir": str(out / "saved"),
        "benchmark_filename": ["train", "valid", "test"],
        "USER_ID_FIELD": user,
        "ITEM_ID_FIELD": item,
        "RATING_FIELD": None,
        "TIME_FIELD": None,
        "LABEL_FIELD": task,
        "threshold": None,
        "load_col": load_col,
        "numerical_features": numerical,
        # RecBole's logarithm discretization (floor(ln(x)^2 + 1) above 2, the Criteo winners'
        # transform): a raw price of thousands, as value times a vector, swamps the model
        "discretization": ({c: {"method": "LD"} for c in candidate_numeric}
                           if numerical and candidate_numeric else None),
        "alias_of_item_id": [item_list] if item_list in load_col["inter"] else None,
        "MAX_ITEM_LIST_LENGTH": int(manifest["max_seq_len"]),
        "filter_inter_by_user_or_item": False,
        "eval_args": {"split": {"RS": [0.8, 0.1, 0.1]}, "order": "TO", "group_by": None,
                      "mode": "labeled"},
        "train_neg_sample_args": None,
        "metrics": ["AUC", "LogLoss"],
        "valid_metric": "AUC",
        "epochs": epochs,
        # None: RecBole's default (overall.yaml: 2048)
        **({"train_batch_size": train_batch_size} if train_batch_size else {}),
        "seed": seed,
        "reproducibility": True,
        "show_progress": False,
        "save_dataset": False,
        "save_dataloaders": False,
        "log_wandb": False,
        "worker": 0,
    }


def parse_history_keep(value: str, columns: list[str]) -> tuple[str, list[str]]:
    """``FEATURE=ID,...`` as the list column to read and the raw ids to keep; a feature
    without a ``<FEATURE>_list`` column in the export is refused, naming those there are."""
    feature, sep, ids = value.partition("=")
    raw_ids = [i.strip() for i in ids.split(",") if i.strip()]
    if not sep or not feature or not raw_ids:
        raise ValueError(f"--history-keep {value!r}: expected FEATURE=ID[,ID...], "
                         "e.g. action=1,2")
    field = f"{feature}_list"
    names = [c.split(":")[0] for c in columns]
    if field not in names:
        lists = sorted(n[:-len("_list")] for n in names if n.endswith("_list")
                       and n != "item_id_list")
        raise ValueError(f"--history-keep {value!r}: the export has no {field!r} column; "
                         f"its event features: {', '.join(lists) or 'none'}")
    return field, raw_ids


def keep_history_events(histories, values, wanted) -> tuple[list, int, int]:
    """Each history with only the events whose value is in ``wanted``, order kept; and the
    events kept and seen. A history whose values are not one per event is refused."""
    import numpy as np

    wanted = np.asarray(sorted(wanted), dtype=np.int64)
    kept, kept_events, events = [], 0, 0
    for row, (history, value) in enumerate(zip(histories, values)):
        history = np.asarray(history, dtype=np.int64)
        value = np.asarray(value, dtype=np.int64)
        if history.shape != value.shape:
            raise ValueError(f"impression {row}: {history.size} history events but "
                             f"{value.size} values to filter them by")
        mask = np.isin(value, wanted)
        kept.append(history[mask])
        kept_events += int(mask.sum())
        events += history.size
    return kept, kept_events, events


def _keep_history(dataset, field: str, raw_ids: list[str]) -> dict:
    """``--history-keep`` on the loaded DataFrame (train, valid and test alike), before RecBole
    turns it into tensors; the filtering column is dropped after."""
    known = dataset.field2token_id[field]
    missing = [raw for raw in raw_ids if raw not in known]
    if missing:
        sys.exit(f"--history-keep: {field} never takes the ids {missing}; it takes "
                 f"{sorted(t for t in known if t != '[PAD]')}")
    feat = dataset.inter_feat
    list_field, length_field = dataset.item_id_list_field, dataset.item_list_length_field
    try:
        kept, kept_events, events = keep_history_events(
            feat[list_field].values, feat[field].values, {known[raw] for raw in raw_ids})
    except ValueError as error:
        sys.exit(f"--history-keep: {error}")
    longest = max((history.size for history in kept), default=0)
    if longest == 0:
        sys.exit(f"--history-keep: no history event has {field} in {raw_ids}")
    feat[list_field] = kept
    feat[length_field] = [history.size for history in kept]
    # RecBole pads the lists to the longest one present and sizes DIN's mask by this width
    dataset.field2seqlen[list_field] = longest
    dataset._del_col(feat, field)
    return {"field": field, "raw_ids": raw_ids, "events_kept": kept_events, "events": events}


def _dien_presets(dataset) -> None:
    """The negative history DIEN's auxiliary loss reads, and length >= 1 for its GRU (see the
    module docstring); on the loaded DataFrame, before RecBole turns it into tensors."""
    import numpy as np
    from recbole.utils import FeatureSource, FeatureType

    feat = dataset.inter_feat
    list_field, length_field = dataset.item_id_list_field, dataset.item_list_length_field
    neg_field = dataset.config["NEG_PREFIX"] + list_field
    item_num = dataset.item_num
    negatives = []
    for history in feat[list_field].values:
        history = np.asarray(history, dtype=np.int64)
        neg = np.random.randint(1, item_num, history.size)
        clash = neg == history
        while clash.any():
            neg[clash] = np.random.randint(1, item_num, int(clash.sum()))
            clash = neg == history
        negatives.append(neg)
    feat[neg_field] = negatives
    dataset.set_field_property(neg_field, FeatureType.TOKEN_SEQ, FeatureSource.INTERACTION,
                               dataset.field2seqlen[list_field])
    feat[length_field] = np.maximum(feat[length_field].to_numpy(), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="The export directory.")
    parser.add_argument("--model", required=True, choices=SEQUENTIAL + CONTEXT)
    parser.add_argument("--task", default=None,
                        help="the label to train on (default: the export's first task)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=2020, help="RecBole's seed (its default).")
    parser.add_argument("--train-batch-size", type=int, default=None,
                        help="impressions per training step (default: RecBole's, 2048)")
    parser.add_argument("--eval-batch-size", type=int, default=4096)
    parser.add_argument("--history-bags", action="store_true",
                        help="DeepFM, DCNV2: read the history columns too, as bags of ids")
    parser.add_argument("--history-keep", default=None, metavar="FEATURE=ID,...",
                        help="DIN, DIEN: keep only the history events whose FEATURE has one "
                             "of these raw ids (e.g. action=1,2: the engaged ones)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    export = args.data.resolve()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((export / "manifest.json").read_text())
    if "item_field" not in manifest:
        sys.exit(f"{export}: an export of format {manifest.get('format')!r}, without the "
                 "RecBole fields in its manifest; export it anew (tools/peers.py --fresh)")
    if args.task is None:
        args.task = manifest["tasks"][0]
    if export.name != manifest["name"]:
        sys.exit(f"{export}: the directory must be named after the export "
                 f"({manifest['name']!r}), as RecBole looks for its files")
    if args.task not in manifest["tasks"]:
        sys.exit(f"task {args.task!r} is not one of the export's: {manifest['tasks']}")
    refusal = model_refusal(manifest, args.model)
    if refusal:
        sys.exit(f"{export}: {refusal}")
    keep = None
    if args.history_keep is not None:
        if args.model not in SEQUENTIAL:
            sys.exit(f"--history-keep is for {', '.join(SEQUENTIAL)}, not {args.model}")
        try:
            keep = parse_history_keep(args.history_keep, manifest["columns"])
        except ValueError as error:
            sys.exit(str(error))
    os.chdir(out)  # RecBole writes log/ and log_tensorboard/ into the working directory

    started = time.perf_counter()
    # RecBole 1.2.1 under pandas 2.2 and torch 2.13: FutureWarnings by the dozen, none of them
    # about these runs' results.
    warnings.filterwarnings("ignore", category=FutureWarning)
    import numpy as np
    import torch
    from recbole.config import Config
    from recbole.data import create_dataset
    from recbole.data.dataloader import TrainDataLoader
    from recbole.utils import get_model, get_trainer, init_logger, init_seed

    config = Config(model=args.model, dataset=manifest["name"],
                    config_dict=_config_dict(manifest, export, args.model, args.task,
                                             args.epochs, args.seed, out,
                                             history_bags=args.history_bags,
                                             train_batch_size=args.train_batch_size,
                                             keep_field=keep[0] if keep else None))
    init_seed(config["seed"], config["reproducibility"])
    init_logger(config)
    dataset = create_dataset(config)
    history_keep = ({"option": args.history_keep, **_keep_history(dataset, *keep)} if keep
                    else None)
    if args.model in SEQUENTIAL:
        # RecBole sizes DIN's and DIEN's history mask by MAX_ITEM_LIST_LENGTH: the loaded width.
        config["MAX_ITEM_LIST_LENGTH"] = int(dataset.field2seqlen[dataset.item_id_list_field])
    if args.model == "DIEN":
        _dien_presets(dataset)
    train_set, _, test_set = dataset.build()
    keys = np.load(export / "eval_keys.npz")
    for part, expected in (("train", manifest["train_impressions"]),
                           ("test", manifest["eval_impressions"])):
        got = len(train_set if part == "train" else test_set)
        if got != expected:
            sys.exit(f"RecBole loaded {got} {part} impressions, the export has {expected}")
    labels = test_set.inter_feat[args.task].numpy()
    user_field = manifest["user_field"]
    users = dataset.id2token(user_field, test_set.inter_feat[user_field].numpy())
    if not (np.array_equal(labels, keys[args.task])
            and np.array_equal(users.astype(str), keys["user_ids"].astype(str))):
        sys.exit("RecBole's eval impressions are not the export's, row for row")
    loaded = time.perf_counter()

    train_data = TrainDataLoader(config, train_set, None, shuffle=config["shuffle"])
    init_seed(config["seed"] + config["local_rank"], config["reproducibility"])
    model = get_model(config["model"])(config, train_set).to(config["device"])
    trainer = get_trainer(config["MODEL_TYPE"], config["model"])(config, model)
    trainer.fit(train_data, valid_data=None, saved=False, show_progress=False)
    trained = time.perf_counter()

    model.eval()
    predictions = []
    with torch.no_grad():
        for start in range(0, len(test_set), args.eval_batch_size):
            index = np.arange(start, min(start + args.eval_batch_size, len(test_set)))
            batch = test_set[index].to(config["device"])
            predictions.append(model.predict(batch).double().cpu().numpy())
    scores = np.concatenate(predictions) if predictions else np.zeros(0)
    np.save(out / "predictions.npy", scores)
    done = time.perf_counter()

    import recbole

    report = {
        "model": args.model,
        "task": args.task,
        "epochs": args.epochs,
        "train_batch_size": config["train_batch_size"],
        "seed": args.seed,
        "history_bags": args.history_bags and args.model in CONTEXT,
        "history_keep": history_keep,
        "recbole": recbole.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "threads": torch.get_num_threads(),
        "device": str(config["device"]),
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "hyperparameters": {key: config[key] for key in (
            "embedding_size", "mlp_hidden_size", "dropout_prob", "pooling_mode", "gru_type",
            "alpha", "cross_layer_num", "structure", "mixed", "reg_weight", "low_rank",
            "expert_num", "learning_rate", "train_batch_size", "learner", "weight_decay",
            "MAX_ITEM_LIST_LENGTH") if config[key] is not None},
        "fields": sorted(f for f in train_set.field2type
                         if f not in ("item_length",)),
        "train_impressions": len(train_set),
        "eval_impressions": len(test_set),
        "load_s": loaded - started,
        "train_s": trained - loaded,
        "predict_s": done - trained,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    (out / "run.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
