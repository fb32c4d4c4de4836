//! A small `--flag value` parser, so the CLI needs no argument-parsing crate.

use std::collections::BTreeMap;
use std::str::FromStr;

/// Parsed `--name value` options and bare `--switch`es.
#[derive(Debug, Default)]
pub struct Args {
    values: BTreeMap<String, String>,
    switches: Vec<String>,
    positional: Vec<String>,
}

/// A usage error, printed as one line before exiting with status 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

impl Args {
    /// Parses `argv`. Names listed in `switches` take no value; every other
    /// `--name` takes the next argument (or `--name=value`).
    pub fn parse(argv: &[String], switches: &[&str]) -> Result<Args, UsageError> {
        let mut out = Args::default();
        let mut it = argv.iter();
        while let Some(arg) = it.next() {
            let Some(name) = arg.strip_prefix("--") else {
                out.positional.push(arg.clone());
                continue;
            };
            if let Some((name, value)) = name.split_once('=') {
                out.values.insert(name.to_string(), value.to_string());
            } else if switches.contains(&name) {
                out.switches.push(name.to_string());
            } else {
                let value = it
                    .next()
                    .ok_or_else(|| UsageError(format!("--{name} needs a value")))?;
                out.values.insert(name.to_string(), value.clone());
            }
        }
        Ok(out)
    }

    /// True if the bare switch `--name` was given.
    pub fn flag(&self, name: &str) -> bool {
        self.switches.iter().any(|s| s == name)
    }

    /// Positional (non-option) arguments, in order.
    pub fn positional(&self) -> &[String] {
        &self.positional
    }

    /// The raw value of `--name`, if given.
    pub fn get_str(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    /// `--name` parsed as `T`, or `default` when absent.
    pub fn get_or<T: FromStr>(&self, name: &str, default: T) -> Result<T, UsageError> {
        match self.values.get(name) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| UsageError(format!("--{name}: cannot parse {v:?}"))),
        }
    }

    /// Fails on any option not in `known`, so typos are not silently ignored.
    pub fn reject_unknown(&self, known: &[&str]) -> Result<(), UsageError> {
        for name in self.values.keys().chain(self.switches.iter()) {
            if !known.contains(&name.as_str()) {
                return Err(UsageError(format!("unknown option --{name}")));
            }
        }
        Ok(())
    }
}
