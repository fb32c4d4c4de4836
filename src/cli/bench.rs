//! `kvferry bench ...` (filled by the transport work).
use std::process::ExitCode;
pub fn main(_argv: &[String]) -> ExitCode {
    eprintln!("kvferry bench: not built yet");
    ExitCode::from(2)
}
