//go:build tools

// Package tools pins NVIDIA's nvidia-ctk for gpupool's CDI conformance and
// benchmark comparison. It is never a runtime dependency of gpupool.
package tools

import _ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk"
