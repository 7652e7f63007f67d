// Command fakecri serves an in-memory container runtime (CRI RuntimeService
// and ImageService) on a unix socket, for a real kubelet on a machine with no
// container runtime. Pods "run" only in memory: the kubelet creates sandboxes
// and containers, starts them and reports them Running, and nothing executes.
//
// The runtime is Kubernetes' own fake (k8s.io/cri-client/pkg/fake over
// k8s.io/cri-api/pkg/apis/testing), the one kubemark's hollow nodes use. On top
// of it, every CreateContainer request is appended to a JSON-lines file: the
// pod it belongs to and the container config as the kubelet sent it (CDI
// devices, env, mounts, devices, annotations) in the CRI's protobuf JSON form,
// plus the environment as plain text, so tests can check what a device
// plugin's Allocate answer became.
//
//	fakecri --socket /run/fakecri/cri.sock --record /tmp/create-container.jsonl
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protojson"
	kubeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg/fake"
)

// recordingRuntime is the stock fake runtime with CreateContainer recorded.
type recordingRuntime struct {
	*fake.RemoteRuntime

	mu     sync.Mutex
	record *os.File
	// Container ID -> absolute log path. The stock fake reports an empty log
	// path, and the kubelet deletes "<log path>*" when it removes a container:
	// with "" that is every file in the kubelet's working directory.
	logPaths map[string]string
}

// createRecord is one line of the record file.
type createRecord struct {
	Time         string `json:"time"`
	PodSandboxID string `json:"podSandboxId"`
	ContainerID  string `json:"containerId,omitempty"`
	Error        string `json:"error,omitempty"`
	PodName      string `json:"podName"`
	PodNamespace string `json:"podNamespace"`
	PodUID       string `json:"podUid"`
	Container    string `json:"container"`
	// The container's environment as text (the CRI carries values as bytes,
	// which the protobuf JSON form shows base64-encoded).
	Env map[string]string `json:"env"`
	// The fully qualified CDI device names (config.CDIDevices).
	CDIDevices []string        `json:"cdiDevices"`
	Config     json.RawMessage `json:"config"`
}

func (r *recordingRuntime) CreateContainer(ctx context.Context, req *kubeapi.CreateContainerRequest) (*kubeapi.CreateContainerResponse, error) {
	resp, err := r.RemoteRuntime.CreateContainer(ctx, req)
	rec := createRecord{
		Time:         time.Now().UTC().Format(time.RFC3339Nano),
		PodSandboxID: req.GetPodSandboxId(),
		PodName:      req.GetSandboxConfig().GetMetadata().GetName(),
		PodNamespace: req.GetSandboxConfig().GetMetadata().GetNamespace(),
		PodUID:       req.GetSandboxConfig().GetMetadata().GetUid(),
		Container:    req.GetConfig().GetMetadata().GetName(),
		Env:          map[string]string{},
	}
	for _, kv := range req.GetConfig().GetEnvs() {
		rec.Env[kv.GetKey()] = string(kv.GetValue())
	}
	rec.CDIDevices = []string{}
	for _, d := range req.GetConfig().GetCDIDevices() {
		rec.CDIDevices = append(rec.CDIDevices, d.GetName())
	}
	if err != nil {
		rec.Error = err.Error()
	} else {
		rec.ContainerID = resp.GetContainerId()
		logPath := filepath.Join(req.GetSandboxConfig().GetLogDirectory(), req.GetConfig().GetLogPath())
		if !filepath.IsAbs(logPath) {
			logPath = filepath.Join(os.TempDir(), "fakecri-no-log-dir", rec.ContainerID, "log")
		}
		r.mu.Lock()
		r.logPaths[rec.ContainerID] = logPath
		r.mu.Unlock()
	}
	config, merr := protojson.MarshalOptions{UseProtoNames: false}.Marshal(req.GetConfig())
	if merr != nil {
		config, _ = json.Marshal(fmt.Sprintf("marshal error: %v", merr))
	}
	rec.Config = config
	line, _ := json.Marshal(rec)
	r.mu.Lock()
	defer r.mu.Unlock()
	// One write per record, so a reader never sees half a line.
	if _, werr := r.record.Write(append(line, '\n')); werr != nil {
		log.Printf("fakecri: recording CreateContainer: %v", werr)
	}
	return resp, err
}

