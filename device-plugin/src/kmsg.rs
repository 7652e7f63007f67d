//! NVIDIA Xid errors from the kernel log, so the `XidErrors` check covers the time since boot,
//! not only since the agent started listening to NVML events.
//!
//! The kernel ring buffer is read through `/dev/kmsg` (configurable): each record is
//! `priority,sequence,timestamp,flags[,…];message`, followed by continuation lines that start
//! with a space. The driver logs Xids as `NVRM: Xid (PCI:0000:3b:00): 79, pid=…, …`.
//! [`KernelLog`] keeps the file open between scans, opened non-blocking, and reads until the
//! kernel answers "no more records" (or, for a plain file, end of file), so each scan costs only
//! the records that arrived since the last one. [`parse_record`], [`parse_xid`] and
//! [`attribute`] are pure.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// Where the agent reads the kernel log by default.
pub const DEFAULT_KMSG_PATH: &str = "/dev/kmsg";

/// A record is at most 8 KiB in `/dev/kmsg`; a read with a smaller buffer fails.
const READ_BUFFER: usize = 16 * 1024;

/// Most bytes one scan reads, so a kernel logging without pause cannot hold the agent here; the
/// rest is read by the next scan.
const MAX_BYTES_PER_SCAN: usize = 32 * 1024 * 1024;

/// A PCI device address as the kernel log and NVML name GPUs: domain, bus and device (the
/// function is left out: a GPU is function 0, and the driver's Xid lines omit it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    /// PCI domain (segment).
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device number.
    pub device: u8,
}

/// A PCI address that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("PCI address {0:?}: expected [domain:]bus:device[.function] in hex")]
pub struct PciAddressError(pub String);

impl FromStr for PciAddress {
    type Err = PciAddressError;

    /// Accepts the driver's `0000:3b:00`, NVML's `00000000:3B:00.0` and the short `3b:00.0`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || PciAddressError(s.to_owned());
        let without_function = match s.rsplit_once('.') {
            Some((head, function)) if u8::from_str_radix(function, 16).is_ok() => head,
            Some(_) => return Err(bad()),
            None => s,
        };
        let parts: Vec<&str> = without_function.split(':').collect();
        let (domain, bus, device) = match parts.as_slice() {
            [bus, device] => ("0", *bus, *device),
            [domain, bus, device] => (*domain, *bus, *device),
            _ => return Err(bad()),
        };
        let hex_u8 = |t: &str| {
            if (1..=2).contains(&t.len()) {
                u8::from_str_radix(t, 16).ok()
            } else {
                None
            }
        };
        if domain.is_empty() || domain.len() > 8 {
            return Err(bad());
        }
        Ok(PciAddress {
            domain: u32::from_str_radix(domain, 16).map_err(|_| bad())?,
            bus: hex_u8(bus).ok_or_else(bad)?,
            device: hex_u8(device).ok_or_else(bad)?,
        })
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}",
            self.domain, self.bus, self.device
        )
    }
}

/// One kernel log record's sequence number and message text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record<'a> {
    /// The kernel's sequence number (increases by one per record since boot).
    pub seq: u64,
    /// The message, as `/dev/kmsg` escapes it.
    pub message: &'a str,
}

/// Parses one `/dev/kmsg` line: `priority,sequence,timestamp,flags[,…];message`. `None` for a
/// continuation line (` KEY=value`) or anything else that is not a record.
pub fn parse_record(line: &str) -> Option<Record<'_>> {
    let (prefix, message) = line.split_once(';')?;
    let mut fields = prefix.split(',');
    fields.next()?.parse::<u32>().ok()?;
    let seq = fields.next()?.parse::<u64>().ok()?;
    fields.next()?.parse::<u64>().ok()?;
    Some(Record {
        seq,
        message: message.trim_end_matches(['\n', '\r']),
    })
}

/// Finds an NVIDIA Xid report in a kernel message: `NVRM: Xid (PCI:0000:3b:00): 79, …` gives
/// the GPU's address and the Xid. Older drivers leave out `PCI:`.
pub fn parse_xid(message: &str) -> Option<(PciAddress, u64)> {
    const MARK: &str = "NVRM: Xid (";
    let start = message.find(MARK)? + MARK.len();
    let (address, rest) = message[start..].split_once(')')?;
    let address = address.strip_prefix("PCI:").unwrap_or(address).trim();
    let pci = address.parse::<PciAddress>().ok()?;
    let rest = rest.strip_prefix(':')?.trim_start();
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    let xid = rest[..end].parse::<u64>().ok()?;
    Some((pci, xid))
}

/// An Xid the kernel logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelXid {
    /// The record's sequence number.
    pub seq: u64,
    /// The GPU it names.
    pub pci: PciAddress,
    /// The Xid.
    pub xid: u64,
}

