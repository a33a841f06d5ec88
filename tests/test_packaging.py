"""Packaging: the wheel holds every package under `pagefleet`; operator/ never shadows stdlib."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = [
    "pagefleet",
    "pagefleet.engine",
    "pagefleet.engine.kv_cache",
    "pagefleet.engine.scheduler",
    "pagefleet.router",
    "pagefleet.operator",
    "pagefleet.operator.names",
    "pagefleet.proto",
]
SOURCES = ["pyproject.toml", "README.md", "pagefleet", "engine", "router", "operator", "proto"]


def _run(*args, cwd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=True, **kw)


def test_wheel_installs_into_a_fresh_venv_and_imports_every_package(tmp_path):
    src = tmp_path / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(path, src / name)
    wheels = tmp_path / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), ".", cwd=src)
    (wheel,) = wheels.glob("pagefleet-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert all(n.startswith(("pagefleet/", "pagefleet-")) for n in names), names
    assert "pagefleet/operator/names.py" in names

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv), cwd=tmp_path)
    py = venv / "bin" / "python"
    _run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(py),
        "install",
        "-q",
        "--no-deps",
        str(wheel),
        cwd=tmp_path,
    )
    # Dependencies come from the project venv (appended, so the wheel's own files win).
    site = Path(
        _run(
            str(py), "-c", "import site; print(site.getsitepackages()[0])", cwd=tmp_path
        ).stdout.strip()
    )
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import importlib, sys\n"
        f"for name in {PACKAGES!r}:\n"
        "    mod = importlib.import_module(name)\n"
        f"    assert str(getattr(mod, '__file__', None) or list(mod.__path__)[0]).startswith("
        f"{str(venv)!r}), (name, mod)\n"
        "from pagefleet.cli import main\n"
        "sys.exit(main(['--version']))\n"
    )
    out = _run(str(py), "-c", code, cwd=tmp_path)
    assert out.stdout.startswith("pagefleet ")


def test_operator_folder_never_shadows_the_standard_library():
    # Run from the repository root, where '' (the root) is first on sys.path.
    code = (
        "import operator, sys, sysconfig\n"
        "assert operator.__file__.startswith(sysconfig.get_paths()['stdlib']), operator.__file__\n"
        "import pagefleet.operator.names as n\n"
        "assert n.GROUP == 'pagefleet.io'\n"
        "import collections, functools\n"
        "print('ok')\n"
    )
    out = _run(sys.executable, "-c", code, cwd=ROOT)
    assert out.stdout.strip() == "ok"
    assert not (ROOT / "operator" / "__init__.py").exists()
