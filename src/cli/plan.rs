//! `kvferry plan --spec FILE` (filled by the planner work).
use std::process::ExitCode;
pub fn main(_argv: &[String]) -> ExitCode {
    eprintln!("kvferry plan: not built yet");
    ExitCode::from(2)
}