/// Reading the kernel log failed.
#[derive(Debug, thiserror::Error)]
pub enum KmsgError {
    /// The path could not be opened (absent, or no permission: `/dev/kmsg` needs
    /// `CAP_SYSLOG` where `kernel.dmesg_restrict` is set).
    #[error("opening {path}: {source}")]
    Open {
        /// The kernel log path.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A read failed.
    #[error("reading {path}: {source}")]
    Read {
        /// The kernel log path.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
}

impl KmsgError {
    /// The I/O error underneath, without the path.
    pub fn io_error(&self) -> &io::Error {
        match self {
            KmsgError::Open { source, .. } | KmsgError::Read { source, .. } => source,
        }
    }
}

/// The kernel log, read incrementally: each [`KernelLog::scan`] returns the Xids of the records
/// that arrived since the previous one.
#[derive(Debug)]
pub struct KernelLog {
    path: PathBuf,
    file: Option<File>,
    /// Bytes of a record not yet ended by a newline.
    partial: Vec<u8>,
    /// The last record read; records at or below it are skipped after a reopen.
    last_seq: Option<u64>,
}

impl KernelLog {
    /// A reader of the kernel log at `path`; nothing is opened until the first scan.
    pub fn new(path: impl Into<PathBuf>) -> KernelLog {
        KernelLog {
            path: path.into(),
            file: None,
            partial: Vec::new(),
            last_seq: None,
        }
    }

    /// The path read.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the records that arrived since the last scan (everything the ring buffer holds, on
    /// the first) and returns their Xids. On an error the file is closed and the next scan
    /// opens it again, skipping the records already seen.
    pub fn scan(&mut self) -> Result<Vec<KernelXid>, KmsgError> {
        let mut file = match self.file.take() {
            Some(f) => f,
            None => {
                self.partial.clear();
                OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NONBLOCK)
                    .open(&self.path)
                    .map_err(|source| KmsgError::Open {
                        path: self.path.clone(),
                        source,
                    })?
            }
        };
        let mut found = Vec::new();
        let mut buf = vec![0u8; READ_BUFFER];
        let mut total = 0usize;
        while total < MAX_BYTES_PER_SCAN {
            match file.read(&mut buf) {
                // A plain file at its end (`/dev/kmsg` answers WouldBlock instead).
                Ok(0) => break,
                Ok(n) => {
                    total += n;
                    self.partial.extend_from_slice(&buf[..n]);
                    self.take_lines(&mut found);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // `/dev/kmsg` answers EPIPE once when records were overwritten before this
                // reader got to them; the next read returns the oldest record still held.
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {
                    tracing::debug!(path = %self.path.display(), "kernel log records were overwritten before they were read");
                }
                Err(source) => {
                    return Err(KmsgError::Read {
                        path: self.path.clone(),
                        source,
                    });
                }
            }
        }
        self.file = Some(file);
        Ok(found)
    }

    /// Parses every complete line in `partial`, keeping the unfinished rest.
    fn take_lines(&mut self, found: &mut Vec<KernelXid>) {
        let Some(end) = self.partial.iter().rposition(|b| *b == b'\n') else {
            return;
        };
        let complete: Vec<u8> = self.partial.drain(..=end).collect();
        for line in complete.split(|b| *b == b'\n') {
            if line.first().is_none_or(|b| *b == b' ') {
                continue;
            }
            let line = String::from_utf8_lossy(line);
            let Some(record) = parse_record(&line) else {
                continue;
            };
            if self.last_seq.is_some_and(|last| record.seq <= last) {
                continue;
            }
            self.last_seq = Some(record.seq);
            if let Some((pci, xid)) = parse_xid(record.message) {
                found.push(KernelXid {
                    seq: record.seq,
                    pci,
                    xid,
                });
            }
        }
    }
}

/// Kernel-log Xids split by whether a GPU of the inventory sits at their address.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attributed {
    /// (GPU index, Xid).
    pub on_gpus: Vec<(u32, u64)>,
    /// (address, Xid) for addresses where no enumerated GPU is (one that fell off the bus may
    /// no longer enumerate).
    pub elsewhere: Vec<(PciAddress, u64)>,
}

/// Maps each Xid's PCI address to a GPU index through the GPUs' bus IDs (`(index, bus ID)` as
/// NVML reports them; IDs that do not parse match nothing).
pub fn attribute(
    xids: impl IntoIterator<Item = (PciAddress, u64)>,
    gpus: &[(u32, String)],
) -> Attributed {
    let by_address: BTreeMap<PciAddress, u32> = gpus
        .iter()
        .filter_map(|(index, bus_id)| bus_id.parse::<PciAddress>().ok().map(|a| (a, *index)))
        .collect();
    let mut out = Attributed::default();
    for (pci, xid) in xids {
        match by_address.get(&pci) {
            Some(gpu) => out.on_gpus.push((*gpu, xid)),
            None => out.elsewhere.push((pci, xid)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn pci(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    #[test]
    fn pci_addresses_in_the_kernel_and_nvml_forms_agree() {
        let kernel = pci("0000:3b:00");
        assert_eq!(pci("00000000:3B:00.0"), kernel);
        assert_eq!(pci("3b:00.0"), kernel);
        assert_eq!(
            kernel,
            PciAddress {
                domain: 0,
                bus: 0x3b,
                device: 0
            }
        );
        assert_eq!(kernel.to_string(), "0000:3b:00");
        assert_eq!(pci("0001:18:1f").to_string(), "0001:18:1f");
        assert_ne!(pci("0001:3b:00"), kernel);
        for bad in [
            "",
            "3b",
            "zz:00",
            "0000:3b:00.x",
            "0000:3b:100",
            "123456789:3b:00",
            "0000:3b:00:00",
            ":3b:00",
        ] {
            assert!(bad.parse::<PciAddress>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn records_parse_and_others_do_not() {
        assert_eq!(
            parse_record("4,1342,56783412,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=0\n"),
            Some(Record {
                seq: 1342,
                message: "NVRM: Xid (PCI:0000:3b:00): 79, pid=0"
            })
        );
        // Newer kernels add fields after the flags (the caller ID).
        assert_eq!(
            parse_record("6,7,8,-,caller=T12;hello").map(|r| (r.seq, r.message)),
            Some((7, "hello"))
        );
        for bad in [
            " SUBSYSTEM=pci",
            " DEVICE=+pci:0000:3b:00.0",
            "",
            "garbage",
            "x,1,2,-;msg",
            "6,-1,2,-;msg",
            "6,1;msg",
            "[   12.345] NVRM: Xid (PCI:0000:3b:00): 79",
        ] {
            assert_eq!(parse_record(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn xid_lines_as_drivers_write_them() {
        let cases = [
            (
                "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
                Some(("0000:3b:00", 79)),
            ),
            (
                "NVRM: Xid (PCI:0000:b1:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.",
                Some(("0000:b1:00", 48)),
            ),
            (
                "NVRM: Xid (PCI:0000:18:00): 13, Graphics Exception: ESR 0x404600=0x80000002",
                Some(("0000:18:00", 13)),
            ),
            (
                "NVRM: Xid (0000:07:00): 31, Ch 00000010, engmask 00000101",
                Some(("0000:07:00", 31)),
            ),
            ("NVRM: Xid (PCI:0001:5d:00): 94", Some(("0001:5d:00", 94))),
            // Not Xids, or not NVIDIA's.
            (
                "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
                None,
            ),
            ("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028", None),
            ("usb 1-1: new high-speed USB device number 2", None),
            ("NVRM: Xid (PCI:0000:3b:00): pid=1", None),
            ("NVRM: Xid (PCI:nonsense): 79, pid=1", None),
            ("NVRM: Xid (PCI:0000:3b:00 79", None),
        ];
        for (message, want) in cases {
            let got = parse_xid(message);
            assert_eq!(got, want.map(|(a, x)| (pci(a), x)), "{message:?}");
        }
    }

    #[test]
    fn xids_map_to_gpus_by_bus_id() {
        let gpus = vec![
            (0, "00000000:18:00.0".to_owned()),
            (1, "00000000:3B:00.0".to_owned()),
            (2, "not a bus id".to_owned()),
        ];
        let got = attribute(
            [
                (pci("0000:3b:00"), 79),
                (pci("0000:18:00"), 48),
                (pci("0000:b1:00"), 94),
                (pci("0001:3b:00"), 63),
            ],
            &gpus,
        );
        assert_eq!(got.on_gpus, vec![(1, 79), (0, 48)]);
        assert_eq!(
            got.elsewhere,
            vec![(pci("0000:b1:00"), 94), (pci("0001:3b:00"), 63)]
        );
        assert_eq!(attribute([], &gpus), Attributed::default());
    }

    const RECORDS: &str = "\
6,100,1000,-;Linux version 6.8.0
4,101,2000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.
 SUBSYSTEM=pci
 DEVICE=+pci:0000:3b:00.0
this line is garbage
6,102,3000,-;NVRM: Xid (PCI:0000:18:00): 13, Graphics Exception
";

    #[test]
    fn scans_read_only_new_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kmsg");
        std::fs::write(&path, RECORDS).unwrap();
        let mut log = KernelLog::new(&path);
        let first = log.scan().unwrap();
        assert_eq!(
            first,
            vec![
                KernelXid {
                    seq: 101,
                    pci: pci("0000:3b:00"),
                    xid: 79
                },
                KernelXid {
                    seq: 102,
                    pci: pci("0000:18:00"),
                    xid: 13
                },
            ]
        );
        assert!(log.scan().unwrap().is_empty(), "nothing new");

        // A record arrives in two pieces: nothing until its line ends.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"4,103,4000,-;NVRM: Xid (PCI:0000:b1:00): ")
            .unwrap();
        assert!(log.scan().unwrap().is_empty());
        f.write_all(b"48, pid=7\n").unwrap();
        let got = log.scan().unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].seq, got[0].xid), (103, 48));

        // After a reopen (a read error closes the file) the records already seen are skipped.
        log.file = None;
        f.write_all(b"4,104,5000,-;NVRM: Xid (PCI:0000:b1:00): 94, pid=8\n")
            .unwrap();
        let got = log.scan().unwrap();
        assert_eq!(got.iter().map(|x| x.seq).collect::<Vec<_>>(), vec![104]);
    }

    #[test]
    fn an_unreadable_path_says_which() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent");
        let err = KernelLog::new(&path).scan().unwrap_err();
        assert!(matches!(err, KmsgError::Open { .. }));
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
    }
}
