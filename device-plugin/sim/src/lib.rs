//! The simulated GPU node behind both `SimBackend` (in the node agent) and the fake
//! `libnvidia-ml.so` (`e2e/fake-nvml`): one fixture format and one state machine, so the two
//! backends cannot disagree about the data, only about the code that maps it.
//!
//! - [`fixture`]: the YAML format a simulated node is written in.
//! - [`models`]: the GPU models a fixture may name.
//! - [`node`]: a fixture resolved into GPUs (UUIDs, bus IDs, topology); immutable.
//! - [`state`]: what changes while the node runs, and what NVML answers from it.
//! - [`state_file`]: the state kept in a locked JSON file, shared by processes.
//! - `driver_root` (feature `driver-root`): a fake driver install for tests and the demo.
//!
//! Errors are [`SimError`] values that mirror NVML return codes one to one, so the fake can
//! return exactly what a driver would and `SimBackend` can map them as `NvmlBackend` maps
//! NVML's.

#[cfg(feature = "driver-root")]
pub mod driver_root;
pub mod error;
pub mod fixture;
pub mod models;
pub mod node;
pub mod state;
pub mod state_file;
#[cfg(feature = "driver-root")]
pub mod testbed;

pub use error::{SimError, SimResult};
pub use fixture::{
    BusyPeriod, DeviceNodes, DriverFixture, FaultFixture, FaultKind, Fixture, GpuGroup,
    ProcessFixture, TopologyFixture, UtilizationFixture,
};
pub use models::{MODEL_INFOS, ModelInfo, arch, model_info};
pub use node::{Node, SimGpu, mig_uuid, topology};
pub use state::{
    CiState, Clear, EventKey, GiState, GpuState, InjectedFault, SimEvent, SimHealth, SimMigDevice,
    SimProcess, SimState, XID_FALLEN_OFF_BUS, event_type,
};
pub use state_file::{Staged, StateCache, StateFile};
