//go:build tools

// Package tools records the helm command so `go mod tidy` keeps its dependencies in go.sum.
package tools

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
