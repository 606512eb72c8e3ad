//! A small open-addressing map from token id to position among a row's candidates: built in
//! O(K), so penalties cost O(K + history) per row instead of a sort.

use deepinfer_plugin_sdk::TokenId;

const EMPTY: TokenId = TokenId::MAX;

#[derive(Debug, Default)]
pub(crate) struct IdIndex {
    slots: Vec<(TokenId, u32)>,
    mask: usize,
}

fn hash(id: TokenId) -> usize {
    ((id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize
}

impl IdIndex {
    /// Indexes `ids` by position; a repeated id keeps its first position.
    pub(crate) fn build(&mut self, ids: impl ExactSizeIterator<Item = TokenId>) {
        let cap = (ids.len() * 2).next_power_of_two().max(16);
        self.slots.clear();
        self.slots.resize(cap, (EMPTY, 0));
        self.mask = cap - 1;
        for (i, id) in ids.enumerate() {
            if id == EMPTY {
                continue;
            }
            let mut h = hash(id) & self.mask;
            loop {
                let slot = &mut self.slots[h];
                if slot.0 == EMPTY {
                    *slot = (id, i as u32);
                    break;
                }
                if slot.0 == id {
                    break;
                }
                h = (h + 1) & self.mask;
            }
        }
    }

    /// The position of `id`, if it was indexed.
    pub(crate) fn get(&self, id: TokenId) -> Option<usize> {
        if id == EMPTY || self.slots.is_empty() {
            return None;
        }
        let mut h = hash(id) & self.mask;
        loop {
            let (k, i) = self.slots[h];
            if k == id {
                return Some(i as usize);
            }
            if k == EMPTY {
                return None;
            }
            h = (h + 1) & self.mask;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_every_id_and_nothing_else() {
        let ids: Vec<TokenId> = (0..300).map(|i| i * 7 + 3).collect();
        let mut ix = IdIndex::default();
        ix.build(ids.iter().copied());
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(ix.get(id), Some(i));
        }
        assert_eq!(ix.get(4), None);
        assert_eq!(ix.get(EMPTY), None);
        ix.build([5, 5, 9].into_iter());
        assert_eq!(ix.get(5), Some(0));
    }
}
