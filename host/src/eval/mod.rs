//! Evaluation: generation and scoring are separate steps. `generate` writes k samples per
//! question with their seeds; `score` extracts answers and reports pass@1 as the mean accuracy
//! over all samples with its standard error; `perplexity` scores a text under the model.

pub mod ppl;
pub mod score;
pub mod tasks;

pub use ppl::perplexity;
pub use score::{extract_answer, score_samples, Sample, ScoreReport};
pub use tasks::{arithmetic_tasks, AnswerKind, Task};
