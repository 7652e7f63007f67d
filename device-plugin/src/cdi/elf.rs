//! The soname (`DT_SONAME`) and machine of an ELF shared object, for driver libraries the
//! ld.so.cache does not name.
//!
//! Only what that needs is read, at the offsets the file gives: the ELF header, the program
//! headers, the `PT_DYNAMIC` segment, and one string of the dynamic string table (found through
//! the `PT_LOAD` segment that maps `DT_STRTAB`). The file is untrusted: every offset and size is
//! checked against the file's length and against fixed caps, so a malformed file is an error,
//! never a panic or a large read. 32- and 64-bit, either byte order.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// `e_machine` of x86-64.
pub const EM_X86_64: u16 = 62;
/// `e_machine` of AArch64.
pub const EM_AARCH64: u16 = 183;

const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const DT_NULL: u64 = 0;
const DT_STRTAB: u64 = 5;
const DT_STRSZ: u64 = 10;
const DT_SONAME: u64 = 14;
/// Program header tables larger than this are refused (real ones have about ten entries).
const MAX_PHDRS_BYTES: u64 = 64 << 10;
/// Dynamic sections larger than this are refused (real ones are a few hundred bytes).
const MAX_DYNAMIC_BYTES: u64 = 64 << 10;
/// Longest soname read.
const MAX_SONAME_BYTES: u64 = 255;

/// What was read from a shared object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElfInfo {
    /// `e_machine` (62: x86-64, 183: AArch64).
    pub machine: u16,
    /// `DT_SONAME`, when the object has one that is UTF-8.
    pub soname: Option<String>,
}

/// Why a file could not be read as an ELF shared object.
#[derive(Debug, thiserror::Error)]
pub enum ElfError {
    /// Opening or reading the file.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Something the file says does not hold.
    #[error("{path}: not a readable ELF shared object: {problem}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: &'static str,
    },
}

/// Random access to the bytes of a file (or of a buffer, in tests).
pub trait ReadAt {
    /// Length in bytes.
    fn size(&self) -> u64;
    /// Fills `buf` from `offset`; the caller has checked the range against [`ReadAt::size`].
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()>;
}

impl ReadAt for [u8] {
    fn size(&self) -> u64 {
        <[u8]>::len(self) as u64
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let start = usize::try_from(offset).map_err(std::io::Error::other)?;
        let bytes = start
            .checked_add(buf.len())
            .and_then(|end| self.get(start..end))
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(bytes);
        Ok(())
    }
}

struct FileAt {
    file: File,
    len: u64,
}

impl ReadAt for FileAt {
    fn size(&self) -> u64 {
        self.len
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        FileExt::read_exact_at(&self.file, buf, offset)
    }
}

/// Reads the machine and soname of the shared object at `path`.
pub fn read(path: &Path) -> Result<ElfInfo, ElfError> {
    let io = |source| ElfError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    parse(&FileAt { file, len }).map_err(|e| match e {
        Problem::Io(source) => io(source),
        Problem::Malformed(problem) => ElfError::Malformed {
            path: path.to_path_buf(),
            problem,
        },
    })
}

