"""A synthetic log with the shape of the public Taobao display-ads data (Ali-CCP) and a KNOWN
click probability per impression: how far are our models from the achievable NE on a log that
was not built for our model?

    python tools/taobao_shaped.py generate --out runs/taobao-s0 --seed 0
    gem data import --impressions runs/taobao-s0/raw_sample.csv \\
        --events runs/taobao-s0/behavior_log.csv --schema runs/taobao-s0/taobao.toml \\
        --out runs/taobao-s0-data
    python tools/taobao_shaped.py measure --raw runs/taobao-s0 --data runs/taobao-s0-data

``generate`` writes the four tables of docs/byod.md's "A multi-table log: Taobao display ads"
(raw_sample.csv, ad_feature.csv, user_profile.csv, behavior_log.csv), its schema with a longer
history (taobao.toml) and truth.csv: per impression, in raw_sample.csv's order, the click
probability, the planted indicators and the user's and the ad's effects. The click logit is
``b + user effect + ad effect + 1.5 * ENGAGED + 0.3 * VIEWED``: ENGAGED when the ad's category
is among those of the user's last 10 cart/fav/buy events before the request (the 10th is
usually 50-150 events back, though the matching one is mostly far nearer: the favourite
categories recur), VIEWED when among those of the last 5 views.

``measure`` joins the imported data set's impressions to truth.csv and prints the eval split's
achievable NE (that of the true probabilities), the NE a model can reach at best without the
user's effect, which no feature of the schema carries (``achievable_observable_ne``: the true
probabilities averaged over that effect), the NE of the train click rate, and those of logistic
regressions on the planted indicators fitted on the train split: on the indicators as the
generating process knows them, and as the imported tables show them (``*_described``): 3 % of
the ads have no row in ad_feature.csv, so their category, and with it ENGAGED and VIEWED, is
known to no model (truth.csv's ``ad_described``); the ``*_described`` regressions are the
references a model fed these tables can reach.

``tools/taobao_explain.py`` says where a trained model's NE goes on such a log.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

MAX_SEQ_LEN = 256
PIDS = np.array(["430548_1007", "430539_1007"])
BTAGS, BTAG_PROBS = np.array(["pv", "cart", "fav", "buy"]), [0.88, 0.05, 0.04, 0.03]
FIRST_TIME = 1494000000  # early May 2017, when the real log starts
KEY = ["user", "time_stamp", "adgroup_id", "pid"]
INTEREST_SLOTS = 6
CATE_ZIPF = 1.0  # category popularity ~ rank ** -CATE_ZIPF
EVENT_INTEREST_SHARE = 0.85  # of behaviour events in the user's favourite categories
AD_INTEREST_SHARE = 0.4  # of impressions whose ad is picked from the user's favourites
EFFECT_SD = 0.5  # of the user's and the ad's click-logit effects
BASE_LOGIT = -4.2  # not the brief's -3.0: ENGAGED is common (~40 %), and ~5 % CTR is the target

# The schema of docs/byod.md's Taobao section, with a longer history (max_seq_len 256, not 50,
# so that the engaged events are within reach) and a larger ad and category table (fewer hash
# collisions among this world's 20000 ads and 300 categories). That section gives no feature the
# user's id; ``generate --user-id`` adds one (USER_ID_SCHEMA), so that a model can learn the
# user's effect as well as the ad's.
SCHEMA = f"""tasks = ["clk"]
max_seq_len = {MAX_SEQ_LEN}
candidate_numeric_dim = 1
action_feature = "btag"
view_action = "pv"
""" + "".join(f'\n[[tables]]\nname = "{name}"\nnum_embeddings = {size}\n'
              + ('id_policy = "hash"\n' if size >= 1000 else "")
              for name, size in [("adgroup", 200000), ("cate", 50000), ("brand", 100000),
                                 ("campaign", 100000), ("customer", 100000), ("btag", 6),
                                 ("pid", 4), ("gender", 3), ("age", 7), ("pvalue", 4)]) + "".join(
    f'\n[[{kind}]]\nname = "{name}"\ntable = "{table}"\n' for kind, name, table in [
        ("event_features", "cate", "cate"), ("event_features", "brand", "brand"),
        ("event_features", "btag", "btag"), ("candidate_features", "adgroup_id", "adgroup"),
        ("candidate_features", "cate", "cate"), ("candidate_features", "brand", "brand"),
        ("candidate_features", "campaign", "campaign"),
        ("candidate_features", "customer", "customer"), ("candidate_features", "pid", "pid"),
        ("sparse_features", "gender", "gender"), ("sparse_features", "age", "age"),
        ("sparse_features", "pvalue", "pvalue")]) + """
