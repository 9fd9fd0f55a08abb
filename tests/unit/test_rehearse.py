"""rehearse.py's accounting of what travels to the GPU machine (64 MiB, tree and carry)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from iterserve.loadtests.studies.gpu_first_light import rehearse
from iterserve.loadtests.studies.gpu_first_light.gpu_machine import BROUGHT, CARRY_LIMIT_BYTES, MISSING


def test_tree_bytes_counts_what_the_device_tool_sends(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/.gpu_carry/\n*.log\n")  # 19 bytes
    (tmp_path / "tracked.py").write_bytes(b"x" * 1000)
    subprocess.run(["git", "-C", str(tmp_path), "add", "tracked.py", ".gitignore"], check=True)
    (tmp_path / "untracked.py").write_bytes(b"y" * 300)  # sent: not ignored
    (tmp_path / "run.log").write_bytes(b"z" * 5000)  # not sent: ignored
    (tmp_path / ".gpu_carry").mkdir()
    (tmp_path / ".gpu_carry" / "w.whl").write_bytes(b"w" * 7000)  # carried, counted apart
    assert rehearse.tree_bytes(tmp_path) == 19 + 1000 + 300
    assert rehearse.folder_bytes(tmp_path / ".gpu_carry") == 7000


def test_size_report_names_every_size_and_refuses_past_64_mib() -> None:
    lines, fits = rehearse.size_report(20 * 2**20, {"wheels/a.whl": 30 * 2**20, "tok": 14 * 2**20})
    assert fits and lines[-1].split()[1:4] == ["64.00", "MiB", "of"] and lines[-1].endswith("fits")
    assert any("wheels/a.whl" in line and "30.00 MiB" in line for line in lines)
    lines, fits = rehearse.size_report(CARRY_LIMIT_BYTES, {"one more byte": 1})
    assert not fits and lines[-1].endswith("DOES NOT FIT")


def test_what_is_brought_is_pinned_and_is_not_ray() -> None:
    names = [spec.split("==")[0] for spec in BROUGHT]
    assert all("==" in spec for spec in BROUGHT) and len(set(names)) == len(names)
    assert "xgrammar" in names and "ray" not in names and "ray" in MISSING
