"""The ElasticCTR loop on real PaddlePaddle (`make demo-ctr-paddle`, shortened): a Fleet
parameter-server trainer (paddlepaddle 2.6.2, in the venv `make paddle-env` makes; `make test`
makes it), a cube-local cluster reading its saves through Fleet's donefiles, the predictor
running each version's inference model with paddle.inference (3.3.1, the ctr-paddle extra).
Both models: the DeepFM of two sparse tables (first-order weights and embeddings: each save's
two table folders built into one version of two tables, looked up together by the predictor)
that `make demo-ctr-paddle` runs, and the CTR-DNN of one.

Per pass the demo checks, and this test checks again from its report: the served AUC equals
the offline AUC within 0.001, every served probability equals the trainer's own within its
bound (the 6-digit text's), and no request failed while the versions switched under load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from examples.ctr.demo import WIDE_DIM

pytestmark = pytest.mark.slow  # real processes end to end: `make quick` skips them

REPO = Path(__file__).resolve().parents[1]
PADDLE_VENV = REPO / ".paddle-venv"


def unavailable() -> str:
    """Why the Paddle environment is not there ("" when it is)."""
    if (PADDLE_VENV / ".installed").is_file():
        try:
            import paddle.inference  # noqa: F401
        except ImportError:
            return "paddle.inference is not installed in this venv: run make paddle-env"
        return ""
    why = PADDLE_VENV / "UNAVAILABLE"
    if why.is_file():
        return why.read_text().strip()
    return (
        f"no paddlepaddle 2.6.2 environment in {PADDLE_VENV}: run make paddle-env (make test does)"
    )


@pytest.mark.parametrize("model", ["deepfm", "dnn"])
def test_the_loop_on_real_paddlepaddle(tmp_path: Path, model: str) -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    work = tmp_path / "demo"
    argv = [
        sys.executable, "-m", "examples.ctr.demo", "--trainer", "paddle",
        "--paddle_python", str(PADDLE_VENV / "bin" / "python"), "--dir", str(work),
        "--days", "2", "--splits_per_day", "2", "--samples", "20000", "--heldout", "2000",
        "--shards", "2", "--replicas", "2", "--timeout", "120", "--paddle_model", model,
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "background load during the rollouts" in done.stdout
    assert ", 0 errors;" in done.stdout, done.stdout[-3000:]
    rows = json.loads((work / "report.json").read_text())
    assert [r["kind"] for r in rows] == ["base", "delta", "base", "delta"]
    for r in rows:
        assert r["served_versions"] == [r["version"]] and not r["errors"], r
        assert abs(r["served_auc"] - r["offline_auc"]) <= 0.001, r
        assert r["over_bound"] == 0, r
        # the bound is the text's (about 1e-5), not a loose one; the served values are not
        # the trainer's bit for bit (6 digits), so some probability differs
        assert 0 < r["max_prob_diff"] <= r["max_bound"] < 5e-5, r
    assert rows[-1]["offline_auc"] > max(0.6, rows[0]["offline_auc"] + 0.03)  # it learns
    # the transfer read Fleet's donefiles, the builder the saves as they are
    models = work / "out" / "models"
    assert (models / "xbox_base_done.txt").is_file() and (models / "xbox_patch_done.txt").is_file()
    assert (models / "20261123" / "delta-2" / "000").is_dir()
    if model == "dnn":
        return
    # two sparse tables in every save, named by the job's PSParameter; the dense part pools
    # each; every served version holds both tables (the SDK answered both from one version)
    desc = (models / "fleet_desc.prototxt").read_text()
    assert 'table_name: "embedding"' in desc and 'table_name: "first_order"' in desc
    for save in ("base", "delta-2"):
        assert {p.name for p in (models / "20261124" / save).glob("00[01]")} == {"000", "001"}
    layout = json.loads((models / "20261124" / "base" / "dnn_plugin" / "layout.json").read_text())
    wide = WIDE_DIM - 2  # the first-order table's served width (show and click not served)
    assert [(i["table"], i["dim"]) for i in layout["inputs"]] == [("001", wide), ("000", 8)]
    versions = sorted((work / "cluster").glob("**/1795478400_1795482000/TABLES"))
    assert versions, "no served version with a TABLES file"
    for path in versions:
        assert sorted(path.read_text().split()) == ["000", "001"]
