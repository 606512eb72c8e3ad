//! Models: file loaders, tokenizer, chat templates and one file per architecture.
