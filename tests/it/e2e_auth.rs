//! Nodes with a cluster key: KV moves between ranks holding it, through
//! the signed bootstrap service and the authenticated data plane; a rank
//! without it finds nobody and moves nothing; and without a key a node
//! listens on loopback only unless told otherwise.

use std::path::PathBuf;
use std::time::Duration;

use kvferry::auth::Surface;
use kvferry::machines::internal::common::Mode;
use kvferry::machines::{ModelSpec, Phase};
use kvferry::node::{Misuse, Node, NodeConfig, NodeError, PrefillTarget, Role, TransportKind};
use kvferry::TransferId;
use kvferry_testkit::e2e_timeouts;
use kvferry_testkit::model::ModelSpecExt;
use kvferry_testkit::synth::{Rank, SynthKv};

/// Two 64-byte heads in 4-token blocks.
pub(crate) fn model() -> ModelSpec {
    kvferry_testkit::model::small()
        .with_heads(2)
        .with_head_bytes(64)
}

/// A key file of `byte`s, readable by its owner only.
pub(crate) fn key_file(name: &str, byte: u8) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("kvferry-e2e-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, [byte; 32]).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

fn config(role: Role, name: &str, key: Option<PathBuf>) -> NodeConfig {
    let mut c = NodeConfig::new(role, name);
    c.mode = Mode::Push;
    c.transport = TransportKind::Tcp;
    c.timeouts = e2e_timeouts();
    c.timeouts.bootstrap_timeout = Duration::from_secs(2);
    c.cluster_key_file = key;
    c
}

fn rank(c: NodeConfig) -> Rank {
    Rank::start(c, SynthKv::new(model(), 1, 0, 2, 16)).expect("node starts")
}

/// Opens `tid` on both sides as `send_one` does and returns both phases,
/// for requests that must not succeed (the sides may end differently:
/// a refused decode fails at once, its prefill peer expires unasked).
fn attempt(
    p: &Rank,
    d: &Rank,
    target: &PrefillTarget,
    tid: TransferId,
    (src, dst): (u32, u32),
) -> (Phase, Phase) {
    use kvferry::BlockId;
    let wait = Duration::from_secs(10);
    let rx = d.node.receiver(tid, target).unwrap();
    rx.request(vec![vec![BlockId(dst)]]).unwrap();
    let tx = p.node.sender(tid).unwrap();
    tx.send(vec![vec![BlockId(src)]], true).unwrap();
    (tx.wait(wait), rx.wait(wait))
}

#[test]
fn kv_moves_only_between_ranks_holding_the_key() {
    let key = key_file("cluster", 7);
    let mut p = config(Role::Prefill, "prefill", Some(key.clone()));
    p.serve_bootstrap = Some("127.0.0.1:0".into());
    let prefill = rank(p);
    let addr = prefill
        .node
        .bootstrap_addr()
        .expect("serves the bootstrap service");
    let target = PrefillTarget::Bootstrap {
        addr: addr.clone(),
        engine_id: "prefill".into(),
        dp_rank: Some(0),
    };
    let client = kvferry::bootstrap::BootstrapClient::new(&addr)
        .unwrap()
        .with_key(Some(kvferry::auth::ClusterKey::load(&key, None).unwrap()));
    let policy = kvferry::bootstrap::RetryPolicy::default();
    client
        .wait_for_engine("prefill", 1, policy)
        .expect("prefill registered, signed");

    let decode = rank(config(Role::Decode, "decode", Some(key.clone())));
    let wait = Duration::from_secs(10);
    let phase = prefill.send_one(&decode, &target, TransferId(1), (&[1, 2], &[3, 4]), wait);
    assert_eq!(
        phase,
        Phase::Success,
        "keyed ranks move KV (bytes verified)"
    );
    assert_eq!(prefill.node.auth_rejected(Surface::Bootstrap), 0);

    // Another key: the open `/query` names the prefill rank's side
    // channel, whose handshake refuses it; its request fails and nothing
    // lands in its blocks.
    let other = rank(config(Role::Decode, "intruder", Some(key_file("other", 8))));
    prefill.kv.fill(TransferId(2), &[5], 0);
    let started = std::time::Instant::now();
    let (p_phase, d_phase) = attempt(&prefill, &other, &target, TransferId(2), (5, 6));
    assert!(matches!(d_phase, Phase::Failed(_)), "{d_phase:?}");
    assert_ne!(p_phase, Phase::Success);
    assert!(other.untouched(&[6]));
    assert!(prefill.node.auth_rejected(Surface::SideChannel) >= 1);
    assert!(started.elapsed() < Duration::from_secs(5));

    // A keyless rank reaching the prefill rank's side channel directly:
    // its frames are refused there (counted), and nothing moves.
    let direct = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 1,
        side_channels: vec![prefill.node.side_channel_addr()],
    };
    let plain = rank(config(Role::Decode, "plain", None));
    prefill.kv.fill(TransferId(3), &[7], 0);
    let (p_phase, d_phase) = attempt(&prefill, &plain, &direct, TransferId(3), (7, 8));
    assert_ne!(p_phase, Phase::Success);
    assert_ne!(d_phase, Phase::Success);
    assert!(plain.untouched(&[8]));
    assert!(prefill.node.auth_rejected(Surface::SideChannel) >= 1);

    // And the keyed pair still works after all of that.
    let phase = prefill.send_one(&decode, &target, TransferId(4), (&[9], &[10]), wait);
    assert_eq!(phase, Phase::Success);
    let metrics = prefill.node.metrics_text();
    assert!(
        metrics.contains("kvferry_auth_rejected_total{surface=\"side_channel\"}"),
        "{metrics}"
    );
}

