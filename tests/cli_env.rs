//! kiln's environment variables set to an empty value count as unset, as
//! their docs say (`runtime::env`): a script that exports `VAR=` to clear a
//! setting gets the default, not an error.

use std::process::Command;

#[test]
fn empty_variables_count_as_unset() {
    let vars =
        ["KILN_MAX_STEPS_IN_FLIGHT", "KILN_DONATE", "KILN_DEVICE_CHECKS", "KILN_CACHE_READONLY", "KILN_CPU_DEVICES"];
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
    cmd.env("KILN_CACHE", "off").env_remove("PJRT_DEVICE");
    for v in vars {
        cmd.env(v, "");
    }
    let out = cmd.args(["train", "mlp", "--max-steps", "2", "--json"]).output().expect("kiln runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