[import]
user_column = "user"
timestamp_column = "time_stamp"
eval_fraction = 0.25
candidate_dense_columns = ["price"]

[import.strings]
btag = "vocabulary"
pid = "vocabulary"

[import.features]
"event.brand" = { missing = "default", default = 0 }
"candidate.cate" = { missing = "default", default = 0 }
"candidate.brand" = { missing = "default", default = 0 }
"candidate.campaign" = { missing = "default", default = 0 }
"candidate.customer" = { missing = "default", default = 0 }
"candidate_dense.price" = { missing = "default", default = 0.0 }
"sparse.gender" = { missing = "default", default = 0 }
"sparse.age" = { missing = "default", default = 0 }
"sparse.pvalue" = { missing = "default", default = 0 }

[[import.join]]
file = "ad_feature.csv"
key = "adgroup_id"
log = "impressions"
features = { "candidate.cate" = "cate_id", "candidate.brand" = "brand", \
"candidate.campaign" = "campaign_id", "candidate.customer" = "customer", \
"candidate_dense.price" = "price" }

[[import.join]]
file = "user_profile.csv"
key = "userid"
log = "impressions"
log_key = "user"
features = { "sparse.gender" = "final_gender_code", "sparse.age" = "age_level", \
"sparse.pvalue" = "pvalue_level" }
"""
USER_ID_SCHEMA = SCHEMA.replace(
    '\n[[tables]]\nname = "btag"',
    '\n[[tables]]\nname = "user"\nnum_embeddings = 100000\nid_policy = "hash"\n'
    '\n[[tables]]\nname = "btag"', 1).replace(
    '\n[[sparse_features]]\nname = "gender"',
    '\n[[sparse_features]]\nname = "user_id"\ntable = "user"\n'
    '\n[[sparse_features]]\nname = "gender"', 1).replace(
    "\n[import.strings]", '\n[import.columns]\n"sparse.user_id" = "user"\n\n[import.strings]', 1)
assert USER_ID_SCHEMA.count("user_id") == 2, "SCHEMA changed: place the user's id again"


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def average_over_user_effect(logit: np.ndarray, nodes: int = 40) -> np.ndarray:
    """``E[sigmoid(logit + u)]`` over the user effect ``u ~ N(0, EFFECT_SD^2)``
    (Gauss-Hermite quadrature): the click probability given all but the user's effect."""
    x, w = np.polynomial.hermite_e.hermegauss(nodes)  # weight exp(-x^2 / 2)
    return sigmoid(logit[:, None] + EFFECT_SD * x[None, :]) @ (w / math.sqrt(2 * math.pi))


class TruthJoinError(RuntimeError):
    """An impression of the data set with no row, or several, in truth.csv."""


def write_csv(path: Path, columns: dict[str, np.ndarray],
              empty: dict[str, np.ndarray] | None = None,
              null_text: dict[str, str] | None = None) -> None:
    """Unquoted CSV like the real files (pyarrow's writer quotes every string);
    ``empty[name]`` marks the cells written as ``null_text[name]`` (default: empty)."""
    texts = []
    for name, values in columns.items():
        text = pc.cast(pa.array(values, mask=(empty or {}).get(name)), pa.string())
        texts.append(pc.fill_null(text, (null_text or {}).get(name, "")))
    lines = pc.binary_join_element_wise(*texts, ",").to_pylist()
    path.write_text(",".join(columns) + "\n" + "\n".join(lines) + "\n")


def distinct_ids(rng: np.random.Generator, count: int, high: int) -> np.ndarray:
    return rng.choice(high, size=count, replace=False) + 1


def pick_in_groups(group_start: np.ndarray, group_count: np.ndarray, groups: np.ndarray,
                   rng: np.random.Generator) -> np.ndarray:
    """A uniform member index of each group in ``groups`` (members sorted by group); -1 for an
    empty group."""
    count = group_count[groups]
    index = group_start[groups] + np.floor(rng.random(groups.size) * count).astype(np.int64)
    return np.where(count > 0, index, -1)


