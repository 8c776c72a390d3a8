//! kiln runtime: PJRT.
