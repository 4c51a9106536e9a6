"""``ds4d doctor``: check the machine before serving; say what is wrong and how to fix it.

Each check is one small function ``check_<name>(config) -> Check`` that reads the
machine and the effective config (the same flags, file and environment that
``ds4d serve`` would use) and answers one of:

* ``ok``: nothing to do;
* ``warn``: ds4d will run, but slower or less safely than it could (the fix says how);
* ``fail``: ``ds4d serve`` will not start or cannot keep its guarantees;
* ``skip``: the check does not apply here or cannot run (the detail says why).

A check never raises: anything unexpected becomes ``skip`` with the error, so one
broken library cannot hide the rest of the report.  GPU facts come from torch
and, when the optional ``nvidia-ml-py`` (``pynvml``) is installed, from NVML;
nothing here initialises more than a query needs.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from ds4d.registry import PluginError

GIB = 1024**3
STATUSES = ("ok", "warn", "fail", "skip")
MIN_PYTHON = (3, 11)
PACKAGES = ("torch", "aiohttp", "safetensors", "tokenizers")
THP_ENABLED_PATH = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SWAPPINESS_PATH = Path("/proc/sys/vm/swappiness")
NVIDIA_DEVICE_PATH = Path("/dev/nvidia0")
MIN_OPEN_FILES = 65536
BF16_MIN_CAPABILITY = (8, 0)
NVLINK_MAX_LINKS = 18
DEFAULT_WATERMARK_GIB = 15.0
CPU_NOTE = "ds4d will run on the CPU (the embedded model works; DeepSeek-V4 checkpoints need GPUs)"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    """One of STATUSES."""
    detail: str
    """What was found; may span several lines (one per GPU, say)."""
    fix: str = ""
    """How to fix a warn or fail; empty otherwise."""


# --- software


def check_python(config: Any) -> Check:
    """Python >= 3.11 and the installed versions of the packages ds4d leans on."""
    version = ".".join(str(part) for part in sys.version_info[:3])
    found, missing = [], []
    for package in PACKAGES:
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            missing.append(package)
    detail = f"Python {version}; " + ", ".join(found + [f"{p} missing" for p in missing])
    if sys.version_info[:2] < MIN_PYTHON:
        return Check("python", "fail", detail, f"ds4d needs Python {'.'.join(map(str, MIN_PYTHON))} or newer")
    if missing:
        return Check("python", "fail", detail, f"pip install {' '.join(missing)} (or `pip install -e .` in the repo)")
    return Check("python", "ok", detail)


def check_cuda(config: Any) -> Check:
    """torch's CUDA build against the driver, and whether torch can use a GPU at all."""
    try:
        import torch
    except (ImportError, OSError) as exc:  # OSError: a shared library underneath is missing
        return Check("cuda", "fail", f"torch cannot be imported: {exc}", "pip install torch")
    torch_cuda = torch.version.cuda
    available = torch.cuda.is_available()
    driver_version, driver_cuda, nvml_gpus = _driver_facts(torch)
    wants_cuda = str(config.device).startswith("cuda")
    driver = f"driver {driver_version or 'unknown'}" + (f" (CUDA {_cuda_text(driver_cuda)})" if driver_cuda else "")
    if torch_cuda and driver_cuda:
        status, detail, fix = cuda_driver_fit(torch_cuda, driver_cuda)
        if status != "ok":
            return Check("cuda", status, f"torch {torch.__version__} built for CUDA {torch_cuda}, {driver}: {detail}",
                         fix)
    if available:
        return Check("cuda", "ok", f"torch {torch.__version__} built for CUDA {torch_cuda}, {driver}, "
                                   f"{torch.cuda.device_count()} GPU(s) visible")
    hardware = nvml_gpus > 0 or NVIDIA_DEVICE_PATH.exists()
    build = f"torch {torch.__version__}, " + (f"built for CUDA {torch_cuda}" if torch_cuda else "a CPU build")
    if torch_cuda is None:
        fix = "install a CUDA build of torch (https://pytorch.org/get-started/locally/)"
    else:
        fix = "check the driver with `nvidia-smi` and that CUDA_VISIBLE_DEVICES does not hide the GPUs"
    if hardware:
        status = "fail" if wants_cuda else "warn"
        return Check("cuda", status, f"NVIDIA GPU present but torch cannot use it ({build}, {driver}); {CPU_NOTE}",
                     fix)
    if wants_cuda:
        return Check("cuda", "fail", f"device = {config.device} but no CUDA GPU is visible ({build})",
                     "run on a machine with an NVIDIA GPU and driver, or use --device cpu")
    return Check("cuda", "skip", f"no CUDA GPU ({build}): {CPU_NOTE}")


