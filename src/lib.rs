//! kiln facade.
