//! The free list of the block pool: an intrusive doubly linked list over block indices, so a
//! block can leave from the middle in O(1) when a prefix hit revives it. The front is evicted
//! first. It knows nothing of reference counts or hashes.

const NIL: u32 = u32::MAX;

/// An ordered set of block indices with O(1) push at both ends, pop at the front and removal
/// of any member.
#[derive(Debug, Clone)]
pub(crate) struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    member: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    /// A queue holding every index in `0..capacity`, in increasing order.
    pub(crate) fn full(capacity: u32) -> FreeQueue {
        let mut q = FreeQueue {
            prev: vec![NIL; capacity as usize],
            next: vec![NIL; capacity as usize],
            member: vec![false; capacity as usize],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for i in 0..capacity {
            q.push_back(i);
        }
        q
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn contains(&self, i: u32) -> bool {
        self.member.get(i as usize).copied().unwrap_or(false)
    }

    /// Appends `i` at the back (evicted last). `i` must not be in the queue.
    pub(crate) fn push_back(&mut self, i: u32) {
        assert!(!self.contains(i), "block {i} is already free");
        let iu = i as usize;
        self.prev[iu] = self.tail;
        self.next[iu] = NIL;
        if self.tail == NIL {
            self.head = i;
        } else {
            self.next[self.tail as usize] = i;
        }
        self.tail = i;
        self.member[iu] = true;
        self.len += 1;
    }

    /// Inserts `i` at the front (evicted first). `i` must not be in the queue.
    pub(crate) fn push_front(&mut self, i: u32) {
        assert!(!self.contains(i), "block {i} is already free");
        let iu = i as usize;
        self.next[iu] = self.head;
        self.prev[iu] = NIL;
        if self.head == NIL {
            self.tail = i;
        } else {
            self.prev[self.head as usize] = i;
        }
        self.head = i;
        self.member[iu] = true;
        self.len += 1;
    }

    pub(crate) fn pop_front(&mut self) -> Option<u32> {
        if self.head == NIL {
            return None;
        }
        let i = self.head;
        self.remove(i);
        Some(i)
    }

    /// Takes `i` out of the queue; false when it was not in it.
    pub(crate) fn remove(&mut self, i: u32) -> bool {
        if !self.contains(i) {
            return false;
        }
        let iu = i as usize;
        let (p, n) = (self.prev[iu], self.next[iu]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[iu] = NIL;
        self.next[iu] = NIL;
        self.member[iu] = false;
        self.len -= 1;
        true
    }

    /// Members from front to back.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let i = cur;
            cur = self.next[i as usize];
            Some(i)
        })
    }

    /// Checks that the links, the membership flags and the length agree.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut seen = vec![false; self.member.len()];
        let mut prev = NIL;
        let mut count = 0usize;
        for i in self.iter() {
            let iu = i as usize;
            if seen[iu] {
                return Err(format!("free queue visits block {i} twice"));
            }
            seen[iu] = true;
            if !self.member[iu] {
                return Err(format!("block {i} is linked but not marked free"));
            }
            if self.prev[iu] != prev {
                return Err(format!("block {i} has a wrong back link"));
            }
            prev = i;
            count += 1;
            if count > self.member.len() {
                return Err("free queue has a cycle".into());
            }
        }
        if prev != self.tail {
            return Err("free queue tail is wrong".into());
        }
        if count != self.len {
            return Err(format!(
                "free queue length {} but {} linked",
                self.len, count
            ));
        }
        if seen != self.member {
            return Err("a block is marked free but not linked".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn removal_from_the_middle_keeps_order() {
        let mut q = FreeQueue::full(5);
        assert!(q.remove(2));
        assert!(!q.remove(2));
        q.push_front(2);
        q.remove(4);
        q.push_back(4);
        assert_eq!(q.iter().collect::<Vec<_>>(), vec![2, 0, 1, 3, 4]);
        assert_eq!(q.pop_front(), Some(2));
        assert_eq!(q.len(), 4);
        q.check().unwrap();
    }

    proptest! {
        /// Random operations agree with a plain `VecDeque` model.
        #[test]
        fn matches_a_vecdeque(ops in proptest::collection::vec((0u8..4, 0u32..12), 0..200)) {
            let mut q = FreeQueue::full(12);
            let mut model: std::collections::VecDeque<u32> = (0..12).collect();
            for (op, i) in ops {
                match op {
                    0 => prop_assert_eq!(q.pop_front(), model.pop_front()),
                    1 => {
                        let was = model.iter().position(|&x| x == i);
                        if let Some(p) = was { model.remove(p); }
                        prop_assert_eq!(q.remove(i), was.is_some());
                    }
                    2 if !model.contains(&i) => { q.push_back(i); model.push_back(i); }
                    3 if !model.contains(&i) => { q.push_front(i); model.push_front(i); }
                    _ => {}
                }
                prop_assert!(q.check().is_ok());
                prop_assert_eq!(q.iter().collect::<Vec<_>>(), model.iter().copied().collect::<Vec<_>>());
            }
        }
    }
}
