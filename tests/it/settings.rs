//! Node settings from JSON, TOML and `KVFERRY_*` variables, and the
//! reference table of `docs/config.md`.

use std::collections::BTreeSet;
use std::time::Duration;

use kvferry::node::{
    setting_keys, ConfigError, Node, NodeConfig, NodeSettings, Role, TransportKind,
};
use kvferry::transport::PollPolicy;
use kvferry::Mode;

const JSON: &str = r#"{
    "role": "decode", "engine_id": "d0", "dp_rank": 1, "tp_size": 4, "tp_rank": 3,
    "mode": "pull", "transport": "local", "host": "127.0.0.1", "lease_ms": 1500,
    "heartbeat_interval_ms": 250, "heartbeat_misses": 5, "tcp_streams": 2,
    "tcp_spin_us": 50, "data_plane_messages": false, "max_peers": 64
}"#;

fn check_decode(c: &NodeConfig) {
    assert_eq!((c.role, c.engine_id.as_str()), (Role::Decode, "d0"));
    assert_eq!((c.dp_rank, c.tp_size, c.tp_rank), (1, 4, 3));
    assert_eq!((c.mode, c.transport), (Mode::Pull, TransportKind::Local));
    assert_eq!(c.timeouts.lease, Duration::from_millis(1500));
    assert_eq!(c.timeouts.heartbeat_interval, Duration::from_millis(250));
    assert_eq!(c.timeouts.heartbeat_misses, 5);
    assert_eq!(c.tcp_streams, 2);
    let spin = Duration::from_micros(50);
    assert_eq!(c.tcp_poll, PollPolicy::Spin { spin });
    assert!(!c.data_plane_messages);
    assert_eq!(c.max_peers, 64);
    // What is not set keeps the default.
    let d = NodeConfig::new(Role::Decode, "d0");
    assert_eq!(c.timeouts.bootstrap_timeout, d.timeouts.bootstrap_timeout);
    assert_eq!(c.max_data_sessions, d.max_data_sessions);
}

#[test]
fn json_and_toml_give_the_same_config() {
    let from_json = NodeSettings::from_json(JSON).unwrap();
    check_decode(&from_json.build().unwrap());
    let toml = r#"
        role = "decode"
        engine_id = "d0"
        dp_rank = 1
        tp_size = 4
        tp_rank = 3
        mode = "pull"
        transport = "local"
        host = "127.0.0.1"
        lease_ms = 1500
        heartbeat_interval_ms = 250
        heartbeat_misses = 5
        tcp_streams = 2
        tcp_spin_us = 50
        data_plane_messages = false
        max_peers = 64
    "#;
    assert_eq!(NodeSettings::from_toml(toml).unwrap(), from_json);
}