#[test]
fn without_a_key_a_node_listens_on_loopback_only() {
    let refused = |c: NodeConfig| match Node::start(c) {
        Err(NodeError::Misuse(Misuse::UnauthenticatedRemote { .. })) => true,
        Err(e) => panic!("another error: {e}"),
        Ok(_) => false,
    };
    let mut wide = config(Role::Decode, "wide", None);
    wide.listen = Some("0.0.0.0".into());
    assert!(refused(wide.clone()), "0.0.0.0 without a key");

    // A bootstrap service beyond loopback starts without a key and serves
    // this host (callers from other hosts get 403: the cluster tests).
    let mut bootstrap = config(Role::Prefill, "wide-bootstrap", None);
    bootstrap.serve_bootstrap = Some("0.0.0.0:0".into());
    let node = Node::start(bootstrap.clone()).expect("a local-only bootstrap service");
    let port = node
        .bootstrap_addr()
        .unwrap()
        .rsplit_once(':')
        .unwrap()
        .1
        .to_string();
    let local = kvferry::bootstrap::BootstrapClient::new(&format!("127.0.0.1:{port}")).unwrap();
    local.health().expect("this host is served");
    node.shutdown(Duration::ZERO);

    // Said explicitly, or with a key, it starts.
    let mut insecure = wide.clone();
    insecure.allow_unauthenticated_remote = true;
    Node::start(insecure)
        .expect("allowed explicitly")
        .shutdown(Duration::ZERO);
    let mut keyed = wide;
    keyed.cluster_key_file = Some(key_file("wide", 9));
    Node::start(keyed).expect("keyed").shutdown(Duration::ZERO);
    bootstrap.cluster_key_file = Some(key_file("wide", 9));
    Node::start(bootstrap)
        .expect("keyed bootstrap")
        .shutdown(Duration::ZERO);

    // A key file that is too short is an error naming it.
    let short = key_file("short", 1);
    std::fs::write(&short, [1u8; 16]).unwrap();
    let mut c = config(Role::Decode, "short", Some(short));
    c.listen = Some("127.0.0.1".into());
    let Err(e) = Node::start(c) else {
        panic!("a 16-byte key is refused");
    };
    assert!(e.to_string().contains("16 bytes"), "{e}");
}

#[test]
fn metrics_can_require_the_key() {
    let key = key_file("metrics", 11);
    let mut c = config(Role::Decode, "metrics", Some(key.clone()));
    c.metrics_listen = Some("127.0.0.1:0".into());
    c.authenticate_metrics = true;
    let node = Node::start(c).unwrap();
    let addr = node.metrics_addr().unwrap().to_string();
    let plain = kvferry::bootstrap::BootstrapClient::new(&addr).unwrap();
    let e = plain.metrics_text().unwrap_err();
    assert!(
        matches!(e, kvferry::bootstrap::ClientError::Unauthorized),
        "{e}"
    );
    plain.health().expect("/health stays open");
    let signed = plain.with_key(Some(kvferry::auth::ClusterKey::load(&key, None).unwrap()));
    let text = signed.metrics_text().expect("a signed scrape");
    assert!(
        text.contains("kvferry_auth_rejected_total{surface=\"bootstrap\"} 1"),
        "{text}"
    );
    node.shutdown(Duration::ZERO);
}
