//! `kvferry plan --spec FILE`: prints the descriptors the planner produces
//! for a JSON spec (`-` reads the spec from stdin). A bad spec exits with
//! status 2 and a one-line reason on stderr.

use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use self::spec::{plan_from_json, write_plan_json, SpecError};
use clap::Args;

use crate::usage::usage_error;

pub(crate) mod spec;

/// The options of `kvferry plan`.
#[derive(Clone, Debug, Args)]
pub(crate) struct PlanArgs {
    /// The JSON spec (- reads it from stdin).
    #[arg(long, value_name = "FILE")]
    spec: PathBuf,
}

/// Entry point of `kvferry plan`.
pub(crate) fn main(a: &PlanArgs) -> ExitCode {
    let path = a.spec.as_path();
    let text = match read_spec(path) {
        Ok(text) => text,
        Err(e) => return fail(&format!("{}: {}", path.display(), SpecError::Io(e))),
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

fn read_spec(path: &std::path::Path) -> io::Result<String> {
    if path.as_os_str() == "-" {
        let mut text = String::new();
        io::stdin().read_to_string(&mut text)?;
        Ok(text)
    } else {
        std::fs::read_to_string(path)
    }
}

/// Prints `reason` as exactly one line and returns the usage-error status.
fn fail(reason: &str) -> ExitCode {
    usage_error("kvferry plan", reason)
}
