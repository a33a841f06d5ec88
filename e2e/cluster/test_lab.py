"""The cluster lab's own tests: what it promises to behave like Kubernetes does (env expansion,
selectors, probes, API semantics, garbage collection, volumes, network isolation, clean-up)."""

from __future__ import annotations

import json
import os
import socket
import ssl
import sys
import textwrap
import threading
from concurrent import futures

import httpx
import pytest

from .api import quantity, strategic_merge
from .images import image_from_dockerfile
from .labels import from_label_selector, matches, parse_selector
from .podspec import ConfigError, Image, container_argv, container_env, expand
from .probes import Thresholds

IMAGE = "ghcr.io/pagefleet/pagefleet:test"


def pod(name: str, script: str, namespace: str = "default", **spec) -> dict:
    """A bare pod running a Python script in the project's image."""
    container = {
        "name": "main",
        "image": IMAGE,
        "command": ["python", "-c", textwrap.dedent(script)],
    }
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": name}},
        "spec": {"containers": [container], **spec},
    }


def deployment(name: str, script: str, replicas: int = 1, **container) -> dict:
    spec = pod(name, script, container=container)["spec"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec},
        },
    }


def finished(lab, name: str, namespace: str = "default") -> dict:
    return lab.wait_for(
        lambda: (
            (p := lab.kube.get("v1", "Pod", namespace, name))
            and p["status"].get("phase") in {"Succeeded", "Failed"}
            and p
        ),
        60,
        f"pod {name} to finish",
    )


# --- pure parts ----------------------------------------------------------------------------


def test_variable_expansion_follows_kubernetes():
    env = {"A": "x", "B": "y"}
    assert expand("$(A)-$(B)", env) == "x-y"
    assert expand("$$(A)", env) == "$(A)"  # escaped
    assert expand("$(MISSING)", env) == "$(MISSING)"  # unknown stays
    assert expand("$(A", env) == "$(A"  # unclosed stays
    assert expand("cost $5 $", env) == "cost $5 $"
    assert expand("$$$(A)", env) == "$x"


def test_container_env_and_argv_as_the_kubelet_builds_them():
    pod_ = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": {"role": "decode"}},
        "spec": {"nodeName": "node"},
        "status": {"podIP": "10.88.0.7"},
    }
    container = {
        "command": ["serve", "--host", "$(POD_IP)"],
        "args": ["--name=$(NAME)", "$(LATER)", "$$(POD_IP)"],
        "env": [
            {"name": "EARLY", "value": "$(LATER)"},  # defined after: not expanded
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NAME", "value": "$(POD_NS)/$(ROLE)"},
            {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "ROLE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['role']"}}},
            {"name": "LATER", "value": "late"},
            {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            {"name": "CONF", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "x"}}},
        ],
    }
    data = {("Secret", "s"): {"k": "secret"}, ("ConfigMap", "c"): {"x": "conf"}}
    env = container_env(pod_, container, {"SVC": "1"}, lambda kind, name: data.get((kind, name)))
    assert env["EARLY"] == "$(LATER)"
    assert env["NAME"] == "$(POD_NS)/$(ROLE)"  # both defined later
    assert (env["POD_IP"], env["KEY"], env["CONF"], env["SVC"]) == (
        "10.88.0.7",
        "secret",
        "conf",
        "1",
    )
    argv = container_argv(container, Image(entrypoint=("ignored",)), env)
    assert argv == ["serve", "--host", "10.88.0.7", "--name=$(POD_NS)/$(ROLE)", "late", "$(POD_IP)"]
    assert container_argv(
        {"args": ["x"]}, Image(entrypoint=("pagefleet",), cmd=("--help",)), {}
    ) == [
        "pagefleet",
        "x",
    ]
    with pytest.raises(ConfigError):
        container_env(pod_, {"env": [container["env"][6]]}, {}, lambda kind, name: None)