// ContainerStatus is the stock fake's, with the container's absolute log path,
// as a real runtime reports it.
func (r *recordingRuntime) ContainerStatus(ctx context.Context, req *kubeapi.ContainerStatusRequest) (*kubeapi.ContainerStatusResponse, error) {
	resp, err := r.RemoteRuntime.ContainerStatus(ctx, req)
	if err != nil || resp.GetStatus() == nil {
		return resp, err
	}
	r.mu.Lock()
	logPath, ok := r.logPaths[req.GetContainerId()]
	r.mu.Unlock()
	if !ok {
		// Never an empty path (see logPaths).
		logPath = filepath.Join(os.TempDir(), "fakecri-no-log-dir", req.GetContainerId(), "log")
	}
	resp.Status.LogPath = logPath
	return resp, nil
}

func main() {
	socket := flag.String("socket", "", "unix socket to serve the CRI on (required)")
	record := flag.String("record", "", "JSON-lines file that gets one line per CreateContainer (required)")
	flag.Parse()
	if *socket == "" || *record == "" {
		flag.Usage()
		os.Exit(2)
	}
	if err := run(*socket, *record); err != nil {
		log.Fatalf("fakecri: %v", err)
	}
}

func run(socket, record string) error {
	out, err := os.OpenFile(record, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("opening the record file: %w", err)
	}
	defer out.Close()

	if err := os.MkdirAll(filepath.Dir(socket), 0o755); err != nil {
		return err
	}
	if err := os.Remove(socket); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("removing a stale socket: %w", err)
	}
	listener, err := net.Listen("unix", socket)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", socket, err)
	}

	runtime := &recordingRuntime{
		RemoteRuntime: fake.NewFakeRemoteRuntime(),
		record:        out,
		logPaths:      map[string]string{},
	}
	// What fake.RemoteRuntime.Start sets, plus what a kubelet asks a real
	// runtime for: the cgroup driver, and an image filesystem to account.
	runtime.RuntimeService.FakeStatus = &kubeapi.RuntimeStatus{
		Conditions: []*kubeapi.RuntimeCondition{
			{Type: kubeapi.RuntimeReady, Status: true},
			{Type: kubeapi.NetworkReady, Status: true},
		},
	}
	runtime.RuntimeService.FakeLinuxConfiguration = &kubeapi.LinuxRuntimeConfiguration{
		CgroupDriver: kubeapi.CgroupDriver_CGROUPFS,
	}
	fsUsage := []*kubeapi.FilesystemUsage{{
		Timestamp:  time.Now().UnixNano(),
		FsId:       &kubeapi.FilesystemIdentifier{Mountpoint: filepath.Dir(socket)},
		UsedBytes:  &kubeapi.UInt64Value{Value: 0},
		InodesUsed: &kubeapi.UInt64Value{Value: 0},
	}}
	runtime.ImageService.FakeFilesystemUsage = fsUsage
	runtime.ImageService.FakeContainerFilesystemUsage = fsUsage
	// Pulled images get this size; the kubelet refuses an image of size 0.
	runtime.ImageService.SetFakeImageSize(1 << 20)

	server := grpc.NewServer()
	kubeapi.RegisterRuntimeServiceServer(server, runtime)
	kubeapi.RegisterImageServiceServer(server, runtime)

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-signals
		server.Stop()
	}()
	log.Printf("fakecri: serving the CRI on %s; recording CreateContainer to %s", socket, record)
	err = server.Serve(listener)
	_ = os.Remove(socket)
	if err != nil && err != grpc.ErrServerStopped {
		return err
	}
	return nil
}
