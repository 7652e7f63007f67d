//! Whose GPU process is it: a process is mapped to its pod by its cgroup, and the pod to the
//! devices the kubelet gave it by the kubelet's own device checkpoint. Both are written by the
//! kernel and the kubelet, never by the tenant, so a process cannot claim a co-tenant's share
//! (the `GPUPOOL_SHARE_ID` that `Allocate` sets in the container is the tenant's to rewrite,
//! and is not read here).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The kubelet's device manager checkpoint, under its `device-plugins` directory.
pub const CHECKPOINT_FILE: &str = "kubelet_internal_checkpoint";

/// The pod UID in the cgroup path of process `pid`, read at `<proc_root>/<pid>/cgroup`.
/// `None` when that cannot be read or the process is in no pod's cgroup.
pub fn pod_uid(proc_root: &Path, pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup")).ok()?;
    text.lines().find_map(|line| {
        // `hierarchy-ID:controllers:path`; the path may itself hold colons.
        let path = line.splitn(3, ':').nth(2)?;
        pod_uid_in_cgroup_path(path)
    })
}

/// The pod UID a kubelet cgroup path names, for both cgroup drivers:
/// `…/kubepods-burstable-pod<uid with '_'>.slice/…` (systemd) and
/// `…/kubepods/burstable/pod<uid>/…` (cgroupfs). Read from inside a container with a cgroup
/// namespace of its own, the path is relative to the agent's cgroup (`/../../pod<uid>/…`), so
/// the segment is looked for anywhere; it must hold a whole UUID. Only the kubelet (and the
/// privileged) can put a process into a pod's cgroup, so a tenant cannot forge it.
pub fn pod_uid_in_cgroup_path(path: &str) -> Option<String> {
    for segment in path.split('/') {
        let segment = segment.strip_suffix(".slice").unwrap_or(segment);
        let candidate = segment
            .rsplit_once("-pod")
            .map(|(_, uid)| uid)
            .or_else(|| segment.strip_prefix("pod"));
        if let Some(uid) = candidate.map(|u| u.replace('_', "-"))
            && is_uuid(&uid)
        {
            return Some(uid);
        }
    }
    None
}

fn is_uuid(s: &str) -> bool {
    s.len() == 36
        && s.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// What the kubelet's checkpoint says each pod holds: pod UID → every device ID it was given
/// (of any resource).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodDevices(BTreeMap<String, Vec<String>>);

#[derive(Deserialize)]
struct Checkpoint {
    #[serde(rename = "Data")]
    data: CheckpointData,
}

#[derive(Deserialize)]
struct CheckpointData {
    #[serde(rename = "PodDeviceEntries", default)]
    entries: Option<Vec<Entry>>,
}

#[derive(Deserialize)]
struct Entry {
    #[serde(rename = "PodUID")]
    pod_uid: String,
    #[serde(rename = "DeviceIDs", default)]
    device_ids: DeviceIds,
}

/// Device IDs per NUMA node (kubelets since 1.20), or a plain list (older ones).
#[derive(Deserialize, Default)]
#[serde(untagged)]
enum DeviceIds {
    PerNuma(BTreeMap<String, Vec<String>>),
    Plain(Vec<String>),
    #[default]
    None,
}

impl PodDevices {
    /// Parses the checkpoint's JSON.
    pub fn parse(text: &str) -> Result<PodDevices, serde_json::Error> {
        let checkpoint: Checkpoint = serde_json::from_str(text)?;
        let mut pods: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for entry in checkpoint.data.entries.unwrap_or_default() {
            let ids = match entry.device_ids {
                DeviceIds::PerNuma(per) => per.into_values().flatten().collect(),
                DeviceIds::Plain(ids) => ids,
                DeviceIds::None => Vec::new(),
            };
            pods.entry(entry.pod_uid).or_default().extend(ids);
        }
        Ok(PodDevices(pods))
    }

    /// Reads the checkpoint at `path`; `None` when it cannot be read or parsed (then no
    /// process can be attributed, and every share it would decide stays unknown).
    pub fn read(path: &Path) -> Option<PodDevices> {
        let text = std::fs::read_to_string(path).ok()?;
        match PodDevices::parse(&text) {
            Ok(devices) => Some(devices),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "kubelet device checkpoint unreadable");
                None
            }
        }
    }

    /// The device IDs the pod `uid` holds.
    pub fn of(&self, uid: &str) -> Option<&[String]> {
        self.0.get(uid).map(Vec::as_slice)
    }
}

/// Attributes processes to the device IDs their pod holds.
#[derive(Debug, Clone)]
pub struct Attribution {
    /// The host's procfs, where each process's cgroup is read.
    pub proc_root: PathBuf,
    /// The checkpoint as read for this sample (`None`: unreadable).
    pub devices: Option<PodDevices>,
}

impl Attribution {
    /// Reads the checkpoint in `device_plugins_dir` now, for one sample.
    pub fn read(proc_root: &Path, device_plugins_dir: &Path) -> Attribution {
        Attribution {
            proc_root: proc_root.to_path_buf(),
            devices: PodDevices::read(&device_plugins_dir.join(CHECKPOINT_FILE)),
        }
    }

