from __future__ import annotations

import logging
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
DATASET = SHARED / "datasets" / "neusight-asplos25"


@pytest.fixture(autouse=True, scope="session")
def _quiet_transformers():
    from neusight.cli.common import quiet_third_party_logs

    quiet_third_party_logs()
    logging.getLogger("neusight").setLevel(logging.INFO)


def need_shared(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is not there: the shared datasets are expected at ../shared beside the repo")
    return path
