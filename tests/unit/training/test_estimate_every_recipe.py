"""``scripts/estimate_memory.py`` runs for every shipped recipe (``recipes/*.yaml``) at the world
size the recipe plans for (``fsdp_config.dp_shard_size``) and says it fits; a new recipe is
picked up by the glob. The tiny recipes run in seconds (default suite), the 16B ones take
minutes (``slow``; their byte-level checks: test_capacity.py)."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.system.harness import REPO

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def _world(recipe) -> int:
    return int(yaml.safe_load(recipe.read_text())["fsdp_config"]["dp_shard_size"])


@pytest.mark.parametrize("recipe", [
    pytest.param(r, id=r.stem, marks=[pytest.mark.slow] if "16b" in r.stem else []) for r in RECIPES])
def test_estimate_runs_for_every_shipped_recipe(recipe, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import estimate_memory

    out = tmp_path / "report.json"
    code = estimate_memory.main(["--config", str(recipe), "--world", str(_world(recipe)), "--micro", "2",
                                 "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["fits"] is True, report
    assert report["step_peak_bytes"] >= report["resting_bytes"] > 0


def test_every_shipped_recipe_is_looped_over():
    assert {r.stem for r in RECIPES} >= {f"dsv3_{size}_{fmt}" for size in ("tiny", "16b")
                                         for fmt in ("bf16", "mxfp8", "hif8")}