def test_containers_starting_together_share_a_missing_mount_point(tmp_path, monkeypatch):
    """Two replicas of a pod start at once and both find /var/run/secrets missing: the one that
    loses the race to create it still starts (one restarted with "File exists" before), and only
    the parts it made are noted for the lab to remove."""
    from . import shim

    target = tmp_path / "var" / "run" / "secrets" / "token"
    real_mkdir = os.mkdir

    def beaten_to_it(path, mode=0o777):
        if path == str(tmp_path / "var" / "run"):
            real_mkdir(path, mode)  # the other container, between our check and our mkdir
        real_mkdir(path, mode)

    monkeypatch.setattr(shim.os, "mkdir", beaten_to_it)
    created: list[str] = []
    shim.make_mount_point(str(target), False, created)
    assert target.is_dir()
    assert created == [str(tmp_path / "var"), str(target.parent), str(target)]


def test_label_selectors():
    labels = {"app": "x", "tier": "db"}
    assert matches(parse_selector("app=x,tier in (db, cache),!gone,tier"), labels)
    assert not matches(parse_selector("app!=x"), labels)
    assert not matches(parse_selector("tier notin (db)"), labels)
    assert matches(parse_selector(""), labels)
    selector = {
        "matchLabels": {"app": "x"},
        "matchExpressions": [{"key": "tier", "operator": "Exists"}],
    }
    assert matches(from_label_selector(selector), labels)
    assert not matches(from_label_selector(selector), {"app": "x"})
    with pytest.raises(ValueError):
        parse_selector("app in x")


def test_probe_thresholds():
    t = Thresholds(success_threshold=2, failure_threshold=3)
    assert [t.record(ok) for ok in (True, True, False, False, True, False, False, False)] == [
        None,
        True,
        True,
        True,
        True,
        True,
        True,
        False,
    ]


def test_project_image_comes_from_the_dockerfile():
    image = image_from_dockerfile(
        "FROM a AS build\nENV X=1\nFROM b\nENV PATH=/opt/pagefleet/bin:$PATH \\\n    HOME=/tmp\n"
        'USER 1000:1000\nWORKDIR /tmp\nENTRYPOINT ["pagefleet"]\nCMD ["--help"]\n',
        "/venv",
    )
    assert image.env["PATH"].startswith("/venv/bin:/usr/local/sbin")
    assert "X" not in image.env and image.env["HOME"] == "/tmp"
    assert (image.user, image.workdir, image.entrypoint, image.cmd) == (
        (1000, 1000),
        "/tmp",
        ("pagefleet",),
        ("--help",),
    )


