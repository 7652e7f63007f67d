//! Shared copies of the strings that thousands of cached objects repeat: a cluster's pods name
//! a few dozen namespaces, one node each of a few thousand, a handful of priority classes,
//! container names and owner kinds. Each cached pod holding its own copy of each costs a
//! 24–48 byte allocation apiece; an interned string is one allocation the pods share.
//!
//! The table holds a strong reference to every string it hands out and forgets the ones only
//! it still holds whenever it has doubled since it last looked, so strings of deleted
//! namespaces and nodes do not pile up, and the sweep costs O(1) a call amortized.

use std::hash::BuildHasher;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

/// The table never sweeps below this many strings.
const MIN_SWEEP_AT: usize = 256;

/// A set of shared strings.
#[derive(Debug)]
pub struct Interner {
    inner: Mutex<Table>,
}

#[derive(Debug)]
struct Table {
    strings: HashTable<Arc<str>>,
    hasher: hashbrown::DefaultHashBuilder,
    /// The length at which the next insert first sweeps out unused strings.
    sweep_at: usize,
}

impl Default for Interner {
    fn default() -> Self {
        Self::new()
    }
}

impl Interner {
    /// An empty table.
    pub fn new() -> Self {
        Interner {
            inner: Mutex::new(Table {
                strings: HashTable::new(),
                hasher: hashbrown::DefaultHashBuilder::default(),
                sweep_at: MIN_SWEEP_AT,
            }),
        }
    }

    /// The shared copy of `s`, made now if the table has none.
    pub fn intern(&self, s: &str) -> Arc<str> {
        // A panic elsewhere while holding the lock leaves the table consistent (every step
        // below leaves it whole), so a poisoned lock is taken as it is.
        let mut table = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let Table {
            strings,
            hasher,
            sweep_at,
        } = &mut *table;
        let hash = hasher.hash_one(s);
        match strings.entry(hash, |held| &**held == s, |held| hasher.hash_one(&**held)) {
            Entry::Occupied(held) => Arc::clone(held.get()),
            Entry::Vacant(slot) => {
                let fresh: Arc<str> = Arc::from(s);
                slot.insert(Arc::clone(&fresh));
                if strings.len() >= *sweep_at {
                    strings.retain(|held| Arc::strong_count(held) > 1);
                    // A sweep walks the table's capacity: after a burst of strings since
                    // forgotten, give the room back so later sweeps stay short.
                    strings.shrink_to_fit(|held| hasher.hash_one(&**held));
                    *sweep_at = (strings.len() * 2).max(MIN_SWEEP_AT);
                }
                fresh
            }
        }
    }

    /// How many strings the table holds.
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .strings
            .len()
    }

    /// Whether the table holds no strings.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The operator's table: the caches' objects are decoded by serde, where no context reaches.
pub static STRINGS: LazyLock<Interner> = LazyLock::new(Interner::new);

/// The shared copy of `s` from [`STRINGS`].
pub fn intern(s: &str) -> Arc<str> {
    STRINGS.intern(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_strings_share_one_allocation() {
        let table = Interner::new();
        let a = table.intern("scale-bench");
        let b = table.intern(&String::from("scale-bench"));
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(&*a, "scale-bench");
        let c = table.intern("default");
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(table.len(), 2);
    }

    #[test]
    fn strings_no_one_holds_are_swept_as_the_table_grows() {
        let table = Interner::new();
        let kept = table.intern("kept");
        // Strings dropped at once: only the table holds them.
        for i in 0..10 * MIN_SWEEP_AT {
            drop(table.intern(&format!("node-{i}")));
        }
        assert!(
            table.len() < 2 * MIN_SWEEP_AT,
            "{} strings held after sweeps",
            table.len()
        );
        // The string still held elsewhere survived every sweep: the same allocation comes back.
        assert!(Arc::ptr_eq(&kept, &table.intern("kept")));
    }

    #[test]
    fn a_sweep_keeps_every_string_still_held() {
        let table = Interner::new();
        let held: Vec<Arc<str>> = (0..3 * MIN_SWEEP_AT)
            .map(|i| table.intern(&format!("ns-{i}")))
            .collect();
        assert_eq!(table.len(), held.len());
        for s in &held {
            assert!(Arc::ptr_eq(s, &table.intern(s)));
        }
    }
}
