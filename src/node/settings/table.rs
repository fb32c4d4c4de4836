//! docs/config.md's table of keys, made from the keys' declarations.

use super::{NodeSettings, SETTINGS};
use crate::node::{NodeConfig, Role};

/// Keys a config cannot be built without ([`NodeSettings::build`]).
const REQUIRED: [&str; 2] = ["role", "engine_id"];

impl NodeSettings {
    /// One Markdown table row per key, under its header: the key, the
    /// [`NodeConfig`] field it sets, its default, what it means and what
    /// the connectors kvferry replaces use for it (the two paragraphs of
    /// its doc comment). docs/config.md holds exactly this text.
    pub fn markdown_table() -> String {
        let defaults = serde_json::to_value(NodeSettings::of(&NodeConfig::new(
            Role::Prefill,
            String::new(),
        )))
        .expect("settings serialize");
        let mut out = String::from(
            "| settings key | `NodeConfig` field | default | what it sets | in the connectors kvferry replaces |\n\
             |---|---|---|---|---|\n",
        );
        for s in SETTINGS {
            let (meaning, replaces) = paragraphs(s.doc);
            let default = if REQUIRED.contains(&s.key) {
                "required".to_string()
            } else {
                shown(&defaults[s.key])
            };
            out += &format!(
                "| `{}` | `{}` | {default} | {meaning} | {replaces} |\n",
                s.key,
                s.field.replace(' ', ""),
            );
        }
        out
    }
}

/// A doc comment's first paragraph and its `Replaces:` paragraph, each
/// on one line.
fn paragraphs(doc: &str) -> (String, String) {
    let mut meaning = Vec::new();
    let mut replaces = Vec::new();
    let mut into_replaces = false;
    for line in doc.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("Replaces:") {
            into_replaces = true;
            replaces.push(rest.trim());
        } else if !line.is_empty() {
            if into_replaces {
                replaces.push(line);
            } else {
                meaning.push(line);
            }
        }
    }
    let cell = |words: Vec<&str>| words.join(" ").replace('|', "\\|");
    (cell(meaning), cell(replaces))
}

/// A default as the table shows it.
fn shown(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "none".into(),
        serde_json::Value::String(s) => format!("`{s}`"),
        other => format!("`{other}`"),
    }
}
