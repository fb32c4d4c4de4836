//! The command line: one clap parser for every subcommand. Each subcommand
//! lives in its own module and returns an exit code; usage errors exit with
//! status 2 and one line on stderr.

use std::ffi::OsString;
use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, Subcommand};

use crate::usage::usage_error;
use crate::{bench, bootstrap, decode, demo, plan, prefill, soak, store_serve};

/// kvferry: move KV caches from prefill to decode engines.
#[derive(Debug, Parser)]
#[command(name = "kvferry", version, arg_required_else_help = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// `allow_negative_numbers` on the commands with numeric options:
// `--tp-size -1` is a bad value for --tp-size, not an unknown option `-1`.
#[derive(Debug, Subcommand)]
enum Command {
    /// Print the transfer descriptors for a JSON spec.
    Plan(plan::PlanArgs),
    /// Benchmarks.
    #[command(subcommand, arg_required_else_help = true)]
    Bench(bench::BenchCommand),
    /// Standalone bootstrap service.
    Bootstrap(bootstrap::BootstrapArgs),
    /// P and D nodes in one process, verified synthetic KV; with --soak,
    /// thousands of requests in flight with random aborts and an RSS check.
    #[command(after_help = soak::defaults_help(), allow_negative_numbers = true)]
    Demo(demo::DemoArgs),
    /// One prefill rank serving synthetic KV until SIGTERM.
    #[command(allow_negative_numbers = true)]
    Prefill(prefill::PrefillArgs),
    /// One decode rank pulling K requests, JSON summary.
    #[command(allow_negative_numbers = true)]
    Decode(decode::DecodeArgs),
    /// The KV store engines offload to.
    #[command(subcommand, arg_required_else_help = true)]
    Store(store_serve::StoreCommand),
}

/// Parses `argv` (with the program name first) and runs the command.
pub(crate) fn run(argv: impl IntoIterator<Item = OsString>) -> ExitCode {
    let argv: Vec<OsString> = argv.into_iter().collect();
    let cli = match Cli::try_parse_from(&argv) {
        Ok(cli) => cli,
        Err(e) => return parse_failure(&e, &command_path(&argv)),
    };
    match cli.command {
        Command::Plan(a) => plan::main(&a),
        Command::Bench(c) => bench::main(&c),
        Command::Bootstrap(a) => bootstrap::main(&a),
        Command::Demo(a) => demo::main(&a),
        Command::Prefill(a) => prefill::main(&a),
        Command::Decode(a) => decode::main(&a),
        Command::Store(c) => store_serve::main(&c),
    }
}

/// Help and version go to stdout (exit 0); help asked for by a missing
/// command goes to stderr (exit 2); any other error is one line on stderr
/// after `command`, naming the problem (exit 2).
fn parse_failure(e: &clap::Error, command: &str) -> ExitCode {
    let text = e.render().to_string();
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            eprint!("{text}");
            ExitCode::from(2)
        }
        _ => usage_error(
            command,
            &format!("{} (see {command} --help)", one_line(&text)),
        ),
    }
}

/// The problem a rendered clap error names: its message block with the
/// continuation lines joined and the tips left out.
fn one_line(text: &str) -> String {
    text.lines()
        .take_while(|l| !l.trim().is_empty())
        .map(|l| l.trim().trim_start_matches("error: "))
        .filter(|l| !l.starts_with("tip:"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The (sub)commands `argv` names before its first option, such as
/// `kvferry bench transport`.
fn command_path(argv: &[OsString]) -> String {
    let mut command = Cli::command();
    let mut path = vec!["kvferry".to_string()];
    for arg in argv.iter().skip(1).map_while(|a| a.to_str()) {
        let Some(sub) = command.find_subcommand(arg).cloned() else {
            break;
        };
        path.push(arg.to_string());
        command = sub;
    }
    path.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parser_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn an_error_is_one_line_naming_the_command() {
        let argv = ["kvferry", "demo", "--layout", "diagonal"].map(OsString::from);
        assert_eq!(command_path(&argv), "kvferry demo");
        let e = Cli::try_parse_from(&argv).unwrap_err();
        let reason = one_line(&e.render().to_string());
        assert!(reason.contains("'diagonal'"), "{reason}");
        assert!(reason.contains("--layout"), "{reason}");
        assert!(!reason.contains('\n'), "{reason}");
    }
}
