//! `kvferry bench device` end to end, with the host stand-in as the device:
//! a peer process, the three measurements, every byte verified. (On a GPU,
//! `scripts/gpu-check.sh` runs it against `cuda:0`.)

use std::process::Command;

#[test]
fn the_device_bench_verifies_every_measurement_against_the_stand_in() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["bench", "device", "--device", "host", "--json"])
        .args(["--bytes", &(4u64 << 20).to_string(), "--rounds", "2"])
        .output()
        .expect("kvferry runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["device"], "host:0");
    for m in ["copy", "ipc", "staged"] {
        assert_eq!(v[m]["verified"], true, "{m}: {v}");
        assert!(v[m]["kvferry_gbps"].as_f64().unwrap() > 0.0, "{m}: {v}");
        assert!(v[m]["baseline_gbps"].as_f64().unwrap() > 0.0, "{m}: {v}");
    }
    // A stand-in's handles open only in the process that exported them:
    // across processes the bytes went staged.
    assert_eq!(v["ipc"]["opened"], false, "{v}");
}

#[test]
fn without_a_driver_the_device_bench_fails_naming_the_device() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["bench", "device", "--device", "cuda:0", "--bytes", "4096"])
        .output()
        .expect("kvferry runs");
    if std::env::var_os("KVFERRY_GPU_TESTS").is_some() {
        return;
    }
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cuda:0"), "{err}");
}
