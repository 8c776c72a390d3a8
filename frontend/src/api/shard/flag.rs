//! The `--shard` flag of the CLI and the training loops: `dp`, `fsdp`,
//! `tp=N` or `fsdp,tp=N` over a device count, read into a mesh and a policy.
//!
//! Invariant: a spec is refused with [`FrontendError::BadMesh`] or
//! [`FrontendError::MeshDevices`] naming the part at fault, never silently
//! read as another layout (a part given twice, a degree that does not divide
//! the devices).

use crate::core::error::{FrontendError, Result};
use crate::core::mesh::{Mesh, PolicyKind, DATA, MODEL};

/// What `--shard` asks for: `dp` (replicas, no mesh), `fsdp`, `tp=N`, or
/// `fsdp,tp=N`, over `devices` devices. `tp=N` puts the devices that remain
/// on a `data` axis (the batch splits over it; with `fsdp` the parameters
/// too). `None`: data parallel, the replica path.
pub fn parse_shard_flag(spec: &str, devices: usize) -> Result<Option<(Mesh, PolicyKind)>> {
    let bad = |reason: String| FrontendError::BadMesh { spec: spec.to_string(), reason };
    let mut fsdp = false;
    let mut tp: Option<usize> = None;
    let mut dp = false;
    let mut seen: Vec<&str> = Vec::new();
    for part in spec.split(',').map(str::trim) {
        let name = part.split_once('=').map_or(part, |(n, _)| n);
        if seen.contains(&name) {
            return Err(bad(format!("{name} is given twice")));
        }
        seen.push(name);
        match part.split_once('=') {
            None if part == "dp" => dp = true,
            None if part == "fsdp" => fsdp = true,
            Some(("tp", n)) => {
                let n: usize = match n.trim().parse::<usize>() {
                    Ok(v) if v >= 1 => v,
                    // Beyond usize: a count, just far more than the devices.
                    Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => {
                        return Err(bad(format!("tp={n}: more than the {devices} device(s)")))
                    }
                    _ => return Err(bad(format!("tp={n}: the tensor-parallel degree must be a count of at least 1"))),
                };
                tp = Some(n);
            }
            _ => return Err(bad(format!("{part:?} is not dp, fsdp, tp=N or fsdp,tp=N"))),
        }
    }
    if dp && (fsdp || tp.is_some()) {
        return Err(bad("dp (replicas) does not combine with fsdp or tp".into()));
    }
    if dp {
        return Ok(None);
    }
    let model = tp.unwrap_or(1);
    if devices % model != 0 {
        return Err(FrontendError::MeshDevices {
            mesh: format!("model={model}"),
            mesh_devices: model,
            setting: format!("{devices} devices (tp={model} must divide them)"),
        });
    }
    let data = devices / model;
    let mut axes: Vec<(&str, usize)> = Vec::new();
    if data > 1 || tp.is_none() {
        axes.push((DATA, data));
    }
    if tp.is_some() {
        axes.push((MODEL, model));
    }
    let kind = match (fsdp, tp.is_some()) {
        (true, true) => PolicyKind::FsdpTp,
        (true, false) => PolicyKind::Fsdp,
        (false, true) => PolicyKind::TensorParallel,
        (false, false) => PolicyKind::Replicated,
    };
    Ok(Some((Mesh::new(&axes)?, kind)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_flag_names_a_part_given_twice_and_a_degree_beyond_any_count() {
        let msg = |spec: &str| parse_shard_flag(spec, 4).unwrap_err().to_string();
        assert!(msg("fsdp,fsdp").ends_with("fsdp is given twice"), "{}", msg("fsdp,fsdp"));
        assert!(msg("tp=2,tp=2").ends_with("tp is given twice"));
        assert!(msg("tp=99999999999999999999").ends_with("tp=99999999999999999999: more than the 4 device(s)"));
        assert!(msg("tp=0").contains("must be a count of at least 1"));
        assert!(parse_shard_flag("fsdp,tp=2", 4).unwrap().is_some());
    }
}
