//! glibc's `ld.so.cache`, read from the driver root to find where the driver's libraries live.
//!
//! Two layouts exist, both little-endian on the hosts we run on:
//! - the new one alone: `glibc-ld.so.cache` + `1.1`, a 48-byte header (`nlibs`, `len_strings`,
//!   an endianness byte, an extension offset), `nlibs` entries of 24 bytes
//!   (`flags: i32, key: u32, value: u32, osversion: u32, hwcap: u64`), then the strings;
//! - the compatible one: the old `ld.so-1.7.0` header and 12-byte entries first, and the new
//!   layout after them at the next 8-byte boundary.
//!
//! In both, the new entries' string offsets count from the start of the new header. The file is
//! untrusted (it belongs to whatever is at the driver root): every offset is checked against the
//! file's length and a bad one is an error, never a panic.

use std::ffi::OsStr;
use std::fs;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Path of the cache relative to a root.
pub const CACHE_PATH: &str = "etc/ld.so.cache";

/// Caches larger than this are refused (real ones are well under a megabyte).
pub const MAX_CACHE_BYTES: u64 = 64 << 20;

const MAGIC_OLD: &[u8] = b"ld.so-1.7.0";
const MAGIC_NEW: &[u8] = b"glibc-ld.so.cache";
const VERSION_NEW: &[u8] = b"1.1";
/// Old header: 11 magic bytes, one byte of padding, `nlibs: u32`.
const OLD_HEADER_LEN: u64 = 16;
const OLD_ENTRY_LEN: u64 = 12;
const NEW_HEADER_LEN: u64 = 48;
const NEW_ENTRY_LEN: u64 = 24;
/// The new header is aligned as its 8-byte `hwcap` fields need.
const NEW_ALIGN: u64 = 8;

/// An entry's `flags`: ABI type in the low byte, required architecture in the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheFlags(pub i32);

impl CacheFlags {
    /// ELF, libc6, x86-64 (`FLAG_X8664_LIB64 | FLAG_ELF_LIBC6`).
    pub const X86_64_LIBC6: CacheFlags = CacheFlags(0x0303);
    /// ELF, libc6, AArch64 (`FLAG_AARCH64_LIB64 | FLAG_ELF_LIBC6`).
    pub const AARCH64_LIBC6: CacheFlags = CacheFlags(0x0a03);

    /// The flags of libraries this agent's architecture can load; `None` where we know none.
    pub fn host() -> Option<CacheFlags> {
        if cfg!(target_arch = "x86_64") {
            Some(CacheFlags::X86_64_LIBC6)
        } else if cfg!(target_arch = "aarch64") {
            Some(CacheFlags::AARCH64_LIBC6)
        } else {
            None
        }
    }
}

/// One library the cache knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEntry {
    /// ABI and architecture.
    pub flags: CacheFlags,
    /// The name a program asks for (usually a soname such as `libcuda.so.1`).
    pub name: Vec<u8>,
    /// Where ldconfig found it, as seen from the root the cache belongs to.
    pub path: PathBuf,
    /// Hardware capability bits (or a glibc-hwcaps subdirectory reference).
    pub hwcap: u64,
}

impl CacheEntry {
    /// The name as text, when it is UTF-8.
    pub fn name_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.name).ok()
    }
}

/// A parsed `ld.so.cache`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LdCache {
    /// Entries in file order (ldconfig sorts them, most preferred first).
    pub entries: Vec<CacheEntry>,
}

/// Why a cache could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LdCacheError {
    /// Reading the file.
    #[error("reading {path}: {source}")]
    Io {
        /// The cache file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is larger than [`MAX_CACHE_BYTES`].
    #[error("{path} is larger than {MAX_CACHE_BYTES} bytes")]
    TooLarge {
        /// The cache file.
        path: PathBuf,
    },
    /// Neither magic string at the start.
    #[error("not an ld.so.cache: unknown magic at the start of the file")]
    BadMagic,
    /// An old-format cache without the new part after it.
    #[error("old-format ld.so.cache without the glibc-ld.so.cache part (not supported)")]
    OldFormatOnly,
    /// A new-format version other than 1.1.
    #[error("unsupported ld.so.cache version {0:?}")]
    Version(String),
    /// The header says the cache is big-endian or of unknown byte order.
    #[error("unsupported ld.so.cache byte order (header flags {0:#x})")]
    ByteOrder(u8),
    /// A structure runs past the end of the file.
    #[error(
        "truncated ld.so.cache: {what} at byte {offset} needs {need} bytes, the file has {len}"
    )]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Where it starts.
        offset: u64,
        /// How many bytes it needs.
        need: u64,
        /// The file's length.
        len: usize,
    },
    /// A string offset outside the file, or a string without its terminating NUL.
    #[error("ld.so.cache entry {index}: {field} string at byte {offset} {problem}")]
    BadString {
        /// Entry number.
        index: u32,
        /// `name` or `path`.
        field: &'static str,
        /// Offset from the start of the file.
        offset: u64,
        /// What is wrong with it.
        problem: &'static str,
    },
}

