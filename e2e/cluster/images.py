"""Images in the lab: the project's image is read from its Dockerfile (final stage: ENV, USER,
WORKDIR, ENTRYPOINT, CMD) with /opt/pagefleet standing for this virtualenv, so pods run
`pagefleet` from this checkout with the environment the real image sets. A weights image is
a directory the test gives, at the path the image would hold it."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

from .podspec import Image

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "deploy" / "docker" / "Dockerfile.cpu"
IMAGE_VENV = "/opt/pagefleet"
# PATH of the python:*-slim base image, which the Dockerfile's `ENV PATH=...:$PATH` extends.
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PROJECT_REPOSITORY = "ghcr.io/pagefleet/pagefleet"  # the engine
# The router's and the operator's images (Dockerfile.slim): their Dockerfile's environment, run
# from the same virtualenv (the router process keeps torch out: tests/test_packaging.py).
SLIM_DOCKERFILE = REPO_ROOT / "deploy" / "docker" / "Dockerfile.slim"
SLIM_REPOSITORIES = ("ghcr.io/pagefleet/pagefleet-router", "ghcr.io/pagefleet/pagefleet-operator")


def final_stage(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the last stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile)
    stages: list[list[tuple[str, str]]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        stages[-1].append((instruction.upper(), rest.strip()))
    return stages[-1]


def _exec_form(text: str) -> tuple[str, ...]:
    return tuple(json.loads(text)) if text.startswith("[") else ("/bin/sh", "-c", text)


def image_from_dockerfile(dockerfile: str, venv: str) -> Image:
    """The image config the final stage builds, with IMAGE_VENV mapped to `venv`."""
    env: dict[str, str] = {"PATH": BASE_PATH}
    user, workdir = (0, 0), "/"
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    for instruction, args in final_stage(dockerfile):
        if instruction == "ENV":
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                env[key] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m[1], ""), value)
        elif instruction == "USER":
            uid, _, gid = args.partition(":")
            user = (int(uid), int(gid or uid))
        elif instruction == "WORKDIR":
            workdir = args
        elif instruction == "ENTRYPOINT":
            entrypoint = _exec_form(args)
        elif instruction == "CMD":
            cmd = _exec_form(args)
    env = {k: v.replace(IMAGE_VENV, venv) for k, v in env.items()}
    return Image(env=env, entrypoint=entrypoint, cmd=cmd, user=user, workdir=workdir)


def project_image(dockerfile: Path = DOCKERFILE) -> Image:
    """One of the project's images, running this checkout's virtualenv (and the Python it links
    to) with the environment its Dockerfile sets."""
    venv = str(Path(sys.executable).parent.parent)
    base = image_from_dockerfile(dockerfile.read_text(), venv)
    python_home = str(Path(os.path.realpath(sys.executable)).parent.parent)
    expose = tuple(sorted({venv, python_home, str(REPO_ROOT)}))
    return Image(**{**base.__dict__, "expose": expose})


def project_images() -> dict[str, Image]:
    """Every image the chart and the operator name, by repository."""
    slim = project_image(SLIM_DOCKERFILE)
    return {PROJECT_REPOSITORY: project_image(), **dict.fromkeys(SLIM_REPOSITORIES, slim)}


def files_image(files: dict[str, str]) -> Image:
    """An image holding only files (model weights) and a shell: `files` maps the image's
    paths to host directories."""
    return Image(env={"PATH": BASE_PATH}, files=dict(files))
