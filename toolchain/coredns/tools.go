//go:build tools

// Package tools records the CoreDNS command so `go mod tidy` keeps its dependencies in go.sum.
package tools

import (
	_ "github.com/coredns/coredns"
)
