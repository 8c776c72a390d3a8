//! The canonical fingerprint: what it ignores (numbering, order of independent
//! nodes, dead code) and what it must not ignore (ops, attributes, constants,
//! types, outputs, aliases).

use kiln_compiler::fingerprint;
use kiln_compiler::text::parse;

fn fp(text: &str) -> String {
    fingerprint(&parse(text).unwrap_or_else(|e| panic!("{e}\n{text}"))).to_string()
}

const BASE: &str = "
graph(%0: tensor<4x3xf32>, %1: tensor<3xf32>) {
  %2 = broadcast_in_dim %1, dims = [1] : tensor<4x3xf32>
  %3 = add %0, %2 : tensor<4x3xf32>
  %4 = tanh %0 : tensor<4x3xf32>
  %5 = mul %3, %4 : tensor<4x3xf32>
  return %5
}";

#[test]
fn independent_nodes_in_another_order_fingerprint_alike() {
    let reordered = "
graph(%0: tensor<4x3xf32>, %1: tensor<3xf32>) {
  %9 = tanh %0 : tensor<4x3xf32>
  %7 = broadcast_in_dim %1, dims = [1] : tensor<4x3xf32>
  %8 = add %0, %7 : tensor<4x3xf32>
  %2 = mul %8, %9 : tensor<4x3xf32>
  return %2
}";
    assert_eq!(fp(BASE), fp(reordered));
}

#[test]
fn dead_code_does_not_count() {
    let with_dead = "
graph(%0: tensor<4x3xf32>, %1: tensor<3xf32>) {
  %2 = broadcast_in_dim %1, dims = [1] : tensor<4x3xf32>
  %d = exp %0 : tensor<4x3xf32>
  %3 = add %0, %2 : tensor<4x3xf32>
  %4 = tanh %0 : tensor<4x3xf32>
  %e = neg %d : tensor<4x3xf32>
  %5 = mul %3, %4 : tensor<4x3xf32>
  return %5
}";
    assert_eq!(fp(BASE), fp(with_dead));
}

#[test]
fn every_structural_change_changes_it() {
    let base = fp(BASE);
    let variants = [
        // another op
        BASE.replace("%4 = tanh", "%4 = exp"),
        // operands swapped in a non-commutative position
        BASE.replace("%5 = mul %3, %4", "%5 = mul %4, %3"),
        // another parameter shape
        BASE.replace("%0: tensor<4x3xf32>", "%0: tensor<4x1xf32>")
            .replace("%1: tensor<3xf32>", "%1: tensor<1xf32>")
            .replace("tensor<4x3xf32>", "tensor<4x1xf32>"),
        // another dtype
        BASE.replace("f32", "f64"),
        // an extra (unused) parameter changes the program's signature
        BASE.replace("%1: tensor<3xf32>)", "%1: tensor<3xf32>, %9: tensor<2xf32>)"),
        // another output list
        BASE.replace("return %5", "return %5, %3"),
        // an alias
        BASE.replace("return %5", "return %5 {aliases = [0 -> 0]}"),
    ];
    for v in &variants {
        assert_ne!(fp(v), base, "unchanged fingerprint for\n{v}");
    }
    // Constants by value, bit for bit.
    let c = |v: &str| {
        fp(&format!(
            "graph(%0: tensor<f32>) {{\n  %1 = constant dense<{v}> : tensor<f32>\n  %2 = add %0, %1 : tensor<f32>\n  return %2\n}}"
        ))
    };
    assert_ne!(c("1.0"), c("1.0000001"));
    assert_ne!(c("0.0"), c("-0.0"));
    assert_eq!(c("2.5"), c("2.5"));
}

#[test]
fn the_fingerprint_is_64_hex_digits_and_stable_across_parses() {
    let a = fp(BASE);
    assert_eq!(a.len(), 64);
    assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
    assert_eq!(a, fp(BASE));
}