def generate(out: Path, seed: int = 0, users: int = 4000, days: int = 8,
             events_per_user: float = 150.0, categories: int = 300, brands: int = 3000,
             ads: int = 20000, customers: int = 6000, campaigns: int = 10000,
             user_id: bool = False) -> str:
    """Write the four tables, ``truth.csv`` and ``taobao.toml`` (with a ``user_id`` request
    feature when ``user_id``: the tables are the same either way) under ``out``."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    # Categories with Zipf-ish popularity; brands and advertisers (customers) belong to them.
    cate_ids = distinct_ids(rng, categories, 12000)
    cate_pop = 1.0 / np.arange(1, categories + 1) ** CATE_ZIPF
    cate_pop /= cate_pop.sum()
    brand_ids = distinct_ids(rng, brands, 460000)
    brand_cate = rng.choice(categories, brands, p=cate_pop)
    brand_order = np.argsort(brand_cate, kind="stable")
    brand_start = np.searchsorted(brand_cate[brand_order], np.arange(categories))
    brand_count = np.bincount(brand_cate, minlength=categories)
    customer_ids = distinct_ids(rng, customers, 260000)
    customer_cates = rng.choice(categories, (customers, 3), p=cate_pop)
    customer_ncates = rng.choice([1, 2, 3], customers, p=[0.5, 0.3, 0.2])  # 1-3 categories
    campaign_ids = distinct_ids(rng, campaigns, 450000)
    campaign_owner = rng.integers(0, customers, campaigns)
    campaign_cate = customer_cates[campaign_owner,
                                   rng.integers(0, customer_ncates[campaign_owner])]
    # Ads: a campaign each (its advertiser and category), a brand of the category or NULL.
    ad_campaign = rng.integers(0, campaigns, ads)
    ad_cate = campaign_cate[ad_campaign]
    ad_brand = pick_in_groups(brand_start, brand_count, ad_cate, rng)
    ad_brand_null = (ad_brand < 0) | (rng.random(ads) < 0.3)
    ad_price = np.round(rng.lognormal(4.0, 1.3, ads), 2)
    ad_weight = rng.lognormal(0.0, 1.0, ads)  # popularity within the category
    ad_order = np.argsort(ad_cate, kind="stable")  # ads by category, for sampling within one
    ad_cum = np.cumsum(ad_weight[ad_order])
    cate_total = np.bincount(ad_cate, weights=ad_weight, minlength=categories)
    cate_before = np.concatenate([[0.0], np.cumsum(cate_total)[:-1]])
    in_ad_feature = rng.random(ads) >= 0.03
    write_csv(out / "ad_feature.csv", {
        "adgroup_id": np.arange(1, ads + 1)[in_ad_feature],
        "cate_id": cate_ids[ad_cate][in_ad_feature],
        "campaign_id": campaign_ids[ad_campaign][in_ad_feature],
        "customer": customer_ids[campaign_owner[ad_campaign]][in_ad_feature],
        "brand": brand_ids[brand_order[np.maximum(ad_brand, 0)]][in_ad_feature],
        "price": ad_price[in_ad_feature]},
        empty={"brand": ad_brand_null[in_ad_feature],
               "price": (rng.random(ads) < 0.01)[in_ad_feature]}, null_text={"brand": "NULL"})

    # Users: a profile (5 % have none) and a few favourite categories (Dirichlet weights).
    user_ids = distinct_ids(rng, users, 1200000)
    profiled = rng.random(users) >= 0.05
    profile = {"userid": user_ids,
               "cms_segid": np.where(rng.random(users) < 0.9, 0, rng.integers(1, 98, users)),
               "cms_group_id": rng.integers(0, 13, users),
               "final_gender_code": rng.choice([1, 2], users, p=[0.35, 0.65]),
               "age_level": rng.integers(1, 7, users), "pvalue_level": rng.integers(1, 4, users),
               "shopping_level": rng.choice([1, 2, 3], users, p=[0.05, 0.15, 0.8]),
               "occupation": (rng.random(users) < 0.06).astype(np.int64),
               "new_user_class_level": rng.integers(1, 5, users)}
    write_csv(out / "user_profile.csv", {k: v[profiled] for k, v in profile.items()},
              empty={"pvalue_level": (rng.random(users) < 0.3)[profiled],
                     "new_user_class_level": (rng.random(users) < 0.25)[profiled]})
    fav_cates = rng.choice(categories, (users, INTEREST_SLOTS), p=cate_pop)
    active = np.arange(INTEREST_SLOTS) <= np.minimum(rng.poisson(1.5, users), 5)[:, None]
    fav_cum = np.cumsum(rng.gamma(1.0, size=(users, INTEREST_SLOTS)) * active, axis=1)
    fav_cum /= fav_cum[:, -1:]

    def interest_cates(user: np.ndarray) -> np.ndarray:
        slot = (rng.random(user.size)[:, None] > fav_cum[user]).sum(axis=1)
        return fav_cates[user, np.minimum(slot, INTEREST_SLOTS - 1)]

    def pick_ads(cate: np.ndarray) -> np.ndarray:  # by popularity within each category
        x = cate_before[cate] + rng.random(cate.size) * cate_total[cate]
        return ad_order[np.minimum(np.searchsorted(ad_cum, x, "right"), ads - 1)]

    # Behaviour: ~events_per_user each (lognormal spread), uniform times over the days.
    span = days * 86400
    per_user = np.clip(np.round(rng.lognormal(math.log(events_per_user) - 0.32, 0.8, users)),
                       8, 5000).astype(np.int64)
    ev_user = np.repeat(np.arange(users), per_user)
    ev_time = FIRST_TIME + rng.integers(0, span, ev_user.size)
    order = np.argsort(ev_user * (1 << 32) + ev_time, kind="stable")
    ev_time = ev_time[order]
    ev_start = np.concatenate([[0], np.cumsum(per_user)[:-1]])

    # Requests at random points of each timeline (after a few events), one (user, second) each.
    req_user = np.repeat(np.arange(users), rng.poisson(per_user / 6.0))
    first = ev_start[req_user] + np.minimum(5, per_user[req_user] - 1)
    after = first + np.floor(rng.random(req_user.size)
                             * (ev_start[req_user] + per_user[req_user] - first)).astype(np.int64)
    req_time = ev_time[after] + rng.integers(1, 1800, req_user.size)
    req_key = np.unique(req_user * (1 << 32) + req_time)
    req_user, req_time = req_key >> 32, req_key & ((1 << 32) - 1)
    # 1-2 ads a request, each in its own slot; 40 % from the user's interests.
    two = rng.random(req_user.size) < 0.5
    imp_req = np.repeat(np.arange(req_user.size), 1 + two)
    imp_slot = np.arange(imp_req.size) - np.searchsorted(imp_req, imp_req)
    imp_pid = (rng.integers(0, 2, req_user.size)[imp_req] + imp_slot) % 2
    imp_user, imp_time = req_user[imp_req], req_time[imp_req]
    from_interest = rng.random(imp_req.size) < AD_INTEREST_SHARE
    imp_ad = np.where(from_interest, pick_ads(interest_cates(imp_user)),
                      pick_ads(rng.choice(categories, imp_req.size, p=cate_pop)))

    # The events' attributes; a few at exactly a request's time (the importer leaves those out
    # of that request's history, as it should for the impression's own outcome).
    at_request = np.flatnonzero(rng.random(req_user.size) < 0.1)
    first_imp = np.searchsorted(imp_req, at_request)
    ev_user = np.concatenate([ev_user, req_user[at_request]])
    ev_time = np.concatenate([ev_time, req_time[at_request]])
    ev_tag = rng.choice(4, ev_user.size, p=BTAG_PROBS)
    ev_cate = np.where(rng.random(ev_user.size) < EVENT_INTEREST_SHARE, interest_cates(ev_user),
                       rng.choice(categories, ev_user.size, p=cate_pop))
    ev_cate[per_user.sum():] = ad_cate[imp_ad[first_imp]]  # a look at the shown ad
    ev_key = ev_user * (1 << 32) + ev_time
    order = np.argsort(ev_key, kind="stable")
    ev_user, ev_time, ev_tag, ev_cate, ev_key = (a[order] for a in (ev_user, ev_time, ev_tag,
                                                                    ev_cate, ev_key))
    ev_brand = pick_in_groups(brand_start, brand_count, ev_cate, rng)
    write_csv(out / "behavior_log.csv", {
        "user": user_ids[ev_user], "time_stamp": ev_time, "btag": BTAGS[ev_tag],
        "cate": cate_ids[ev_cate], "brand": brand_ids[brand_order[np.maximum(ev_brand, 0)]]},
        empty={"brand": (ev_brand < 0) | (rng.random(ev_user.size) < 0.2)})

    # The planted indicators, from the events strictly before each request.
    imp_key = imp_user * (1 << 32) + imp_time
    history_end = np.searchsorted(ev_key, imp_key, "left")  # log index after the history

    def recent_match(mask: np.ndarray, back: int) -> np.ndarray:
        """Position in the event log of the most recent of the user's last ``back`` events
        under ``mask`` before the request with the ad's category; -1 if none."""
        rows = np.flatnonzero(mask)
        end = np.searchsorted(ev_key[rows], imp_key, "left")
        start = np.searchsorted(ev_key[rows], imp_user * (1 << 32), "left")
        found = np.full(imp_key.size, -1)
        for step in range(1, back + 1):
            index = end - step
            hit = (found < 0) & (index >= start) & (ev_cate[rows[np.maximum(index, 0)]]
                                                    == ad_cate[imp_ad])
            found[hit] = rows[index[hit]]
        return found

    engaged_at = recent_match(ev_tag > 0, 10)
    engaged, viewed = engaged_at >= 0, recent_match(ev_tag == 0, 5) >= 0
    visible = engaged & (engaged_at >= history_end - MAX_SEQ_LEN)
    user_effect = rng.normal(0.0, EFFECT_SD, users)[imp_user]
    ad_effect = rng.normal(0.0, EFFECT_SD, ads)[imp_ad]
    seen_logit = BASE_LOGIT + ad_effect + 1.5 * engaged + 0.3 * viewed
    p_click = sigmoid(seen_logit + user_effect)
    # The schema gives no feature the user's effect (no user id; the history does not depend
    # on it), so no model can know it: the best it can do is to average it out.
    p_observable = average_over_user_effect(seen_logit)
    clk = (rng.random(p_click.size) < p_click).astype(np.int64)
    key = {"user": user_ids[imp_user], "time_stamp": imp_time, "adgroup_id": imp_ad + 1,
           "pid": PIDS[imp_pid]}
    write_csv(out / "raw_sample.csv", {**key, "nonclk": 1 - clk, "clk": clk})
    write_csv(out / "truth.csv", {**key, "p_click": p_click, "p_click_observable": p_observable,
                                  "engaged_cate_recent": engaged.astype(np.int64),
                                  "viewed_cate_recent": viewed.astype(np.int64),
                                  "engaged_visible_256": visible.astype(np.int64),
                                  "ad_described": in_ad_feature[imp_ad].astype(np.int64),
                                  "user_effect": user_effect, "ad_effect": ad_effect})
    (out / "taobao.toml").write_text(USER_ID_SCHEMA if user_id else SCHEMA)
    return (f"{users} users, {ads} ads, {clk.size} impressions ({req_user.size} requests), "
            f"{ev_user.size} behaviour events; CTR {clk.mean():.4f}; ENGAGED=1 on "
            f"{engaged.mean():.1%} of impressions ({visible.mean():.1%} within the last "
            f"{MAX_SEQ_LEN} events), VIEWED=1 on {viewed.mean():.1%}")


