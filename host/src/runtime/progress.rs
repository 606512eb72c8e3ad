//! The progress bar of long runs (indicatif, on stderr): requests done, generated tokens per
//! second and ETA. Hidden unless asked for and stderr is a terminal, so piped output and
//! tests stay clean.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A run's progress display.
pub struct Progress {
    bar: ProgressBar,
    start: Instant,
    tokens: u64,
}

impl Progress {
    /// A bar over `total` requests; hidden when `show` is false or stderr is not a terminal.
    pub fn new(total: usize, show: bool) -> Progress {
        let bar = if show && std::io::stderr().is_terminal() {
            ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        let style = ProgressStyle::with_template(
            "{bar:30.cyan/blue} {pos}/{len} requests  {msg}  elapsed {elapsed}  ETA {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        if !bar.is_hidden() {
            bar.enable_steady_tick(Duration::from_millis(500));
        }
        Progress {
            bar,
            start: Instant::now(),
            tokens: 0,
        }
    }

    /// A request finished with `tokens` generated tokens.
    pub fn request_done(&mut self, tokens: usize) {
        self.tokens += tokens as u64;
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        self.bar
            .set_message(format!("{:.1} tok/s", self.tokens as f64 / secs));
        self.bar.inc(1);
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
