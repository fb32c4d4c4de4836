//! Command-line entry points. Each subcommand lives in its own module and
//! returns an exit code; usage errors exit with status 2.

pub mod args;
pub mod bench;
pub mod bootstrap;
pub mod decode;
pub mod demo;
pub mod plan;
pub mod prefill;
pub mod soak;

use std::process::ExitCode;

const USAGE: &str = "\
kvferry — move KV caches from prefill to decode engines

usage: kvferry <command> [options]

commands:
  plan --spec FILE        print the transfer descriptors for a JSON spec
  bench transport ...     transport throughput and latency benchmark
  bootstrap [--listen ADDR]  standalone bootstrap service (default 0.0.0.0:8998)
  demo [options]          P and D nodes in one process, verified synthetic KV
  demo --soak SECONDS     thousands of requests in flight, random aborts, RSS check
  prefill --bootstrap ADDR --engine-id ID --tp-size N --tp-rank R [...]
                          one prefill rank serving synthetic KV until SIGTERM
  decode --bootstrap ADDR --engine-id ID --tp-size N --tp-rank R --requests K
                          one decode rank pulling K requests, JSON summary
  help                    this text
";

/// Logs go to stderr; `RUST_LOG` selects the level (default: warn).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Dispatches `argv` (without the program name) to a subcommand.
pub fn run(argv: Vec<String>) -> ExitCode {
    let Some((command, rest)) = argv.split_first() else {
        eprint!("{USAGE}");
        return ExitCode::from(2);
    };
    match command.as_str() {
        "plan" => plan::main(rest),
        "bench" => bench::main(rest),
        "bootstrap" => bootstrap::main(rest),
        "demo" => demo::main(rest),
        "prefill" => prefill::main(rest),
        "decode" => decode::main(rest),
        "help" | "--help" | "-h" => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        other => {
            eprintln!("kvferry: unknown command {other:?}\n");
            eprint!("{USAGE}");
            ExitCode::from(2)
        }
    }
}
