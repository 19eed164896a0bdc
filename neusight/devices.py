"""GPU spec library: one YAML per GPU in ``data/devices``, loaded into a frozen, validated :class:`Device`.

Units live in the field names; a spec value is a plain number in that unit or a string with a unit
("3.35 TB/s", "80 GB"), converted on load. No GPU is known by name here: every number comes from a spec file.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import math
import os
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, get_args, get_type_hints

import yaml

from neusight.errors import DeviceError

__all__ = ["Device", "device_dir", "device_rows", "list_devices", "load_device"]

log = logging.getLogger(__name__)

VENDORS = ("nvidia", "amd")
ARCHITECTURES = ("maxwell", "pascal", "volta", "turing", "ampere", "ada", "hopper", "blackwell",
                 "cdna1", "cdna2", "cdna3")
# DRAM technology as the spec sheet names it: stacked HBM (wide, slow interface beside the die) or GDDR
# (narrow, fast, on the board); memory-bound kernels reach a different share of the datasheet bandwidth on each.
MEMORY_TYPES = ("GDDR5", "GDDR5X", "GDDR6", "GDDR6X", "GDDR7", "HBM2", "HBM2e", "HBM3", "HBM3e")
SPEC_SUFFIXES = (".yaml", ".yml", ".json")
_EXAMPLE = "data/devices/h100-sxm5-80gb.yaml"


@dataclasses.dataclass(frozen=True)
class Device:
    """Spec sheet of one GPU as torch sees it (one GCD of a two-die AMD package); units in the field names.

    Tensor peaks are dense (no 2:4 sparsity), None where the type is unsupported. GB/s are decimal
    (10**9 bytes/s); memory and cache sizes are binary as marketed (GB = GiB, MB = MiB).
    """

    key: str  # library key = file stem, e.g. "h100-sxm5-80gb"
    name: str  # marketing name
    aliases: tuple[str, ...]  # other names, incl. every torch.cuda.get_device_name() spelling
    vendor: str  # "nvidia" | "amd"
    architecture: str  # one of ARCHITECTURES
    compute_capability: str  # CUDA "8.0"; AMD gfx target "gfx90a"
    sm_count: int  # SMs (AMD: compute units)
    fp32_cores_per_sm: int  # FP32 lanes per SM as the spec sheet counts them
    fp32_dual_issue: bool  # SGEMM cannot fill them: 32 per one-warp-per-clock scheduler (GA10x, Ada, Hopper, Blackwell)
    boost_clock_mhz: float  # clock behind fp32_tflops = 2 x sm_count x fp32_cores_per_sm x clock
    fp32_tflops: float  # non-tensor (vector) FP32 peak
    fp32_matrix_tflops: float  # FP32 on matrix units (AMD MFMA); NVIDIA: = fp32_tflops
    fp16_tensor_tflops: float  # FP16 tensor peak, FP32 accumulate; without tensor cores what FP16 really does
    memory_gib: float  # marketed memory
    memory_type: str  # one of MEMORY_TYPES, e.g. "HBM2e", "GDDR6"
    mem_bandwidth_gbps: float  # DRAM bandwidth, GB/s
    l2_cache_mib: float
    shared_mem_per_sm_kib: float  # max configurable shared memory (AMD: LDS) per SM
    registers_per_sm_k: int  # 32-bit registers per SM, in units of 1024
    max_threads_per_sm: int
    max_blocks_per_sm: int
    interconnect_gbps: float  # NVLink / Infinity Fabric per GPU, bidirectional; PCIe where there is none
    pcie_gbps: float  # host link, bidirectional
    tdp_w: float  # board power
    source: str  # the public documents the numbers come from
    tf32_tensor_tflops: float | None = None  # None before Ampere / CDNA3
    bf16_tensor_tflops: float | None = None  # None where BF16 math is not supported
    fp8_tensor_tflops: float | None = None  # dense FP8 tensor peak, FP32 accumulate; None before Ada / Hopper / CDNA3
    fp4_tensor_tflops: float | None = None  # dense FP4 tensor peak (NVFP4 / MXFP4 operands); None before Blackwell
    infinity_cache_mib: float | None = None  # AMD memory-side cache
    interconnect_group: int | None = None  # GPUs interconnect_gbps joins (an NVLink bridge: 2, an Infinity Fabric
    #                                        hive: 4); beyond them PCIe. None: every GPU of a node (NVSwitch, a mesh)
    nvls: bool = False  # the node's NVSwitches reduce and multicast in the switch (NVLink SHARP: HGX / DGX H100, H200,
    #                     B200), which NCCL's NVLS and NVLS_TREE all-reduces use

    @property
    def peak_fp32_flops(self) -> float:
        """Non-tensor FP32 peak in FLOP/s."""
        return self.fp32_tflops * 1e12

    @property
    def cc(self) -> float:
        """Compute capability as a number (8.9 -> 8.9); AMD gfx targets (and anything unparsable) map to 0.0."""
        try:
            return float(self.compute_capability)
        except (TypeError, ValueError):
            return 0.0

    @property
    def hbm(self) -> bool:
        """Stacked high-bandwidth memory (HBM*) rather than GDDR."""
        return self.memory_type.startswith("HBM")

    @property
    def mem_bandwidth_bytes_per_s(self) -> float:
        """DRAM bandwidth in bytes/s (datasheet GB/s are decimal)."""
        return self.mem_bandwidth_gbps * 1e9

    @property
    def l2_cache_bytes(self) -> int:
        """L2 size in bytes (a marketed "50 MB" L2 is 50 MiB)."""
        return round(self.l2_cache_mib * 2**20)

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes (a marketed "80 GB" of HBM is 80 GiB)."""
        return round(self.memory_gib * 2**30)

    @property
    def ridge_point_fp32(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the FP32 roofline turns from memory- to compute-bound."""
        return self.peak_fp32_flops / self.mem_bandwidth_bytes_per_s

    def peak_flops(self, dtype: Any, tensor_cores: bool = True) -> float:
        """Peak FLOP/s for `dtype` ("float32", "tf32", "float16", "bfloat16", "float8", short names or a torch.dtype).

        float32: matrix-unit peak if `tensor_cores` (= vector peak on NVIDIA); tf32: float32 where unsupported
        or without tensor cores; float16/bfloat16: tensor peak, else packed-vector min(2 x FP32, tensor peak);
        float8 (e4m3 / e5m2): the FP8 tensor peak, a DeviceError on a GPU without FP8 tensor cores; float4 (e2m1)
        likewise at the FP4 tensor peak.
        """
        kind = dtype_kind(dtype)
        if kind is None:
            raise DeviceError(f"peak_flops: unknown dtype {dtype!r}. Fix: pass one of {sorted(_DTYPES)}.")
        if kind in _NARROW:     # FP8 / FP4: their own tensor peak, or none
            name, gpus = _NARROW[kind]
            peak = getattr(self, f"{name.lower()}_tensor_tflops")
            if peak is None:
                raise DeviceError(f"{self.key} ({self.name}) has no {name} tensor cores ({name.lower()}_tensor_tflops "
                                  f"is not given): {name} matrix multiplies run on {gpus} GPUs. Fix: choose such a "
                                  f"GPU, or leave {name} out")
            return peak * 1e12
        if kind == "tf32" and tensor_cores and self.tf32_tensor_tflops is not None:
            return self.tf32_tensor_tflops * 1e12
        tensor = {"float16": self.fp16_tensor_tflops, "bfloat16": self.bf16_tensor_tflops}.get(kind)
        if tensor is None:  # float32, tf32 without TF32 units, and bfloat16 on parts without BF16 math
            # NB: without BF16 units frameworks upcast bfloat16 math to FP32, so it runs at the FP32 rate.
            return (self.fp32_matrix_tflops if tensor_cores else self.fp32_tflops) * 1e12
        return (tensor if tensor_cores else min(2 * self.fp32_tflops, tensor)) * 1e12

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (aliases as a list), ready for YAML/JSON."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


# narrow tensor-core precisions: (their name in messages and spec fields, the GPUs that have them)
_NARROW = {"float8": ("FP8", "Ada, Hopper, Blackwell and CDNA3"), "float4": ("FP4", "Blackwell (B200)")}

_DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "tf32": "tf32",
           "tensorfloat32": "tf32", "float16": "float16", "fp16": "float16", "half": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16", "float8": "float8", "fp8": "float8",
           "float8_e4m3fn": "float8", "float8_e5m2": "float8", "float4": "float4", "fp4": "float4",
           "float4_e2m1": "float4", "float4_e2m1fn_x2": "float4"}


def dtype_kind(dtype: Any) -> str | None:
    """The precision whose peak :meth:`Device.peak_flops` takes for ``dtype`` (a name, a short name or a
    torch.dtype): "float32", "tf32", "float16", "bfloat16", "float8" or "float4"; None if it is none of them."""
    return _DTYPES.get(str(dtype).lower().removeprefix("torch."))


# Accepted unit spellings per key-name suffix -> factor into the key's unit. NB: memory sizes are binary as
# marketed ("80 GB" of HBM is 80 GiB, a "50 MB" L2 is 50 MiB), so GB and GiB mean the same here.
_SIZES = {"KB": 2**10, "KiB": 2**10, "MB": 2**20, "MiB": 2**20, "GB": 2**30, "GiB": 2**30, "TB": 2**40,
          "TiB": 2**40}
_UNITS: dict[str, tuple[str, dict[str, float]]] = {  # suffix -> (the key's unit, accepted units)
    "_mhz": ("MHz", {"MHz": 1.0, "GHz": 1e3}),
    "_tflops": ("TFLOPS", {"GFLOPS": 1e-3, "TFLOPS": 1.0, "PFLOPS": 1e3, "GFLOP/s": 1e-3, "TFLOP/s": 1.0,
                           "PFLOP/s": 1e3}),
    "_gbps": ("GB/s", {"MB/s": 1e-3, "GB/s": 1.0, "TB/s": 1e3}),
    "_w": ("W", {"W": 1.0, "kW": 1e3}),
    "_kib": ("KiB", {u: f / 2**10 for u, f in _SIZES.items()}),
    "_mib": ("MiB", {u: f / 2**20 for u, f in _SIZES.items()}),
    "_gib": ("GiB", {u: f / 2**30 for u, f in _SIZES.items()}),
}
_QUANTITY = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(.*?)\s*$")
_FIELDS = {f.name: f for f in dataclasses.fields(Device)}
_TYPES = get_type_hints(Device)
_CHOICES = {"vendor": VENDORS, "architecture": ARCHITECTURES, "memory_type": MEMORY_TYPES}


def _units_of(field: str) -> tuple[str, dict[str, float]]:
    """The unit a field is stored in (from its name's suffix) and the unit spellings it accepts."""
    return next((spec for suffix, spec in _UNITS.items() if field.endswith(suffix)), ("", {}))


def _fail(where: str, field: str, value: Any, problem: str, fix: str) -> DeviceError:
    return DeviceError(f"{where}: field '{field}' = {value!r}: {problem}. Fix: {fix}")


def _number(field: str, value: Any, where: str, integer: bool) -> float | int:
    """One numeric field: a plain number in the key's unit, or a string "<number> <unit>"."""
    base, units = _units_of(field)
    accepted = f"a plain number in {base} or a string with a unit ({', '.join(units)})" if units else "a number"
    if isinstance(value, str):
        match = _QUANTITY.match(value)
        if match is None:
            raise _fail(where, field, value, "not a number", f"write {accepted}")
        number, unit = float(match.group(1)), match.group(2)
        if unit:
            factor = {u.lower(): f for u, f in units.items()}.get(unit.lower())
            if factor is None:
                raise _fail(where, field, value, f"unknown unit '{unit}'", f"write {accepted}")
            number *= factor
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = value
    else:
        raise _fail(where, field, value, f"expected a number, got {type(value).__name__}", f"write {accepted}")
    if not math.isfinite(number) or number <= 0:
        raise _fail(where, field, value, "must be > 0", "write the positive spec-sheet value")
    if integer:
        if float(number) != int(number):
            raise _fail(where, field, value, "must be a whole number", "write an integer count")
        return int(number)
    return float(number)


def _convert(field: str, value: Any, where: str) -> Any:
    """Check and convert one field's raw value to the dataclass type (units converted, tuples frozen)."""
    kind = _TYPES[field]
    if get_args(kind) and type(None) in get_args(kind):  # Optional[float]
        if value is None:
            return None
        kind = next(a for a in get_args(kind) if a is not type(None))
    if kind is bool and not isinstance(value, bool):
        raise _fail(where, field, value, "expected true or false", "write true or false")
    if kind is bool:
        return value
    if kind in (int, float):
        return _number(field, value, where, integer=kind is int)
    if kind is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and field == "compute_capability":
            value = str(value)  # YAML reads an unquoted 8.0 as a float
        if not isinstance(value, str) or not value.strip():
            raise _fail(where, field, value, "expected a non-empty string", "quote the text")
        if field in _CHOICES and value not in _CHOICES[field]:
            raise _fail(where, field, value, "not a known value", f"use one of {', '.join(_CHOICES[field])}")
        return value
    # tuple[str, ...]: aliases
    if not isinstance(value, list) or not all(isinstance(a, str) and a.strip() for a in value):
        raise _fail(where, field, value, "expected a list of non-empty strings",
                    'write e.g. aliases: ["NVIDIA H100 80GB HBM3", "H100"]')
    return tuple(value)


def _from_mapping(raw: Any, key: str, where: str) -> Device:
    """Validate a parsed spec (mapping of field -> raw value) and build the Device called `key`."""
    if not isinstance(raw, Mapping):
        raise DeviceError(f"{where}: expected a mapping of 'field: value' lines at the top level, got "
                          f"{type(raw).__name__} {str(raw)[:60]!r}. Fix: write one 'field: value' per line "
                          f"as in {_EXAMPLE}.")
    if "Num_Sm" in raw and "Device" in raw:
        return _from_neusight(raw, where)
    unknown = [k for k in raw if k not in _FIELDS]
    if unknown:
        hints = [f"'{u}' (did you mean '{m[0]}'?)" if (m := difflib.get_close_matches(str(u), _FIELDS, 1))
                 else f"'{u}'" for u in unknown]
        raise DeviceError(f"{where}: unknown field {', '.join(hints)} = {raw[unknown[0]]!r}. Fix: rename or remove "
                          f"it; accepted fields: {', '.join(f for f in _FIELDS if f != 'key')}.")
    if raw.get("key", key) != key:
        raise _fail(where, "key", raw["key"], f"differs from the file name '{key}'", "rename the file or the key")
    values: dict[str, Any] = {"key": key}
    for field, spec in _FIELDS.items():
        if field == "key":
            continue
        if field not in raw:
            if spec.default is dataclasses.MISSING:
                unit = _units_of(field)[0]
                raise DeviceError(f"{where}: missing required field '{field}'{f' (in {unit})' if unit else ''}."
                                  f" Fix: add '{field}: <value>' from the spec sheet, see {_EXAMPLE}.")
            continue
        values[field] = _convert(field, raw[field], where)
    return Device(**values)


# NeuSight's own device JSONs (its artifact's devices/*.json): their field -> (our field, factor into our unit).
# NB: its Core_Per_SM is FP32 lanes per SM on NVIDIA but SIMD units per CU on AMD (4), so it is taken on NVIDIA
# only; AMD files give the vector and matrix peaks separately, NVIDIA's one peak serves both.
_NEUSIGHT_FIELDS: dict[str, tuple[str, float]] = {
    "Dev_Mem": ("memory_gib", 1.0), "Mem_Bw": ("mem_bandwidth_gbps", 1.0), "Num_Sm": ("sm_count", 1.0),
    "Freq": ("boost_clock_mhz", 1.0), "L2Cache": ("l2_cache_mib", 1.0), "SingleFLOPs": ("fp32_tflops", 1e-3),
    "SingleFLOPsVEC": ("fp32_tflops", 1e-3), "SingleFLOPsMM": ("fp32_matrix_tflops", 1e-3)}
_NEUSIGHT_INFO = ("Device", "Core_Per_SM")
# A peak further than this from lanes x clock is not one GPU's FP32 vector peak (a multi-GPU sum, a tensor peak,
# a unit slip); spec sheets' own rounding and boost-clock choices stay well inside it (NeuSight's P100 file: 3.8 %).
PEAK_TOLERANCE = 0.10


def _from_neusight(raw: Mapping, where: str) -> Device:
    """A NeuSight-style JSON ('Device', 'Num_Sm', 'Mem_Bw', ...), as users of that tool hold their GPUs.

    It names the GPU but not what the predictor also needs (architecture, compute capability, memory type,
    board power, tensor peaks), so the GPU must be in the spec library; the numbers the JSON gives replace the
    library's (the user's spec sheet wins) and are checked for consistency: the FP32 peak must equal
    2 x SMs x FP32 lanes per SM x clock.
    """
    name = raw["Device"]
    if not isinstance(name, str) or not name.strip():
        raise _fail(where, "Device", name, "expected the GPU's name", 'write e.g. "Device": "NVIDIA H100 80GB HBM3"')
    devices, index = _library(str(device_dir()))
    key = index.get(_normalize(name))
    if key is None:
        raise DeviceError(f"{where}: NeuSight-style JSON of {name!r}, a GPU the spec library does not know. Its "
                          "fields do not give the architecture, compute capability, memory type and board power "
                          f"the predictor needs. Fix: write a neusight spec YAML as in {_EXAMPLE} and pass its "
                          "path, or add the name to the aliases of the library entry it is.")
    unknown = [k for k in raw if k not in _NEUSIGHT_FIELDS and k not in _NEUSIGHT_INFO]
    if unknown:
        raise DeviceError(f"{where}: unknown NeuSight field '{unknown[0]}' = {raw[unknown[0]]!r}. Fix: remove it; "
                          f"accepted: {', '.join((*_NEUSIGHT_INFO, *_NEUSIGHT_FIELDS))}.")
    base = devices[key]
    values = dataclasses.asdict(base)
    for src, (field, factor) in _NEUSIGHT_FIELDS.items():
        if src in raw:
            number = _number(src, raw[src], where, integer=field == "sm_count")
            values[field] = int(number) if field == "sm_count" else number * factor
            if not math.isclose(values[field], getattr(base, field), rel_tol=1e-3):
                log.warning("%s: %s = %s replaces the spec library's %s = %s for %s", where, src, raw[src], field,
                            getattr(base, field), key)
    if base.vendor == "nvidia":
        values["fp32_matrix_tflops"] = values["fp32_tflops"]   # FP32 GEMMs run on the same lanes
        if "Core_Per_SM" in raw:
            values["fp32_cores_per_sm"] = _number("Core_Per_SM", raw["Core_Per_SM"], where, integer=True)
    lanes = values["fp32_cores_per_sm"]
    implied = 2 * values["sm_count"] * lanes * values["boost_clock_mhz"] * 1e-6
    if abs(values["fp32_tflops"] / implied - 1) > PEAK_TOLERANCE:
        src = "SingleFLOPsVEC" if "SingleFLOPsVEC" in raw else "SingleFLOPs"
        raise DeviceError(f"{where}: '{src}' = {raw.get(src, base.fp32_tflops * 1e3)!r} GFLOP/s disagrees with "
                          f"2 x Num_Sm x FP32 lanes per SM x Freq = 2 x {values['sm_count']} x {lanes} x "
                          f"{values['boost_clock_mhz']:g} MHz = {implied * 1e3:.0f} GFLOP/s (a multi-GPU or "
                          "tensor-core peak?). Fix: give the FP32 vector peak of one GPU.")
    values["aliases"] = base.aliases
    values["source"] = f"{where} (NeuSight-style JSON) over the library entry '{key}': {base.source}"
    return Device(**values)


def _read_spec(path: Path) -> Device:
    """Parse and validate one spec file (YAML, or JSON with the same fields)."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))  # NB: JSON is read by the YAML parser too
    except OSError as exc:
        raise DeviceError(f"{path}: cannot read device spec ({exc}). Fix: check the path.") from exc
    except yaml.YAMLError as exc:
        raise DeviceError(f"{path}: not valid YAML: {exc}. Fix: correct the syntax at the line shown.") from exc
    return _from_mapping(raw, key=path.stem, where=str(path))


def _normalize(label: str) -> str:
    """Case-insensitive form that also ignores spaces, dashes and underscores."""
    return re.sub(r"[\s_\-]+", "", label).lower()


# Words a listing may add to or drop from a GPU's name without naming another GPU ("Tesla V100", "NVIDIA A10").
_MAKER_WORDS = frozenset({"nvidia", "tesla", "geforce", "amd", "instinct"})


def _tokens(label: str) -> frozenset[str]:
    """The words of a name in any order, lower case, without maker words: benchmark tables write the same card
    as "A100 80GB SXM4", "A100-SXM4-80GB" or "NVIDIA A100 SXM4 80GB"."""
    return frozenset(t for t in re.split(r"[\s_\-/]+", label.lower()) if t and t not in _MAKER_WORDS)


@functools.lru_cache(maxsize=8)
def _token_index(directory: str) -> Mapping[frozenset[str], str]:
    """Word set of every key, name and alias -> key, leaving out word sets that name two GPUs. Only the same
    words match (never a subset: "RTX 3090 Ti" must not find the RTX 3090)."""
    owners: dict[frozenset[str], set[str]] = {}
    for key, device in _library(directory)[0].items():
        for label in (key, device.name, *device.aliases):
            owners.setdefault(_tokens(label), set()).add(key)
    return MappingProxyType({words: next(iter(keys)) for words, keys in owners.items() if words and len(keys) == 1})


def device_dir() -> Path:
    """Folder of the spec library: ``$NEUSIGHT_DATA/devices`` if set, else ``data/devices`` of the repo."""
    env = os.environ.get("NEUSIGHT_DATA")
    base = Path(env).expanduser() if env else Path(__file__).resolve().parent.parent / "data"
    return base / "devices"


@functools.lru_cache(maxsize=8)
def _library(directory: str) -> tuple[Mapping[str, Device], Mapping[str, str]]:
    """Every spec in `directory` by key, and an index normalized key/name/alias -> key (cached, read-only)."""
    devices: dict[str, Device] = {}
    index: dict[str, str] = {}
    for path in sorted(p for p in Path(directory).glob("*.y*ml") if p.suffix in (".yaml", ".yml")):
        device = _read_spec(path)
        devices[device.key] = device
        for label in (device.key, device.name, *device.aliases):
            owner = index.setdefault(_normalize(label), device.key)
            if owner != device.key:
                raise DeviceError(f"{path}: name or alias {label!r} also names device '{owner}' ({owner}.yaml). Fix: "
                                  "keep it in one file; names must be unique ignoring case, spaces, '-' and '_'.")
    if not devices:
        raise DeviceError(f"no device specs (*.yaml) found in {directory}. Fix: set NEUSIGHT_DATA to the "
                          "folder that holds devices/*.yaml (the repository's data/ folder).")
    return MappingProxyType(devices), MappingProxyType(index)


def list_devices() -> list[str]:
    """Sorted keys of every GPU in the spec library."""
    return sorted(_library(str(device_dir()))[0])


def also_named(name: str) -> list[str]:
    """Other GPUs of the library that ``name`` could mean besides the one :func:`load_device` returns for it: those
    with a key, name or alias holding every word of ``name`` (maker words aside). A short name such as "A100" is
    one GPU's alias, and the forecast says which others it leaves out. Paths and unknown names give [].

    >>> also_named("A100")
    ['a100-80gb-pcie', 'a100-pcie-40gb', 'a100-sxm4-80gb']
    >>> also_named("a100-sxm4-40gb"), also_named("t4")
    ([], [])
    """
    if Path(name).suffix.lower() in SPEC_SUFFIXES:
        return []
    try:
        chosen = load_device(name).key
    except DeviceError:
        return []
    words = _tokens(name)
    if not words:
        return []
    devices = _library(str(device_dir()))[0]
    return sorted(key for key, d in devices.items() if key != chosen
                  and any(words <= _tokens(label) for label in (key, d.name, *d.aliases)))


def device_rows() -> list[dict[str, Any]]:
    """One row per GPU of the library (sorted by key): the spec-sheet numbers a user picks a GPU by. What
    ``neusight-predict device=list`` prints.

    >>> row = next(r for r in device_rows() if r["key"] == "t4")
    >>> row["fp32_tflops"], row["mem_bandwidth_gbps"], row["memory_gib"]
    (8.1, 320.0, 16.0)
    """
    devices = _library(str(device_dir()))[0]
    return [{"key": k, "name": d.name, "vendor": d.vendor, "architecture": d.architecture,
             "sm_count": d.sm_count, "fp32_tflops": d.fp32_tflops, "mem_bandwidth_gbps": d.mem_bandwidth_gbps,
             "memory_gib": d.memory_gib, "l2_cache_mib": d.l2_cache_mib, "tdp_w": d.tdp_w}
            for k, d in sorted(devices.items())]


# What-if edits (modify_device): the peaks that follow the SM count and the clock when only those are changed.
_SCALED_PEAKS = ("fp32_tflops", "fp32_matrix_tflops", "tf32_tensor_tflops", "fp16_tensor_tflops",
                 "bf16_tensor_tflops", "fp8_tensor_tflops", "fp4_tensor_tflops")
_FIXED = ("key", "name", "aliases", "source", "vendor")


def modify_device(device: str | os.PathLike[str] | Device, **changes: Any) -> Device:
    """A GPU of the library (or any Device) with some spec-sheet numbers changed: "what if H100 had 4.8 TB/s?".

    ``changes`` are Device fields with values as a spec file would give them (units accepted, e.g.
    ``mem_bandwidth_gbps="4.8 TB/s"``), checked the same way. Changing ``sm_count``, ``boost_clock_mhz`` or
    ``fp32_cores_per_sm`` without giving the peaks rescales every FLOP/s peak with them (the FP32 peaks by SMs
    x lanes x clock, the tensor peaks by SMs x clock), so the sheet stays consistent. The result is keyed
    ``<key>+<field>=<value>...`` and named after the base GPU and its changes; it has no aliases.

    >>> modify_device("h100-sxm5-80gb", mem_bandwidth_gbps="4.8 TB/s").mem_bandwidth_gbps
    4800.0
    >>> round(modify_device("a100-pcie-40gb", sm_count=54).fp32_tflops, 2)
    9.75
    """
    base = load_device(device)
    if not changes:
        return base
    where = f"modify_device({base.key})"
    fixed = [k for k in changes if k in _FIXED]
    unknown = [k for k in changes if k not in _FIELDS]
    if unknown or fixed:
        bad = (unknown or fixed)[0]
        close = difflib.get_close_matches(bad, [f for f in _FIELDS if f not in _FIXED], 1)
        raise _fail(where, bad, changes[bad], "not a spec number that can be changed" if fixed else "unknown field",
                    (f"did you mean '{close[0]}'? " if close else "") + "change one of "
                    + ", ".join(f for f in _FIELDS if f not in _FIXED))
    raw = base.to_dict()
    raw.update(changes)
    new = {f: _convert(f, v, where) for f, v in changes.items()}
    lanes = lambda d: d["sm_count"] * d["boost_clock_mhz"] * d["fp32_cores_per_sm"]   # noqa: E731
    units = lambda d: d["sm_count"] * d["boost_clock_mhz"]                             # noqa: E731
    old_d = {f: getattr(base, f) for f in ("sm_count", "boost_clock_mhz", "fp32_cores_per_sm")}
    new_d = {**old_d, **{f: new[f] for f in old_d if f in new}}
    for peak in _SCALED_PEAKS:
        if peak in changes or getattr(base, peak) is None or new_d == old_d:
            continue
        ratio = (lanes(new_d) / lanes(old_d)) if peak.startswith("fp32") else (units(new_d) / units(old_d))
        raw[peak] = getattr(base, peak) * ratio
    show = lambda v: f"{v:g}" if isinstance(v, float) else str(v)   # noqa: E731
    desc = ", ".join(f"{f} {show(getattr(base, f))} -> {show(new[f])}" for f in changes)
    raw.update({"name": f"{base.name} (what-if: {desc})", "aliases": [],
                "source": f"{base.source}; modified: {desc}"})
    raw.pop("key")
    key = base.key + "".join(f"+{f}={show(new[f])}" for f in changes)
    return _from_mapping(raw, key=key, where=where)


def load_device(name_or_path: str | os.PathLike[str] | Device) -> Device:
    """Find a GPU by key, alias or spec-file path and return its validated :class:`Device`.

    Parameters
    ----------
    name_or_path : str, os.PathLike or Device
        A Device (returned as is); a path to a ``.yaml``/``.yml``/``.json`` spec; or a library key
        (``"h100-sxm5-80gb"``), its display name (``"NVIDIA H100 SXM5 80GB"``, as forecasts print it) or an
        alias such as the exact ``torch.cuda.get_device_name()`` string. Names match ignoring case, spaces,
        dashes and underscores; failing that, by their words in any order, maker words (NVIDIA, Tesla, GeForce,
        AMD, Instinct) aside, when those words name one GPU only ("A100 80GB SXM4").

    Returns
    -------
    Device
        Frozen and validated; library entries are parsed once per process and shared.

    Raises
    ------
    DeviceError
        Unknown name (the message lists the closest known keys), missing file, or an invalid spec.

    Examples
    --------
    >>> h100 = load_device("NVIDIA H100 80GB HBM3")
    >>> h100.key, h100.sm_count, h100.fp32_dual_issue
    ('h100-sxm5-80gb', 132, True)
    >>> load_device("a100 sxm4 40gb").mem_bandwidth_gbps
    1555.0
    >>> round(load_device("t4").ridge_point_fp32, 1)
    25.3
    """
    if isinstance(name_or_path, Device):
        return name_or_path
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise DeviceError(f"load_device: expected a device name, a spec path or a Device, got "
                          f"{type(name_or_path).__name__} {name_or_path!r}. Fix: pass e.g. 'h100-sxm5-80gb'.")
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if isinstance(name_or_path, os.PathLike) or path.suffix.lower() in SPEC_SUFFIXES:
        if not path.is_file():
            raise DeviceError(f"device spec file {str(path)!r} does not exist or is not a file. Fix: check the path, or pass a "
                              "library key (neusight.devices.list_devices()) instead.")
        return _read_spec(path)
    devices, index = _library(str(device_dir()))
    key = index.get(_normalize(text)) or _token_index(str(device_dir())).get(_tokens(text))
    if key is None:
        query = _normalize(text)  # labels containing the query first ("v100"), then the most similar ones
        close = [c for c in index if query in c] + difflib.get_close_matches(query, list(index), len(index), 0)
        nearest = list(dict.fromkeys(index[c] for c in close))[:3]
        raise DeviceError(f"unknown device {text!r}. Closest known: {', '.join(nearest)}. Fix: pass a key from "
                          f"neusight.devices.list_devices() (neusight-predict device=list prints them), an alias "
                          f"(e.g. the torch.cuda.get_device_name() string) or a spec path; for a new GPU add "
                          f"{device_dir()}/<key>.yaml (copy {_EXAMPLE}, cite the datasheet in 'source').")
    return devices[key]
