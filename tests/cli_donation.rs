//! `KILN_DONATE=1` with the XLA CPU plugin is allowed (kiln's own tests of
//! donation use it) but warned about once: the plugin has computed wrong
//! values on donated buffers (docs/donation.md).

use std::process::Command;

fn train(donate: Option<&str>) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
    cmd.env("KILN_CACHE", "off").env_remove("KILN_CPU_DEVICES").env_remove("PJRT_DEVICE").env_remove("KILN_DONATE");
    if let Some(v) = donate {
        cmd.env("KILN_DONATE", v);
    }
    let out = cmd.args(["train", "mlp", "--max-steps", "3"]).output().expect("kiln runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    stderr
}

#[test]
fn forcing_donation_on_the_cpu_plugin_is_warned_about_once() {
    let stderr = train(Some("1"));
    let warning = "KILN_DONATE=1 with the XLA CPU plugin, which has computed wrong values on donated buffers";
    assert_eq!(stderr.matches(warning).count(), 1, "{stderr}");
    assert!(!train(None).contains("KILN_DONATE"));
    assert!(!train(Some("0")).contains("KILN_DONATE"));
}