/// Why [`parse`] failed, before a path is attached.
#[derive(Debug)]
pub enum Problem {
    /// A read failed.
    Io(std::io::Error),
    /// The content is not what ELF says it must be.
    Malformed(&'static str),
}

/// The class and byte order from `e_ident`, with readers for the two.
#[derive(Clone, Copy)]
struct Layout {
    wide: bool,
    little: bool,
}

impl Layout {
    fn u16(self, b: &[u8], at: usize) -> u16 {
        let v = [b[at], b[at + 1]];
        if self.little {
            u16::from_le_bytes(v)
        } else {
            u16::from_be_bytes(v)
        }
    }
    fn u32(self, b: &[u8], at: usize) -> u32 {
        let v = [b[at], b[at + 1], b[at + 2], b[at + 3]];
        if self.little {
            u32::from_le_bytes(v)
        } else {
            u32::from_be_bytes(v)
        }
    }
    fn u64(self, b: &[u8], at: usize) -> u64 {
        let mut v = [0; 8];
        v.copy_from_slice(&b[at..at + 8]);
        if self.little {
            u64::from_le_bytes(v)
        } else {
            u64::from_be_bytes(v)
        }
    }
    /// An address-sized word: 8 bytes in ELF64, 4 in ELF32.
    fn word(self, b: &[u8], at: usize) -> u64 {
        if self.wide {
            self.u64(b, at)
        } else {
            u64::from(self.u32(b, at))
        }
    }
}

/// Reads `len` bytes at `offset`, after checking the range against the file.
fn read_range(
    src: &(impl ReadAt + ?Sized),
    offset: u64,
    len: u64,
    what: &'static str,
) -> Result<Vec<u8>, Problem> {
    let end = offset.checked_add(len).ok_or(Problem::Malformed(what))?;
    if end > src.size() {
        return Err(Problem::Malformed(what));
    }
    let len = usize::try_from(len).map_err(|_| Problem::Malformed(what))?;
    let mut buf = vec![0; len];
    src.read_exact_at(&mut buf, offset).map_err(Problem::Io)?;
    Ok(buf)
}

/// A loadable segment: where it is in the file and in memory.
struct Load {
    offset: u64,
    vaddr: u64,
    filesz: u64,
}

/// Parses an ELF shared object from `src`. Every field read lies inside a buffer whose length
/// was checked first, so indexing cannot go out of bounds.
pub fn parse(src: &(impl ReadAt + ?Sized)) -> Result<ElfInfo, Problem> {
    let ident = read_range(src, 0, 16, "shorter than an ELF identification")?;
    if ident[..4] != *b"\x7fELF" {
        return Err(Problem::Malformed("no ELF magic"));
    }
    let wide = match ident[4] {
        1 => false,
        2 => true,
        _ => return Err(Problem::Malformed("unknown ELF class")),
    };
    let little = match ident[5] {
        1 => true,
        2 => false,
        _ => return Err(Problem::Malformed("unknown ELF byte order")),
    };
    let l = Layout { wide, little };
    let header = read_range(src, 0, if wide { 64 } else { 52 }, "truncated ELF header")?;
    let machine = l.u16(&header, 18);
    let (phoff, phentsize, phnum) = if wide {
        (l.u64(&header, 32), l.u16(&header, 54), l.u16(&header, 56))
    } else {
        (
            u64::from(l.u32(&header, 28)),
            l.u16(&header, 42),
            l.u16(&header, 44),
        )
    };
    let min_entry: u16 = if wide { 56 } else { 32 };
    if phnum == 0 {
        return Err(Problem::Malformed("no program headers"));
    }
    if phentsize < min_entry {
        return Err(Problem::Malformed("program header entries too small"));
    }
    let table_len = u64::from(phentsize) * u64::from(phnum);
    if table_len > MAX_PHDRS_BYTES {
        return Err(Problem::Malformed("program header table too large"));
    }
    let table = read_range(src, phoff, table_len, "program headers outside the file")?;
    let mut loads = Vec::new();
    let mut dynamic = None;
    for entry in table.chunks_exact(usize::from(phentsize)) {
        let kind = l.u32(entry, 0);
        // (offset, vaddr, filesz) in both classes' field order.
        let (offset, vaddr, filesz) = if wide {
            (l.u64(entry, 8), l.u64(entry, 16), l.u64(entry, 32))
        } else {
            (l.word(entry, 4), l.word(entry, 8), l.word(entry, 16))
        };
        match kind {
            PT_LOAD => loads.push(Load {
                offset,
                vaddr,
                filesz,
            }),
            PT_DYNAMIC => dynamic = Some((offset, filesz)),
            _ => {}
        }
    }
    let Some((dyn_offset, dyn_size)) = dynamic else {
        return Err(Problem::Malformed("no dynamic segment"));
    };
    if dyn_size > MAX_DYNAMIC_BYTES {
        return Err(Problem::Malformed("dynamic segment too large"));
    }
    let dynamic = read_range(
        src,
        dyn_offset,
        dyn_size,
        "dynamic segment outside the file",
    )?;
    let entry_len = if wide { 16 } else { 8 };
    let half = entry_len / 2;
    let (mut strtab, mut strsz, mut soname) = (None, None, None);
    for entry in dynamic.chunks_exact(entry_len) {
        let (tag, value) = (l.word(entry, 0), l.word(entry, half));
        match tag {
            DT_NULL => break,
            DT_STRTAB => strtab = Some(value),
            DT_STRSZ => strsz = Some(value),
            DT_SONAME => soname = Some(value),
            _ => {}
        }
    }
    let Some(index) = soname else {
        return Ok(ElfInfo {
            machine,
            soname: None,
        });
    };
    let (Some(strtab), Some(strsz)) = (strtab, strsz) else {
        return Err(Problem::Malformed("DT_SONAME without a string table"));
    };
    if index >= strsz {
        return Err(Problem::Malformed("DT_SONAME outside the string table"));
    }
    // The string table's address, mapped to the file through the segment that loads it.
    let table_offset = loads
        .iter()
        .find(|s| strtab >= s.vaddr && strtab - s.vaddr < s.filesz)
        .and_then(|s| (strtab - s.vaddr).checked_add(s.offset))
        .ok_or(Problem::Malformed("string table in no loaded segment"))?;
    let start = table_offset
        .checked_add(index)
        .ok_or(Problem::Malformed("DT_SONAME offset overflows"))?;
    let available = (strsz - index)
        .min(MAX_SONAME_BYTES + 1)
        .min(src.size().saturating_sub(start));
    let bytes = read_range(src, start, available, "DT_SONAME outside the file")?;
    let Some(end) = bytes.iter().position(|b| *b == 0) else {
        return Err(Problem::Malformed("DT_SONAME not terminated or too long"));
    };
    Ok(ElfInfo {
        machine,
        soname: std::str::from_utf8(&bytes[..end]).ok().map(str::to_owned),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 little-endian shared object: header, two program headers (a PT_LOAD
    /// of the whole file at address 0x1000, the PT_DYNAMIC), the dynamic section and strings.
    fn tiny_elf(soname: &str) -> Vec<u8> {
        let mut f = vec![0u8; 64];
        f[..4].copy_from_slice(b"\x7fELF");
        f[4] = 2;
        f[5] = 1;
        f[6] = 1;
        f[16..18].copy_from_slice(&3u16.to_le_bytes());
        f[18..20].copy_from_slice(&EM_X86_64.to_le_bytes());
        f[32..40].copy_from_slice(&64u64.to_le_bytes());
        f[54..56].copy_from_slice(&56u16.to_le_bytes());
        f[56..58].copy_from_slice(&2u16.to_le_bytes());
        let dyn_at = 64 + 2 * 56;
        let str_at = dyn_at + 4 * 16;
        let mut strings = vec![0u8];
        strings.extend_from_slice(soname.as_bytes());
        strings.push(0);
        let total = (str_at + strings.len()) as u64;
        let phdr = |kind: u32, offset: u64, vaddr: u64, size: u64| {
            let mut p = vec![0u8; 56];
            p[0..4].copy_from_slice(&kind.to_le_bytes());
            p[8..16].copy_from_slice(&offset.to_le_bytes());
            p[16..24].copy_from_slice(&vaddr.to_le_bytes());
            p[32..40].copy_from_slice(&size.to_le_bytes());
            p
        };
        f.extend(phdr(PT_LOAD, 0, 0x1000, total));
        f.extend(phdr(PT_DYNAMIC, dyn_at as u64, 0x1000 + dyn_at as u64, 64));
        for (tag, value) in [
            (DT_STRTAB, 0x1000 + str_at as u64),
            (DT_STRSZ, strings.len() as u64),
            (DT_SONAME, 1),
            (DT_NULL, 0),
        ] {
            f.extend_from_slice(&tag.to_le_bytes());
            f.extend_from_slice(&value.to_le_bytes());
        }
        f.extend_from_slice(&strings);
        f
    }

    #[test]
    fn reads_the_soname_of_a_hand_made_object() {
        let info = parse(tiny_elf("libcuda.so.1").as_slice()).unwrap();
        assert_eq!(info.machine, EM_X86_64);
        assert_eq!(info.soname.as_deref(), Some("libcuda.so.1"));
    }

    #[test]
    fn every_truncation_and_byte_change_is_an_answer_not_a_panic() {
        let full = tiny_elf("libnvidia-ml.so.1");
        for len in 0..full.len() {
            assert!(parse(&full[..len]).is_err(), "{len} bytes parsed");
        }
        for at in 0..full.len() {
            for value in [0x00, 0x01, 0x7f, 0x80, 0xff] {
                let mut bad = full.clone();
                bad[at] = value;
                let _ = parse(bad.as_slice());
            }
        }
    }

    #[test]
    fn not_elf_is_an_error_with_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("libcuda.so.550.54.15");
        std::fs::write(&path, "").unwrap();
        let err = read(&path).unwrap_err().to_string();
        assert!(err.contains("libcuda.so.550.54.15"), "{err}");
        assert!(read(&dir.path().join("missing")).is_err());
    }
}
