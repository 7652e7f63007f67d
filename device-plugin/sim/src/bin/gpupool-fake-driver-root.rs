//! `gpupool-fake-driver-root ROOT DRIVER_VERSION GPUS`: builds a fake driver root (device nodes
//! as plain files, `mig-minors`, the kernel module's version file, driver libraries,
//! `nvidia-smi`, GSP firmware) for the demo's simulated nodes, with the same builder the tests
//! use (`gpupool_sim::driver_root`).

use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "\
usage: gpupool-fake-driver-root ROOT DRIVER_VERSION GPUS

Builds a fake NVIDIA driver root under ROOT (created if missing) for driver DRIVER_VERSION
(e.g. 550.54.15) with GPUS GPUs: device nodes as plain files, MIG capability nodes and their
mig-minors table, the kernel module's version file, driver libraries, nvidia-smi and GSP
firmware. For tests and the demo; a node agent pointed at it validates and writes CDI specs
without a GPU.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let [root, version, gpus] = args.as_slice() else {
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
    match gpupool_sim::driver_root::build(&PathBuf::from(root), version, gpus) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpupool-fake-driver-root: {root}: {e}");
            ExitCode::FAILURE
        }
    }
}
