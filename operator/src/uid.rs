//! Object UIDs as the caches keep them. The API server hands out UIDs as RFC 4122 strings, 36
//! characters that cost a cached object a 48-byte allocation; held as the 128-bit number they
//! spell, a UID costs nothing beside the object. A UID in any other form (the API does not
//! promise the format) is kept as it came, so every UID reads back exactly as sent.

use std::fmt;

/// A UID: the number an RFC 4122 string in canonical form (lowercase, hyphenated) spells, or
/// the string itself. The number is held as two halves, so a `Uid` is 24 bytes where a `u128`
/// would align it to 32.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Uid {
    Uuid([u64; 2]),
    Other(Box<str>),
}

fn halves(n: u128) -> [u64; 2] {
    // Truncation intended: the high and the low 64 bits.
    [(n >> 64) as u64, n as u64]
}

/// Where the hyphens of a canonical UUID string sit.
const HYPHENS: [usize; 4] = [8, 13, 18, 23];

impl Uid {
    /// The UID `s` names.
    pub fn new(s: &str) -> Self {
        Self::parse_canonical(s).map_or_else(|| Uid::Other(s.into()), |n| Uid::Uuid(halves(n)))
    }

    /// The number a canonical UUID string spells; `None` for anything that would not print
    /// back as the same string.
    fn parse_canonical(s: &str) -> Option<u128> {
        let bytes = s.as_bytes();
        if bytes.len() != 36 {
            return None;
        }
        let mut n: u128 = 0;
        for (i, &b) in bytes.iter().enumerate() {
            if HYPHENS.contains(&i) {
                if b != b'-' {
                    return None;
                }
                continue;
            }
            let digit = match b {
                b'0'..=b'9' => b - b'0',
                b'a'..=b'f' => b - b'a' + 10,
                _ => return None,
            };
            n = (n << 4) | u128::from(digit);
        }
        Some(n)
    }
}

impl fmt::Display for Uid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Uid::Uuid([hi, lo]) => {
                let hex = format!("{hi:016x}{lo:016x}");
                write!(
                    f,
                    "{}-{}-{}-{}-{}",
                    &hex[0..8],
                    &hex[8..12],
                    &hex[12..16],
                    &hex[16..20],
                    &hex[20..32]
                )
            }
            Uid::Other(s) => f.write_str(s),
        }
    }
}

impl PartialEq<str> for Uid {
    fn eq(&self, other: &str) -> bool {
        match self {
            Uid::Uuid(n) => Self::parse_canonical(other).map(halves) == Some(*n),
            Uid::Other(s) => &**s == other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_canonical_uuid_is_held_as_a_number_and_reads_back_as_sent() {
        for s in [
            "0c6f3a52-9d1e-4b7a-8f21-000000010203",
            "00000000-0000-0000-0000-000000000000",
            "ffffffff-ffff-ffff-ffff-ffffffffffff",
        ] {
            let uid = Uid::new(s);
            assert!(matches!(uid, Uid::Uuid(_)), "{s} kept as a string");
            assert_eq!(uid.to_string(), s);
            assert!(uid == *s);
        }
    }

    #[test]
    fn any_other_uid_is_kept_as_it_came() {
        for s in [
            "pod-w-uid",
            "0C6F3A52-9D1E-4B7A-8F21-000000010203",
            "0c6f3a529d1e4b7a8f21000000010203",
            "0c6f3a52-9d1e-4b7a-8f21-00000001020g",
            "0c6f3a52-9d1e-4b7a-8f21+000000010203",
            "",
        ] {
            let uid = Uid::new(s);
            assert_eq!(uid, Uid::Other(s.into()), "{s}");
            assert_eq!(uid.to_string(), s);
            assert!(uid == *s);
        }
    }

    #[test]
    fn a_uid_takes_24_bytes() {
        assert_eq!(std::mem::size_of::<Uid>(), 24);
        assert_eq!(std::mem::size_of::<Option<Uid>>(), 24);
    }

    #[test]
    fn uids_compare_by_what_they_spell() {
        let a = Uid::new("0c6f3a52-9d1e-4b7a-8f21-000000010203");
        assert!(a != *"0c6f3a52-9d1e-4b7a-8f21-000000010204");
        assert!(a != *"0C6F3A52-9D1E-4B7A-8F21-000000010203");
        assert_ne!(a, Uid::new("0c6f3a52-9d1e-4b7a-8f21-000000010204"));
        assert_eq!(a, Uid::new("0c6f3a52-9d1e-4b7a-8f21-000000010203"));
    }
}
