//! Attention over the paged KV layout (block tables), with grouped-query heads.
