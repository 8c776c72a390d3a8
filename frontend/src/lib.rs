//! kiln frontend.