/// Little-endian reads with bounds checks.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn slice(&self, what: &'static str, offset: u64, need: u64) -> Result<&[u8], LdCacheError> {
        let truncated = || LdCacheError::Truncated {
            what,
            offset,
            need,
            len: self.0.len(),
        };
        let start = usize::try_from(offset).map_err(|_| truncated())?;
        let end = offset
            .checked_add(need)
            .and_then(|e| usize::try_from(e).ok())
            .ok_or_else(truncated)?;
        self.0.get(start..end).ok_or_else(truncated)
    }

    fn array<const N: usize>(
        &self,
        what: &'static str,
        offset: u64,
    ) -> Result<[u8; N], LdCacheError> {
        let s = self.slice(what, offset, N as u64)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn u32(&self, what: &'static str, offset: u64) -> Result<u32, LdCacheError> {
        self.array(what, offset).map(u32::from_le_bytes)
    }

    /// The NUL-terminated string at `offset`.
    fn string(&self, index: u32, field: &'static str, offset: u64) -> Result<&[u8], LdCacheError> {
        let bad = |problem| LdCacheError::BadString {
            index,
            field,
            offset,
            problem,
        };
        let rest = usize::try_from(offset)
            .ok()
            .and_then(|start| self.0.get(start..))
            .ok_or_else(|| bad("is outside the file"))?;
        let nul = rest
            .iter()
            .position(|b| *b == 0)
            .ok_or_else(|| bad("has no terminating NUL"))?;
        Ok(&rest[..nul])
    }
}

impl LdCache {
    /// Reads and parses the cache at `path` (already resolved by the caller), refusing files
    /// larger than [`MAX_CACHE_BYTES`].
    pub fn read(path: &Path) -> Result<LdCache, LdCacheError> {
        let io = |source| LdCacheError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = fs::File::open(path).map_err(io)?;
        let mut data = Vec::new();
        file.take(MAX_CACHE_BYTES + 1)
            .read_to_end(&mut data)
            .map_err(io)?;
        if data.len() as u64 > MAX_CACHE_BYTES {
            return Err(LdCacheError::TooLarge {
                path: path.to_path_buf(),
            });
        }
        LdCache::parse(&data)
    }

    /// Parses a cache in the new or the compatible layout.
    pub fn parse(data: &[u8]) -> Result<LdCache, LdCacheError> {
        let bytes = Bytes(data);
        let base = if data.starts_with(MAGIC_NEW) {
            0
        } else if data.starts_with(MAGIC_OLD) {
            let old_libs = bytes.u32("old header", MAGIC_OLD.len() as u64 + 1)?;
            let end = OLD_HEADER_LEN + u64::from(old_libs) * OLD_ENTRY_LEN;
            let base = end.div_ceil(NEW_ALIGN) * NEW_ALIGN;
            bytes.slice("old entries", OLD_HEADER_LEN, base - OLD_HEADER_LEN)?;
            match bytes.slice("new header", base, MAGIC_NEW.len() as u64) {
                Ok(magic) if magic == MAGIC_NEW => base,
                _ => return Err(LdCacheError::OldFormatOnly),
            }
        } else {
            return Err(LdCacheError::BadMagic);
        };
        bytes.slice("new header", base, NEW_HEADER_LEN)?;
        let version = bytes.slice("version", base + MAGIC_NEW.len() as u64, 3)?;
        if version != VERSION_NEW {
            return Err(LdCacheError::Version(
                String::from_utf8_lossy(version).into_owned(),
            ));
        }
        let nlibs = bytes.u32("nlibs", base + 20)?;
        // 0: written before the byte order was recorded (so native, little-endian here);
        // 2: little-endian. 1 (invalid) and 3 (big-endian) are refused.
        let [order] = bytes.array::<1>("byte order", base + 28)?;
        if !matches!(order, 0 | 2) {
            return Err(LdCacheError::ByteOrder(order));
        }
        let first = base + NEW_HEADER_LEN;
        // Checks the whole table first, so `nlibs` cannot make us allocate past the file.
        bytes.slice("entries", first, u64::from(nlibs) * NEW_ENTRY_LEN)?;
        let mut entries = Vec::with_capacity(nlibs as usize);
        for index in 0..nlibs {
            let at = first + u64::from(index) * NEW_ENTRY_LEN;
            let flags = CacheFlags(i32::from_le_bytes(bytes.array("entry", at)?));
            let key = bytes.u32("entry", at + 4)?;
            let value = bytes.u32("entry", at + 8)?;
            let hwcap = u64::from_le_bytes(bytes.array("entry", at + 16)?);
            let name = bytes.string(index, "name", base + u64::from(key))?;
            let path = bytes.string(index, "path", base + u64::from(value))?;
            entries.push(CacheEntry {
                flags,
                name: name.to_vec(),
                path: PathBuf::from(OsStr::from_bytes(path)),
                hwcap,
            });
        }
        Ok(LdCache { entries })
    }

