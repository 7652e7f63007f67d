//! The operator's object caches: a reader/writer split store that a watch fills, as kube's
//! reflector store does, but keyed by the objects themselves.
//!
//! kube's store keys each object by an `ObjectRef`: a copy of its name, namespace, resource
//! version and UID, four more allocations and a 96-byte key beside every object. At 5,000
//! nodes the Node, GpuNode and pod caches hold 30,000 objects, and those keys were about a
//! fifth of the caches' heap. Here an entry is the object's `Arc` alone: its slot is found by
//! hashing the namespace and name the object already carries, and compared against them.
//!
//! Semantics follow kube's writer: `Apply` and `Delete` change the store at once; a list
//! (`Init`, `InitApply`..., `InitDone`) is gathered apart and replaces the whole store at
//! `InitDone`, so readers see the old picture until the new one is complete; the store is
//! ready from its first `InitDone`.

use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, PoisonError, RwLock};

use hashbrown::HashTable;
use kube::runtime::reflector::{Lookup, ObjectRef};
use kube::runtime::watcher;
use tokio::sync::watch;

/// The writer went away before the store's first list was complete.
#[derive(Debug, thiserror::Error)]
#[error("the cache's writer was dropped before its first list completed")]
pub struct WriterDropped;

/// Objects keyed by their own namespace and name.
struct Table<K> {
    objects: HashTable<Arc<K>>,
    hasher: RandomState,
}

/// The hash an object's slot is found by: of its namespace and name.
fn hash_of<K: Lookup>(hasher: &RandomState, obj: &K) -> u64 {
    hasher.hash_one((obj.namespace().as_deref(), obj.name().as_deref()))
}

impl<K: Lookup> Table<K> {
    fn new(hasher: RandomState) -> Self {
        Table {
            objects: HashTable::new(),
            hasher,
        }
    }

    fn hash(&self, namespace: Option<&str>, name: Option<&str>) -> u64 {
        self.hasher.hash_one((namespace, name))
    }

    fn same(obj: &K, namespace: Option<&str>, name: Option<&str>) -> bool {
        obj.name().as_deref() == name && obj.namespace().as_deref() == namespace
    }

    fn insert(&mut self, obj: Arc<K>) {
        let hasher = &self.hasher;
        let entry = self.objects.entry(
            hash_of(hasher, obj.as_ref()),
            |o| Self::same(o, obj.namespace().as_deref(), obj.name().as_deref()),
            |o| hash_of(hasher, o.as_ref()),
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(mut e) => *e.get_mut() = obj,
            hashbrown::hash_table::Entry::Vacant(e) => {
                e.insert(obj);
            }
        }
    }

    fn remove(&mut self, obj: &K) {
        let (namespace, name) = (obj.namespace(), obj.name());
        let hash = hash_of(&self.hasher, obj);
        if let Ok(e) = self.objects.find_entry(hash, |o| {
            Self::same(o, namespace.as_deref(), name.as_deref())
        }) {
            e.remove();
        }
    }

    fn get(&self, namespace: Option<&str>, name: Option<&str>) -> Option<&Arc<K>> {
        self.objects.find(self.hash(namespace, name), |o| {
            Self::same(o, namespace, name)
        })
    }
}

/// The read side of a cache; cheap to clone, all clones see one store.
pub struct Store<K> {
    table: Arc<RwLock<Table<K>>>,
    ready: watch::Receiver<bool>,
}

impl<K> Clone for Store<K> {
    fn clone(&self) -> Self {
        Store {
            table: self.table.clone(),
            ready: self.ready.clone(),
        }
    }
}

