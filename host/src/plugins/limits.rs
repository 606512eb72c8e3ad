//! What a plugin instance may use (memory, time, tables, instances) and what it did: the
//! store's data, its resource limiter, the host's `log` import, and the translation of a failed
//! call into an error message that says which limit was hit.

use wasmtime::{ResourceLimiter, StoreLimits, StoreLimitsBuilder, Trap};

use crate::config::PluginConfig;

/// Wasm stack per call, in bytes (engine-wide). Deeper recursion traps as a stack overflow.
pub const MAX_WASM_STACK: usize = 512 << 10;
/// Epoch ticks per millisecond of the ticker thread.
pub const TICK: std::time::Duration = std::time::Duration::from_millis(1);
/// Log lines kept per call, and bytes per line.
const MAX_LOG_LINES: u32 = 16;
const MAX_LOG_BYTES: usize = 1024;

/// One plugin's limits, resolved from its `[plugins.NAME]` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PluginLimits {
    /// Most linear memory per instance, in MiB.
    pub memory_mib: u32,
    /// Most wall time per call, in ms (enforced by epoch interruption; granularity 1 ms).
    pub time_limit_ms: u32,
    /// Most live instances (so the most concurrent calls).
    pub pool_size: u32,
}

impl Default for PluginLimits {
    fn default() -> Self {
        PluginLimits {
            memory_mib: 64,
            time_limit_ms: 100,
            pool_size: 4,
        }
    }
}

impl PluginLimits {
    pub fn from_config(c: Option<&PluginConfig>) -> Self {
        let d = PluginLimits::default();
        let Some(c) = c else { return d };
        PluginLimits {
            memory_mib: c.memory_mib.unwrap_or(d.memory_mib),
            time_limit_ms: c.time_limit_ms.unwrap_or(d.time_limit_ms),
            pool_size: c.pool_size.unwrap_or(d.pool_size),
        }
    }

    /// Epoch ticks before a call is interrupted: the limit, plus one for the partial tick.
    pub fn deadline_ticks(&self) -> u64 {
        self.time_limit_ms as u64 / TICK.as_millis().max(1) as u64 + 1
    }
}

/// A store's data: the limiter and what the current call did.
pub struct PluginState {
    plugin: std::sync::Arc<str>,
    limits: StoreLimits,
    memory_mib: u32,
    memory_denied: bool,
    log_lines: u32,
    last_panic: Option<String>,
}

impl PluginState {
    pub fn new(plugin: std::sync::Arc<str>, limits: &PluginLimits) -> Self {
        PluginState {
            plugin,
            limits: StoreLimitsBuilder::new()
                .memory_size(limits.memory_mib as usize * (1 << 20))
                .memories(4)
                .tables(16)
                .table_elements(1 << 16)
                .instances(16)
                .trap_on_grow_failure(true)
                .build(),
            memory_mib: limits.memory_mib,
            memory_denied: false,
            log_lines: 0,
            last_panic: None,
        }
    }

    /// Forgets what the previous call did.
    pub fn begin_call(&mut self) {
        self.memory_denied = false;
        self.log_lines = 0;
        self.last_panic = None;
    }

    /// Says why a call failed, naming the limit it hit where one did.
    pub fn describe_failure(&self, err: &wasmtime::Error, time_limit_ms: u32) -> String {
        if self.memory_denied {
            return format!("exceeded its memory limit of {} MiB", self.memory_mib);
        }
        match err.downcast_ref::<Trap>() {
            Some(Trap::Interrupt) => format!("exceeded its time limit of {time_limit_ms} ms"),
            Some(Trap::StackOverflow) => {
                format!("overflowed its stack ({} KiB)", MAX_WASM_STACK >> 10)
            }
            Some(Trap::UnreachableCodeReached) => match &self.last_panic {
                Some(msg) => format!("panicked ({msg})"),
                None => "trapped: wasm `unreachable` executed (a panic or abort)".into(),
            },
            Some(trap) => format!("trapped: {trap}"),
            None => format!("call failed: {err}"),
        }
    }

    /// The host's `log` import.
    fn log(&mut self, level: tracing::Level, message: &str) {
        if message.starts_with("panic: ") {
            let mut m = message.trim_start_matches("panic: ").to_string();
            truncate(&mut m, MAX_LOG_BYTES);
            self.last_panic = Some(m);
        }
        self.log_lines += 1;
        if self.log_lines > MAX_LOG_LINES {
            return;
        }
        let mut m = message.to_string();
        truncate(&mut m, MAX_LOG_BYTES);
        let plugin = &*self.plugin;
        match level {
            tracing::Level::ERROR => tracing::error!(plugin, "{m}"),
            tracing::Level::WARN => tracing::warn!(plugin, "{m}"),
            tracing::Level::INFO => tracing::info!(plugin, "{m}"),
            tracing::Level::DEBUG => tracing::debug!(plugin, "{m}"),
            _ => tracing::trace!(plugin, "{m}"),
        }
    }
}

fn truncate(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
}

impl ResourceLimiter for PluginState {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let r = self.limits.memory_growing(current, desired, maximum);
        if !matches!(r, Ok(true)) {
            self.memory_denied = true;
        }
        r
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.memory_denied = true;
        self.limits.memory_grow_failed(error)
    }

    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.limits.table_grow_failed(error)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.limits.table_growing(current, desired, maximum)
    }

    fn instances(&self) -> usize {
        self.limits.instances()
    }

    fn tables(&self) -> usize {
        self.limits.tables()
    }

    fn memories(&self) -> usize {
        self.limits.memories()
    }
}

/// Host imports shared by every world of ABI 0.1.
pub mod imports_v0_1 {
    use super::PluginState;
    use crate::plugins::bindings::v0_1::sampler::deepinfer::plugin::{host, types};

    impl types::Host for PluginState {}

    impl host::Host for PluginState {
        fn log(&mut self, level: host::LogLevel, message: String) {
            let level = match level {
                host::LogLevel::Error => tracing::Level::ERROR,
                host::LogLevel::Warn => tracing::Level::WARN,
                host::LogLevel::Info => tracing::Level::INFO,
                host::LogLevel::Debug => tracing::Level::DEBUG,
                host::LogLevel::Trace => tracing::Level::TRACE,
            };
            PluginState::log(self, level, &message);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_come_from_config_with_defaults() {
        let c = PluginConfig {
            memory_mib: Some(8),
            ..Default::default()
        };
        let l = PluginLimits::from_config(Some(&c));
        assert_eq!(
            l,
            PluginLimits {
                memory_mib: 8,
                ..Default::default()
            }
        );
        assert_eq!(
            PluginLimits {
                time_limit_ms: 20,
                ..l
            }
            .deadline_ticks(),
            21
        );
    }

    #[test]
    fn long_log_lines_are_cut_on_a_char_boundary() {
        let mut s = "é".repeat(600);
        truncate(&mut s, 1023);
        assert!(s.len() <= 1026 && s.ends_with('…'));
    }
}
