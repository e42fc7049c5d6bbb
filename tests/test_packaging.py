"""What `pip install .` puts on a machine: one `trainq` import package, the schemas, LICENSE, a working --version."""

from __future__ import annotations

import subprocess
import venv
import zipfile
from pathlib import Path

from conftest import PY, REPO


def test_a_non_editable_install_holds_only_the_trainq_package(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    # the wheel is built with this venv's setuptools (no network), then installed into a fresh venv without deps
    subprocess.run(
        [PY, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = next(wheels.glob("trainq-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"trainq", wheel.name.split("-py")[0] + ".dist-info"}, names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    env_dir = tmp_path / "v"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [PY, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) == ["trainq"]
    assert {p.name for p in (site / "trainq" / "schemas").glob("*.json")} >= {
        "job.schema.json",
        "train.schema.json",
        "status.schema.json",
        "run.schema.json",
        "watcher.schema.json",
    }

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(python), "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)

    for generic in ("trainer", "watcher", "schemas"):  # from outside the repo, no generic top-level names
        assert run(f"import {generic}").returncode == 1
    assert run("import trainq.watcher, trainq.schemas").returncode == 0
    from importlib.metadata import version

    out = subprocess.run(
        [str(env_dir / "bin" / "trainq"), "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == f"trainq {version('trainq')}", out.stderr
