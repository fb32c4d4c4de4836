//! `kvferry plan --spec FILE`: prints the descriptors the planner produces
//! for a JSON spec (`-` reads the spec from stdin). A bad spec exits with
//! status 2 and a one-line reason on stderr.

use crate::cli::args::Args;
use crate::plan::{plan_from_json, write_plan_json, SpecError};
use std::io::{self, Read, Write};
use std::process::ExitCode;

const USAGE: &str = "usage: kvferry plan --spec FILE   (FILE may be - for stdin)";

/// Entry point of `kvferry plan`.
pub fn main(argv: &[String]) -> ExitCode {
    let args = match Args::parse(argv, &[]).and_then(|a| a.reject_unknown(&["spec"]).map(|()| a)) {
        Ok(args) => args,
        Err(e) => return fail(&format!("{e}; {USAGE}")),
    };
    if !args.positional().is_empty() {
        return fail(&format!("unexpected argument {:?}; {USAGE}", args.positional()[0]));
    }
    let Some(path) = args.get_str("spec") else {
        return fail(&format!("--spec is required; {USAGE}"));
    };
    let text = match read_spec(path) {
        Ok(text) => text,
        Err(e) => return fail(&SpecError::Io(e).to_string()),
    };
    let plan = match plan_from_json(&text) {
        Ok(plan) => plan,
        Err(e) => return fail(&e.to_string()),
    };
    let stdout = io::stdout();
    let mut out = io::BufWriter::new(stdout.lock());
    match write_plan_json(&plan, &mut out).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        // A closed pipe (`kvferry plan ... | head`) is not worth a panic.
        Err(e) => {
            eprintln!("kvferry plan: cannot write output: {e}");
            ExitCode::FAILURE
        }
    }
}

fn read_spec(path: &str) -> io::Result<String> {
    if path == "-" {
        let mut text = String::new();
        io::stdin().read_to_string(&mut text)?;
        Ok(text)
    } else {
        std::fs::read_to_string(path)
    }
}

/// Prints `reason` as exactly one line and returns the usage-error status.
fn fail(reason: &str) -> ExitCode {
    let line: String = reason
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    eprintln!("kvferry plan: {line}");
    ExitCode::from(2)
}