def imported_impressions(data: Path, split: str) -> pa.Table:
    """One row per impression of the split: the key columns of truth.csv and the label."""
    from gem_data.dataset import DatasetReader, split_units
    from gem_data.import_strings import FIRST_ID, read_vocabularies

    reader = DatasetReader(data)
    pid_texts = np.array(read_vocabularies(data)["pid"].values)
    parts = []
    for unit in split_units(reader.manifest, split):
        table = reader.read(unit)
        ads = table.column("candidate.adgroup_id").combine_chunks()
        owner = pc.list_parent_indices(ads).to_numpy()
        pid_ids = pc.list_flatten(table.column("candidate.pid")).to_numpy()
        if (pid_ids < FIRST_ID).any():
            raise TruthJoinError(f"{data} ({split}): a candidate with pid id "
                                 f"{pid_ids[pid_ids < FIRST_ID][0]} (missing or not in "
                                 "vocabulary.pid.json)")
        parts.append(pa.table({
            "user": table.column("user_id").to_numpy()[owner],
            "time_stamp": table.column("request_timestamp").to_numpy()[owner],
            "adgroup_id": pc.list_flatten(ads), "pid": pid_texts[pid_ids - FIRST_ID],
            "clk": pc.list_flatten(table.column("label.clk"))}))
    return pa.concat_tables(parts)