    /// The device IDs held by the pod process `pid` runs in; `None` when the process is in no
    /// pod, or its pod holds nothing the checkpoint records (whose process it is cannot be told).
    pub fn owner(&self, pid: u32) -> Option<Vec<String>> {
        let uid = pod_uid(&self.proc_root, pid)?;
        let ids = self.devices.as_ref()?.of(&uid)?;
        (!ids.is_empty()).then(|| ids.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f3a5b6c-1d2e-4f50-8a9b-0c1d2e3f4a5b";

    #[test]
    fn pod_uids_are_read_from_both_cgroup_drivers() {
        let systemd = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-abc.scope",
            UID.replace('-', "_")
        );
        assert_eq!(pod_uid_in_cgroup_path(&systemd).as_deref(), Some(UID));
        let best_effort = format!(
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/x",
            UID.replace('-', "_")
        );
        assert_eq!(pod_uid_in_cgroup_path(&best_effort).as_deref(), Some(UID));
        let guaranteed = format!(
            "/kubepods.slice/kubepods-pod{}.slice",
            UID.replace('-', "_")
        );
        assert_eq!(pod_uid_in_cgroup_path(&guaranteed).as_deref(), Some(UID));
        let cgroupfs = format!("/kubepods/burstable/pod{UID}/0123456789abcdef");
        assert_eq!(pod_uid_in_cgroup_path(&cgroupfs).as_deref(), Some(UID));
        // Seen from inside the agent's own cgroup namespace.
        for relative in [
            format!("/../../pod{UID}/0123456789abcdef"),
            format!(
                "/../../kubepods-besteffort-pod{}.slice/cri-containerd-abc.scope",
                UID.replace('-', "_")
            ),
        ] {
            assert_eq!(
                pod_uid_in_cgroup_path(&relative).as_deref(),
                Some(UID),
                "{relative}"
            );
        }
        for not_a_pod in [
            "/system.slice/containerd.service".to_owned(),
            "/user.slice/user-1000.slice/session-2.scope".to_owned(),
            "/kubepods/burstable/podnot-a-uid".to_owned(),
            format!("/kubepods/burstable/pod{UID}x"),
            "/".to_owned(),
        ] {
            assert_eq!(pod_uid_in_cgroup_path(&not_a_pod), None, "{not_a_pod}");
        }
    }

    #[test]
    fn the_checkpoint_gives_each_pod_its_devices_in_both_formats() {
        let numa = format!(
            r#"{{"Data":{{"PodDeviceEntries":[
                {{"PodUID":"{UID}","ContainerName":"a","ResourceName":"nvidia.com/gpu","DeviceIDs":{{"0":["GPU-1::0"],"-1":["GPU-1::3"]}},"AllocResp":"AA=="}},
                {{"PodUID":"other","ContainerName":"b","ResourceName":"nvidia.com/gpu","DeviceIDs":{{"0":["GPU-1::1"]}},"AllocResp":"AA=="}}
            ],"RegisteredDevices":{{"nvidia.com/gpu":["GPU-1::0"]}}}},"Checksum":1}}"#
        );
        let devices = PodDevices::parse(&numa).unwrap();
        let mut ids = devices.of(UID).unwrap().to_vec();
        ids.sort();
        assert_eq!(ids, ["GPU-1::0", "GPU-1::3"]);
        assert_eq!(devices.of("other").unwrap(), ["GPU-1::1"]);
        let plain = format!(
            r#"{{"Data":{{"PodDeviceEntries":[{{"PodUID":"{UID}","ContainerName":"a","ResourceName":"r","DeviceIDs":["d1"]}}]}}}}"#
        );
        assert_eq!(PodDevices::parse(&plain).unwrap().of(UID).unwrap(), ["d1"]);
        let empty = r#"{"Data":{"PodDeviceEntries":null,"RegisteredDevices":null},"Checksum":0}"#;
        assert_eq!(PodDevices::parse(empty).unwrap(), PodDevices::default());
        assert!(PodDevices::parse("{").is_err());
    }

    #[test]
    fn a_process_is_attributed_by_its_cgroup_not_its_environment() {
        let proc = tempfile::tempdir().unwrap();
        let write = |pid: u32, cgroup: &str, environ: &str| {
            let dir = proc.path().join(pid.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("cgroup"), cgroup).unwrap();
            std::fs::write(dir.join("environ"), environ).unwrap();
        };
        // It claims another share in its environment; its cgroup says whose it is.
        write(
            10,
            &format!("0::/kubepods/burstable/pod{UID}/c1\n"),
            "GPUPOOL_SHARE_ID=GPU-1::1\0",
        );
        write(
            11,
            "0::/system.slice/sshd.service\n",
            "GPUPOOL_SHARE_ID=GPU-1::1\0",
        );
        let devices = PodDevices(BTreeMap::from([(UID.to_owned(), vec!["GPU-1::0".into()])]));
        let attribution = Attribution {
            proc_root: proc.path().to_path_buf(),
            devices: Some(devices),
        };
        assert_eq!(attribution.owner(10), Some(vec!["GPU-1::0".to_owned()]));
        assert_eq!(attribution.owner(11), None, "not in a pod: nobody's share");
        assert_eq!(attribution.owner(12), None, "no such process");
        let unreadable = Attribution {
            devices: None,
            ..attribution
        };
        assert_eq!(unreadable.owner(10), None, "no checkpoint: cannot be told");
    }
}
