"""The GPU spec library: every shipped YAML, lookup by key/alias/path, and validation errors."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from neusight.devices import Device, device_dir, list_devices, load_device
from neusight.errors import DeviceError

SPEC_FILES = sorted(device_dir().glob("*.yaml"))
KEYS = [p.stem for p in SPEC_FILES]

REQUIRED_KEYS = [
    "p4", "p100-pcie-16gb", "t4", "v100-pcie-32gb", "v100-sxm2-16gb", "a10", "a10g", "a40", "a100-pcie-40gb",
    "a100-sxm4-40gb", "a100-80gb-pcie", "a100-sxm4-80gb", "a800-sxm4-80gb", "l4", "l40", "l40s", "h100-pcie",
    "h100-sxm5-80gb", "h800-sxm5-80gb",
    "h200", "b200", "rtx-3060", "rtx-3090", "rtx-4070", "rtx-4080", "rtx-4090", "rtx-2080-ti", "gtx-1080-ti",
    "titan-v", "titan-rtx",
    "titan-xp", "quadro-rtx-5000", "quadro-rtx-6000", "quadro-rtx-8000", "mi100", "mi210", "mi250", "mi300x",
]

# exact torch.cuda.get_device_name() strings (old and new driver spellings) -> library key
REQUIRED_ALIASES = {
    "Tesla P4": "p4",
    "Tesla P100-PCIE-16GB": "p100-pcie-16gb",
    "Tesla T4": "t4",
    "Tesla V100-PCIE-32GB": "v100-pcie-32gb",
    "Tesla V100-SXM2-16GB": "v100-sxm2-16gb",
    "v100-sxm2": "v100-sxm2-16gb",
    "NVIDIA A10": "a10",
    "NVIDIA A10G": "a10g",
    "NVIDIA A40": "a40",
    "NVIDIA A100-PCIE-40GB": "a100-pcie-40gb",
    "NVIDIA A100-SXM4-40GB": "a100-sxm4-40gb",
    "NVIDIA A100 80GB PCIe": "a100-80gb-pcie",
    "NVIDIA A100-SXM4-80GB": "a100-sxm4-80gb",
    "NVIDIA L4": "l4",
    "NVIDIA L40S": "l40s",
    "NVIDIA L40": "l40",
    "NVIDIA H800": "h800-sxm5-80gb",
    "NVIDIA A800-SXM4-80GB": "a800-sxm4-80gb",
    "NVIDIA H100 80GB HBM3": "h100-sxm5-80gb",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H200": "h200",
    "NVIDIA B200": "b200",
    "H100": "h100-sxm5-80gb",
    "A100": "a100-sxm4-40gb",
    "GeForce RTX 2080 Ti": "rtx-2080-ti",
    "NVIDIA GeForce RTX 2080 Ti": "rtx-2080-ti",
    "GeForce GTX 1080 Ti": "gtx-1080-ti",
    "NVIDIA GeForce GTX 1080 Ti": "gtx-1080-ti",
    "GeForce RTX 3090": "rtx-3090",
    "NVIDIA GeForce RTX 3090": "rtx-3090",
    "NVIDIA GeForce RTX 4080": "rtx-4080",
    "NVIDIA GeForce RTX 4090": "rtx-4090",
    "TITAN V": "titan-v",
    "NVIDIA TITAN V": "titan-v",
    "TITAN RTX": "titan-rtx",
    "NVIDIA TITAN RTX": "titan-rtx",
    "TITAN Xp": "titan-xp",
    "NVIDIA TITAN Xp": "titan-xp",
    "TITAN X (Pascal)": "titan-x-pascal",
    "Tesla M40": "m40",
    "Tesla M60": "m60",
    "NVIDIA GeForce RTX 3060": "rtx-3060",
    "NVIDIA GeForce RTX 4070": "rtx-4070",
    "Quadro RTX 5000": "quadro-rtx-5000",
    "Quadro RTX 6000": "quadro-rtx-6000",
    "Quadro RTX 8000": "quadro-rtx-8000",
    "NVIDIA RTX A4000": "rtx-a4000",
    "NVIDIA RTX A4500": "rtx-a4500",
    "NVIDIA RTX A5000": "rtx-a5000",
    "NVIDIA RTX A5500": "rtx-a5500",
    "NVIDIA GeForce RTX 3070": "rtx-3070",
    "AMD Instinct MI100": "mi100",
    "AMD Instinct MI210": "mi210",
    "AMD Instinct MI250": "mi250",
    "AMD Instinct MI250X / MI250": "mi250",
    "AMD Instinct MI250X": "mi250x",
    "AMD Instinct MI300X": "mi300x",
}


def _norm(label: str) -> str:
    return re.sub(r"[\s_\-]+", "", label).lower()


# ---- the shipped library ---------------------------------------------------------------------------------

def test_library_has_every_required_key():
    assert set(REQUIRED_KEYS) <= set(list_devices())
    assert list_devices() == sorted(KEYS)


@pytest.mark.parametrize("path", SPEC_FILES, ids=KEYS)
def test_every_spec_file_loads_and_cites_its_source(path: Path):
    device = load_device(path)
    assert device.key == path.stem
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", device.key)
    assert path.read_text().startswith("# source: ")
    assert len(device.source) > 20
    assert load_device(device.key) == device  # same numbers by path and by key


@pytest.mark.parametrize("alias, key", REQUIRED_ALIASES.items())
def test_required_alias_resolves(alias: str, key: str):
    assert load_device(alias).key == key


@pytest.mark.parametrize("name, key", [
    ("nvidia h100 80gb hbm3", "h100-sxm5-80gb"),
    ("NVIDIA_H100_80GB_HBM3", "h100-sxm5-80gb"),
    ("  Tesla T4 ", "t4"),
    ("tesla-t4", "t4"),
    ("A100 SXM4 40GB", "a100-sxm4-40gb"),
    ("H100_SXM5_80GB", "h100-sxm5-80gb"),
    ("geforce rtx 2080ti", "rtx-2080-ti"),
    ("MI300X", "mi300x"),
    ("NVIDIA_A100_80GB_PCIe", "a100-80gb-pcie"),  # file-stem spellings of the NeuSight dataset
    ("Tesla_V100-PCIE-32GB", "v100-pcie-32gb"),
    ("AMD_Instinct_MI250", "mi250"),
])
def test_lookup_ignores_case_spaces_dashes_underscores(name: str, key: str):
    assert load_device(name).key == key


@pytest.mark.parametrize("name, key", [
    ("A100 80GB SXM4", "a100-sxm4-80gb"),       # benchmark tables put the words in another order
    ("80GB A100 PCIe", "a100-80gb-pcie"),
    ("Tesla A100 SXM4 40GB", "a100-sxm4-40gb"),  # maker words added ...
    ("Instinct MI250", "mi250"),                 # ... or dropped
    ("H200 SXM 141GB", "h200"),
    ("H100-NVL-94GB", "h100-nvl"),
    ("GH200-96GB", "gh200"),
])
def test_lookup_takes_the_words_of_a_name_in_any_order(name: str, key: str):
    assert load_device(name).key == key


@pytest.mark.parametrize("name", ["A100-80GB",      # both A100 80GB cards: which one is not said
                                  "RTX 3090 Ti",    # another card than the RTX 3090, never its near match
                                  "A100 SXM4 80GB 40GB"])
def test_word_lookup_needs_exactly_one_gpus_words(name: str):
    with pytest.raises(DeviceError, match="unknown device"):
        load_device(name)


def test_no_two_devices_share_an_alias():
    owner: dict[str, str] = {}
    for key in list_devices():
        device = load_device(key)
        for label in {_norm(a) for a in (key, device.name, *device.aliases)}:
            assert owner.setdefault(label, key) == key, f"{label!r} names both {owner[label]} and {key}"


@pytest.mark.parametrize("key", KEYS)
def test_display_name_resolves(key: str):
    """The name a forecast prints ("NVIDIA H100 SXM5 80GB") finds its GPU again."""
    device = load_device(key)
    assert load_device(device.name).key == key
    assert load_device(device.name.upper().replace(" ", "_")).key == key


@pytest.mark.parametrize("key", KEYS)
def test_fp32_peak_matches_lanes_times_clock(key: str):
    # fp32 = 2 FLOP/FMA x SMs x FP32 lanes per SM x clock, e.g. H100 SXM: 2 x 132 x 128 x 1980 MHz = 66.9 TF
    d = load_device(key)
    derived_tflops = 2 * d.sm_count * d.fp32_cores_per_sm * d.boost_clock_mhz / 1e6
    assert derived_tflops == pytest.approx(d.fp32_tflops, rel=0.03)


@pytest.mark.parametrize("key", KEYS)
def test_peaks_are_ordered_sensibly(key: str):
    d = load_device(key)
    assert d.fp32_matrix_tflops >= d.fp32_tflops
    assert d.fp16_tensor_tflops >= d.fp32_tflops
    for tensor in (d.tf32_tensor_tflops, d.bf16_tensor_tflops):
        assert tensor is None or tensor >= d.fp32_tflops
    assert d.interconnect_gbps >= d.pcie_gbps
    assert d.architecture in ("maxwell", "pascal", "volta", "turing") or d.bf16_tensor_tflops is not None
    # FP8 tensor cores from Ada, Hopper and CDNA3 on, at twice the FP16 rate (the RTX 6000 Ada's FP16 figure is
    # its L40 twin's, at half rate, see its spec file)
    assert (d.fp8_tensor_tflops is not None) == (d.architecture in ("ada", "hopper", "blackwell", "cdna3"))
    if d.fp8_tensor_tflops is not None:
        ratio = d.fp8_tensor_tflops / d.fp16_tensor_tflops
        assert ratio == pytest.approx(4 if key == "rtx-6000-ada" else 2, rel=0.02)   # L40S: 733 / 362.05
    # FP4 tensor cores on Blackwell alone, at twice the FP8 rate (B200: 9 of the datasheet's 18 sparse PFLOPS)
    assert (d.fp4_tensor_tflops is not None) == (d.architecture == "blackwell")
    if d.fp4_tensor_tflops is not None:
        assert d.fp4_tensor_tflops / d.fp8_tensor_tflops == pytest.approx(2, rel=0.02)


@pytest.mark.parametrize("key", KEYS)
def test_dual_issue_flag_marks_ga10x_ada_hopper_and_blackwell_only(key: str):
    # the SMs whose schedulers feed 32 FP32 lanes each (neusight.tiles.DUAL_ISSUE_GEMM_FRACTION)
    d = load_device(key)
    assert d.fp32_dual_issue == (d.architecture in ("ada", "hopper", "blackwell") or d.compute_capability == "8.6")


@pytest.mark.parametrize("a100", ["a100-pcie-40gb", "a100-sxm4-40gb", "a100-80gb-pcie", "a100-sxm4-80gb"])
def test_h100_sxm_beats_a100_in_every_peak(a100: str):
    h, a = load_device("h100-sxm5-80gb"), load_device(a100)
    for dtype in ("float32", "tf32", "float16", "bfloat16"):
        for tensor_cores in (True, False):
            assert h.peak_flops(dtype, tensor_cores) > a.peak_flops(dtype, tensor_cores)
    assert h.mem_bandwidth_bytes_per_s > a.mem_bandwidth_bytes_per_s
    assert h.l2_cache_bytes > a.l2_cache_bytes
    assert h.interconnect_gbps > a.interconnect_gbps


def test_mi250_is_one_gcd():
    # torch sees each of the two dies as a device: half the package's 208 CUs, 128 GB, 3.2768 TB/s
    d = load_device("AMD Instinct MI250")
    assert (d.sm_count, d.memory_gib, d.mem_bandwidth_gbps) == (104, 64, 1638.4)
    # MI250X: 220 CUs per package, so 110 per GCD, at the same clock and memory
    x = load_device("AMD Instinct MI250X")
    assert (x.sm_count, x.memory_gib, x.mem_bandwidth_gbps) == (110, 64, 1638.4)
    assert x.peak_fp32_flops > d.peak_fp32_flops


# ---- derived quantities ----------------------------------------------------------------------------------

def test_derived_properties():
    d = load_device("h100-sxm5-80gb")
    assert d.peak_fp32_flops == 67e12
    assert d.mem_bandwidth_bytes_per_s == 3350e9
    assert d.memory_bytes == 80 * 2**30
    assert d.l2_cache_bytes == 50 * 2**20
    assert d.ridge_point_fp32 == pytest.approx(67e12 / 3350e9)  # = 20 FLOP/byte


def test_peak_flops_by_dtype():
    h, v, p100, mi = (load_device(k) for k in ("h100-sxm5-80gb", "v100-sxm2-16gb", "p100-pcie-16gb", "mi100"))
    assert h.peak_flops("float32") == h.peak_flops("fp32", tensor_cores=False) == 67e12
    assert h.peak_flops("tf32") == pytest.approx(494.7e12)
    assert h.peak_flops("tf32", tensor_cores=False) == 67e12
    assert h.peak_flops("torch.bfloat16") == h.peak_flops("bf16") == pytest.approx(989.4e12)
    assert h.peak_flops("half", tensor_cores=False) == 2 * 67e12  # packed half2 vector rate
    assert v.peak_flops("tf32") == v.peak_flops("float32") == 15.7e12  # no TF32 before Ampere
    assert v.peak_flops("bfloat16") == 15.7e12  # no BF16 units: upcast to FP32
    assert p100.peak_flops("float16") == pytest.approx(18.7e12)
    assert p100.peak_flops("float16", tensor_cores=False) == pytest.approx(18.6e12)  # min(2 x 9.3, 18.7)
    assert mi.peak_flops("float32") == pytest.approx(46.1e12)  # matrix cores
    assert mi.peak_flops("float32", tensor_cores=False) == pytest.approx(23.1e12)
    with pytest.raises(DeviceError, match="int8"):
        h.peak_flops("int8")
    assert h.peak_flops("float8_e4m3fn") == h.peak_flops("torch.float8_e5m2") == pytest.approx(1978.9e12)
    with pytest.raises(DeviceError, match=r"v100-sxm2-16gb .* has no FP8 tensor cores"):
        v.peak_flops("fp8")
    with pytest.raises(DeviceError, match=r"h100-sxm5-80gb .* has no FP4 tensor cores \(fp4_tensor_tflops"):
        h.peak_flops("fp4")
    assert load_device("b200").peak_flops("float4_e2m1") == load_device("b200").peak_flops("fp4") == 9000e12


def test_device_is_frozen_and_round_trips_through_dict():
    d = load_device("l4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.sm_count = 1  # type: ignore[misc]
    as_dict = d.to_dict()
    assert isinstance(as_dict["aliases"], list)
    assert Device(**{**as_dict, "aliases": tuple(as_dict["aliases"])}) == d
    assert load_device(d) is d
    assert load_device("NVIDIA L4") is load_device("l4")  # parsed once, shared


# ---- spec files given by path ----------------------------------------------------------------------------

def _valid_spec() -> dict:
    spec = load_device("h100-sxm5-80gb").to_dict()
    del spec["key"]
    return spec


def _write(tmp_path: Path, spec, name: str = "my-gpu.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False) if not isinstance(spec, str) else spec)
    return path


def test_path_loading_yaml_json_and_pathlike(tmp_path: Path):
    by_str = load_device(str(_write(tmp_path, _valid_spec())))
    assert by_str.key == "my-gpu" and by_str.sm_count == 132
    assert load_device(tmp_path / "my-gpu.yaml") == by_str
    json_path = tmp_path / "h100-sxm5-80gb.json"
    json_path.write_text(json.dumps(load_device("h100-sxm5-80gb").to_dict()))
    assert load_device(json_path) == load_device("h100-sxm5-80gb")


def test_values_with_units_are_converted(tmp_path: Path):
    spec = {**_valid_spec(), "mem_bandwidth_gbps": "3.35 TB/s", "memory_gib": "80 GB",
            "boost_clock_mhz": "1.98 GHz", "l2_cache_mib": "50 MB", "fp32_tflops": "67 TFLOPS",
            "shared_mem_per_sm_kib": "228 KiB", "tdp_w": "0.7 kW", "interconnect_gbps": "900 GB/s",
            "sm_count": "132"}
    d = load_device(_write(tmp_path, spec))
    assert d.mem_bandwidth_gbps == pytest.approx(3350)
    assert d.memory_gib == 80 and d.l2_cache_mib == 50 and d.shared_mem_per_sm_kib == 228
    assert d.boost_clock_mhz == pytest.approx(1980) and d.tdp_w == pytest.approx(700)
    assert d.fp32_tflops == 67 and d.interconnect_gbps == 900 and d.sm_count == 132
    assert load_device(_write(tmp_path, {**spec, "l2_cache_mib": "512 KB"})).l2_cache_mib == 0.5


@pytest.mark.parametrize("change, expected", [
    ({"mem_bandwidth_gbps": -5}, ["mem_bandwidth_gbps", "-5", "must be > 0"]),
    ({"sm_count": 0}, ["sm_count", "0", "must be > 0"]),
    ({"mem_bandwidth_gbps": "3.35 TB/sec"}, ["mem_bandwidth_gbps", "3.35 TB/sec", "TB/sec", "GB/s", "TB/s"]),
    ({"boost_clock_mhz": "fast"}, ["boost_clock_mhz", "fast", "MHz", "GHz"]),
    ({"sm_count": 131.5}, ["sm_count", "131.5", "whole number"]),
    ({"sm_count": "132 SMs"}, ["sm_count", "132 SMs", "unknown unit"]),
    ({"fp32_dual_issue": "yes"}, ["fp32_dual_issue", "yes", "true or false"]),
    ({"aliases": "H100"}, ["aliases", "H100", "list"]),
    ({"vendor": "intel"}, ["vendor", "intel", "nvidia, amd"]),
    ({"architecture": "Hopper"}, ["architecture", "Hopper", "hopper"]),
    ({"memory_type": "HBM4X"}, ["memory_type", "HBM4X", "HBM3e", "GDDR6"]),
    ({"mem_bandwith_gbps": 3350}, ["mem_bandwith_gbps", "3350", "did you mean 'mem_bandwidth_gbps'"]),
    ({"tf32_tensor_tflops": True}, ["tf32_tensor_tflops", "True", "expected a number"]),
])
def test_bad_value_names_file_field_and_value(tmp_path: Path, change: dict, expected: list[str]):
    path = _write(tmp_path, {**_valid_spec(), **change})
    with pytest.raises(DeviceError) as info:
        load_device(path)
    message = str(info.value)
    assert str(path) in message and "Fix:" in message
    for part in expected:
        assert part in message


def test_missing_field_is_named(tmp_path: Path):
    spec = _valid_spec()
    del spec["mem_bandwidth_gbps"]
    with pytest.raises(DeviceError, match=r"missing required field 'mem_bandwidth_gbps' \(in GB/s\)"):
        load_device(_write(tmp_path, spec))
    del spec["infinity_cache_mib"], spec["bf16_tensor_tflops"]  # optional ones may be left out
    spec["mem_bandwidth_gbps"] = 3350
    assert load_device(_write(tmp_path, spec)).bf16_tensor_tflops is None


@pytest.mark.parametrize("text, expected", [
    ("- name: H100\n- sm_count: 132\n", "expected a mapping"),
    ("just a string\n", "expected a mapping"),
    ("", "expected a mapping"),
    ("name: [unclosed\n", "not valid YAML"),
    (json.dumps({"Device": "Tesla T9", "Num_Sm": 40, "Mem_Bw": 320}), "a GPU the spec library does not know"),
    (json.dumps({"Device": "Tesla T4", "Num_Sm": 40, "Mem_Bw": "fast"}), "'Mem_Bw' = 'fast'"),
    (json.dumps({"Device": "Tesla T4", "Num_Sm": 40, "Mem_BW": 320}), "unknown NeuSight field 'Mem_BW'"),
    # NeuSight's tensor-parallel H100 file: a two-GPU 1,979 TFLOPS "peak" is no GPU's FP32 vector peak
    (json.dumps({"Device": "NVIDIA H100 80GB HBM3", "Num_Sm": 132, "Core_Per_SM": 128, "Freq": 1980,
                 "SingleFLOPs": 1979000}), "disagrees with 2 x Num_Sm"),
])
def test_malformed_file(tmp_path: Path, text: str, expected: str):
    path = _write(tmp_path, text)
    with pytest.raises(DeviceError, match=re.escape(expected)) as info:
        load_device(path)
    assert str(path) in str(info.value)


def test_missing_spec_file(tmp_path: Path):
    with pytest.raises(DeviceError, match="does not exist"):
        load_device(tmp_path / "nope.yaml")


# ---- unknown names and other libraries -------------------------------------------------------------------

@pytest.mark.parametrize("name, close", [
    ("H100 SXM6", "h100-sxm5-80gb"),
    ("a100-sxm4-40g", "a100-sxm4-40gb"),
    ("rtx 4060", "rtx-4090"),
])
def test_unknown_name_lists_close_matches(name: str, close: str):
    with pytest.raises(DeviceError) as info:
        load_device(name)
    message = str(info.value)
    assert repr(name) in message and close in message and ".yaml" in message
    listed = message.split("Closest known: ")[1].split(". Fix")[0].split(", ")
    assert len(listed) == 3 and close in listed


def test_wrong_argument_type():
    with pytest.raises(DeviceError, match="expected a device name"):
        load_device(132)  # type: ignore[arg-type]


def test_neusight_data_env_and_duplicate_aliases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = _valid_spec()  # read from the shipped library before NEUSIGHT_DATA points elsewhere
    folder = tmp_path / "devices"
    folder.mkdir()
    _write(folder, spec, "gpu-a.yaml")
    monkeypatch.setenv("NEUSIGHT_DATA", str(tmp_path))
    assert device_dir() == folder
    assert list_devices() == ["gpu-a"]
    assert load_device("NVIDIA H100 80GB HBM3").key == "gpu-a"

    other = tmp_path / "other"
    (other / "devices").mkdir(parents=True)
    _write(other / "devices", spec, "gpu-a.yaml")
    _write(other / "devices", {**spec, "name": "GPU B", "aliases": ["h100_sxm"]}, "gpu-b.yaml")
    monkeypatch.setenv("NEUSIGHT_DATA", str(other))
    with pytest.raises(DeviceError, match=r"gpu-b\.yaml: name or alias 'h100_sxm' also names device 'gpu-a'"):
        list_devices()

    monkeypatch.setenv("NEUSIGHT_DATA", str(tmp_path / "empty"))
    with pytest.raises(DeviceError, match="NEUSIGHT_DATA"):
        load_device("h100")


def test_memory_type_is_required_and_classified(tmp_path: Path):
    spec = _valid_spec()
    del spec["memory_type"]
    with pytest.raises(DeviceError, match="missing required field 'memory_type'"):
        load_device(_write(tmp_path, spec))
    assert load_device("h100-sxm5-80gb").hbm and load_device("a100-pcie-40gb").hbm
    assert not load_device("l4").hbm and not load_device("t4").hbm and not load_device("rtx-4090").hbm


def test_neusight_json_takes_its_numbers_over_the_library_entry(tmp_path: Path, caplog):
    # NeuSight's own H100 file: 3430 GB/s where the library has the datasheet's 3350; the rest agrees
    spec = {"Device": "NVIDIA H100 80GB HBM3", "Dev_Mem": 80, "Mem_Bw": 3430, "Num_Sm": 132, "Core_Per_SM": 128,
            "Freq": 1980, "SingleFLOPs": 66908, "L2Cache": 50}
    with caplog.at_level("WARNING", logger="neusight.devices"):
        d = load_device(_write(tmp_path, json.dumps(spec), "NVIDIA_H100_80GB_HBM3.json"))
    lib = load_device("h100-sxm5-80gb")
    assert d.key == lib.key and d.architecture == lib.architecture and d.tdp_w == lib.tdp_w
    assert d.mem_bandwidth_gbps == 3430.0
    assert d.fp32_tflops == pytest.approx(66.908) and d.fp32_matrix_tflops == pytest.approx(66.908)
    assert "Mem_Bw = 3430 replaces" in caplog.text and "NeuSight-style JSON" in d.source


def test_neusight_json_amd_peaks_and_lanes(tmp_path: Path):
    # AMD files count Core_Per_SM as SIMD units (4 per CU), not lanes: the vector peak is checked against the
    # library's 64 lanes: 2 x 104 x 64 x 1700 MHz = 22.63 TFLOPS
    spec = {"Device": "AMD Instinct MI210", "Num_Sm": 104, "Core_Per_SM": 4, "Freq": 1700,
            "SingleFLOPsMM": 45300, "SingleFLOPsVEC": 22600, "L2Cache": 8}
    d = load_device(_write(tmp_path, json.dumps(spec), "mi210.json"))
    assert d.fp32_cores_per_sm == 64 and d.fp32_tflops == pytest.approx(22.6)
    assert d.fp32_matrix_tflops == pytest.approx(45.3)


def test_every_neusight_json_of_the_dataset_loads_but_the_tensor_parallel_one():
    from tests.conftest import DATASET, need_shared

    files = sorted(need_shared(DATASET / "devices").glob("*.json"))
    for f in files:
        name = json.loads(f.read_text())["Device"]
        if f.stem.endswith("_TP"):   # two H100s' tensor peak, 1,979 TFLOPS, written as one GPU's FP32 peak
            with pytest.raises(DeviceError, match="'SingleFLOPs' = 1979000"):
                load_device(f)
        else:
            assert load_device(f).key == load_device(name).key, f



# ---- what-if edits --------------------------------------------------------------------------------------

def test_modify_device_changes_one_number_and_says_so():
    from neusight.devices import modify_device

    base = load_device("h100-sxm5-80gb")
    d = modify_device(base, mem_bandwidth_gbps="4.8 TB/s", memory_gib=141)
    assert (d.mem_bandwidth_gbps, d.memory_gib) == (4800.0, 141.0)
    assert d.key == "h100-sxm5-80gb+mem_bandwidth_gbps=4800+memory_gib=141" and d.aliases == ()
    assert "what-if" in d.name and "3350 -> 4800" in d.name
    same = {f.name for f in dataclasses.fields(Device)} - {"key", "name", "aliases", "source", "mem_bandwidth_gbps",
                                                            "memory_gib"}
    assert all(getattr(d, f) == getattr(base, f) for f in same)
    assert modify_device(base) is base


def test_modify_device_rescales_the_peaks_with_sms_and_clock_unless_given():
    from neusight.devices import modify_device

    base = load_device("a100-pcie-40gb")
    half = modify_device(base, sm_count=base.sm_count // 2)
    for peak in ("fp32_tflops", "fp32_matrix_tflops", "tf32_tensor_tflops", "fp16_tensor_tflops", "bf16_tensor_tflops"):
        assert getattr(half, peak) == pytest.approx(getattr(base, peak) / 2)
    assert modify_device("l4", sm_count=29).fp8_tensor_tflops == pytest.approx(242.5 / 2)   # L4: 58 SMs
    assert modify_device("b200", boost_clock_mhz=990).fp4_tensor_tflops == pytest.approx(9000 / 2)   # B200: 1,980
    pinned = modify_device(base, boost_clock_mhz=2 * base.boost_clock_mhz, fp16_tensor_tflops=400)
    assert pinned.fp16_tensor_tflops == 400 and pinned.fp32_tflops == pytest.approx(2 * base.fp32_tflops)
    lanes = modify_device(base, fp32_cores_per_sm=128)        # twice the FP32 lanes: FP32 peaks only
    assert lanes.fp32_tflops == pytest.approx(2 * base.fp32_tflops)
    assert lanes.fp16_tensor_tflops == pytest.approx(base.fp16_tensor_tflops)


@pytest.mark.parametrize("changes, fragment", [
    ({"mem_bandwith_gbps": 1000}, "did you mean 'mem_bandwidth_gbps'"),
    ({"name": "my GPU"}, "not a spec number that can be changed"),
    ({"sm_count": -4}, "sm_count"),
    ({"memory_type": "HBM9"}, "HBM9"),
    ({"mem_bandwidth_gbps": "fast"}, "mem_bandwidth_gbps"),
])
def test_modify_device_refuses_bad_changes_by_name(changes, fragment):
    from neusight.devices import modify_device

    with pytest.raises(DeviceError, match=re.escape(fragment)):
        modify_device("t4", **changes)


@pytest.mark.parametrize("name, taken, others", [
    ("A100", "a100-sxm4-40gb", ["a100-80gb-pcie", "a100-pcie-40gb", "a100-sxm4-80gb"]),
    ("h100", "h100-sxm5-80gb", ["h100-nvl", "h100-pcie"]),
    ("a100-pcie-40gb", "a100-pcie-40gb", []),          # a full key leaves nothing open
    ("NVIDIA H100 80GB HBM3", "h100-sxm5-80gb", []),   # nor does a torch.cuda.get_device_name() string
    ("t4", "t4", []),
])
def test_a_short_name_says_which_other_gpus_it_fits(name, taken, others):
    from neusight.devices import _tokens, also_named

    assert load_device(name).key == taken
    got = also_named(name)
    assert got == others
    for key in got:          # every one holds the name's words in its key, name or an alias
        d = load_device(key)
        assert any(_tokens(name) <= _tokens(label) for label in (key, d.name, *d.aliases))
    assert also_named("h999") == [] and also_named("/some/gpu.yaml") == []


def test_the_command_line_notes_what_a_short_device_name_leaves_out(capsys):
    from omegaconf import OmegaConf

    from neusight.cli.predict import _say_what_short_names_leave_out

    _say_what_short_names_leave_out(OmegaConf.create({"device": ["a100", "t4", "a100"]}))
    out = capsys.readouterr().out.splitlines()
    assert out == ["note: device=a100 is taken as a100-sxm4-40gb; the name also fits a100-80gb-pcie, a100-pcie-40gb, "
                   "a100-sxm4-80gb (pass one of those keys to forecast it instead)"]
    _say_what_short_names_leave_out(OmegaConf.create({"device": "all"}))
    assert capsys.readouterr().out == ""
