//! A bounded pool of plugin instances, so plugin calls can run on several threads at once: a
//! call takes an idle instance or builds a new one (up to the pool's size), and gives it back
//! afterwards, unless it trapped, in which case it is dropped and a fresh one is built later.

use std::sync::{Condvar, Mutex, MutexGuard};

struct State<T> {
    idle: Vec<T>,
    live: usize,
}

/// At most `max` live instances of `T`.
pub struct Pool<T> {
    state: Mutex<State<T>>,
    freed: Condvar,
    max: usize,
}

impl<T> Pool<T> {
    pub fn new(max: usize) -> Self {
        Pool {
            state: Mutex::new(State {
                idle: Vec::new(),
                live: 0,
            }),
            freed: Condvar::new(),
            max: max.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // A panic while holding the lock leaves the state consistent (it only moves values
        // in and out), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes an idle instance, or builds one with `create` if fewer than `max` are live, or
    /// waits for one to come back.
    pub fn take<E>(&self, create: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        let mut s = self.lock();
        loop {
            if let Some(t) = s.idle.pop() {
                return Ok(t);
            }
            if s.live < self.max {
                s.live += 1;
                drop(s);
                return create().inspect_err(|_| self.discard());
            }
            s = self.freed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Like [`Pool::take`], as a [`Lease`] that counts as discarded if it is dropped without
    /// being given back (say, by a panic), so the pool never loses a slot.
    pub fn lease<E>(&self, create: impl FnOnce() -> Result<T, E>) -> Result<Lease<'_, T>, E> {
        Ok(Lease {
            pool: self,
            item: Some(self.take(create)?),
        })
    }

    /// Adds an instance built outside `take` (counts as live, starts idle).
    pub fn adopt(&self, t: T) {
        let mut s = self.lock();
        s.live += 1;
        s.idle.push(t);
        drop(s);
        self.freed.notify_one();
    }

    /// Returns a healthy instance.
    pub fn put(&self, t: T) {
        self.lock().idle.push(t);
        self.freed.notify_one();
    }

    /// Forgets a taken instance (it trapped, or could not be built).
    pub fn discard(&self) {
        let mut s = self.lock();
        s.live = s.live.saturating_sub(1);
        drop(s);
        self.freed.notify_one();
    }

    /// Live instances (idle or taken).
    #[cfg(test)]
    pub fn live(&self) -> usize {
        self.lock().live
    }
}

/// An instance taken from a pool.
pub struct Lease<'a, T> {
    pool: &'a Pool<T>,
    item: Option<T>,
}

impl<T> Lease<'_, T> {
    /// Returns the healthy instance to the pool.
    pub fn give_back(mut self) {
        if let Some(t) = self.item.take() {
            self.pool.put(t);
        }
    }

    /// Drops the instance (it trapped); the pool builds a fresh one when needed.
    pub fn discard(mut self) {
        if self.item.take().is_some() {
            self.pool.discard();
        }
    }
}

impl<T> std::ops::Deref for Lease<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.item
            .as_ref()
            .expect("a lease holds its item until it ends")
    }
}

impl<T> std::ops::DerefMut for Lease<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.item
            .as_mut()
            .expect("a lease holds its item until it ends")
    }
}

impl<T> Drop for Lease<'_, T> {
    fn drop(&mut self) {
        if self.item.take().is_some() {
            self.pool.discard();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn reuses_idle_and_rebuilds_after_discard() {
        let built = AtomicUsize::new(0);
        let make = || -> Result<usize, ()> { Ok(built.fetch_add(1, Ordering::SeqCst)) };
        let pool = Pool::new(2);
        let a = pool.take(make).unwrap();
        pool.put(a);
        assert_eq!(pool.take(make).unwrap(), a, "idle instance reused");
        pool.discard();
        assert_eq!(pool.live(), 0);
        assert_eq!(pool.take(make).unwrap(), 1, "a fresh one after a discard");
        assert!(pool.take(|| Err::<usize, ()>(())).is_err());
        assert_eq!(pool.live(), 1, "a failed build does not count");
    }

    #[test]
    fn a_dropped_lease_frees_its_slot() {
        let pool = Pool::new(1);
        let lease = pool.lease(|| Ok::<_, ()>(7)).unwrap();
        assert_eq!(*lease, 7);
        drop(lease);
        assert_eq!(pool.live(), 0);
        pool.lease(|| Ok::<_, ()>(8)).unwrap().give_back();
        assert_eq!(pool.live(), 1);
        pool.lease(|| Ok::<_, ()>(9)).unwrap().discard();
        assert_eq!(pool.live(), 0);
    }

    #[test]
    fn never_exceeds_max_live_across_threads() {
        let pool = Arc::new(Pool::new(2));
        let live_now = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..6)
            .map(|_| {
                let (pool, live_now, peak) = (pool.clone(), live_now.clone(), peak.clone());
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        let t = pool.take(|| Ok::<_, ()>(0u8)).unwrap();
                        let n = live_now.fetch_add(1, Ordering::SeqCst) + 1;
                        peak.fetch_max(n, Ordering::SeqCst);
                        std::thread::yield_now();
                        live_now.fetch_sub(1, Ordering::SeqCst);
                        pool.put(t);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(peak.load(Ordering::SeqCst) <= 2);
        assert!(pool.live() <= 2);
    }
}
