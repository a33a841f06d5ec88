"""The operator: reconciles ModelDeployment resources into Deployments, Services and
NetworkPolicies, and scales their pools."""