def test_server_side_shapes():
    assert [quantity(v) for v in (1, 0.5, "32Gi", 2.0)] == ["1", "500m", "32Gi", "2"]
    old = {"containers": [{"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}]}]}
    patch = {"containers": [{"name": "a", "env": [{"name": "B", "value": "2"}]}]}
    merged = strategic_merge(old, patch)
    assert merged["containers"][0]["image"] == "x"
    assert [e["name"] for e in merged["containers"][0]["env"]] == ["A", "B"]


# --- the API server --------------------------------------------------------------------------


def core(lab):
    """The official client on the lab's plain port (call it from lab threads)."""
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = lab.api_url
    return client.CoreV1Api(client.ApiClient(configuration))


def test_api_server_metadata_selectors_status_and_conflicts(lab):
    api = core(lab)
    cm = {"metadata": {"name": "c", "labels": {"app": "a"}}, "data": {"k": "v"}}
    created = lab.in_lab(api.create_namespaced_config_map, "default", cm)
    assert created.metadata.uid and created.metadata.creation_timestamp
    rv = int(created.metadata.resource_version)
    other = {"metadata": {"name": "d", "labels": {"app": "b"}}}
    lab.in_lab(api.create_namespaced_config_map, "default", other)
    listed = lab.in_lab(api.list_namespaced_config_map, "default", label_selector="app=a")
    assert [i.metadata.name for i in listed.items] == ["c"]
    assert int(listed.metadata.resource_version) > rv

    # A no-op write changes nothing; a change bumps the version; a stale version conflicts.
    same = lab.kube.patch(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": cm["metadata"] | {"namespace": "default"},
        },
        {"data": {"k": "v"}},
    )
    assert same["metadata"]["resourceVersion"] == str(rv)
    changed = lab.kube.patch(same, {"data": {"k": "w"}})
    assert int(changed["metadata"]["resourceVersion"]) > rv
    from kubernetes.client.exceptions import ApiException

    stale = {"metadata": {"name": "c", "resourceVersion": str(rv)}, "data": {"k": "x"}}
    with pytest.raises(ApiException) as conflict:
        lab.in_lab(api.replace_namespaced_config_map, "c", "default", stale)
    assert conflict.value.status == 409
    with pytest.raises(ApiException) as missing_ns:
        lab.in_lab(api.create_namespaced_config_map, "nowhere", cm)
    assert missing_ns.value.status == 404

    # Deployments: defaults, generation only on spec changes, status only through /status.
    d = lab.kube.create(deployment("web", "import time; time.sleep(60)", replicas=0))
    assert d["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == "25%"
    assert d["metadata"]["generation"] == 1
    d = lab.kube.patch(d, {"metadata": {"labels": {"x": "y"}}, "status": {"replicas": 9}})
    assert d["metadata"]["generation"] == 1 and d.get("status", {}).get("replicas") != 9
    d = lab.kube.patch(d, {"spec": {"replicas": 0, "paused": True}})
    assert d["metadata"]["generation"] == 2
    d = lab.kube.patch(d, {"status": {"replicas": 9}}, "status")
    assert d["status"]["replicas"] == 9 and d["metadata"]["generation"] == 2

    # The TLS port wants a bearer token; unauthenticated clients get 401.
    url = f"https://{lab.node_ip}:6443/api/v1/namespaces"
    tls = ssl.create_default_context(cafile=str(lab.ca_file))
    assert lab.in_lab(httpx.get, url, verify=tls).status_code == 401
    ok = lab.in_lab(httpx.get, url, verify=tls, headers={"Authorization": "Bearer t"})
    assert ok.status_code == 200


def test_watch_resumes_from_a_resource_version_and_follows_the_selector(lab):
    api = core(lab)
    first = lab.kube.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "a", "namespace": "default", "labels": {"w": "1"}},
        }
    )
    since = first["metadata"]["resourceVersion"]
    lab.kube.patch(first, {"metadata": {"labels": {"w": "2"}}})  # leaves the selector
    lab.kube.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "b", "namespace": "default", "labels": {"w": "1"}},
        }
    )

    def events():
        from kubernetes import watch

        w = watch.Watch()
        out = []
        for e in w.stream(
            api.list_namespaced_config_map,
            "default",
            label_selector="w=1",
            resource_version=since,
            timeout_seconds=1,
        ):
            out.append((e["type"], e["object"].metadata.name))
        return out

    assert lab.in_lab(events) == [("DELETED", "a"), ("ADDED", "b")]

    # Cluster-scoped Namespaces too: a namespace-scoped kopf (the chart's operator) watches
    # them, and stops after a few refused watches.
    lab.kube.create_namespace("later")

    def namespaces():
        from kubernetes import watch

        stream = watch.Watch().stream(api.list_namespace, resource_version=since, timeout_seconds=1)
        return [(e["type"], e["object"].metadata.name) for e in stream]

    assert lab.in_lab(namespaces) == [("ADDED", "later")]