#[test]
fn environment_variables_override_a_file() {
    let dir = std::env::temp_dir().join(format!("kvferry-settings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("node.json");
    std::fs::write(&path, JSON).unwrap();
    let file = NodeSettings::from_file(path.to_str().unwrap()).unwrap();
    let vars = [
        ("KVFERRY_LEASE_MS", "3000"),
        ("KVFERRY_ENGINE_ID", "d7"),
        ("KVFERRY_DATA_PLANE_MESSAGES", "1"),
        // Other kvferry variables are not node settings.
        ("KVFERRY_SIM_SEEDS", "20"),
        ("PATH", "/bin"),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()));
    let env = NodeSettings::from_vars(vars).unwrap();
    let c = file.overridden_by(env).build().unwrap();
    assert_eq!(c.timeouts.lease, Duration::from_millis(3000));
    assert_eq!(c.engine_id, "d7");
    assert!(c.data_plane_messages);
    assert_eq!(c.tp_size, 4, "kept from the file");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_configs_settings_build_the_same_config() {
    let set = NodeSettings::from_json(JSON).unwrap();
    let effective = NodeSettings::of(&set.build().unwrap());
    // Every key the JSON set reads back as set ...
    assert_eq!(effective.clone().overridden_by(set.clone()), effective);
    assert_eq!(effective.lease_ms, Some(1500));
    assert_eq!(effective.tcp_spin_us, Some(50));
    // ... the defaults are filled in ...
    let d = NodeConfig::new(Role::Decode, "d0");
    let default_ms = d.timeouts.bootstrap_timeout.as_millis() as u64;
    assert_eq!(effective.bootstrap_timeout_ms, Some(default_ms));
    assert_eq!(effective.side_channel_port, Some(d.side_channel_port));
    // ... and they build the config again.
    check_decode(&effective.build().unwrap());
    assert_eq!(NodeSettings::of(&effective.build().unwrap()), effective);
}

#[test]
fn both_roles_are_one_setting_under_kvferrys_and_vllms_names() {
    for name in ["both", "kv_both"] {
        let json = format!(r#"{{"role": "{name}", "engine_id": "e"}}"#);
        let c = NodeSettings::from_json(&json).unwrap().build().unwrap();
        assert_eq!(c.role, Role::Both, "{name}");
    }
    let vars = [
        ("KVFERRY_ROLE".to_string(), "kv_both".to_string()),
        ("KVFERRY_ENGINE_ID".to_string(), "e".to_string()),
    ];
    let c = NodeSettings::from_vars(vars).unwrap().build().unwrap();
    assert_eq!(c.role, Role::Both);
}

#[test]
fn bad_settings_are_refused_with_what_is_wrong() {
    let e = NodeSettings::from_json(r#"{"role": "decode", "leas_ms": 5}"#).unwrap_err();
    assert!(
        matches!(e, ConfigError::Json(_)) && e.to_string().contains("leas_ms"),
        "{e}"
    );
    let e = NodeSettings::from_json(r#"{"role": "kv_sideways"}"#).unwrap_err();
    assert!(e.to_string().contains("kv_sideways"), "{e}");
    let vars = [("KVFERRY_TP_SIZE".to_string(), "two".to_string())];
    let e = NodeSettings::from_vars(vars).unwrap_err();
    assert!(
        matches!(&e, ConfigError::Env { var, .. } if var == "KVFERRY_TP_SIZE"),
        "{e}"
    );
    let e = NodeSettings::from_json(r#"{"engine_id": "p"}"#)
        .unwrap()
        .build()
        .unwrap_err();
    assert!(matches!(e, ConfigError::Missing("role")), "{e}");
    let e = NodeSettings::from_file("node.yaml").unwrap_err();
    assert!(
        matches!(
            e,
            ConfigError::Io { .. } | ConfigError::UnknownFormat { .. }
        ),
        "{e}"
    );
}

#[test]
fn every_schema_key_is_a_field_and_every_field_a_key() {
    let value = serde_json::to_value(NodeSettings::default()).unwrap();
    let fields: BTreeSet<&str> = value
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let keys: BTreeSet<&str> = setting_keys().collect();
    assert_eq!(fields, keys);
}

/// The `pub` fields of `NodeConfig`, read from its source.
fn node_config_fields() -> Vec<String> {
    let src = include_str!("../../src/node/config.rs");
    let body = src
        .split("pub struct NodeConfig {")
        .nth(1)
        .and_then(|rest| rest.split("\n}").next())
        .expect("NodeConfig in src/node/config.rs");
    body.lines()
        .filter_map(|l| l.trim().strip_prefix("pub "))
        .filter_map(|l| l.split(':').next())
        .map(str::to_string)
        .collect()
}

#[test]
fn docs_config_has_a_row_for_every_field_and_key() {
    let doc = include_str!("../../docs/config.md");
    let rows: Vec<&str> = doc.lines().filter(|l| l.starts_with('|')).collect();
    // A field is named whole or by a path into it (`timeouts.lease`).
    let has_row = |name: &str| {
        let (cell, path) = (format!("`{name}`"), format!("`{name}."));
        rows.iter().any(|r| r.contains(&cell) || r.contains(&path))
    };
    let fields = node_config_fields();
    assert!(fields.len() > 20, "{fields:?}");
    let keys = setting_keys().map(str::to_string);
    for f in fields.iter().cloned().chain(keys) {
        assert!(has_row(&f), "docs/config.md has no row for `{f}`");
    }
}

#[test]
fn a_node_listens_on_the_configured_data_plane_port() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let json = format!(r#"{{"role": "prefill", "engine_id": "p", "data_plane_port": {port}}}"#);
    let c = NodeSettings::from_json(&json).unwrap().build().unwrap();
    let node = Node::start(c).unwrap();
    assert_eq!(node.endpoint(), format!("tcp://127.0.0.1:{port}"));
    node.shutdown(Duration::ZERO);
}

#[test]
fn a_cuda_device_without_a_driver_fails_the_config_clearly() {
    let with = |device: &str| {
        let json = format!(r#"{{"role": "decode", "engine_id": "d", "device": "{device}"}}"#);
        NodeSettings::from_json(&json).unwrap().build()
    };
    assert!(with("cpu").unwrap().device.is_none());
    assert!(matches!(with("gpu0"), Err(ConfigError::BadDevice(_))));
    assert!(matches!(with("cuda:x"), Err(ConfigError::BadDevice(_))));
    if std::env::var_os("KVFERRY_GPU_TESTS").is_none() {
        // No driver here: one error naming the device, at config time.
        let err = with("cuda:0").expect_err("no CUDA driver on this machine");
        assert!(matches!(err, ConfigError::Device(_)), "{err:?}");
        assert!(err.to_string().contains("cuda:0"), "{err}");
    }
}

/// Where docs/config.md's generated table of keys starts and ends.
const TABLE_BEGIN: &str = "<!-- keys: made from src/node/settings/mod.rs; KVFERRY_BLESS=1 cargo test --test it docs_config rewrites it -->\n";
const TABLE_END: &str = "<!-- end of keys -->";

#[test]
fn docs_config_lists_every_key_as_declared() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/config.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let (head, rest) = doc
        .split_once(TABLE_BEGIN)
        .expect("docs/config.md: table start");
    let (_, tail) = rest
        .split_once(TABLE_END)
        .expect("docs/config.md: table end");
    let want = format!(
        "{head}{TABLE_BEGIN}{}{TABLE_END}{tail}",
        NodeSettings::markdown_table()
    );
    if std::env::var_os("KVFERRY_BLESS").is_some() {
        std::fs::write(path, want).unwrap();
    } else {
        assert!(
            doc == want,
            "docs/config.md's table of keys is not the declarations' \
             (KVFERRY_BLESS=1 cargo test --test it docs_config rewrites it)"
        );
    }
}
