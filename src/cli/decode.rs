//! `kvferry decode` (see the module docs of the node).

use std::process::ExitCode;

pub fn main(_argv: &[String]) -> ExitCode {
    eprintln!("kvferry decode: not implemented yet");
    ExitCode::from(2)
}