def test_rolling_update_scaling_and_garbage_collection(lab):
    d = lab.kube.create(deployment("web", "import time; time.sleep(600)", replicas=2))

    def pods():
        return lab.kube.pods("default", "app=web")

    first = lab.wait_for(
        lambda: len(lab.kube.ready_pods("default", "app=web")) == 2 and pods(), 30, "2 pods"
    )
    hashes = {p["metadata"]["labels"]["pod-template-hash"] for p in first}
    assert len(hashes) == 1
    rs_name = f"web-{hashes.pop()}"
    for p in first:
        ref = p["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"], ref["controller"]) == ("ReplicaSet", rs_name, True)
        assert p["metadata"]["name"].startswith(rs_name + "-")

    # A deleted pod is replaced; a template change rolls every pod to a new ReplicaSet.
    lab.kube.delete("v1", "Pod", "default", first[0]["metadata"]["name"], grace_s=0)
    lab.wait_for(
        lambda: (
            len(lab.kube.ready_pods("default", "app=web")) == 2
            and first[0]["metadata"]["name"] not in {p["metadata"]["name"] for p in pods()}
        ),
        30,
        "replacement",
    )
    # Re-applied with a new replica count by a merge patch, which replaces the containers list
    # without the defaults the server added: the server defaults it again, so it scales and
    # rolls nothing (as an operator re-applying its Deployment expects).
    again = deployment("web", "import time; time.sleep(600)", replicas=3)
    d = lab.kube.patch(d, {"spec": again["spec"]})
    lab.wait_for(lambda: len(lab.kube.ready_pods("default", "app=web")) == 3, 30, "3 pods")
    assert {p["metadata"]["labels"]["pod-template-hash"] for p in pods()} == {rs_name[4:]}
    assert [r["metadata"]["name"] for r in lab.kube.list("apps/v1", "ReplicaSet")] == [rs_name]
    d = lab.kube.patch(d, {"spec": {"template": {"metadata": {"annotations": {"rev": "2"}}}}})
    lab.wait_for(
        lambda: (
            (live := [p for p in pods() if not p["metadata"].get("deletionTimestamp")])
            and len(live) == 3
            and all(p["metadata"]["labels"]["pod-template-hash"] != rs_name[4:] for p in live)
            and all(p["status"]["phase"] == "Running" for p in live)
        ),
        60,
        "rolled pods",
    )
    assert lab.kube.get("apps/v1", "ReplicaSet", "default", rs_name)["spec"]["replicas"] == 0

    # Foreground deletion: the Deployment stays until its ReplicaSets and pods are gone.
    lab.kube.delete("apps/v1", "Deployment", "default", "web", propagation="Foreground")
    held = lab.kube.get("apps/v1", "Deployment", "default", "web")
    assert "foregroundDeletion" in held["metadata"]["finalizers"]
    lab.wait_for(
        lambda: lab.kube.get("apps/v1", "Deployment", "default", "web") is None,
        60,
        "deployment gone",
    )
    assert not lab.kube.list("apps/v1", "ReplicaSet", "default") and not pods()

    # Orphan deletion leaves the dependents, without the owner reference.
    owner = lab.kube.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "owner", "namespace": "default"},
        }
    )
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
    }
    for name in ("kept", "collected"):
        lab.kube.create(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": "default", "ownerReferences": [ref]},
            }
        )
    lab.kube.delete("v1", "ConfigMap", "default", "owner", propagation="Orphan")
    lab.wait_for(
        lambda: lab.kube.get("v1", "ConfigMap", "default", "owner") is None, 10, "owner gone"
    )
    assert (
        lab.kube.get("v1", "ConfigMap", "default", "kept")["metadata"].get("ownerReferences")
        is None
    )
    # Background: a dependent whose owner is gone is collected.
    owner = lab.kube.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "owner2", "namespace": "default"},
        }
    )
    ref = {**ref, "name": "owner2", "uid": owner["metadata"]["uid"]}
    lab.kube.patch(
        lab.kube.get("v1", "ConfigMap", "default", "collected"),
        {"metadata": {"ownerReferences": [ref]}},
    )
    lab.kube.delete("v1", "ConfigMap", "default", "owner2")
    lab.wait_for(
        lambda: lab.kube.get("v1", "ConfigMap", "default", "collected") is None, 10, "collected"
    )


