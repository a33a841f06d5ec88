"""Packaging and layout: every module sits at its import path; `pip install -e .` (the default
mode), `pip install .` and each role's own wheel work with no re-link step; the router and the
operator run without the model stack; the standard library's `operator` is never shadowed."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import httpx

from pagefleet.common import __version__
from server_utils import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
ROLE_DIRS = ["pagefleet", "proto", "engine", "router", "operator"]
SOURCES = ["pyproject.toml", "README.md", *ROLE_DIRS]
MODEL_STACK = ("torch", "triton", "nixl", "safetensors")


def _run(*args, cwd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=True, **kw)


def _src_files() -> list[tuple[str, Path]]:
    """(import name, file) of every module under the role folders' src trees."""
    found = []
    for role in ROLE_DIRS:
        src = ROOT / role / "src"
        for path in sorted(src.rglob("*.py")):
            parts = path.relative_to(src).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found.append((name, path))
    return found


def _src_packages() -> list[str]:
    return sorted(name for name, path in _src_files() if path.name == "__init__.py")


def _copy_sources(dest: Path) -> Path:
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, dest / name)
    return dest


def _fresh_venv(tmp_path: Path) -> Path:
    """A venv whose third-party dependencies come from this one (no downloads), but none of
    pagefleet's own files or metadata: what it sees of pagefleet is what the test installs."""
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv), cwd=tmp_path)
    deps = tmp_path / "deps"
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(("pagefleet", "__editable__", "_pagefleet")):
            (deps / entry.name).symlink_to(entry)
    site = Path(
        _run(
            str(venv / "bin" / "python"),
            "-c",
            "import site; print(site.getsitepackages()[0])",
            cwd=tmp_path,
        ).stdout.strip()
    )
    (site / "zz_deps.pth").write_text(f"{deps}\n")
    return venv


def _pip(venv: Path, *args: str, cwd: Path) -> None:
    _run(str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
         "--no-build-isolation", *args, cwd=cwd)  # fmt: skip


def test_every_module_is_found_at_its_file_path():
    files = _src_files()
    assert len(files) > 50
    tracked = subprocess.run(
        ["git", "ls-files", *ROLE_DIRS], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    strays = [f for f in tracked if f.endswith(".py") and f.split("/")[1] != "src"]
    assert not strays, f"modules outside a role's src/ never import: {strays}"
    for name, path in files:
        spec = importlib.util.find_spec(name)
        assert spec is not None and Path(spec.origin).resolve() == path.resolve(), (name, spec)


def test_the_all_in_one_distribution_lists_every_package_and_folder():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(config["packages"]) == _src_packages()
    for package, folder in config["package-dir"].items():
        assert folder == f"{folder.split('/')[0]}/src/{package.replace('.', '/')}"


def test_role_distributions_share_one_version_and_pin_the_shared_pieces():
    for role in ROLE_DIRS:
        project = tomllib.loads((ROOT / role / "pyproject.toml").read_text())["project"]
        assert project["version"] == __version__, role
        if role not in ("pagefleet", "proto"):
            deps = project["dependencies"]
            assert f"=={__version__}" in next(d for d in deps if d.startswith("pagefleet-common"))
            assert role == "engine" or not any(d.startswith(MODEL_STACK) for d in deps), role


def test_wheel_installs_into_a_fresh_venv_and_imports_every_package(tmp_path):
    src = _copy_sources(tmp_path / "src")
    wheels = tmp_path / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), ".", cwd=src)  # fmt: skip
    (wheel,) = wheels.glob("pagefleet-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert all(n.startswith(("pagefleet/", "pagefleet-")) for n in names), names
    assert "pagefleet/__init__.py" not in names  # a namespace over every role
    assert "pagefleet/proto/kv_transfer.proto" in names
    venv = _fresh_venv(tmp_path)
    _pip(venv, str(wheel), cwd=tmp_path)
    code = (
        "import importlib\n"
        f"for name in {_src_packages()!r}:\n"
        "    mod = importlib.import_module(name)\n"
        f"    assert mod.__file__.startswith({str(venv)!r}), (name, mod)\n"
    )
    _run(str(venv / "bin" / "python"), "-c", code, cwd=tmp_path)
    out = _run(str(venv / "bin" / "pagefleet"), "--version", cwd=tmp_path)
    assert out.stdout.strip() == f"pagefleet {__version__}"


def test_a_default_editable_install_sees_new_modules_without_a_reinstall(tmp_path):
    src = _copy_sources(tmp_path / "src")
    venv = _fresh_venv(tmp_path)
    _pip(venv, "-e", ".", cwd=src)
    engine = src / "engine" / "src" / "pagefleet" / "engine"
    (engine / "zz_added.py").write_text("WHERE = 'module'\n")
    (engine / "zz_pkg").mkdir()
    (engine / "zz_pkg" / "__init__.py").write_text("")
    (engine / "zz_pkg" / "inner.py").write_text("WHERE = 'subpackage'\n")
    code = (
        "import pagefleet.engine.scheduler as s, pagefleet.engine.zz_added as a\n"
        "import pagefleet.engine.zz_pkg.inner as i, pagefleet.router.app as r\n"
        "print(s.__file__, a.WHERE, i.WHERE, r.__file__)\n"
    )
    out = _run(str(venv / "bin" / "python"), "-c", code, cwd=tmp_path).stdout.split()
    assert out == [
        str(engine / "scheduler.py"),
        "module",
        "subpackage",
        str(src / "router" / "src" / "pagefleet" / "router" / "app.py"),
    ]
    help_text = _run(str(venv / "bin" / "pagefleet"), "--help", cwd=tmp_path).stdout
    assert all(c in help_text for c in ("serve", "router", "operator", "up"))


def test_the_router_image_installs_without_the_engine_and_runs_the_router(tmp_path):
    """What the router image installs (proto, the shared pieces, the router): its `pagefleet`
    knows `router` and `epp` (the same core behind a Gateway) and nothing else, and the engine
    is not there to import."""
    src = _copy_sources(tmp_path / "src")
    wheels = tmp_path / "wheels"
    for role in ("proto", "pagefleet", "router"):
        _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
             "-w", str(wheels), f"./{role}", cwd=src)  # fmt: skip
    venv = _fresh_venv(tmp_path)
    _pip(venv, *map(str, sorted(wheels.glob("*.whl"))), cwd=tmp_path)
    help_text = _run(str(venv / "bin" / "pagefleet"), "--help", cwd=tmp_path).stdout
    assert "router" in help_text and "serve" not in help_text and "operator" not in help_text
    assert "epp" in help_text
    _run(str(venv / "bin" / "pagefleet"), "router", "--help", cwd=tmp_path)
    _run(str(venv / "bin" / "pagefleet"), "epp", "--help", cwd=tmp_path)
    code = (
        "import importlib.util as u; from pagefleet.router.openapi import body_schemas\n"
        "print(u.find_spec('pagefleet.engine'), 'CompletionRequest' in body_schemas())"
    )
    out = _run(str(venv / "bin" / "python"), "-c", code, cwd=tmp_path).stdout.strip()
    assert out == "None True"  # no engine, and the router's OpenAPI bodies (package data)


