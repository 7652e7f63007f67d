//! `gpupool-fake-driver-root [OPTIONS] ROOT DRIVER_VERSION GPUS`: builds a fake driver root
//! (device nodes, `mig-minors`, the kernel module's version file, driver libraries, binaries,
//! loader configuration files, GSP firmware, IPC sockets) for the demo's simulated nodes and
//! the end-to-end layer, with the same builder the tests use (`gpupool_sim::driver_root`).

use std::path::PathBuf;
use std::process::ExitCode;

use gpupool_sim::driver_root::{BuildOptions, DeviceNodes, build_with};

const USAGE: &str = "\
usage: gpupool-fake-driver-root [OPTIONS] ROOT DRIVER_VERSION GPUS

Builds a fake NVIDIA driver root under ROOT (created if missing) for driver DRIVER_VERSION
(e.g. 550.54.15) with GPUS GPUs: device nodes, MIG capability nodes and their mig-minors
table, the kernel module's version file, the driver's compute, video and graphics libraries,
its binaries, the EGL/Vulkan/OpenCL configuration files, GSP firmware, the MPS pipe directory
and the daemons' sockets. A node agent pointed at it validates and writes CDI specs without a
GPU. By default device nodes are plain files and libraries empty files (no privileges needed).

options:
  --elf-libraries   make each library a real ELF shared object carrying its soname
                    (runs cc -shared; a C compiler is needed)
  --char-devices    make device nodes character devices with the driver's numbers
                    (runs mknod; needs root or CAP_MKNOD)
  --nvml PATH       install PATH as libnvidia-ml.so.DRIVER_VERSION (e.g. the fake NVML)
  --cuda PATH       install PATH as libcuda.so.DRIVER_VERSION (e.g. a fake libcuda)
  --ldconfig        make the soname links and run ldconfig -r ROOT, so ROOT/etc/ld.so.cache
                    lists the libraries as on a real host (needs root; use with
                    --elf-libraries, ldconfig skips files that are not ELF)
  -h, --help        print this help";

fn main() -> ExitCode {
    let mut options = BuildOptions::default();
    let mut positional = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            "--elf-libraries" => options.elf_libraries = true,
            "--char-devices" => options.device_nodes = DeviceNodes::CharDevices,
            "--ldconfig" => options.ldconfig = true,
            "--nvml" | "--cuda" => {
                let Some(path) = args.next() else {
                    eprintln!("gpupool-fake-driver-root: {arg} needs a PATH\n\n{USAGE}");
                    return ExitCode::from(2);
                };
                let slot = if arg == "--nvml" {
                    &mut options.nvml
                } else {
                    &mut options.cuda
                };
                *slot = Some(PathBuf::from(path));
            }
            flag if flag.starts_with('-') => {
                eprintln!("gpupool-fake-driver-root: unknown option {flag}\n\n{USAGE}");
                return ExitCode::from(2);
            }
            _ => positional.push(arg),
        }
    }
    let [root, version, gpus] = positional.as_slice() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let gpus: u32 = match gpus.parse() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("gpupool-fake-driver-root: GPUS {gpus:?}: {e}");
            return ExitCode::from(2);
        }
    };
    match build_with(&PathBuf::from(root), version, gpus, &options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpupool-fake-driver-root: {root}: {e}");
            ExitCode::FAILURE
        }
    }
}