def cuda_driver_fit(torch_cuda: str, driver_cuda: int) -> tuple[str, str, str]:
    """(status, detail, fix) for a torch built for ``torch_cuda`` ("12.8") on a driver that
    supports up to ``driver_cuda`` (NVML's integer: 12040 = 12.4).

    A newer major version than the driver's does not run at all; a newer minor version
    runs under CUDA minor-version compatibility, except for kernels compiled at run time
    from PTX (Triton, Numba), which need the driver to know the newer version.
    """
    torch_version = tuple(int(part) for part in torch_cuda.split(".")[:2])
    driver_version = (driver_cuda // 1000, driver_cuda % 1000 // 10)
    fix = f"upgrade the NVIDIA driver or install a torch build for CUDA {_cuda_text(driver_cuda)}"
    if torch_version[0] > driver_version[0]:
        return "fail", "the driver is too old for this torch build (CUDA runtime major version newer)", fix
    if torch_version > driver_version:
        return "warn", "the driver predates this CUDA minor version (kernels compiled at run time may fail)", fix
    return "ok", "driver supports this torch build", ""


def _cuda_text(driver_cuda: int) -> str:
    return f"{driver_cuda // 1000}.{driver_cuda % 1000 // 10}"


def _driver_facts(torch: Any) -> tuple[str, int, int]:
    """(driver version text, CUDA version the driver supports as NVML's integer, GPUs NVML sees);
    "" / 0 where unknown.  NVML first; torch knows only the CUDA number."""
    with _nvml() as pynvml:
        if pynvml is not None:
            version = pynvml.nvmlSystemGetDriverVersion()
            version = version.decode() if isinstance(version, bytes) else str(version)
            return version, int(pynvml.nvmlSystemGetCudaDriverVersion()), int(pynvml.nvmlDeviceGetCount())
    try:
        return "", int(torch._C._cuda_getDriverVersion()), 0
    except (AttributeError, RuntimeError):  # a CPU build has no such call; no driver raises
        return "", 0, 0


@contextmanager
def _nvml() -> Iterator[Any]:
    """The ``pynvml`` module, initialised, or None where it is missing or finds no driver."""
    pynvml = _nvml_init()
    try:
        yield pynvml
    finally:
        if pynvml is not None:
            pynvml.nvmlShutdown()


def _nvml_init() -> Any:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver, or no NVML library
        return None
    return pynvml


# --- GPUs


def check_gpus(config: Any) -> Check:
    """Per GPU: name, memory, compute capability and active NVLinks; peer access between GPUs."""
    try:
        import torch
    except (ImportError, OSError) as exc:
        return Check("gpus", "skip", f"torch cannot be imported: {exc}")
    if not torch.cuda.is_available():
        return Check("gpus", "skip", "no CUDA GPU visible to torch")
    count = torch.cuda.device_count()
    lines, old = [], []
    with _nvml() as pynvml:
        for index in range(count):
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
            nvlinks = _active_nvlinks(pynvml, props, index)
            links = "NVLinks unknown (pip install nvidia-ml-py)" if nvlinks is None else f"{nvlinks} NVLinks active"
            lines.append(f"GPU {index} {props.name}: compute {props.major}.{props.minor}, "
                         f"{free / GIB:.1f} of {total / GIB:.1f} GiB free, {links}")
            if (props.major, props.minor) < BF16_MIN_CAPABILITY:
                old.append(index)
    pairs = [(a, b) for a in range(count) for b in range(a + 1, count)]
    no_peer = [(a, b) for a, b in pairs if not torch.cuda.can_device_access_peer(a, b)]
    if pairs:
        lines.append(f"peer access: {len(pairs) - len(no_peer)} of {len(pairs)} GPU pairs"
                     + ("" if not no_peer else " (none between " + ", ".join(f"{a}-{b}" for a, b in no_peer) + ")"))
    detail = "\n".join(lines)
    if old:
        return Check("gpus", "warn", detail,
                     f"GPU(s) {', '.join(map(str, old))} below compute 8.0 have no bf16 tensor cores: "
                     "use --dtype float16 there, or newer GPUs")
    if no_peer:
        return Check("gpus", "warn", detail,
                     "GPUs without peer access exchange data through host memory (slow expert parallelism); "
                     "see `nvidia-smi topo -m`, and check that IOMMU/ACS settings allow peer-to-peer")
    return Check("gpus", "ok", detail)


def _active_nvlinks(pynvml: Any, props: Any, index: int) -> int | None:
    """Active NVLinks of the GPU torch calls ``index`` (matched by UUID: NVML numbers GPUs by PCI bus,
    CUDA by speed unless CUDA_DEVICE_ORDER=PCI_BUS_ID), or None without NVML."""
    if pynvml is None:
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{props.uuid}")
    except (AttributeError, pynvml.NVMLError):  # older torch has no uuid; fall back to the same index
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    active = 0
    for link in range(NVLINK_MAX_LINKS):
        try:
            active += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
        except pynvml.NVMLError:  # the link does not exist on this GPU
            continue
    return active


# --- host


def check_host_ram(config: Any) -> Check:
    """MemAvailable against the watermark below which /ready turns false and the RAM tier sheds."""
    watermark_gib = float(getattr(config, "mem_watermark_gib", DEFAULT_WATERMARK_GIB))
    cache_ram_gib = float(getattr(config, "cache_ram_gib", 0.0))
    memory = psutil.virtual_memory()
    available_gib = memory.available / GIB
    detail = (f"MemTotal {memory.total / GIB:.1f} GiB, MemAvailable {available_gib:.1f} GiB, "
              f"watermark {watermark_gib:g} GiB, RAM cache tier {cache_ram_gib:g} GiB")
    if available_gib < watermark_gib:
        return Check("host_ram", "fail", detail,
                     f"MemAvailable is below the watermark ({watermark_gib:g} GiB), so /ready stays false: free host "
                     f"memory, or lower the watermark to at most {int(available_gib)} GiB with --mem-watermark-gib "
                     "(and --mem-floor-gib, which must not exceed it)")
    if available_gib - cache_ram_gib < watermark_gib:
        return Check("host_ram", "warn", detail,
                     "a full RAM cache tier would take MemAvailable below the watermark and be shed again: "
                     "lower --cache-ram-gib or --mem-watermark-gib")
    return Check("host_ram", "ok", detail)


def check_swap(config: Any, swappiness_path: Path = SWAPPINESS_PATH) -> Check:
    """The daemon's memory must never be swapped out: no swap, or swappiness 1 and nothing swapped."""
    swap = psutil.swap_memory()
    try:
        swappiness = int(swappiness_path.read_text().strip())
    except (OSError, ValueError):
        swappiness = None
    shown = "unknown" if swappiness is None else str(swappiness)
    detail = f"swap {swap.used / GIB:.1f} of {swap.total / GIB:.1f} GiB used, vm.swappiness {shown}"
    if swap.total == 0:
        return Check("swap", "ok", f"no swap, vm.swappiness {shown}")
    if swap.used == 0 and swappiness is not None and swappiness <= 1:
        return Check("swap", "ok", detail)
    return Check("swap", "warn", detail,
                 "swapped-out weights or cache stall every step: `sudo swapoff -a`, "
                 "or `sudo sysctl vm.swappiness=1` to keep swap for emergencies")


def check_transparent_hugepages(config: Any, path: Path = THP_ENABLED_PATH) -> Check:
    """Pinned expert memory asks for huge pages with madvise; "never" turns that off."""
    try:
        text = path.read_text()
    except OSError as exc:
        return Check("transparent_hugepages", "skip", f"cannot read {path}: {exc.strerror or exc}")
    match = re.search(r"\[(\w+)\]", text)
    if match is None:
        return Check("transparent_hugepages", "skip", f"no bracketed value in {path}: {text.strip()!r}")
    mode = match.group(1)
    if mode == "never":
        return Check("transparent_hugepages", "warn", f"{path}: never",
                     f"echo madvise | sudo tee {path} (expert memory in host RAM asks for huge pages with madvise)")
    return Check("transparent_hugepages", "ok", f"{path}: {mode}")


def check_open_files(config: Any) -> Check:
    """The disk cache tier keeps one file per block and every client holds a socket."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shown = ["unlimited" if limit == resource.RLIM_INFINITY else str(limit) for limit in (soft, hard)]
    detail = f"open-file limit: soft {shown[0]}, hard {shown[1]}"
    if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        fix = f"ulimit -n {MIN_OPEN_FILES} before `ds4d serve` (LimitNOFILE={MIN_OPEN_FILES} in a systemd unit)"
        if hard != resource.RLIM_INFINITY and hard < MIN_OPEN_FILES:
            fix += f"; the hard limit is {hard}: raise nofile in /etc/security/limits.conf first"
        return Check("open_files", "warn", detail, fix)
    return Check("open_files", "ok", detail)


# --- files


def check_model(config: Any) -> Check:
    """The checkpoint serve would load: --model, or the embedded demo model when that is empty."""
    if not config.model:
        try:
            from ds4d.kernel import embedded_model_path

            path = embedded_model_path()
        except (ImportError, PluginError) as exc:
            return Check("model", "fail", "no --model given and the embedded model is not usable",
                         str(exc) or type(exc).__name__)
        return Check("model", "ok", f"embedded model {path} ({path.stat().st_size / GIB:.2f} GiB)")
    path = Path(config.model).expanduser()
    if not path.exists():
        return Check("model", "fail", f"{path} does not exist",
                     "pass --model with a GGUF file or a DeepSeek-V4 checkpoint directory")
    if not os.access(path, os.R_OK):
        return Check("model", "fail", f"{path} is not readable", f"give the serving user read access to {path}")
    if path.is_dir():
        shards = sorted(path.glob("*.safetensors"))
        size = sum(shard.stat().st_size for shard in shards)
        return Check("model", "ok", f"{path}: directory, {len(shards)} safetensors file(s), {size / GIB:.1f} GiB")
    return Check("model", "ok", f"{path}: file, {path.stat().st_size / GIB:.2f} GiB")


def check_cache_disk(config: Any) -> Check:
    """The disk cache tier's directory: there or creatable, writable, and room for its budget."""
    directory = str(getattr(config, "cache_disk_dir", ""))
    budget_gib = float(getattr(config, "cache_disk_gib", 0.0))
    if not directory:
        return Check("cache_disk", "skip", "disk cache tier off (cache_disk_dir is empty)")
    if "disk" not in getattr(config, "cache_tiers", ("disk",)) or budget_gib <= 0:
        return Check("cache_disk", "skip", "disk cache tier off (not in cache_tiers, or cache_disk_gib is 0)")
    path = Path(directory).expanduser()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return Check("cache_disk", "fail", f"{existing} is not a directory", "set --cache-disk-dir to a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created ({existing} is not writable)"
        return Check("cache_disk", "fail", f"{path} {what}",
                     f"give the serving user write access to {existing}, or choose another --cache-disk-dir")
    held = _blocks_bytes(path) if path.exists() else 0
    free = shutil.disk_usage(existing).free
    state = "exists" if existing == path else "will be created"
    detail = (f"{path} {state}, writable; {free / GIB:.1f} GiB free + {held / GIB:.1f} GiB of blocks held, "
              f"budget {budget_gib:g} GiB")
    if (free + held) / GIB < budget_gib:
        return Check("cache_disk", "warn", detail,
                     f"the filesystem cannot hold the budget: free space there, or lower --cache-disk-gib to "
                     f"{int((free + held) / GIB * 0.9)}")
    return Check("cache_disk", "ok", detail)


def _blocks_bytes(root: Path) -> int:
    """Bytes of the ``.blk`` files the disk tier already keeps under ``root`` (they count toward its budget)."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(".blk"):
                try:
                    total += os.stat(os.path.join(folder, name)).st_size
                except OSError:
                    continue
    return total


# --- running and reporting

CHECKS: tuple[Callable[[Any], Check], ...] = (
    check_python, check_cuda, check_gpus, check_host_ram, check_swap,
    check_transparent_hugepages, check_open_files, check_model, check_cache_disk,
)


def run_checks(config: Any) -> list[Check]:
    """Every check, in order; one that raises is reported as ``skip`` with the error."""
    results = []
    for check in CHECKS:
        try:
            results.append(check(config))
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            name = check.__name__.removeprefix("check_")
            results.append(Check(name, "skip", f"check could not run: {type(exc).__name__}: {exc}"))
    return results


def format_table(checks: list[Check]) -> str:
    """One line per check (status, name, detail), detail continuations and a fix line indented under it."""
    width = max(len(check.name) for check in checks)
    indent = " " * (4 + 2 + width + 2)
    lines = []
    for check in checks:
        first, *rest = check.detail.splitlines() or [""]
        lines.append(f"{check.status.upper():4}  {check.name:{width}}  {first}")
        lines += [indent + line for line in rest]
        if check.status in ("warn", "fail") and check.fix:
            lines.append(f"{indent}fix: {check.fix}")
    counts = ", ".join(f"{sum(c.status == s for c in checks)} {s}" for s in STATUSES)
    lines.append(f"\n{counts}")
    return "\n".join(lines)


def main(config: Any, as_json: bool = False) -> int:
    """Print the report for ``config`` (a table, or JSON); 1 if any check failed, else 0."""
    checks = run_checks(config)
    if as_json:
        print(json.dumps([asdict(check) for check in checks], indent=2))
    else:
        print(format_table(checks))
    return 1 if any(check.status == "fail" for check in checks) else 0
