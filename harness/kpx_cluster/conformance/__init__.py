"""Kubernetes' own [sig-network] e2e specs on real kubelets (`make conformance`)."""
