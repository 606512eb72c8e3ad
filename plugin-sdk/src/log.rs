//! Logging through the host: the one import a plugin has. Outside the sandbox (native tests)
//! lines go to stderr.

/// How important a log line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

/// Writes a line to the host's log. The host keeps a few lines per call and truncates long ones.
pub fn log(level: Level, message: &str) {
    #[cfg(target_arch = "wasm32")]
    {
        use crate::bindings::sampler::deepinfer::plugin::host::{self, LogLevel};
        let level = match level {
            Level::Error => LogLevel::Error,
            Level::Warn => LogLevel::Warn,
            Level::Info => LogLevel::Info,
            Level::Debug => LogLevel::Debug,
            Level::Trace => LogLevel::Trace,
        };
        host::log(level, message);
    }
    #[cfg(not(target_arch = "wasm32"))]
    eprintln!("[{level:?}] {message}");
}

pub fn error(message: &str) {
    log(Level::Error, message)
}

pub fn warn(message: &str) {
    log(Level::Warn, message)
}

pub fn info(message: &str) {
    log(Level::Info, message)
}

pub fn debug(message: &str) {
    log(Level::Debug, message)
}

/// Sends panic messages to the host before the instance traps, so the host's error says why.
/// The export macros install it on the first call.
pub(crate) fn install_panic_hook() {
    #[cfg(target_arch = "wasm32")]
    std::panic::set_hook(Box::new(|info| {
        error(&format!("panic: {info}"));
    }));
}
