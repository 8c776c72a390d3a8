//! Cross-crate tests live in `tests/`.