def join_truth(impressions: pa.Table, truth: pa.Table, where: str) -> pa.Table:
    """Each impression with its one truth row, in the impressions' order; stops when an
    impression has none or several."""
    numbered = impressions.append_column("row", pa.array(np.arange(impressions.num_rows)))
    joined = numbered.join(truth.append_column("truth_row", pa.array(
        np.arange(truth.num_rows))), KEY, join_type="left outer")
    counts = joined.group_by("row").aggregate([("truth_row", "count")]).sort_by("row")
    per_row = counts.column("truth_row_count").to_numpy()
    for bad, what in ((per_row == 0, "no row"), (per_row > 1, "more than one row")):
        if bad.any():
            example = {k: impressions.column(k)[int(np.flatnonzero(bad)[0])].as_py()
                       for k in KEY}
            raise TruthJoinError(f"{where}: {int(bad.sum())} of {impressions.num_rows} "
                                 f"impressions have {what} in truth.csv, e.g. {example}")
    return joined.sort_by("row")


def measure(raw: Path, data: Path, train_sample: int = 50000, seed: int = 0) -> dict:
    from gem_data.generator import normalized_entropy_of_probabilities as ne
    from gem_data.indicator_ne import fit_logistic, sigmoid

    truth = read_truth(raw)
    splits = {split: join_truth(imported_impressions(data, split), truth,
                                f"{data} ({split} split)") for split in ("train", "eval")}
    train_rows = splits["train"].num_rows
    keep = np.random.default_rng(seed).permutation(train_rows)[:train_sample]

    def column(split: str, name: str, rows: np.ndarray | None = None) -> np.ndarray:
        values = splits[split].column(name).to_numpy().astype(np.float64)
        return values if rows is None else values[rows]

    def design(names: list[str], split: str, rows: np.ndarray | None = None) -> np.ndarray:
        """An intercept and the named truth columns."""
        columns = [column(split, name, rows) for name in names]
        return np.column_stack([np.ones(columns[0].size), *columns])

    y_train, y_eval = column("train", "clk", keep), column("eval", "clk")
    result = {"eval_impressions": int(y_eval.size), "eval_ctr": float(y_eval.mean()),
              "train_impressions_fitted": int(y_train.size),
              "achievable_ne": ne(column("eval", "p_click"), y_eval),
              "achievable_observable_ne": ne(column("eval", "p_click_observable"), y_eval),
              "base_rate_ne": ne(np.full(y_eval.size, y_train.mean()), y_eval)}
    for label, names in (("engaged", ["engaged_cate_recent"]),
                         ("engaged_viewed", ["engaged_cate_recent", "viewed_cate_recent"]),
                         ("engaged_visible_256", ["engaged_visible_256"])):
        weights = fit_logistic(design(names, "train", keep), y_train)
        result[f"lr_{label}_ne"] = ne(sigmoid(design(names, "eval") @ weights), y_eval)
    # The indicators and a click-logit offset per ad (its effect, under its true prior) fitted
    # on every training impression: what the ad effect adds where a model learns it as well as
    # one pass of these impressions allows.
    names = ["engaged_cate_recent", "viewed_cate_recent"]
    p_eval = fit_with_offsets(design(names, "train"), [column("train", "adgroup_id")],
                              column("train", "clk"), design(names, "eval"),
                              [column("eval", "adgroup_id")])
    result["lr_engaged_viewed_ad_ne"] = ne(p_eval, y_eval)
    # The same as the imported tables show them: an ad without a row in ad_feature.csv has no
    # category there, so no model can tell whether ENGAGED or VIEWED holds for it; the
    # regressions see each indicator only where the ad is described, and whether it is.
    seen = {split: indicators_as_seen(splits[split], raw) for split in ("train", "eval")}

    def seen_design(split: str, rows: np.ndarray | None = None) -> np.ndarray:
        columns = [seen[split][name] for name in SEEN_INDICATORS]
        if rows is not None:
            columns = [c[rows] for c in columns]
        return np.column_stack([np.ones(columns[0].size), *columns])

    weights = fit_logistic(seen_design("train", keep), y_train)
    result["lr_engaged_viewed_described_ne"] = ne(sigmoid(seen_design("eval") @ weights), y_eval)
    p_eval = fit_with_offsets(seen_design("train"), [column("train", "adgroup_id")],
                              column("train", "clk"), seen_design("eval"),
                              [column("eval", "adgroup_id")])
    result["lr_engaged_viewed_ad_described_ne"] = ne(p_eval, y_eval)
    # The same offsets learnt as a one-pass model learns them: each training impression once,
    # in the split's order, moving its ad's offset by EFFECT_SD^2 (y - p) (the indicators'
    # weights fitted beforehand): what one pass allows of the offsets' gain.
    p_eval = one_pass_offsets(seen_design("train"), [column("train", "adgroup_id")],
                              column("train", "clk"), seen_design("eval"),
                              [column("eval", "adgroup_id")])
    result["lr_engaged_viewed_ad_one_pass_described_ne"] = ne(p_eval, y_eval)
    # With an offset per user as well (the user's effect): what a model can reach where the
    # schema names the user's id (generate --user-id), fitted and learnt in one pass.
    ids = {split: [column(split, "adgroup_id"), column(split, "user")] for split in splits}
    p_eval = fit_with_offsets(seen_design("train"), ids["train"], column("train", "clk"),
                              seen_design("eval"), ids["eval"])
    result["lr_engaged_viewed_ad_user_described_ne"] = ne(p_eval, y_eval)
    p_eval = one_pass_offsets(seen_design("train"), ids["train"], column("train", "clk"),
                              seen_design("eval"), ids["eval"])
    result["lr_engaged_viewed_ad_user_one_pass_described_ne"] = ne(p_eval, y_eval)
    p_eval = one_pass_offsets(seen_design("train"), ids["train"], column("train", "clk"),
                              seen_design("eval"), ids["eval"], fisher=True)
    result["lr_engaged_viewed_ad_user_one_pass_fisher_described_ne"] = ne(p_eval, y_eval)
    # The ids alone (no indicator: what a model that does not match the candidate against the
    # history can learn): the offsets per ad, and per ad and user, learnt in one pass.
    described = {split: np.column_stack([np.ones(seen[split]["ad_described"].size),
                                         seen[split]["ad_described"]]) for split in splits}
    for label, width in (("ad", 1), ("ad_user", 2)):
        p_eval = one_pass_offsets(described["train"], ids["train"][:width],
                                  column("train", "clk"), described["eval"],
                                  ids["eval"][:width], fisher=True)
        result[f"lr_{label}_one_pass_fisher_described_ne"] = ne(p_eval, y_eval)
    result["eval_ads_undescribed"] = int((1 - seen["eval"]["ad_described"]).sum())
    engaged, visible = column("eval", "engaged_cate_recent"), column("eval", "engaged_visible_256")
    result["eval_engaged"] = int(engaged.sum())
    result["eval_engaged_beyond_256"] = int((engaged * (1 - visible)).sum())
    return result


