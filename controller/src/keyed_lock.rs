//! One async lock per key, held across awaits (an agent call), and
//! forgotten when nobody holds or waits for it.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::OwnedMutexGuard;

#[derive(Debug)]
pub struct KeyedLocks<K> {
    map: Mutex<HashMap<K, Arc<tokio::sync::Mutex<()>>>>,
}

impl<K> Default for KeyedLocks<K> {
    fn default() -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
        }
    }
}

/// Holds one key's lock; dropping it lets the next holder in.
pub struct KeyedGuard<'a, K: Hash + Eq + Clone> {
    locks: &'a KeyedLocks<K>,
    key: K,
    lock: Arc<tokio::sync::Mutex<()>>,
    held: Option<OwnedMutexGuard<()>>,
}

impl<K: Hash + Eq + Clone> KeyedLocks<K> {
    pub async fn lock(&self, key: K) -> KeyedGuard<'_, K> {
        let lock = self.map.lock().entry(key.clone()).or_default().clone();
        let held = lock.clone().lock_owned().await;
        KeyedGuard {
            locks: self,
            key,
            lock,
            held: Some(held),
        }
    }

    /// Locks every key, in sorted order (so two callers with overlapping
    /// sets cannot deadlock).
    pub async fn lock_all(&self, mut keys: Vec<K>) -> Vec<KeyedGuard<'_, K>>
    where
        K: Ord,
    {
        keys.sort();
        keys.dedup();
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            out.push(self.lock(k).await);
        }
        out
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.lock().len()
    }
}

impl<K: Hash + Eq + Clone> Drop for KeyedGuard<'_, K> {
    fn drop(&mut self) {
        self.held.take();
        let mut g = self.locks.map.lock();
        // Clones are taken under this mutex: 2 = the map's and ours, so
        // nobody else holds or waits.
        if Arc::strong_count(&self.lock) == 2 {
            g.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn one_holder_per_key_and_nothing_left_behind() {
        let locks: Arc<KeyedLocks<String>> = Arc::default();
        let first = locks.lock("a".into()).await;
        let l2 = locks.clone();
        let waiter = tokio::spawn(async move {
            let _g = l2.lock("a".into()).await;
        });
        // Another key is free meanwhile.
        drop(locks.lock("b".into()).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "a is held");
        drop(first);
        waiter.await.unwrap();
        assert_eq!(locks.len(), 0);
        let all = locks
            .lock_all(vec!["z".into(), "a".into(), "a".into()])
            .await;
        assert_eq!(all.len(), 2);
        drop(all);
        assert_eq!(locks.len(), 0);
    }
}