impl<K: Lookup + 'static> Store<K> {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Table<K>> {
        // A panicking writer leaves a table that is still whole: each change is one insert,
        // removal or swap.
        self.table.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every object, in no particular order.
    pub fn state(&self) -> Vec<Arc<K>> {
        self.read().objects.iter().cloned().collect()
    }

    /// The object `key` names (its namespace and name; the rest of the reference is not
    /// compared).
    pub fn get(&self, key: &ObjectRef<K>) -> Option<Arc<K>>
    where
        K::DynamicType: Eq + std::hash::Hash + Clone,
    {
        self.read()
            .get(key.namespace.as_deref(), Some(&key.name))
            .cloned()
    }

    /// How many objects the store holds.
    pub fn len(&self) -> usize {
        self.read().objects.len()
    }

    /// Whether the store holds no object.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the first list has been stored.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Waits until the first list has been stored.
    pub async fn wait_until_ready(&self) -> Result<(), WriterDropped> {
        let mut ready = self.ready.clone();
        ready
            .wait_for(|r| *r)
            .await
            .map(|_| ())
            .map_err(|_| WriterDropped)
    }
}

/// The write side of a cache, fed one watch's events in order.
pub struct Writer<K> {
    table: Arc<RwLock<Table<K>>>,
    /// The list being gathered, between `Init` and `InitDone`.
    listing: Option<Table<K>>,
    hasher: RandomState,
    ready: watch::Sender<bool>,
}

impl<K: Lookup + Clone + 'static> Default for Writer<K> {
    fn default() -> Self {
        let (ready, _) = watch::channel(false);
        let hasher = RandomState::new();
        Writer {
            table: Arc::new(RwLock::new(Table::new(hasher.clone()))),
            listing: None,
            hasher,
            ready,
        }
    }
}

/// An empty store and its writer.
pub fn store<K: Lookup + Clone + 'static>() -> (Store<K>, Writer<K>) {
    let writer = Writer::default();
    (writer.as_reader(), writer)
}