# --- pods ----------------------------------------------------------------------------------


def test_network_isolation_between_pods(lab):
    """A server on 127.0.0.1 in one pod is unreachable from another pod and from the node; one
    on the pod IP answers both. Pods reach nothing outside the lab, and the machine's own
    namespace does not reach them."""
    server = pod(
        "server",
        """
        import os, socket, threading
        def serve(host, port):
            s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port)); s.listen()
            while True:
                conn, _ = s.accept(); conn.sendall(b"server-pod\\n"); conn.close()
        threading.Thread(target=serve, args=("127.0.0.1", 9000)).start()
        serve(os.environ["POD_IP"], 9001)
        """,
        container={
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "readinessProbe": {"tcpSocket": {"port": 9001}, "periodSeconds": 1},
        },
    )
    lab.kube.create(server)
    ready = lab.wait_for(lambda: lab.kube.ready_pods("default", "app=server"), 30, "server")
    ip = ready[0]["status"]["podIP"]
    client = pod(
        "client",
        f"""
        import json, socket
        def ask(host, port):
            try:
                with socket.create_connection((host, port), timeout=2) as c:
                    return c.recv(64).decode().strip()
            except OSError as e:
                return type(e).__name__
        out = {{str(p): ask("{ip}", p) for p in (9000, 9001)}}
        out["outside"] = ask("1.1.1.1", 80)
        print(json.dumps(out))
        """,
        restartPolicy="Never",
    )
    lab.kube.create(client)
    done = finished(lab, "client")
    assert done["status"]["phase"] == "Succeeded"
    result = json.loads(lab.pod_log(done).splitlines()[-1])
    assert result["9000"] == "ConnectionRefusedError" and result["9001"] == "server-pod"
    assert result["outside"] != "server-pod" and "Error" in result["outside"]
    assert done["status"]["podIP"] != ip

    def ask(port: int) -> str:
        try:
            with socket.create_connection((ip, port), timeout=2) as c:
                c.settimeout(2)
                return c.recv(64).decode(errors="replace").strip()
        except OSError as e:
            return type(e).__name__

    assert lab.in_lab(ask, 9001) == "server-pod"
    assert lab.in_lab(ask, 9000) == "ConnectionRefusedError"
    assert ask(9001) != "server-pod", "a pod answered the machine's own namespace"


