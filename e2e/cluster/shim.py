"""The lab's container runtime shim: `python shim.py SPEC.json` turns itself into one container.

It enters the pod's network namespace, takes a private mount and UTS namespace, gives the
container its own /dev/shm, mounts the pod's volumes at their mountPath (bind or tmpfs, read-only
where asked), makes the rest of the filesystem read-only for `readOnlyRootFilesystem`, drops to
the container's user and execs the command. Standard library only: it runs before anything else.

The spec (written by kubelet.py) is a JSON object:
  netns, hostname, argv, env, workdir, uid, gid, groups, read_only_root,
  mounts: [{source, target, read_only, tmpfs_options}]  (source null: a tmpfs)
  expose: image paths a non-root user must be able to reach (see `expose`),
  created_log: file that lists mount points this shim created on the host (the lab removes
  them when it stops).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import warnings  # noqa: F401 - os.execvpe imports it, after the user change may hide it

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
SYS_MOUNT_SETATTR = 442  # x86_64 and aarch64
PR_SET_PDEATHSIG = 1
RUNTIME_SHM = "size=64m,mode=1777"  # what container runtimes give a container by default

libc = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    check(
        libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data or None)),
        f"mount {source} on {target}",
    )


def set_read_only(path: str, read_only: bool, recursive: bool = True) -> None:
    """Set or clear MOUNT_ATTR_RDONLY on the mount at `path` (and every mount below it)."""
    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0) if read_only else MountAttr(0, MOUNT_ATTR_RDONLY)
    check(
        libc.syscall(
            SYS_MOUNT_SETATTR,
            AT_FDCWD,
            path.encode(),
            AT_RECURSIVE if recursive else 0,
            ctypes.byref(attr),
            ctypes.sizeof(attr),
        ),
        f"mount_setattr {path}",
    )


def under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def make_mount_point(target: str, is_file: bool, created: list[str]) -> None:
    """Create the missing parts of `target`, noting each one made (deepest last)."""
    missing = []
    path = target
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    for part in reversed(missing):
        if part == target and is_file:
            open(part, "a").close()
        else:
            try:
                os.mkdir(part, 0o755)
            except FileExistsError:  # a container starting beside this one made it first
                continue
        created.append(part)


def expose(paths: list[str], uid: int) -> None:
    """Image paths behind a directory the container's user cannot enter (the venv's Python under
    /root here) get a tmpfs over that directory with only them bind-mounted back, as an image
    would hold just those files."""
    if uid == 0:
        return
    fds = {p: os.open(p, os.O_PATH) for p in paths}
    masked: set[str] = set()
    for path, fd in fds.items():
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:i])
            if ancestor in masked or not os.stat(ancestor).st_mode & 0o001:
                if ancestor not in masked:
                    mount("tmpfs", ancestor, "tmpfs", 0, "mode=755")
                    masked.add(ancestor)
                os.makedirs(path, exist_ok=True)
                mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
                break
        os.close(fd)


def mount_volumes(mounts: list[dict]) -> None:
    """Bind (or tmpfs) each volume at its target, parents before children. Sources are opened
    first: a volume mounted at /tmp must not hide another one's source under /tmp."""
    sources = {i: os.open(m["source"], os.O_PATH) for i, m in enumerate(mounts) if m["source"]}
    order = sorted(range(len(mounts)), key=lambda i: mounts[i]["target"].count("/"))
    for i in order:
        m = mounts[i]
        target = m["target"]
        if not os.path.lexists(target):  # under another volume: it lands in that volume
            make_mount_point(target, m["source"] is not None and os.path.isfile(m["source"]), [])
        if m["source"] is None:
            mount("tmpfs", target, "tmpfs", 0, m.get("tmpfs_options") or "mode=1777")
        else:
            mount(f"/proc/self/fd/{sources[i]}", target, None, MS_BIND)
        # A bind inherits its source mount's flags (read-only under readOnlyRootFilesystem):
        # each volume says for itself.
        set_read_only(target, bool(m.get("read_only")), recursive=False)
    for fd in sources.values():
        os.close(fd)


def uncover(image_paths: dict[str, int], targets: list[str]) -> None:
    """The image's own files stay visible under a volume: a checkout under /tmp (the image's
    /opt/pagefleet in the lab) is not hidden by the pod's emptyDir at /tmp. Closes the fds."""
    for path, fd in image_paths.items():
        if any(under(path, t) for t in targets):
            os.makedirs(path, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)


def become(spec: dict) -> None:
    """Everything but the exec: namespaces, mounts, hostname, user."""
    os.setsid()  # the container's processes are one group: the kubelet kills them together
    if spec.get("netns"):
        fd = os.open(spec["netns"], os.O_RDONLY)
        check(libc.setns(fd, CLONE_NEWNET), "setns")
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    hostname = spec["hostname"].encode()
    check(libc.sethostname(hostname, len(hostname)), "sethostname")

    mounts = spec["mounts"]
    targets = [m["target"] for m in mounts]
    created: list[str] = []
    for m in mounts:  # mount points on the host's tree; those under a volume come later
        if not any(t != m["target"] and under(m["target"], t) for t in targets):
            is_file = m["source"] is not None and os.path.isfile(m["source"])
            make_mount_point(m["target"], is_file, created)
    if created and spec.get("created_log"):
        with open(spec["created_log"], "a") as log:
            log.writelines(f"{path}\n" for path in created)

    uid = spec.get("uid") or 0
    image_paths = {p: os.open(p, os.O_PATH) for p in spec.get("expose") or []}
    expose(spec.get("expose") or [], uid)
    if spec.get("read_only_root"):
        set_read_only("/", True)
        set_read_only("/proc", False)
    mount("shm", "/dev/shm", "tmpfs", 0, RUNTIME_SHM)
    mount_volumes(mounts)
    uncover(image_paths, targets)

    os.chdir(spec.get("workdir") or "/")
    gid = spec.get("gid")
    os.setgroups(spec.get("groups") or ([gid] if gid is not None else []))
    if gid is not None:
        os.setgid(gid)
    os.setuid(uid)
    # After the user change (which clears it): die with the kubelet's thread, never orphaned.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    try:
        become(spec)
    except OSError as e:
        print(f"lab shim: cannot create the container: {e}", file=sys.stderr, flush=True)
        os._exit(128)
    argv, env = spec["argv"], spec["env"]
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        print(f"lab shim: exec {argv[0]!r}: {e}", file=sys.stderr, flush=True)
        os._exit(127)


if __name__ == "__main__":
    main()