    /// Entries for libraries of the given ABI and architecture.
    pub fn for_flags(&self, flags: CacheFlags) -> impl Iterator<Item = &CacheEntry> {
        self.entries.iter().filter(move |e| e.flags == flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-entry new-format cache, written by hand to pin the layout.
    fn one_entry(flags: i32) -> Vec<u8> {
        let mut d = Vec::new();
        d.extend_from_slice(b"glibc-ld.so.cache1.1");
        d.extend_from_slice(&1u32.to_le_bytes()); // nlibs
        d.extend_from_slice(&0u32.to_le_bytes()); // len_strings (not needed to read)
        d.extend_from_slice(&[2, 0, 0, 0]); // little-endian, padding
        d.extend_from_slice(&[0; 16]); // extension offset, unused
        assert_eq!(d.len(), 48);
        let strings = 48 + 24;
        d.extend_from_slice(&flags.to_le_bytes());
        d.extend_from_slice(&(strings as u32).to_le_bytes());
        d.extend_from_slice(&(strings as u32 + 5).to_le_bytes());
        d.extend_from_slice(&[0; 12]); // osversion, hwcap
        d.extend_from_slice(b"libx\0/lib/libx.so\0");
        d
    }

    #[test]
    fn reads_the_new_layout() {
        let cache = LdCache::parse(&one_entry(0x0303)).unwrap();
        assert_eq!(cache.entries.len(), 1);
        let e = &cache.entries[0];
        assert_eq!(
            (e.flags, e.name_str(), e.path.as_path()),
            (CacheFlags(0x0303), Some("libx"), Path::new("/lib/libx.so"))
        );
        assert_eq!(cache.for_flags(CacheFlags::X86_64_LIBC6).count(), 1);
        assert_eq!(cache.for_flags(CacheFlags::AARCH64_LIBC6).count(), 0);
    }

    #[test]
    fn refuses_what_it_cannot_read() {
        assert!(matches!(LdCache::parse(b""), Err(LdCacheError::BadMagic)));
        assert!(matches!(
            LdCache::parse(b"ELF\x7f...."),
            Err(LdCacheError::BadMagic)
        ));
        let mut big_endian = one_entry(0x0303);
        big_endian[28] = 3;
        assert!(matches!(
            LdCache::parse(&big_endian),
            Err(LdCacheError::ByteOrder(3))
        ));
        let mut version = one_entry(0x0303);
        version[19] = b'2';
        assert!(matches!(
            LdCache::parse(&version),
            Err(LdCacheError::Version(_))
        ));
        let mut far = one_entry(0x0303);
        far[52..56].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            LdCache::parse(&far),
            Err(LdCacheError::BadString { field: "name", .. })
        ));
        let mut no_nul = one_entry(0x0303);
        no_nul.pop();
        assert!(matches!(
            LdCache::parse(&no_nul),
            Err(LdCacheError::BadString { field: "path", .. })
        ));
        let mut many = one_entry(0x0303);
        many[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            LdCache::parse(&many),
            Err(LdCacheError::Truncated {
                what: "entries",
                ..
            })
        ));
        // Old layout only: the old header and one entry, then old-style strings.
        let mut old = b"ld.so-1.7.0\0".to_vec();
        old.extend_from_slice(&1u32.to_le_bytes());
        old.extend_from_slice(&[3, 3, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0]);
        old.extend_from_slice(b"libx\0/lib/libx.so\0");
        assert!(matches!(
            LdCache::parse(&old),
            Err(LdCacheError::OldFormatOnly)
        ));
    }

    #[test]
    fn every_truncation_is_an_error() {
        let full = one_entry(0x0303);
        for len in 0..full.len() {
            assert!(LdCache::parse(&full[..len]).is_err(), "{len} bytes parsed");
        }
    }

    /// The machine's own cache, when it has one, parses and names its C library.
    #[test]
    fn parses_this_machines_cache() {
        let path = Path::new("/etc/ld.so.cache");
        let Ok(data) = fs::read(path) else {
            gpupool_sim::testbed::skip(&format!("no {}", path.display()));
            return;
        };
        let cache = match LdCache::parse(&data) {
            Ok(c) => c,
            // A machine still on the old-only layout (glibc before 2.32 with `-c old`).
            Err(LdCacheError::OldFormatOnly) => return,
            Err(e) => panic!("{}: {e}", path.display()),
        };
        assert!(!cache.entries.is_empty());
        assert!(
            cache.entries.iter().all(|e| e.path.is_absolute()),
            "{cache:?}"
        );
        if let Some(host) = CacheFlags::host() {
            assert!(
                cache
                    .for_flags(host)
                    .any(|e| e.name_str().is_some_and(|n| n.starts_with("libc.so"))),
                "no libc for this architecture in {}",
                path.display()
            );
        }
    }
}
