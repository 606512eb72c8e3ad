//! Answer extraction and scoring. pass@1 is the mean accuracy over every sample (not "any
//! sample right"); its standard error treats questions as the unit (the spread of per-question
//! accuracies), so k samples of one question are not counted as k independent trials.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::tasks::AnswerKind;

/// One generated sample, as `eval generate` writes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub task_id: String,
    pub sample: usize,
    pub seed: u64,
    pub question: String,
    pub answer: String,
    pub kind: AnswerKind,
    pub output: String,
}

/// Scores of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoreReport {
    pub questions: usize,
    pub samples: usize,
    /// Mean accuracy over all samples.
    pub pass_at_1: f64,
    /// Standard error of `pass_at_1` over questions.
    pub stderr: f64,
    /// Share of questions with at least one correct sample (pass@k), for contrast.
    pub any_correct: f64,
}

fn last_number(text: &str) -> Option<f64> {
    let mut best = None;
    let bytes: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let start_neg = bytes[i] == '-' && i + 1 < bytes.len() && bytes[i + 1].is_ascii_digit();
        if bytes[i].is_ascii_digit() || start_neg {
            let mut j = i + 1;
            while j < bytes.len()
                && (bytes[j].is_ascii_digit() || bytes[j] == ',' || bytes[j] == '.')
            {
                j += 1;
            }
            let s: String = bytes[i..j].iter().filter(|&&c| c != ',').collect();
            let s = s.trim_end_matches('.');
            if let Ok(v) = s.parse::<f64>() {
                best = Some(v);
            }
            i = j;
        } else {
            i += 1;
        }
    }
    best
}

/// The chosen option: "(X)" anywhere, else a line starting "X)", "X." or "X:", else an output
/// that is a bare letter. (A lone "A" or "I" inside prose is an article or a pronoun.)
fn choice_letter(output: &str) -> Option<String> {
    let chars: Vec<char> = output.chars().collect();
    for w in chars.windows(3) {
        if w[0] == '(' && w[1].is_ascii_uppercase() && w[2] == ')' {
            return Some(w[1].to_string());
        }
    }
    for line in output.lines().map(str::trim) {
        let mut it = line.chars();
        if let (Some(c), Some(p)) = (it.next(), it.next()) {
            if c.is_ascii_uppercase() && matches!(p, ')' | '.' | ':') {
                return Some(c.to_string());
            }
        }
    }
    let t = output.trim().trim_end_matches('.');
    (t.len() == 1 && t.chars().all(|c| c.is_ascii_uppercase())).then(|| t.to_string())
}

fn normalize(s: &str) -> String {
    s.trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || c.is_whitespace())
        .collect::<String>()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// The answer found in `output`, normalized for comparison.
pub fn extract_answer(kind: AnswerKind, output: &str) -> Option<String> {
    match kind {
        AnswerKind::Numeric => last_number(output).map(|v| format!("{v}")),
        AnswerKind::Exact => {
            let line = output.lines().map(str::trim).find(|l| !l.is_empty())?;
            Some(normalize(line))
        }
        AnswerKind::Choice => choice_letter(output),
    }
}

fn is_correct(s: &Sample) -> bool {
    let want = match s.kind {
        AnswerKind::Numeric => s.answer.trim().parse::<f64>().ok().map(|v| format!("{v}")),
        AnswerKind::Exact => Some(normalize(&s.answer)),
        AnswerKind::Choice => Some(s.answer.trim().to_uppercase()),
    };
    want.is_some() && extract_answer(s.kind, &s.output) == want
}

/// Scores samples; `None` when there are none.
pub fn score_samples(samples: &[Sample]) -> Option<ScoreReport> {
    if samples.is_empty() {
        return None;
    }
    let mut per_q: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    let mut correct = 0usize;
    for s in samples {
        let ok = is_correct(s);
        correct += ok as usize;
        let e = per_q.entry(&s.task_id).or_default();
        e.0 += ok as usize;
        e.1 += 1;
    }
    let acc: Vec<f64> = per_q.values().map(|&(c, n)| c as f64 / n as f64).collect();
    let q = acc.len();
    let mean_q = acc.iter().sum::<f64>() / q as f64;
    let stderr = if q > 1 {
        let var = acc.iter().map(|a| (a - mean_q).powi(2)).sum::<f64>() / (q - 1) as f64;
        (var / q as f64).sqrt()
    } else {
        0.0
    };
    Some(ScoreReport {
        questions: q,
        samples: samples.len(),
        pass_at_1: correct as f64 / samples.len() as f64,
        stderr,
        any_correct: per_q.values().filter(|&&(c, _)| c > 0).count() as f64 / q as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(task: &str, kind: AnswerKind, answer: &str, output: &str) -> Sample {
        Sample {
            task_id: task.into(),
            sample: 0,
            seed: 0,
            question: String::new(),
            answer: answer.into(),
            kind,
            output: output.into(),
        }
    }

    #[test]
    fn extraction() {
        assert_eq!(
            extract_answer(AnswerKind::Numeric, "3 + 4 = 7. So the answer is 7."),
            Some("7".into())
        );
        assert_eq!(
            extract_answer(AnswerKind::Numeric, "It costs 1,200 dollars"),
            Some("1200".into())
        );
        assert_eq!(
            extract_answer(AnswerKind::Numeric, "minus -3"),
            Some("-3".into())
        );
        assert_eq!(extract_answer(AnswerKind::Numeric, "none"), None);
        assert_eq!(
            extract_answer(AnswerKind::Choice, "I think (B) is right"),
            Some("B".into())
        );
        assert_eq!(
            extract_answer(AnswerKind::Choice, "C. Paris"),
            Some("C".into())
        );
        assert_eq!(extract_answer(AnswerKind::Choice, " D "), Some("D".into()));
        assert_eq!(
            extract_answer(AnswerKind::Choice, "A cat is not an option"),
            None
        );
        assert_eq!(
            extract_answer(AnswerKind::Exact, "\n  Paris!\nmore"),
            Some("paris".into())
        );
    }

    #[test]
    fn pass_at_1_is_the_mean_over_samples_not_any_correct() {
        // q1: 1 of 4 right; q2: 4 of 4 right -> pass@1 = 5/8, any-correct = 1.0
        let mut v = Vec::new();
        for i in 0..4 {
            v.push(s(
                "q1",
                AnswerKind::Numeric,
                "5",
                if i == 0 { "5" } else { "6" },
            ));
            v.push(s("q2", AnswerKind::Numeric, "2", "it is 2"));
        }
        let r = score_samples(&v).unwrap();
        assert_eq!(r.pass_at_1, 5.0 / 8.0);
        assert_eq!(r.any_correct, 1.0);
        assert_eq!(r.questions, 2);
        // per-question accuracies 0.25 and 1.0: sd = 0.53033, se = sd / sqrt(2) = 0.375
        assert!((r.stderr - 0.375).abs() < 1e-9, "{}", r.stderr);
        assert!(score_samples(&[]).is_none());
    }
}
