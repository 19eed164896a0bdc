"""Each vendor's GPUs get the shipped predictor trained on that vendor's kernels, unless a checkpoint is given."""

from __future__ import annotations

import pandas as pd
import pytest

import neusight
from neusight.api import load_predictor, shipped_predictor_dir
from neusight.devices import load_device
from neusight.predictor.model import SHIPPED, SHIPPED_AMD

NVIDIA_GPUS = ("a100-pcie-40gb", "p100-pcie-16gb", "p4", "t4", "v100-pcie-32gb")


def test_amd_gpus_get_the_amd_predictor_and_nvidia_gpus_the_nvidia_one():
    assert SHIPPED_AMD.is_dir(), "data/predictor-amd is shipped (see its manifest for the command)"
    assert shipped_predictor_dir(load_device("mi250")) == SHIPPED_AMD
    assert shipped_predictor_dir(load_device("h100-sxm5-80gb")) == SHIPPED == shipped_predictor_dir()
    amd = neusight.predict("gpt2", "mi250", batch_size=1, seq_len=64, memory=False)
    nv = neusight.predict("gpt2", "h100-sxm5-80gb", batch_size=1, seq_len=64, memory=False)
    assert tuple(amd.predictor_devices) == ("mi100", "mi210")
    assert tuple(nv.predictor_devices) == NVIDIA_GPUS
    # an explicit checkpoint wins over the vendor's default
    forced = neusight.predict("gpt2", "mi250", batch_size=1, seq_len=64, memory=False, predictor=SHIPPED)
    assert tuple(forced.predictor_devices) == NVIDIA_GPUS and forced.latency_ms != amd.latency_ms


def test_kernel_table_rows_are_predicted_by_their_vendors_predictor():
    rows = pd.DataFrame({"OPName": ["linear", "linear"], "Device": ["AMD Instinct MI210", "Tesla T4"],
                         "B": [1, 1], "M": [1024, 1024], "N": [1024, 1024], "K": [1024, 1024]})
    mixed = neusight.predict_kernel_table(rows)
    assert mixed.iloc[0] == pytest.approx(neusight.predict_kernel_table(rows.iloc[:1], SHIPPED_AMD).iloc[0])
    assert mixed.iloc[1] == pytest.approx(neusight.predict_kernel_table(rows.iloc[1:], SHIPPED).iloc[0])
    assert mixed.iloc[0] != pytest.approx(neusight.predict_kernel_table(rows.iloc[:1], SHIPPED).iloc[0])
    assert load_predictor(None, "mi100") is load_predictor(SHIPPED_AMD)     # cached, one object per checkpoint