def test_router_and_operator_entry_points_import_no_model_stack():
    code = (
        "import sys\n"
        "from pagefleet.common.cli import build_parser\n"
        "import pagefleet.router.main, pagefleet.router.app, pagefleet.router.pd\n"
        "import pagefleet.router.discovery, pagefleet.router.kv_subscriber\n"
        "import pagefleet.router.epp_main, pagefleet.router.epp, pagefleet.router.ext_proc\n"
        "import pagefleet.operator.main, pagefleet.operator.handlers\n"
        "import pagefleet.operator.reconcile, pagefleet.operator.metrics_source\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in "
        f"{MODEL_STACK!r} or m.startswith(('transformers.models', 'pagefleet.engine'))]\n"
        "print(heavy)\n"
    )
    assert _run(sys.executable, "-c", code, cwd=ROOT).stdout.strip() == "[]"


def test_a_running_router_with_a_tokenizer_maps_no_torch(tiny_checkpoints, tmp_path):
    """transformers imports torch whenever it is installed; the router keeps it out even here."""
    port = free_port()
    log = tmp_path / "router.log"
    with log.open("w") as out:
        command = [str(Path(sys.executable).parent / "pagefleet"), "router", "--host", "127.0.0.1",
                   "--port", str(port), "--endpoints", f"http://127.0.0.1:{free_port()}",
                   "--tokenizer", str(tiny_checkpoints["llama"])]  # fmt: skip
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    try:

        def live() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/livez", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(live, timeout=120)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in maps and "tokenizers" in maps, log.read_text()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def test_operator_folder_never_shadows_the_standard_library():
    # Run from the repository root, where '' (the root) is first on sys.path.
    code = (
        "import operator, sys, sysconfig\n"
        "assert operator.__file__.startswith(sysconfig.get_paths()['stdlib']), operator.__file__\n"
        "import pagefleet.operator.reconcile, pagefleet.common.names as n\n"
        "assert n.GROUP == 'pagefleet.io'\n"
        "import collections, functools\n"
        "print('ok')\n"
    )
    out = _run(sys.executable, "-c", code, cwd=ROOT)
    assert out.stdout.strip() == "ok"
    assert not (ROOT / "operator" / "__init__.py").exists()