SEEN_INDICATORS = ("engaged_cate_recent", "viewed_cate_recent", "ad_described")
"""The click logit's indicators as the imported tables show them, in this order."""


def indicators_as_seen(impressions: pa.Table, raw: Path) -> dict[str, np.ndarray]:
    """:data:`SEEN_INDICATORS` of ``impressions`` (joined to ``raw``'s truth.csv), as float64:
    ENGAGED and VIEWED where the ad is described (an ad without a row in ad_feature.csv has no
    category in the tables, so no model can tell either for it), and whether it is."""
    if "ad_described" not in impressions.column_names:
        raise TruthJoinError(f"{raw / 'truth.csv'} has no ad_described column: it was written "
                             "by an older version of this tool; run generate again (same "
                             "seed: the same tables)")

    def column(name: str) -> np.ndarray:
        return impressions.column(name).to_numpy().astype(np.float64)

    described = column("ad_described")
    return {"engaged_cate_recent": column("engaged_cate_recent") * described,
            "viewed_cate_recent": column("viewed_cate_recent") * described,
            "ad_described": described}


def read_truth(raw: Path) -> pa.Table:
    """truth.csv with its key columns typed as the imported impressions' (join_truth)."""
    return pacsv.read_csv(raw / "truth.csv", convert_options=pacsv.ConvertOptions(
        column_types={"user": pa.int64(), "time_stamp": pa.int64(),
                      "adgroup_id": pa.int64(), "pid": pa.string()}))


