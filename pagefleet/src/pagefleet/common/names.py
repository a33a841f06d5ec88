"""Names the operator, router and chart share: the CRD's group/version/kind, pod labels."""

GROUP = "pagefleet.io"
VERSION = "v1alpha1"
KIND = "ModelDeployment"
PLURAL = "modeldeployments"

LABEL_MODEL = "pagefleet.io/model"
LABEL_ROLE = "pagefleet.io/role"
# The ModelDeployment a pod belongs to, and its pool (colocated | prefill | decode).
LABEL_INSTANCE = "pagefleet.io/deployment"
LABEL_POOL = "pagefleet.io/pool"
# Set by the LeaderWorkerSet controller on a multi-node pool's pods: "0" on each group's leader
# (the pod that serves), 1.. on the workers that only hold ranks.
LABEL_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"

# A LoRA adapter's name: what clients put in `model`, a metric label, part of its blocks' hash
# (short, printable, none of the separators the metrics' comma-joined lists would misread).
LORA_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}"

# The request header naming a client's tenant: the router's flow control takes turns by it,
# and forwards it, so an engine's grammar compiles take turns by it too.
TENANT_HEADER = "x-tenant-id"
