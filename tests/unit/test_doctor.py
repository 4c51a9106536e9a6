from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections import namedtuple
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from ds4d import doctor
from ds4d.config import GIB, REPO_ROOT, Config

CHECK_NAMES = [check.__name__.removeprefix("check_") for check in doctor.CHECKS]
VirtualMemory = namedtuple("VirtualMemory", "total available")
SwapMemory = namedtuple("SwapMemory", "total used")


def _by_name(checks: list[doctor.Check]) -> dict[str, doctor.Check]:
    return {check.name: check for check in checks}


def test_run_checks_on_this_machine_answers_every_check_without_raising():
    checks = doctor.run_checks(Config())
    assert [check.name for check in checks] == CHECK_NAMES
    for check in checks:
        assert check.status in doctor.STATUSES
        assert check.detail, check
        if check.status in ("warn", "fail"):
            assert check.fix, check
        assert "check could not run" not in check.detail, check


def test_without_a_gpu_the_cuda_checks_skip_or_warn_with_a_reason():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    checks = _by_name(doctor.run_checks(Config()))
    assert checks["cuda"].status in ("skip", "warn")
    assert "CPU" in checks["cuda"].detail
    assert checks["gpus"].status == "skip"
    assert "no CUDA GPU" in checks["gpus"].detail


def test_asking_for_cuda_without_a_gpu_fails():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    check = doctor.check_cuda(replace(Config(), device="cuda"))
    assert check.status == "fail"
    assert "--device cpu" in check.fix


@pytest.mark.parametrize("torch_cuda,driver_cuda,status", [
    ("12.4", 12040, "ok"),
    ("12.1", 12040, "ok"),
    ("12.4", 13000, "ok"),
    ("12.8", 12040, "warn"),
    ("13.0", 12080, "fail"),
])
def test_cuda_driver_fit(torch_cuda, driver_cuda, status):
    got, detail, fix = doctor.cuda_driver_fit(torch_cuda, driver_cuda)
    assert got == status, detail
    if status != "ok":
        assert f"CUDA {driver_cuda // 1000}.{driver_cuda % 1000 // 10}" in fix
        assert "upgrade the NVIDIA driver" in fix


def test_host_ram_below_the_watermark_fails(monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: VirtualMemory(total=64 * GIB, available=2 * GIB))
    check = doctor.check_host_ram(replace(Config(), mem_watermark_gib=15.0, mem_floor_gib=8.0))
    assert check.status == "fail"
    assert "watermark" in check.fix and "--mem-watermark-gib" in check.fix
    assert "MemAvailable 2.0 GiB" in check.detail


def test_host_ram_above_the_watermark(monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: VirtualMemory(total=64 * GIB, available=40 * GIB))
    config = replace(Config(), mem_watermark_gib=15.0, cache_ram_gib=4.0)
    assert doctor.check_host_ram(config).status == "ok"
    assert doctor.check_host_ram(replace(config, cache_ram_gib=30.0)).status == "warn"


def test_swap_in_use_warns_and_no_swap_is_ok(monkeypatch, tmp_path: Path):
    swappiness = tmp_path / "swappiness"
    swappiness.write_text("60\n")
    monkeypatch.setattr(psutil, "swap_memory", lambda: SwapMemory(total=8 * GIB, used=GIB))
    check = doctor.check_swap(Config(), swappiness_path=swappiness)
    assert check.status == "warn"
    assert "swapoff -a" in check.fix and "vm.swappiness 60" in check.detail
    swappiness.write_text("1\n")
    monkeypatch.setattr(psutil, "swap_memory", lambda: SwapMemory(total=8 * GIB, used=0))
    assert doctor.check_swap(Config(), swappiness_path=swappiness).status == "ok"
    monkeypatch.setattr(psutil, "swap_memory", lambda: SwapMemory(total=0, used=0))
    assert doctor.check_swap(Config(), swappiness_path=tmp_path / "absent").status == "ok"


def test_low_open_file_limit_warns(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    check = doctor.check_open_files(Config())
    assert check.status == "warn"
    assert "ulimit -n 65536" in check.fix and "LimitNOFILE" in check.fix
    assert "hard limit is 4096" in check.fix
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1 << 20, 1 << 20))
    assert doctor.check_open_files(Config()).status == "ok"


