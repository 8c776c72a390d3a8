//! Built-in models and their training loops (used by the CLI, tests and benches).

pub mod mlp;
pub mod gpt;
