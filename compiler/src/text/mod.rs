//! kiln's text form of a [`Graph`]: readable, MLIR-flavoured, one node per line.
//!
//! Snapshot tests compare it, `KILN_DUMP_DIR` writes it after each pass (the
//! pipeline's observer, implemented in the frontend's `dump` module), and the
//! CLI reads it, so it is deterministic and round-trips exactly:
//! `parse(&print(&g))` is structurally equal to `g` and prints identically
//! (constants included, bit for bit).
//!
//! ```text
//! graph(%0: tensor<4x3xf32>, %1: tensor<3xf32>) {
//!   %2 = broadcast_in_dim %1, dims = [1] : tensor<4x3xf32>
//!   %3 = add %0, %2 : tensor<4x3xf32>
//!   %4 = reduce sum %3, axes = [1] : tensor<4xf32>
//!   %5:2 = rng_bit_generator THREE_FRY %6 : (tensor<2xui32>, tensor<4xui32>)
//!   return %3, %4 {aliases = [0 -> 0]}
//! }
//! ```
//!
//! Grammar (whitespace between tokens is free within a line; `//` starts a comment):
//!
//! ```text
//! graph   := 'graph' '(' (name ':' type),* ')' '{'  node*  'return' value,* aliases?  '}'
//! node    := name (':' count)? '=' op-name keyword? operands-and-attrs ':' types
//! name    := '%' [A-Za-z0-9_]+            value := name ('#' output)?
//! types   := type | '(' type,* ')'        type  := 'tensor<' (dim 'x')* dtype '>'
//! attr    := ident '=' (int | '[' int,* ']' | '[' value,* ']' | '[' int,* ']' 'x' '[' int,* ']')
//! aliases := '{' 'aliases' '=' '[' (param-index '->' output-index),* ']' '}'
//! ```
//!
//! - The header declares the parameters that open the graph; a parameter added
//!   after other nodes is a node line `%7 = parameter 2 : tensor<f32>`, so the
//!   node order (and with it every id) survives the round trip.
//! - A node with one output is named `%3`; one with `k != 1` outputs is `%3:k`,
//!   its outputs are used as `%3#0 ..` (`%3` = `%3#0`) and its types are written
//!   in parentheses.
//! - Attributes that the result type determines are not repeated: `reshape`'s
//!   and `broadcast_in_dim`'s shape, `convert`'s dtype, `dynamic_slice`'s sizes,
//!   `iota`'s, `parameter`'s and `rng_bit_generator`'s type.
//! - Constants are `dense<v>` for a splat and `dense<[v, ..]>` (row-major) else.
//!   Floats use Rust's shortest round-trip spelling (`1.5`, `1e-7`, `-0.0`,
//!   `inf`, `-inf`), f16/bf16 via f32; the canonical NaN is `nan`, any other NaN
//!   its bits in hex (`0x7fc00001`); pred is `true`/`false`.
//! - The printer numbers nodes with the graph's own dense ids. The parser accepts
//!   any names defined before use and renumbers densely in line order; it builds
//!   the graph through `Graph::add`, so the op type-checks, and then checks that
//!   the written types equal the inferred ones. Errors carry the line number.

mod parse;
mod print;

pub use parse::parse;
pub use print::print;

#[cfg(doc)]
use crate::ir::Graph;
