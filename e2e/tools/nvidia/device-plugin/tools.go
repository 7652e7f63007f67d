//go:build tools

// Package tools pins NVIDIA's kubelet device plugin for gpupool's conformance
// and benchmark comparison. It is never a runtime dependency of gpupool.
package tools

import _ "github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin"
