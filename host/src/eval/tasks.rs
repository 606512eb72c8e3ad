//! Task sets: a generated arithmetic word-problem set with known answers, or a user's JSONL.

use serde::{Deserialize, Serialize};

/// How an answer is compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AnswerKind {
    /// The last number in the output equals the answer.
    Numeric,
    /// The normalized output (or its last line) equals the normalized answer.
    Exact,
    /// The first standalone option letter (A, B, C, ...) equals the answer.
    Choice,
}

/// One question.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Task {
    pub id: String,
    pub question: String,
    pub answer: String,
    pub kind: AnswerKind,
}

const NAMES: &[&str] = &["Tom", "Ana", "Li", "Sara", "Omar", "Mia", "Ken", "Ivy"];
const THINGS: &[&str] = &["apples", "books", "coins", "pencils", "stickers", "marbles"];

/// `n` arithmetic word problems, the same for the same seed.
pub fn arithmetic_tasks(n: usize, seed: u64) -> Vec<Task> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let mut next = move |m: u64| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s % m
    };
    (0..n)
        .map(|i| {
            let name = NAMES[next(NAMES.len() as u64) as usize];
            let thing = THINGS[next(THINGS.len() as u64) as usize];
            let a = 2 + next(40) as i64;
            let b = 1 + next(20) as i64;
            let (question, answer) = match next(3) {
                0 => (format!("{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"), a + b),
                1 => {
                    let (hi, lo) = (a.max(b), a.min(b));
                    (format!("{name} has {hi} {thing} and gives away {lo}. How many {thing} are left?"), hi - lo)
                }
                _ => {
                    let (k, m) = (2 + next(8) as i64, 2 + next(9) as i64);
                    (format!("{name} buys {k} boxes with {m} {thing} in each box. How many {thing} is that in total?"), k * m)
                }
            };
            Task { id: format!("arith-{i}"), question, answer: answer.to_string(), kind: AnswerKind::Numeric }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_tasks_are_deterministic_and_consistent() {
        let a = arithmetic_tasks(30, 7);
        assert_eq!(a, arithmetic_tasks(30, 7));
        assert_ne!(a, arithmetic_tasks(30, 8));
        for t in &a {
            let nums: Vec<i64> = t
                .question
                .split(|c: char| !c.is_ascii_digit())
                .filter_map(|w| w.parse().ok())
                .collect();
            let ans: i64 = t.answer.parse().unwrap();
            assert!(
                ans == nums[0] + nums[1] || ans == nums[0] - nums[1] || ans == nums[0] * nums[1],
                "{t:?}"
            );
        }
    }
}
