//! The `kvferry` command-line tool. See `kvferry help`.

use std::process::ExitCode;

fn main() -> ExitCode {
    kvferry::cli::init_tracing();
    let argv: Vec<String> = std::env::args().skip(1).collect();
    kvferry::cli::run(argv)
}
