"""Names the operator, router and chart share: the CRD's group/version/kind, pod labels."""

GROUP = "pagefleet.io"
VERSION = "v1alpha1"
KIND = "ModelDeployment"
PLURAL = "modeldeployments"

LABEL_MODEL = "pagefleet.io/model"
LABEL_ROLE = "pagefleet.io/role"
ROLES = ("prefill", "decode", "both")
