//! `deepinfer eval generate|score|ppl`: generation writes samples, scoring is a separate step.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};

use crate::backend::Device;
use crate::eval::{arithmetic_tasks, perplexity, score_samples, Sample, Task};
use crate::model::chat::Message;
use crate::model::fetch::resolve_model;
use crate::runtime::{EngineOptions, Llm, PromptInput, Request};
use crate::sampling::{NativeSampler, SamplingParams};

#[derive(Debug, clap::Args)]
pub struct EvalArgs {
    #[command(subcommand)]
    pub command: EvalCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum EvalCommand {
    /// Generate k samples per question and write them as JSONL (seeds recorded).
    Generate {
        /// A JSONL task file ({"id","question","answer","kind": numeric|exact|choice});
        /// default: the generated arithmetic word problems.
        #[arg(long)]
        tasks: Option<PathBuf>,
        /// Questions of the generated set.
        #[arg(long, default_value_t = 20)]
        questions: usize,
        /// Samples per question.
        #[arg(long, short = 'k', default_value_t = 4)]
        k: usize,
        #[arg(long, default_value_t = 0.7)]
        temperature: f32,
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        /// Base seed: sample j of question i uses seed + i * k + j.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, short = 'o')]
        output: PathBuf,
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, value_parser = super::at_least::<1>)]
        threads: Option<usize>,
    },
    /// Score a samples file: pass@1 (mean over samples) with its standard error.
    Score { samples: PathBuf },
    /// Perplexity of a text file under the model.
    Ppl {
        text: PathBuf,
        /// Tokens per scoring window (at least 2: a window scores each token after its first;
        /// one longer than the model's context is cut to it).
        #[arg(long, default_value_t = 512, value_parser = super::at_least::<2>)]
        window: usize,
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, value_parser = super::at_least::<1>)]
        threads: Option<usize>,
    },
}

fn device(threads: Option<usize>) -> Device {
    threads.map_or_else(Device::cpu_all, |threads| Device::Cpu { threads })
}

pub fn run(a: EvalArgs) -> anyhow::Result<()> {
    match a.command {
        EvalCommand::Generate {
            tasks,
            questions,
            k,
            temperature,
            max_tokens,
            seed,
            output,
            model,
            threads,
        } => {
            // Every request is built up front: a typo such as `-k 100000000000` is refused
            // here, not met by the allocator.
            const MAX_SAMPLES: usize = 1 << 20;
            if tasks.is_none() && questions > MAX_SAMPLES {
                bail!("--questions {questions}: at most {MAX_SAMPLES}");
            }
            let tasks = match tasks {
                Some(p) => crate::files::read_jsonl::<Task>(&p, "a task")?,
                None => arithmetic_tasks(questions, seed),
            };
            if tasks.is_empty() || k == 0 {
                bail!("nothing to generate: {} tasks, k = {k}", tasks.len());
            }
            if tasks.len().saturating_mul(k) > MAX_SAMPLES {
                bail!(
                    "{} tasks x k = {k} samples is more than the {MAX_SAMPLES} one run takes",
                    tasks.len()
                );
            }
            let path = resolve_model(model.as_deref(), &mut |m| eprintln!("deepinfer: {m}"))?;
            let loaded = crate::model::load(&path, device(threads))?;
            let llm = Llm::new(
                loaded,
                Arc::new(NativeSampler),
                EngineOptions {
                    seed,
                    ..Default::default()
                },
            )?;
            let mut requests = Vec::new();
            for (i, t) in tasks.iter().enumerate() {
                for j in 0..k {
                    let content = format!(
                        "{}\nAnswer with the final number or option only.",
                        t.question
                    );
                    requests.push(Request::new(
                        format!("{}#{j}", t.id),
                        PromptInput::Chat(vec![Message {
                            role: "user".into(),
                            content,
                        }]),
                        SamplingParams {
                            temperature,
                            max_tokens,
                            seed: Some(seed.wrapping_add((i * k + j) as u64)),
                            ..Default::default()
                        },
                    ));
                }
            }
            let mut out = std::io::BufWriter::new(
                std::fs::File::create(&output)
                    .with_context(|| format!("creating {}", output.display()))?,
            );
            let results = llm.generate(&requests, &mut |_| {});
            for (idx, (r, res)) in requests.iter().zip(&results).enumerate() {
                let t = &tasks[idx / k];
                let sample = Sample {
                    task_id: t.id.clone(),
                    sample: idx % k,
                    seed: r.params.seed.unwrap_or(0),
                    question: t.question.clone(),
                    answer: t.answer.clone(),
                    kind: t.kind,
                    output: res.text.clone(),
                };
                writeln!(out, "{}", serde_json::to_string(&sample)?)?;
            }
            out.flush()?;
            eprintln!(
                "deepinfer: wrote {} samples ({} questions x {k}) to {}",
                results.len(),
                tasks.len(),
                output.display()
            );
            Ok(())
        }
        EvalCommand::Score { samples } => {
            let parsed: Vec<Sample> = crate::files::read_jsonl(&samples, "a sample")?;
            let r = score_samples(&parsed).context("the samples file is empty")?;
            println!("{}", serde_json::to_string(&r)?);
            eprintln!(
                "pass@1 = {:.3} ± {:.3} (mean over {} samples of {} questions; any-correct {:.3})",
                r.pass_at_1, r.stderr, r.samples, r.questions, r.any_correct
            );
            Ok(())
        }
        EvalCommand::Ppl {
            text,
            window,
            model,
            threads,
        } => {
            let path = resolve_model(model.as_deref(), &mut |m| eprintln!("deepinfer: {m}"))?;
            let loaded = crate::model::load(&path, device(threads))?;
            let body = crate::files::read_text_bounded(&text, crate::files::ASSET_MAX)
                .with_context(|| format!("reading {}", text.display()))?;
            let ids = loaded.tokenizer.encode(&body)?;
            let p = perplexity(loaded.model.as_ref(), &ids, window)?;
            println!("{}", serde_json::to_string(&p)?);
            eprintln!("perplexity {:.3} over {} tokens", p.ppl, p.tokens_scored);
            Ok(())
        }
    }
}
