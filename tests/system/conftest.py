"""Session fixtures: one spawned 2-rank job per recipe, shared by every Q3 test that reads it.

``bf16_run`` / ``mxfp8_run`` / ``hif8_run`` -> ``{"workdir": Path, "ranks": [rank0, rank1]}``
where each rank's dict holds the phases of ``harness.run_main_worker``. A job runs only when
a selected test asks for it; the default (``-m 'not slow'``) selection spawns four jobs:
bf16, mxfp8 (main + variant + misaligned shard), hif8 (main + variant), mxfp8 DCP resume.
"""
from __future__ import annotations

import warnings

import pytest

from tests.system import harness as H

PHASES_BY_FORMAT = {
    "bf16": ("main",),
    "mxfp8": ("main", "variant", "misaligned"),
    "hif8": ("main", "variant"),
}


@pytest.fixture(scope="session")
def st_data_dir(tmp_path_factory):
    """The small stdlib byte corpus (256 KiB), built once for every spawned run."""
    from te_npu.training.data import build_datasets

    data_dir = tmp_path_factory.mktemp("st_data")
    build_datasets(H.st_config("bf16", data_dir / "unused", data_dir).data)
    return data_dir


def _run(tmp_path_factory, data_dir, fmt, phases):
    workdir = tmp_path_factory.mktemp(f"st_{fmt}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks = H.spawn(H.run_main_worker, workdir, str(data_dir), fmt, tuple(phases))
    return {"workdir": workdir, "ranks": ranks, "fmt": fmt}


@pytest.fixture(scope="session")
def bf16_run(tmp_path_factory, st_data_dir):
    return _run(tmp_path_factory, st_data_dir, "bf16", PHASES_BY_FORMAT["bf16"])


@pytest.fixture(scope="session")
def mxfp8_run(tmp_path_factory, st_data_dir):
    return _run(tmp_path_factory, st_data_dir, "mxfp8", PHASES_BY_FORMAT["mxfp8"])


@pytest.fixture(scope="session")
def hif8_run(tmp_path_factory, st_data_dir):
    return _run(tmp_path_factory, st_data_dir, "hif8", PHASES_BY_FORMAT["hif8"])


@pytest.fixture
def run_of(request):
    """``run_of("mxfp8")`` -> that format's session run (lazily, so only selected ones spawn)."""
    return lambda fmt: request.getfixturevalue(f"{fmt}_run")


@pytest.fixture(scope="session")
def resume_runs(st_data_dir):
    """``resume(run)`` -> ranks of a fresh 2-process job that loads ``run``'s DCP at step 17 and
    trains 3 more steps (cached per format)."""
    cache = {}

    def resume(run):
        fmt = run["fmt"]
        if fmt not in cache:
            cache[fmt] = H.spawn(H.run_resume_worker, run["workdir"], str(st_data_dir), fmt,
                                 H.MAIN_STEPS - H.SAVE_AT)
        return cache[fmt]

    return resume
