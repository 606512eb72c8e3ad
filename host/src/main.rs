//! The `deepinfer` binary: everything lives in the library's `cli` module.

fn main() -> std::process::ExitCode {
    match deepinfer::cli::main() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", deepinfer::cli::error_chain(&e));
            std::process::ExitCode::FAILURE
        }
    }
}
