"""The cluster lab: the operator's objects run as real pods on one machine, as Kubernetes runs
them, inside a network namespace the test creates (needs root, `ip`, `openssl`).

- api.py: kmock's KubernetesEmulator with the API server's behaviour our objects rely on
  (server-owned metadata, defaults, status subresource, patches, selectors, watches, graceful
  and propagated deletion, CRDs, bearer tokens on TLS);
- controllers.py: Deployments, ReplicaSets, Endpoints, claims, the garbage collector;
- kubelet.py + shim.py: pods as processes from their spec (env, volumes, users, probes,
  restarts, SIGTERM then SIGKILL), each pod in its own network namespace (net.py);
- images.py: the project's image from its Dockerfile, weights images from directories;
- lab.py: all of it on one event loop, plus what tests drive it with; fleet.py: scenarios'
  helpers.

It proves what our manifests and processes do when they run: commands, flags, environment,
probes, addresses between pods, discovery, autoscaling, deletion. It does not prove scheduling,
resource limits, GPUs, a CNI, DNS, kube-proxy (Services are reached through their endpoints),
RBAC, admission webhooks, or the behaviour of a real kubelet and API server beyond what is
written here; it never stands in for a real cluster.
"""