def test_probes_restart_and_termination(lab):
    """Liveness failures restart the container (restartCount); readiness gates Ready; a pod
    deleted gets SIGTERM and, ignoring it, SIGKILL after its grace period."""
    stubborn = deployment(
        "stubborn",
        """
        import signal, socket, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        s = socket.socket(); s.bind(("0.0.0.0", 8000)); s.listen()
        time.sleep(600)
        """,
        ports=[{"name": "http", "containerPort": 8000}],
        readinessProbe={"tcpSocket": {"port": "http"}, "periodSeconds": 1},
        livenessProbe={
            "httpGet": {"path": "/", "port": 8001},
            "periodSeconds": 1,
            "failureThreshold": 2,
        },
    )
    stubborn["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 2
    lab.kube.create(stubborn)
    restarted = lab.wait_for(
        lambda: [
            p
            for p in lab.kube.pods("default", "app=stubborn")
            if p["status"].get("containerStatuses", [{}])[0].get("restartCount", 0) >= 2
        ],
        60,
        "restarts on liveness failure",
    )
    status = restarted[0]["status"]["containerStatuses"][0]
    assert status["lastState"]["terminated"]["exitCode"] == 137  # ignored SIGTERM, got SIGKILL

    # Ready only once its handler is installed (a listening socket after it): on a busy box a
    # pod Ready at process start got SIGTERM before Python had set the handler.
    polite = deployment(
        "polite",
        """
        import signal, socket, sys, time
        signal.signal(signal.SIGTERM, lambda *_: (print("drained", flush=True), sys.exit(0)))
        s = socket.socket(); s.bind(("0.0.0.0", 8000)); s.listen()
        time.sleep(600)
        """,
        ports=[{"name": "http", "containerPort": 8000}],
        readinessProbe={"tcpSocket": {"port": "http"}, "periodSeconds": 1},
    )
    polite["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 120
    lab.kube.create(polite)
    running = lab.wait_for(lambda: lab.kube.ready_pods("default", "app=polite"), 30, "polite pod")
    lab.kube.patch(
        lab.kube.get("apps/v1", "Deployment", "default", "polite"), {"spec": {"replicas": 0}}
    )
    lab.wait_for(
        lambda: not lab.kube.pods("default", "app=polite"), 30, "scaled away"
    )  # well before 60 s
    assert "drained" in lab.pod_log(running[0])


def test_termination_messages_as_the_kubelet_reports_them(lab):
    """A container's `state.terminated.message`: what it wrote to its terminationMessagePath
    (a non-root user under a read-only root may write it); with FallbackToLogsOnError and
    nothing written, the end of a failed run's log (80 lines at most); with the default File
    policy, nothing from the log."""
    many = "import sys; [print(f'line {i}') for i in range(100)]; sys.exit(3)"
    pods = {
        "wrote": ("open('/dev/termination-log', 'w').write('model ready: 42')", None),
        "fell-back": (many, "FallbackToLogsOnError"),
        "file-policy": (many, "File"),
    }
    for name, (script, policy) in pods.items():
        container = {"securityContext": {"runAsUser": 1000, "readOnlyRootFilesystem": True}}
        if policy:
            container["terminationMessagePolicy"] = policy
        lab.kube.create(pod(name, script, restartPolicy="Never", container=container))

    def ended(name: str) -> dict | None:
        status = (lab.kube.get("v1", "Pod", "default", name).get("status") or {}).get(
            "containerStatuses"
        ) or [{}]
        return status[0].get("state", {}).get("terminated")

    done = {n: lab.wait_for(lambda n=n: ended(n), 60, f"{n} to end") for n in pods}
    assert done["wrote"]["message"] == "model ready: 42"
    fell_back = done["fell-back"]["message"].splitlines()
    assert fell_back == [f"line {i}" for i in range(20, 100)]
    assert "message" not in done["file-policy"]


def test_volumes_users_and_read_only_root(lab):
    """ConfigMap files, Secret env, an emptyDir an init container fills, the pod's user and
    fsGroup, a read-only root, the service-account token, all as the spec states them."""
    lab.kube.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "conf", "namespace": "default"},
            "data": {"app.yaml": "a: 1\n"},
        }
    )
    lab.kube.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "sec", "namespace": "default"},
            "data": {"key": "c2VjcmV0"},
        }
    )
    script = """
        import json, os
        root_writable = True
        try:
            open("/usr/lab-probe", "w")
        except OSError:
            root_writable = False
        sa = "/var/run/secrets/kubernetes.io/serviceaccount"
        print(json.dumps({
            "uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
            "conf": open("/etc/app/app.yaml").read(), "seeded": open("/data/seed").read(),
            "secret": os.environ["KEY"], "root_writable": root_writable,
            "tmp_writable": os.access("/data", os.W_OK), "hostname": os.uname().nodename,
            "namespace": open(sa + "/namespace").read(), "token": bool(open(sa + "/token").read()),
            "api": os.environ["KUBERNETES_SERVICE_HOST"],
        }))
    """
    spec = pod("vols", script, restartPolicy="Never")
    main = spec["spec"]["containers"][0]
    main.update(
        env=[{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "key"}}}],
        volumeMounts=[
            {"name": "conf", "mountPath": "/etc/app"},
            {"name": "work", "mountPath": "/data"},
        ],
        securityContext={"readOnlyRootFilesystem": True, "runAsNonRoot": True},
    )
    spec["spec"].update(
        securityContext={"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000},
        volumes=[{"name": "conf", "configMap": {"name": "conf"}}, {"name": "work", "emptyDir": {}}],
        initContainers=[
            {
                "name": "seed",
                "image": IMAGE,
                "command": ["sh", "-c", "echo seeded > /data/seed"],
                "volumeMounts": [{"name": "work", "mountPath": "/data"}],
            }
        ],
    )
    lab.kube.create(spec)
    done = finished(lab, "vols")
    out = json.loads(lab.pod_log(done).splitlines()[-1])
    assert out == {
        "uid": 1000,
        "gid": 1000,
        "groups": [1000, 2000],
        "conf": "a: 1\n",
        "seeded": "seeded\n",
        "secret": "secret",
        "root_writable": False,
        "tmp_writable": True,
        "hostname": "vols",
        "namespace": "default",
        "token": True,
        "api": lab.node_ip,
    }
    assert done["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0

    # A missing ConfigMap keeps the container waiting, as CreateContainerConfigError does.
    missing = pod(
        "missing",
        "print(1)",
        container={
            "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k"}}}]
        },
    )
    lab.kube.create(missing)
    lab.wait_for(
        lambda: (
            (
                lab.kube.get("v1", "Pod", "default", "missing")["status"].get("containerStatuses")
                or [{}]
            )[0]
            .get("state", {})
            .get("waiting", {})
            .get("reason")
            == "CreateContainerConfigError"
        ),
        30,
        "CreateContainerConfigError",
    )