def one_pass_offsets(x: np.ndarray, ids: list[np.ndarray], y: np.ndarray, x_eval: np.ndarray,
                     ids_eval: list[np.ndarray], fisher: bool = False) -> np.ndarray:
    """Eval probabilities of ``sigmoid(x w + sum_k b_k[id_k])`` with ``w`` the logistic
    regression on ``x`` and each id column's offsets ``b_k`` learnt online, one impression at a
    time in the rows' order (:func:`gem_data.one_pass_offsets.one_pass_offsets` at the prior's
    variance ``EFFECT_SD^2``): ``constant`` steps, or with ``fisher`` as
    ``model.id_bias_step = "fisher"`` steps. An id without training rows keeps 0."""
    from gem_data.indicator_ne import fit_logistic, sigmoid
    from gem_data.one_pass_offsets import one_pass_offsets as learn
    from gem_data.one_pass_offsets import summed_offsets

    weights = fit_logistic(x, y)
    offsets = learn(x @ weights, ids, y, rate=EFFECT_SD ** 2,
                    step="fisher" if fisher else "constant")
    return sigmoid(x_eval @ weights + summed_offsets(offsets, ids_eval))


def fit_with_offsets(x: np.ndarray, ids: list[np.ndarray], y: np.ndarray, x_eval: np.ndarray,
                     ids_eval: list[np.ndarray]) -> np.ndarray:
    """Eval probabilities of ``sigmoid(x w + sum_k b_k[id_k])`` fitted by maximum a posteriori:
    the log loss summed over the training rows plus ``|b_k|^2 / (2 EFFECT_SD^2)`` for each id
    column (the effects' prior), by L-BFGS; an id without training rows gets 0."""
    import torch

    uniques = [np.unique(column, return_inverse=True) for column in ids]
    features, labels = torch.tensor(x), torch.tensor(y)
    rows = [torch.tensor(index) for _, index in uniques]
    weights = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    offsets = [torch.zeros(known.size, dtype=torch.float64, requires_grad=True)
               for known, _ in uniques]
    optimizer = torch.optim.LBFGS([weights, *offsets], max_iter=500, tolerance_grad=1e-9,
                                  line_search_fn="strong_wolfe")

    def objective() -> torch.Tensor:
        optimizer.zero_grad()
        logits = features @ weights + sum(b[r] for b, r in zip(offsets, rows))
        loss = (torch.nn.functional.binary_cross_entropy_with_logits(
            logits, labels, reduction="sum")
            + sum(b.square().sum() for b in offsets) / (2 * EFFECT_SD ** 2))
        loss.backward()
        return loss

    optimizer.step(objective)
    logit = x_eval @ weights.detach().numpy()
    for (known, _), b, column in zip(uniques, offsets, ids_eval):
        slot = np.searchsorted(known, column).clip(max=known.size - 1)
        logit = logit + np.where(known[slot] == column, b.detach().numpy()[slot], 0.0)
    return sigmoid(logit)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="write the four tables, taobao.toml, truth.csv")
    gen.add_argument("--out", type=Path, required=True)
    for name, kind, default in (("seed", int, 0), ("users", int, 4000), ("days", int, 8),
                                ("events-per-user", float, 150.0), ("ads", int, 20000)):
        gen.add_argument(f"--{name}", type=kind, default=default)
    gen.add_argument("--user-id", action="store_true",
                     help="the schema names the user's id (a sparse feature user_id)")
    mea = commands.add_parser("measure", help="NE figures on the imported data set's eval split")
    mea.add_argument("--raw", type=Path, required=True, help="the directory generate wrote")
    mea.add_argument("--data", type=Path, required=True, help="gem data import's --out")
    mea.add_argument("--train-sample", type=int, default=50000)
    mea.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "generate":
        print(generate(args.out, args.seed, args.users, args.days, args.events_per_user,
                       ads=args.ads, user_id=args.user_id))
        return
    try:
        result = measure(args.raw, args.data, args.train_sample)
    except TruthJoinError as error:
        sys.exit(f"error: {error}")
    for name, value in result.items():
        print(f"{name}: {value:.4f}" if isinstance(value, float) else f"{name}: {value}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
