//! The `kvferry` command-line tool. See `kvferry help`.

#![warn(missing_docs)]

mod bench;
mod bootstrap;
mod cli;
mod decode;
mod demo;
mod figures;
mod plan;
mod prefill;
mod shape;
mod signals;
mod soak;
mod store_demo;
mod store_serve;
mod usage;

use std::process::ExitCode;

fn main() -> ExitCode {
    kvferry_testkit::init_tracing();
    cli::run(std::env::args_os())
}