@pytest.mark.parametrize("content,status", [
    ("always [madvise] never\n", "ok"),
    ("[always] madvise never\n", "ok"),
    ("always madvise [never]\n", "warn"),
])
def test_transparent_hugepages(tmp_path: Path, content, status):
    enabled = tmp_path / "enabled"
    enabled.write_text(content)
    check = doctor.check_transparent_hugepages(Config(), path=enabled)
    assert check.status == status
    if status == "warn":
        assert "madvise" in check.fix


def test_transparent_hugepages_missing_file_skips(tmp_path: Path):
    check = doctor.check_transparent_hugepages(Config(), path=tmp_path / "absent")
    assert check.status == "skip"
    assert "absent" in check.detail


def test_missing_model_path_fails(tmp_path: Path):
    check = doctor.check_model(replace(Config(), model=str(tmp_path / "no-such.gguf")))
    assert check.status == "fail"
    assert "does not exist" in check.detail and "--model" in check.fix


def test_model_directory_is_described(tmp_path: Path):
    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * 1024)
    check = doctor.check_model(replace(Config(), model=str(tmp_path)))
    assert check.status == "ok"
    assert "1 safetensors file(s)" in check.detail


def test_cache_disk(tmp_path: Path):
    assert doctor.check_cache_disk(Config()).status == "skip"
    target = tmp_path / "blocks" / "new"
    check = doctor.check_cache_disk(replace(Config(), cache_disk_dir=str(target), cache_disk_gib=0.001))
    assert check.status == "ok" and "will be created" in check.detail
    assert not target.exists()
    huge = doctor.check_cache_disk(replace(Config(), cache_disk_dir=str(tmp_path), cache_disk_gib=1e9))
    assert huge.status == "warn" and "--cache-disk-gib" in huge.fix
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    check = doctor.check_cache_disk(replace(Config(), cache_disk_dir=str(blocked / "sub")))
    assert check.status == "fail"


def test_a_check_that_raises_becomes_a_skip(monkeypatch):
    def broken() -> VirtualMemory:
        raise RuntimeError("no /proc here")

    monkeypatch.setattr(psutil, "virtual_memory", broken)
    check = _by_name(doctor.run_checks(Config()))["host_ram"]
    assert check.status == "skip"
    assert "no /proc here" in check.detail


def test_table_shows_fix_lines_only_for_warn_and_fail():
    checks = [doctor.Check("alpha", "ok", "fine", "unused"), doctor.Check("beta", "fail", "broken\nsecond line", "do x")]
    table = doctor.format_table(checks)
    lines = table.splitlines()
    assert lines[0].startswith("OK") and "alpha" in lines[0] and "fine" in lines[0]
    assert lines[1].startswith("FAIL") and "broken" in lines[1]
    assert lines[2].strip() == "second line"
    assert lines[3].strip() == "fix: do x"
    assert "unused" not in table
    assert "1 ok, 0 warn, 1 fail, 0 skip" in table


def _doctor_json(tmp_path: Path, *flags: str) -> tuple[int, list[dict], str]:
    """``ds4d doctor --json`` in a child process with no DS4D_* variables and no config file."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("DS4D_")}
    env["DS4D_CONFIG"] = str(tmp_path / "absent.toml")
    result = subprocess.run([sys.executable, "-m", "ds4d.cli", "doctor", "--json", *flags], check=False,
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    return result.returncode, json.loads(result.stdout), result.stderr


def test_cli_doctor_json(tmp_path: Path):
    returncode, checks, stderr = _doctor_json(tmp_path)
    assert [check["name"] for check in checks] == CHECK_NAMES
    assert all(set(check) == {"name", "status", "detail", "fix"} for check in checks)
    failed = any(check["status"] == "fail" for check in checks)
    assert returncode == (1 if failed else 0), stderr


def test_cli_doctor_takes_the_serve_flags(tmp_path: Path):
    missing_model = str(tmp_path / "missing.gguf")
    returncode, checks, _ = _doctor_json(tmp_path, "--model", missing_model, "--cache-disk-dir", str(tmp_path))
    by_name = {check["name"]: check for check in checks}
    assert by_name["model"]["status"] == "fail" and missing_model in by_name["model"]["detail"]
    assert by_name["cache_disk"]["status"] in ("ok", "warn") and str(tmp_path) in by_name["cache_disk"]["detail"]
    assert returncode == 1
