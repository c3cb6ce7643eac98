"""examples/ctr without a cluster: the sample format, the model's math, the trainer's saves,
checkpoints and restarts (tests/test_ctr_e2e.py runs the loop with Cube)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from cube.donefile import BASE_FILE, PATCH_FILE, DonefileEntry, parse_lines
from examples.ctr import samples as sample_io
from examples.ctr.data import SPLIT_DONE, StreamSpec, generate, list_splits, write_split
from examples.ctr.model import Dense, Hyper, Model, SparseTable, auc, pool
from examples.ctr.store import (
    all_models,
    find_model,
    last_id,
    load_dense,
    read_sparse,
    version_table,
)
from examples.ctr.trainer import run as trainer_run

SMALL = StreamSpec(samples=3000, heldout=1000, vocab=400, growth=40, churn=60, splits_per_day=2)


# -- the sample format ---------------------------------------------------------------------------


def test_lines_round_trip_and_labels() -> None:
    batch = generate(SMALL, 0, 50, 0)
    lines = sample_io.format_lines(batch)
    back = sample_io.parse_lines(lines)
    for name in ("shows", "clicks", "offsets", "feasigns", "slots"):
        np.testing.assert_array_equal(getattr(back, name), getattr(batch, name))
    assert back.labels.tolist() == (batch.clicks > 0).astype(np.float32).tolist()


def test_a_line_without_show_and_click_is_a_request_sample() -> None:
    samples = sample_io.parse_lines(["18446744073709551615:3 5:1", "1 1 7:2"])
    assert samples.feasigns.tolist() == [2**64 - 1, 5, 7]
    assert samples.slots.tolist() == [3, 1, 2]
    assert samples.offsets.tolist() == [0, 2, 3]
    assert samples.clicks.tolist() == [0, 1]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("1 0 12:3 99", "sample 2: feature 2 is not `feasign:slot`"),
        ("1 0 1:2:3 5", "sample 2: feature 1 is not `feasign:slot`"),
        ("1 0 18446744073709551616:1", "sample 2: feature 1"),
        ("x 0 12:3", "sample 2: show is not a non-negative integer"),
        ("1 -1 12:3", "sample 2: click is not a non-negative integer"),
        ("1 12:3", "sample 2: expected `show click feasign:slot ...`"),
        ("1 0 ²:3", "sample 2: feature 1"),
    ],
)
def test_a_bad_line_is_named_and_not_echoed(line: str, problem: str) -> None:
    with pytest.raises(sample_io.SampleError) as err:
        sample_io.parse_lines(["1 0 5:1", line], where="sample", first_line=1)
    assert problem in str(err.value)
    assert line not in str(err.value)


# -- the model ---------------------------------------------------------------------------------


def test_auc_matches_counting_pairs_with_ties() -> None:
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 2, 300)
    scores = rng.integers(0, 20, 300).astype(float)  # many ties
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert auc(labels, scores) == pytest.approx(pairs / (pos.size * neg.size), abs=1e-12)
    assert np.isnan(auc(np.ones(4), np.arange(4.0)))


def test_gradients_match_finite_differences() -> None:
    rng = np.random.default_rng(5)
    model = Model.initial(np.arange(1, 4), Hyper(dim=3, hidden=5), rng)
    model.dense.b1[:] = 0.3  # keep every unit active: relu is not differentiable at 0
    samples = sample_io.parse_lines(["1 1 10:1 11:2 12:3", "1 0 10:1 13:3 14:3", "1 1 11:2"])
    emb = rng.standard_normal((samples.feasigns.shape[0], 3)).astype(np.float64)
    model.dense = Dense(model.dense.slot_ids, 3,
                        *(p.astype(np.float64) for p in model.dense.params.values()))  # fmt: skip
    n = len(samples)
    _, dense_grads, emb_grads = model.gradients(samples, emb)
    h = 1e-6

    def mean_loss(e: np.ndarray) -> float:
        return model.gradients(samples, e)[0] / n

    for index in [(0, 0), (2, 1), (4, 2)]:
        bumped = emb.copy()
        bumped[index] += h
        lower = emb.copy()
        lower[index] -= h
        numeric = (mean_loss(bumped) - mean_loss(lower)) / (2 * h)
        assert emb_grads[index] == pytest.approx(numeric, rel=1e-4, abs=1e-7)
    for name, at in [("w1", (2, 3)), ("b1", (1,)), ("w2", (4, 0)), ("b2", (0,))]:
        param = model.dense.params[name]
        saved = param[at]
        param[at] = saved + h
        up = mean_loss(emb)
        param[at] = saved - h
        down = mean_loss(emb)
        param[at] = saved
        assert dense_grads[name][at] == pytest.approx((up - down) / (2 * h), rel=1e-4, abs=1e-7)


def test_training_learns_the_planted_truth() -> None:
    spec = StreamSpec(samples=20_000, heldout=4000)
    rng = np.random.default_rng(1)
    model = Model.initial(np.arange(1, spec.slots + 1), Hyper(), rng)
    for index in range(2):
        model.train(generate(spec, index, spec.samples, 0), index + 1, rng)
    heldout = generate(spec, 1, spec.heldout, 1)
    assert auc(heldout.labels, model.predict(heldout)) >= 0.70


def test_sparse_table_finds_adds_and_shrinks() -> None:
    rng = np.random.default_rng(0)
    table = SparseTable(dim=2)
    rows = table.rows(np.array([30, 10, 20], np.uint64), rng)
    assert sorted(rows.tolist()) == [0, 1, 2]
    assert table.find(np.array([20, 99], np.uint64))[1] == -1
    table.last_seen[table.find(np.array([10], np.uint64))] = 5
    dropped = table.shrink(now=5, unseen_passes=2)
    assert dropped.tolist() == [20, 30]
    assert table.keys.tolist() == [10]
    assert table.embeddings(np.array([10, 20], np.uint64))[1].tolist() == [0.0, 0.0]


def test_dense_file_that_is_not_one_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "dense.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=str(bad)):
        Dense.load(bad)


def test_version_names_lead_to_the_last_id() -> None:
    assert last_id("1795392000") == "1795392000"
    assert last_id("1795392000_1795395600") == "1795395600"
    with pytest.raises(ValueError):
        last_id("../etc")


# -- the stream and the trainer ------------------------------------------------------------------


def test_an_incomplete_split_is_not_listed(tmp_path: Path) -> None:
    write_split(SMALL, tmp_path, 0)
    second = write_split(SMALL, tmp_path, 1)
    (second / SPLIT_DONE).unlink()
    assert [s.name for s in list_splits(tmp_path / "data")] == ["20261123/0000"]


def train(root: Path, out: Path, *extra: str) -> int:
    return trainer_run(["--data_dir", str(root / "data"), "--heldout_dir", str(root / "heldout"),
                        "--out_dir", str(out), "--wait_timeout", "0", "--shrink_after", "1",
                        *extra])  # fmt: skip


def donefile_entries(out: Path) -> list[DonefileEntry]:
    entries = []
    for name in (BASE_FILE, PATCH_FILE):
        path = out / "donefile" / name
        if path.exists():
            entries += [e for e in parse_lines(name, path.read_text())
                        if isinstance(e, DonefileEntry)]  # fmt: skip
    return entries


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stream")
    for index in range(4):  # two days of two splits: base, delta, base, delta
        write_split(SMALL, root, index)
    return root


@pytest.fixture(scope="module")
def trained(stream: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("out")
    assert train(stream, out) == 0
    return out


def test_a_base_per_day_and_a_delta_per_pass(trained: Path) -> None:
    entries = sorted(donefile_entries(trained), key=lambda e: int(e.id))
    kinds = [(e.file, e.id == e.key) for e in entries]
    assert kinds == [(BASE_FILE, True), (PATCH_FILE, False)] * 2
    models = {meta.id: (meta, path) for meta, path in all_models(trained / "models")}
    metas = [models[int(e.id)][0] for e in entries]
    assert [models[int(e.id)][1].name for e in entries] == ["base", "delta_2"] * 2
    assert [m.kind for m in metas] == ["base", "delta", "base", "delta"]
    assert entries[1].key == entries[0].id and entries[3].key == entries[2].id
    for entry, meta in zip(entries, metas, strict=True):
        assert Path(entry.input) == models[meta.id][1].resolve() / "sparse"
        keys, _ = read_sparse(Path(entry.input), meta.dim)
        assert keys.shape[0] == meta.features
    assert metas[-1].offline_auc >= 0.6 and metas[-1].heldout_samples == SMALL.heldout


def test_a_delta_deletes_what_shrink_dropped_and_a_base_leaves_it_out(trained: Path) -> None:
    metas = [meta for meta, _ in all_models(trained / "models")]
    delta = metas[3]
    delete_file = find_model(trained / "models", delta.id) / "delete.txt"
    deleted = np.array(delete_file.read_text().split(), dtype=np.uint64)
    assert delta.deleted == deleted.shape[0] > 0
    before = version_table(trained, metas[2].version, delta.dim).keys
    after = version_table(trained, delta.version, delta.dim).keys
    assert np.isin(deleted, before).all() and not np.isin(deleted, after).any()
    assert after.shape[0] == delta.table_size
    base_keys, _ = read_sparse(find_model(trained / "models", metas[2].id) / "sparse", delta.dim)
    assert base_keys.shape[0] == metas[2].table_size  # a base is the whole table after shrink


def test_the_saved_version_predicts_what_the_trainer_evaluated(trained: Path, stream: Path) -> None:
    from examples.ctr.model import pool

    meta = all_models(trained / "models")[-1][0]
    table = version_table(trained, meta.version, meta.dim)
    dense, _ = load_dense(trained / "models", meta.version)
    heldout = sample_io.read_file(str(stream / "heldout" / meta.split / "part-00000"))
    emb = table.embeddings(heldout.feasigns)
    served = dense.predict(pool(emb, heldout, dense.slot_ids))
    assert auc(heldout.labels, served) == pytest.approx(meta.offline_auc, abs=1e-9)


def test_a_restart_resumes_where_it_stopped_and_writes_the_same_models(
    stream: Path, trained: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert train(stream, out, "--max_passes", "1") == 0
    assert train(stream, out, "--max_passes", "2") == 0
    assert train(stream, out) == 0
    assert sorted(e.id for e in donefile_entries(out)) == sorted(
        e.id for e in donefile_entries(trained)
    )
    for meta, directory in all_models(trained / "models"):
        again = find_model(out / "models", meta.id)
        assert again.relative_to(out) == directory.relative_to(trained)
        for mine, theirs in zip(
            read_sparse(again / "sparse", 8), read_sparse(directory / "sparse", 8), strict=True
        ):
            np.testing.assert_array_equal(mine, theirs, err_msg=f"{directory}/sparse")
        for name, param in Dense.load(again / "dense.npz").params.items():
            np.testing.assert_array_equal(
                param, Dense.load(directory / "dense.npz").params[name], err_msg=str(directory)
            )


def test_a_crash_between_checkpoint_and_donefile_line_is_announced_on_restart(
    stream: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert train(stream, out, "--max_passes", "2") == 0
    patch = out / "donefile" / PATCH_FILE
    lines = patch.read_text().splitlines(keepends=True)
    patch.write_text("".join(lines[:-1]))  # as if killed after the checkpoint, before the line
    assert train(stream, out, "--max_passes", "0", "--wait_timeout", "0") == 0
    ids = [e.id for e in donefile_entries(out)]
    assert len(ids) == len(set(ids)) == 4


def test_stale_temporary_models_are_removed(stream: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    stale = out / "models" / "20261123" / ".tmp-base-123"
    (stale / "sparse").mkdir(parents=True)
    assert train(stream, out, "--max_passes", "1") == 0
    assert not stale.exists()


def test_a_bad_split_stops_the_trainer_with_its_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_split(SMALL, tmp_path, 0)
    part = tmp_path / "data" / "20261123" / "0000" / "part-00000"
    lines = part.read_text().splitlines()
    lines[6] = "1 0 not-a-feature"
    part.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert train(tmp_path, out) == 1
    assert f"error: {part} 7: feature 1 is not `feasign:slot`" in capsys.readouterr().out
    assert not (out / "donefile" / BASE_FILE).exists()


def test_meta_is_json_with_the_auc_figures(trained: Path) -> None:
    meta = json.loads((all_models(trained / "models")[0][1] / "meta.json").read_text())
    assert {"streaming_auc", "offline_auc", "features", "deleted", "table_size"} <= set(meta)
    assert os.path.isdir(trained / "checkpoint")


def test_a_version_without_its_dense_part_is_an_error_not_another_version(
    trained: Path, tmp_path: Path
) -> None:
    import asyncio

    from examples.ctr.predictor import DenseCache, PredictError

    cache = DenseCache(trained / "models")
    first = all_models(trained / "models")[0][0]
    assert asyncio.run(cache.get(first.version)).dim == first.dim
    with pytest.raises(PredictError) as err:
        asyncio.run(cache.get(f"{first.id}_1795399999"))
    assert err.value.status == 503 and "1795392000_1795399999" in str(err.value)


def test_a_slot_the_model_lacks_is_named_by_sample_and_feature() -> None:
    from examples.ctr.model import slot_index

    samples = sample_io.parse_lines(["1 0 5:1 6:2", "7:2 8:9 9:1"])
    with pytest.raises(sample_io.SampleError, match=r"sample 1: feature 2 is in slot 9,"):
        slot_index(np.arange(1, 4), samples)


# ---------------------------------------------------------------------------------------------
# the Paddle trainer's numbers (numpy; the Fleet job itself: tests/test_ctr_paddle.py)


def _mlp(rng: np.random.Generator, inputs: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [
        (rng.standard_normal((inputs, 16)).astype(np.float32) * 0.4, rng.standard_normal(16)
         .astype(np.float32) * 0.1),
        (rng.standard_normal((16, 8)).astype(np.float32) * 0.4, np.zeros(8, np.float32)),
        (rng.standard_normal((8, 1)).astype(np.float32) * 0.6, np.zeros(1, np.float32)),
    ]  # fmt: skip


def _prob(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    h = x.astype(np.float64)
    for w, b in layers[:-1]:
        h = np.maximum(h @ w + b, 0.0)
    logit: np.ndarray = (h @ layers[-1][0] + layers[-1][1])[:, 0]
    prob: np.ndarray = 1.0 / (1.0 + np.exp(-logit))
    return prob


def test_the_probability_bound_covers_the_six_digit_text() -> None:
    """The served embeddings are the trainer's printed with 6 significant digits and read as
    float32: the bound derived from that (without the allowance for two runtimes) holds for
    every sample of a random model, and is not loose by orders of magnitude."""
    from examples.ctr.paddle_trainer import EVAL_NOISE, mlp_gradients, probability_bounds

    rng = np.random.default_rng(3)
    samples = sample_io.parse_lines(
        [" ".join(f"{k}:{1 + k % 4}" for k in rng.integers(1, 400, 7)) for _ in range(3000)]
    )
    slot_ids = np.arange(1, 5, dtype=np.int64)
    exact = (rng.standard_normal((samples.feasigns.shape[0], 6)) * 0.5).astype(np.float32)
    printed = np.array([[float(f"{v:.6g}") for v in row] for row in exact.tolist()], np.float32)
    pooled, served = pool(exact, samples, slot_ids), pool(printed, samples, slot_ids)
    layers = _mlp(rng, pooled.shape[1])
    mine = _prob(layers, pooled)
    bound = probability_bounds(
        mine, mlp_gradients(pooled, layers), pool(np.abs(exact), samples, slot_ids)
    )
    diff = np.abs(_prob(layers, served) - mine)
    assert (diff <= bound - EVAL_NOISE + 1e-12).all()
    assert diff.max() > 0.02 * (bound - EVAL_NOISE).max()  # a bound, not a wild guess


def test_the_deepfm_bound_covers_the_six_digit_text_of_both_tables() -> None:
    """The Paddle trainer's DeepFM: logit = sum of first-order weights + FM of the slots' pooled
    embeddings + the MLP on them. Its gradient (1 for each first-order input, the FM's
    sum-minus-own plus the MLP's for each embedding input) matches finite differences, and the
    bound from it covers both tables' 6-digit text for every sample of a random model."""
    from examples.ctr.paddle_trainer import (
        EVAL_NOISE,
        fm_gradients,
        mlp_gradients,
        probability_bounds,
    )

    rng = np.random.default_rng(5)
    samples = sample_io.parse_lines(
        [" ".join(f"{k}:{1 + k % 4}" for k in rng.integers(1, 400, 7)) for _ in range(2000)]
    )
    slot_ids = np.arange(1, 5, dtype=np.int64)
    slots, dim = slot_ids.shape[0], 6
    layers = _mlp(rng, slots * dim)

    def logit(first: np.ndarray, emb: np.ndarray) -> np.ndarray:
        fields = emb.astype(np.float64).reshape(emb.shape[0], slots, dim)
        fm = 0.5 * ((fields.sum(axis=1) ** 2) - (fields**2).sum(axis=1)).sum(axis=1)
        p = _prob(layers, emb)
        return np.asarray(first.astype(np.float64).sum(axis=1) + fm + np.log(p / (1 - p)))

    def prob(first: np.ndarray, emb: np.ndarray) -> np.ndarray:
        return np.asarray(1.0 / (1.0 + np.exp(-logit(first, emb))))

    n = samples.feasigns.shape[0]
    wide = (rng.standard_normal((n, 1)) * 0.3).astype(np.float32)
    emb = (rng.standard_normal((n, dim)) * 0.3).astype(np.float32)
    first, pooled = pool(wide, samples, slot_ids), pool(emb, samples, slot_ids)
    grad = np.concatenate(
        [np.ones_like(first, np.float64), mlp_gradients(pooled, layers) + fm_gradients(pooled, 4)],
        axis=1,
    )
    step = 1e-6
    for column in (0, slots + 1, slots + 2 * dim + 3):
        at = [first.astype(np.float64), pooled.astype(np.float64)]
        which, j = (0, column) if column < slots else (1, column - slots)
        at[which][:, j] += step
        numeric = (logit(*at) - logit(first, pooled)) / step
        assert np.allclose(numeric, grad[:, column], atol=1e-3)
    printed = [
        np.array([[float(f"{v:.6g}") for v in row] for row in x.tolist()], np.float32)
        for x in (wide, emb)
    ]
    mine = prob(first, pooled)
    magnitudes = np.concatenate(
        [pool(np.abs(wide), samples, slot_ids), pool(np.abs(emb), samples, slot_ids)], axis=1
    )
    bound = probability_bounds(mine, grad, magnitudes)
    served = prob(pool(printed[0], samples, slot_ids), pool(printed[1], samples, slot_ids))
    diff = np.abs(served - mine)
    assert (diff <= bound - EVAL_NOISE + 1e-12).all()
    assert diff.max() > 0.02 * (bound - EVAL_NOISE).max()


def test_the_trainer_takes_the_saved_rows_as_the_save_wrote_them() -> None:
    """A real save (tests/data/paddle_ps): the rows' served columns as the text has them, a
    row saved without its embedx part serves zeros there (whatever the trainer holds), and a
    pulled value that differs from the text by more than its digits is an error."""
    from examples.ctr.paddle_trainer import ServedTable, as_saved, saved_rows

    save = Path(__file__).parent / "data" / "paddle_ps" / "ctr_common_adagrad"
    expected = json.loads((save / "expected.json").read_text())["saves"]["base"]["tables"]["emb"]
    keys, text, full = saved_rows(save / "base" / "000", 5)
    assert keys.tolist() == expected["keys"] and not full.all() and full.any()
    lookup = np.array(
        [np.frombuffer(bytes.fromhex(h), "<f4") for h in expected["lookup_f32le_hex"]]
    )
    pulled = lookup[:, 2:].copy()  # without show, click
    pulled[~full, 1:] = 0.5  # embedx weights the trainer holds but the save left out
    rows = as_saved("base", text, full, pulled)
    assert (rows[~full, 1:] == 0).all() and (rows[full] == pulled[full]).all()
    pulled[3, 0] += 1e-3 + abs(pulled[3, 0]) * 1e-4
    with pytest.raises(RuntimeError, match="base: 1 saved rows differ from the pserver's"):
        as_saved("base", text, full, pulled)
    table = ServedTable(6)
    table.apply(keys, rows, base=True)
    table.apply(keys[:2], rows[:2] + 1, base=False)
    table.apply(np.array([2**64 - 1], np.uint64), np.ones((1, 6), np.float32), base=False)
    assert table.keys.shape[0] == keys.shape[0] + 1
    assert (table.lookup(keys[:2]) == rows[:2] + 1).all()
    assert (table.lookup(np.array([12345678], np.uint64)) == 0).all()  # not served: zeros
    table.apply(keys[:1], rows[:1], base=True)  # a base replaces the whole table
    assert table.keys.tolist() == keys[:1].tolist()


def test_the_paddle_demo_says_which_pass_failed_and_by_how_much() -> None:
    from examples.ctr.demo import check

    row = {
        "pass": 3, "version": "1_3", "offline_auc": 0.7, "served_auc": 0.7015,
        "served_versions": ["1_3"], "errors": [], "max_prob_diff": 3e-5, "max_bound": 1e-5,
        "over_bound": 2, "worst": {"sample": 17, "diff": 3e-5, "bound": 1e-5},
    }  # fmt: skip
    failures = check([row], None)
    assert failures == [
        "pass 3 (1_3): served AUC 0.7015 vs offline 0.7000: off by 0.0015 (> 0.001)",
        "pass 3 (1_3): 2 served probabilities differ from the trainer's by more than the "
        "6-digit text allows; worst: held-out sample 17, off by 3.000e-05 (bound 1.000e-05)",
    ]
    within = {**row, "served_auc": 0.7009, "over_bound": 0, "max_prob_diff": 9e-6}
    assert check([within], None) == []
    numpy_row = {k: v for k, v in within.items() if k not in ("max_prob_diff", "over_bound")}
    assert check([{**numpy_row, "served_auc": 0.7015}], None) == []  # 0.002 for numpy's
