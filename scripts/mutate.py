"""Mutation testing of the cores with mutmut (`make mutate`): one module at a time, each with
the small set of fast tests that must notice it broken (`[tool.pagefleet.mutate]` in
pyproject.toml). Not part of `make test`: it runs each module's tests once per mutant.

mutmut imports the mutated code from a `mutants/` copy of the source tree, which must be the
import tree itself; ours maps role folders into one namespace (engine/ is pagefleet.engine),
so each run works in build/mutate/<module>/, a copy laid out as Python imports it.

    .venv/bin/python scripts/mutate.py                      # every module in the table
    .venv/bin/python scripts/mutate.py engine/sampler.py    # one
    .venv/bin/python scripts/mutate.py --report-only        # scores of the last runs

Prints per module: mutants, killed, survived (with mutmut's name for each, to `mutmut show`
from its build folder), score; docs/testing.md records the table and why the survivors live.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "mutate"
# Where each role folder sits in the import tree.
IMPORT_PATHS = {
    "pagefleet": "pagefleet",
    "engine": "pagefleet/engine",
    "router": "pagefleet/router",
    "operator": "pagefleet/operator",
    "proto": "pagefleet/proto",
}
# mutmut's exit codes (mutmut/stats.py): a failing test run (1), pytest's internal error (3),
# a timeout (36, SIGXCPU) or a crash kill the mutant; 0 is a survivor, 5/33 "no tests" (no
# selected test runs the mutated function: counted as surviving).
KILLED_CODES = {1, 3, 36, 24, -24, 152, 255, -11, -9}


@dataclass
class Score:
    module: str
    exit_codes: dict[str, int | None] = field(default_factory=dict)  # mutant name -> code

    @property
    def killed(self) -> int:
        return sum(c in KILLED_CODES for c in self.exit_codes.values())

    @property
    def survivors(self) -> list[str]:
        return sorted(n for n, c in self.exit_codes.items() if c not in KILLED_CODES)

    @property
    def percent(self) -> float:
        return 100.0 * self.killed / len(self.exit_codes) if self.exit_codes else 0.0


def table() -> dict[str, list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["pagefleet"]["mutate"]


def import_path(module: str) -> str:
    top, _, rest = module.partition("/")
    return f"{IMPORT_PATHS[top]}/{rest}"


def work_dir(module: str) -> Path:
    return BUILD / module.replace("/", "_").removesuffix(".py")


def stage(module: str, tests: list[str]) -> Path:
    """A fresh copy of the source as the import tree, the tests, and mutmut's config."""
    work = work_dir(module)
    shutil.rmtree(work, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder, target in IMPORT_PATHS.items():
        if folder == "pagefleet":
            (work / target).mkdir(parents=True)
            for f in (ROOT / folder).glob("*.py"):
                shutil.copy2(f, work / target / f.name)
        else:
            shutil.copytree(ROOT / folder, work / target, ignore=ignore)
    shutil.copytree(ROOT / "tests", work / "tests", ignore=ignore)
    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    options = pytest_options["ini_options"]
    lines = [
        "[tool.mutmut]",
        'source_paths = ["pagefleet"]',
        f"only_mutate = [{json.dumps(import_path(module))}]",
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-x", "-q"]',
        "",
        "[tool.pytest.ini_options]",
        'testpaths = ["tests"]',
        f"asyncio_default_fixture_loop_scope = {json.dumps(options['asyncio_default_fixture_loop_scope'])}",  # noqa: E501
        "",
    ]
    (work / "pyproject.toml").write_text("\n".join(lines))
    return work


def run(module: str, tests: list[str], max_children: int) -> None:
    work = stage(module, tests)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    mutmut = Path(sys.executable).parent / "mutmut"
    print(f"== {module}: mutmut over {' '.join(tests)} (log: {work / 'mutmut.log'})", flush=True)
    with (work / "mutmut.log").open("w") as log:
        subprocess.run(
            [str(mutmut), "run", "--max-children", str(max_children)],
            cwd=work,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )


def show_survivors(module: str) -> None:
    """mutmut's diff of each surviving mutant."""
    mutmut = Path(sys.executable).parent / "mutmut"
    for name in score(module).survivors:
        subprocess.run([str(mutmut), "show", name], cwd=work_dir(module), check=False)


def score(module: str) -> Score:
    meta = work_dir(module) / "mutants" / (import_path(module) + ".meta")
    result = Score(module)
    if not meta.exists():
        return result
    result.exit_codes = json.loads(meta.read_text())["exit_code_by_key"]
    return result


def report(modules: list[str]) -> str:
    rows = ["| module | mutants | killed | survived | score |", "|---|--:|--:|--:|--:|"]
    details = []
    for module in modules:
        s = score(module)
        rows.append(
            f"| {module} | {len(s.exit_codes)} | {s.killed} | {len(s.survivors)} | "
            f"{s.percent:.1f}% |"
        )
        if s.survivors:
            details.append(f"{module} survivors: " + ", ".join(s.survivors))
    return "\n".join([*rows, "", *details])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="source paths (default: the whole table)")
    parser.add_argument("--max-children", type=int, default=2)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--show", action="store_true", help="print each survivor's diff")
    args = parser.parse_args(argv)
    modules = table()
    chosen = args.modules or list(modules)
    unknown = [m for m in chosen if m not in modules]
    if unknown:
        parser.error(f"not in [tool.pagefleet.mutate]: {unknown}")
    if not args.report_only:
        for module in chosen:
            run(module, modules[module], args.max_children)
    print(report(chosen))
    if args.show:
        for module in chosen:
            show_survivors(module)
    return 0


if __name__ == "__main__":
    sys.exit(main())