def test_a_node_process_outlives_the_thread_that_started_it(lab):
    """A process on the node (an operator) started from a short-lived thread (the soak's fault
    thread restarts the operator it killed) runs until the lab stops it: it must not die with
    that thread, as a pod's container dies with the kubelet's."""
    script = textwrap.dedent(
        """
        import pathlib, time
        print("up", flush=True)
        while not pathlib.Path("go").exists():
            time.sleep(0.05)
        """
    )
    started = []

    def start() -> None:
        started.append(lab.start_process("node-process", [sys.executable, "-c", script]))
        # The process is past the shim's setup (its exec) before this thread ends.
        lab.wait_for(lambda: "up" in lab.log("node-process"), 60, "the process up")

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    (lab.root / "go").touch()
    assert started[0].wait(60) == 0, lab.log("node-process")


def test_the_lab_leaves_nothing_behind(tmp_path):
    from .conftest import open_lab
    from .fleet import Load

    with open_lab(tmp_path / "lab") as lab:
        # A load a failing test never stopped: it must end with the lab, or its threads keep
        # the test run from exiting.
        _, clients = Load(f"http://{lab.node_ip}:9").run(lab, clients=2)
        lab.kube.create(
            deployment(
                "web",
                "import time; time.sleep(600)",
                replicas=2,
                volumeMounts=[{"name": "x", "mountPath": "/lab-test-mount/deep"}],
            )
        )
        d = lab.kube.get("apps/v1", "Deployment", "default", "web")
        lab.kube.patch(
            d,
            {
                "spec": {
                    "template": {
                        "spec": {"volumes": [{"name": "x", "emptyDir": {"medium": "Memory"}}]}
                    }
                }
            },
        )
        pods = lab.wait_for(
            lambda: (
                len(lab.kube.ready_pods("default", "app=web")) == 2
                and lab.kube.ready_pods("default", "app=web")
            ),
            30,
            "pods",
        )
        pids = [
            int(c["containerID"].split("//")[1])
            for p in pods
            for c in p["status"]["containerStatuses"]
        ]
    assert not lab.leftovers()
    assert not [p for p in pids if _alive(p)], "container processes outlived the lab"
    _, running = futures.wait(clients, timeout=60)
    assert not running, "a load's clients outlived the lab"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
