//! Usage errors: what a command prints when its arguments do not make
//! sense together, and the status it exits with (2).

use std::process::ExitCode;

/// A usage error found after parsing (a value out of range given the
/// others), printed as one line before exiting with status 2.
#[derive(Debug)]
pub(crate) struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Prints `reason` as exactly one line after `command` and returns the
/// usage-error status.
pub(crate) fn usage_error(command: &str, reason: &str) -> ExitCode {
    let line: String = reason
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    eprintln!("{command}: {line}");
    ExitCode::from(2)
}