impl<K: Lookup + Clone + 'static> Writer<K> {
    /// A reader of this writer's store.
    pub fn as_reader(&self) -> Store<K> {
        Store {
            table: self.table.clone(),
            ready: self.ready.subscribe(),
        }
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Table<K>> {
        self.table.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Applies one watch event (see the module docs).
    pub fn apply_watcher_event(&mut self, event: &watcher::Event<K>) {
        match event {
            watcher::Event::Apply(obj) => self.write().insert(Arc::new(obj.clone())),
            watcher::Event::Delete(obj) => self.write().remove(obj),
            watcher::Event::Init => self.listing = Some(Table::new(self.hasher.clone())),
            watcher::Event::InitApply(obj) => {
                let hasher = &self.hasher;
                self.listing
                    .get_or_insert_with(|| Table::new(hasher.clone()))
                    .insert(Arc::new(obj.clone()));
            }
            watcher::Event::InitDone => {
                let listed = self
                    .listing
                    .take()
                    .unwrap_or_else(|| Table::new(self.hasher.clone()));
                // The old table is dropped after the lock is let go.
                let old = std::mem::replace(&mut *self.write(), listed);
                drop(old);
                self.ready.send_replace(true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;
    use k8s_openapi::api::core::v1::{ConfigMap, Node};
    use kube::api::ObjectMeta;

    use super::*;

    fn node(name: &str, version: &str) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                resource_version: Some(version.into()),
                ..ObjectMeta::default()
            },
            ..Node::default()
        }
    }

    fn config_map(ns: &str, name: &str, value: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(ns.into()),
                ..ObjectMeta::default()
            },
            data: Some([("v".to_string(), value.to_string())].into()),
            ..ConfigMap::default()
        }
    }

    fn names(store: &Store<Node>) -> Vec<String> {
        let mut names: Vec<String> = store
            .state()
            .iter()
            .filter_map(|n| n.metadata.name.clone())
            .collect();
        names.sort();
        names
    }

    fn version(store: &Store<Node>, name: &str) -> Option<String> {
        store
            .get(&ObjectRef::new(name))
            .and_then(|n| n.metadata.resource_version.clone())
    }

    #[test]
    fn applies_replace_and_deletes_remove_by_name() {
        let (store, mut writer) = store::<Node>();
        writer.apply_watcher_event(&watcher::Event::Apply(node("a", "1")));
        writer.apply_watcher_event(&watcher::Event::Apply(node("b", "1")));
        writer.apply_watcher_event(&watcher::Event::Apply(node("a", "2")));
        assert_eq!(store.len(), 2);
        assert_eq!(version(&store, "a").as_deref(), Some("2"));
        // A deletion names the object; its other fields need not match.
        writer.apply_watcher_event(&watcher::Event::Delete(node("a", "9")));
        assert_eq!(names(&store), ["b"]);
        assert_eq!(store.get(&ObjectRef::new("a")), None);
        writer.apply_watcher_event(&watcher::Event::Delete(node("never", "1")));
        assert_eq!(names(&store), ["b"]);
    }

    #[test]
    fn a_list_replaces_the_store_whole_when_it_is_done() {
        let (store, mut writer) = store::<Node>();
        assert!(!store.is_ready());
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitApply(node("a", "1")));
        writer.apply_watcher_event(&watcher::Event::InitApply(node("b", "1")));
        assert!(store.is_empty(), "a list in progress is not seen");
        assert!(!store.is_ready());
        writer.apply_watcher_event(&watcher::Event::InitDone);
        assert!(store.is_ready());
        assert_eq!(names(&store), ["a", "b"]);

        // A relist: what it no longer names is gone at its end, not before.
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitApply(node("b", "2")));
        writer.apply_watcher_event(&watcher::Event::InitApply(node("c", "1")));
        assert_eq!(names(&store), ["a", "b"]);
        assert_eq!(version(&store, "b").as_deref(), Some("1"));
        writer.apply_watcher_event(&watcher::Event::InitDone);
        assert_eq!(names(&store), ["b", "c"]);
        assert_eq!(version(&store, "b").as_deref(), Some("2"));
        assert!(store.is_ready());

        // An empty list empties the store.
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitDone);
        assert!(store.is_empty());
    }

    #[test]
    fn objects_of_one_name_in_two_namespaces_are_two_objects() {
        let (store, mut writer) = store::<ConfigMap>();
        writer.apply_watcher_event(&watcher::Event::Apply(config_map("a", "x", "1")));
        writer.apply_watcher_event(&watcher::Event::Apply(config_map("b", "x", "2")));
        assert_eq!(store.len(), 2);
        let value = |ns: &str| {
            store
                .get(&ObjectRef::new("x").within(ns))
                .and_then(|c| c.data.as_ref()?.get("v").cloned())
        };
        assert_eq!(value("a").as_deref(), Some("1"));
        assert_eq!(value("b").as_deref(), Some("2"));
        assert_eq!(store.get(&ObjectRef::new("x")), None, "no cluster-scoped x");
        writer.apply_watcher_event(&watcher::Event::Delete(config_map("a", "x", "")));
        assert_eq!(value("a"), None);
        assert_eq!(value("b").as_deref(), Some("2"));
    }

    #[test]
    fn many_objects_are_each_found() {
        let (store, mut writer) = store::<Node>();
        writer.apply_watcher_event(&watcher::Event::Init);
        for i in 0..5_000 {
            writer.apply_watcher_event(&watcher::Event::InitApply(node(&format!("n{i}"), "1")));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        assert_eq!(store.len(), 5_000);
        for i in (0..5_000).step_by(7) {
            assert!(
                store.get(&ObjectRef::new(&format!("n{i}"))).is_some(),
                "n{i}"
            );
        }
        for i in 0..2_500 {
            writer.apply_watcher_event(&watcher::Event::Delete(node(&format!("n{i}"), "1")));
        }
        assert_eq!(store.len(), 2_500);
        assert!(store.get(&ObjectRef::new("n2499")).is_none());
        assert!(store.get(&ObjectRef::new("n2500")).is_some());
    }

    #[tokio::test]
    async fn waiting_ends_at_the_first_list_or_with_the_writer() {
        let (store, mut writer) = store::<Node>();
        assert!(store.wait_until_ready().now_or_never().is_none());
        let waiter = tokio::spawn({
            let store = store.clone();
            async move { store.wait_until_ready().await.is_ok() }
        });
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitDone);
        assert!(waiter.await.unwrap());
        assert!(matches!(
            store.wait_until_ready().now_or_never(),
            Some(Ok(()))
        ));

        let (never, writer) = super::store::<Node>();
        drop(writer);
        assert!(matches!(never.wait_until_ready().await, Err(WriterDropped)));
    }
}
