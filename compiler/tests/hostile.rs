//! Graphs a hostile-but-realistic user writes that used to crash XLA or wrap
//! shape arithmetic: refused with typed errors before anything reaches the
//! plugin.

use kiln_compiler::lower::{lower, LowerOptions};
use kiln_compiler::text::parse;
use kiln_compiler::CompileError;

fn lowered(text: &str) -> Result<String, CompileError> {
    let g = parse(text)?;
    lower(&g, &LowerOptions::default())
}

fn division(op: &str, dtype: &str, a: &str, b: &str) -> String {
    format!(
        "graph() {{\n  %a = constant dense<{a}> : tensor<4x{dtype}>\n  %b = constant dense<{b}> : tensor<4x{dtype}>\n  %c = {op} %a, %b : tensor<4x{dtype}>\n  return %c\n}}\n"
    )
}

#[test]
fn integer_division_by_a_constant_zero_is_refused_naming_the_op() {
    for dtype in ["i8", "i32", "ui32", "i64", "ui8"] {
        for op in ["div", "rem"] {
            let err = lowered(&division(op, dtype, "7", "0")).unwrap_err();
            match &err {
                CompileError::TrappingDivision { op: got, reason, .. } => {
                    assert_eq!(*got, op, "{err}");
                    assert!(reason.contains("divisor is 0"), "{err}");
                }
                other => panic!("{dtype} {op}: expected TrappingDivision, got {other}"),
            }
            assert!(err.to_string().contains(op), "{err}");
        }
    }
}

#[test]
fn a_zero_divisor_next_to_a_parameter_dividend_is_refused_too() {
    // XLA folds broadcasts of constants before division, so kiln cannot tell
    // which dividends end up constant: any constant zero divisor is refused.
    let text = "graph(%x: tensor<3xi32>) {\n  %z = constant dense<[1, 0, 2]> : tensor<3xi32>\n  %q = div %x, %z : tensor<3xi32>\n  return %q\n}\n";
    assert!(matches!(lowered(text), Err(CompileError::TrappingDivision { .. })));
}

#[test]
fn signed_minimum_over_minus_one_is_refused() {
    let err = lowered(&division("div", "i32", "-2147483648", "-1")).unwrap_err();
    assert!(matches!(err, CompileError::TrappingDivision { .. }), "{err}");
    let err = lowered(&division("rem", "i8", "-128", "-1")).unwrap_err();
    assert!(matches!(err, CompileError::TrappingDivision { .. }), "{err}");
}

#[test]
fn safe_divisions_still_lower() {
    lowered(&division("div", "i32", "7", "3")).unwrap();
    lowered(&division("div", "i32", "-2147483648", "2")).unwrap();
    // Unsigned: 0xffffffff is not -1.
    lowered(&division("div", "ui32", "4294967295", "4294967295")).unwrap();
    // Floats divide by zero to inf/NaN without trapping.
    lowered(&division("div", "f32", "1.0", "0.0")).unwrap();
}

fn pad(low: i64, high: i64, interior: u64) -> String {
    format!(
        "graph(%x: tensor<4xf32>) {{\n  %v = constant dense<0.0> : tensor<f32>\n  %p = pad %x, %v, low = [{low}], high = [{high}], interior = [{interior}] : tensor<8xf32>\n  return %p\n}}\n"
    )
}

#[test]
fn pad_with_extreme_sizes_is_a_typed_error_not_a_wrapped_shape() {
    for (low, high, interior) in [
        (i64::MIN, i64::MAX, 0),
        (i64::MAX, i64::MAX, 0),
        (0, 0, i64::MAX as u64),
        (0, 0, u64::MAX),
        (i64::MAX, 0, 1),
        (i64::MIN, 0, 0),
    ] {
        match parse(&pad(low, high, interior)) {
            Err(CompileError::Parse { reason, .. }) => {
                assert!(
                    reason.contains("overflow") || reason.contains("negative") || reason.contains("not a valid"),
                    "{low} {high} {interior}: {reason}"
                );
            }
            Err(other) => panic!("{low} {high} {interior}: unexpected error {other}"),
            Ok(_) => panic!("{low} {high} {interior}: accepted"),
        }
    }
    // A sane pad still parses: 1 + 4 + 3*1 + 0 = 8.
    parse(&pad(1, 0, 1)).unwrap();
}

#[test]
fn concatenate_whose_sizes_overflow_is_refused() {
    let big = usize::MAX / 2 + 1;
    let text = format!(
        "graph(%x: tensor<{big}xui8>, %y: tensor<{big}xui8>) {{\n  %c = concatenate %x, %y, axis = 0 : tensor<1xui8>\n  return %c\n}}\n"
    );
    let err = parse(&text).unwrap_err().to_string();
    assert!(err.contains("overflow") || err.contains("exceeds") || err.contains("address"), "{err}");
}

/// `div %x, DIVISOR` on `tensor<4xi32>`, the divisor built by `body` (which
/// defines `%d`).
fn divided_by(body: &str) -> String {
    format!("graph(%x: tensor<4xi32>) {{\n{body}\n  %q = div %x, %d : tensor<4xi32>\n  return %q\n}}\n")
}

/// A zero divisor is refused by value, however it is spelled: XLA's constant
/// folder reaches it through broadcasts, reshapes, converts, concatenations
/// and arithmetic on constants as it does a bare literal (each of these
/// killed the process with SIGFPE before).
#[test]
fn a_zero_divisor_is_refused_whatever_constant_ops_spell_it() {
    let cases = [
        ("broadcast", "  %z = constant dense<0> : tensor<i32>\n  %d = broadcast_in_dim %z, dims = [] : tensor<4xi32>"),
        ("reshape", "  %z = constant dense<[3, 0, 1, 2]> : tensor<2x2xi32>\n  %d = reshape %z : tensor<4xi32>"),
        ("convert", "  %z = constant dense<[0.5, 1.0, 2.0, 3.0]> : tensor<4xf32>\n  %d = convert %z : tensor<4xi32>"),
        (
            "concatenate",
            "  %a = constant dense<[1, 2]> : tensor<2xi32>\n  %b = constant dense<[3, 0]> : tensor<2xi32>\n  %d = concatenate %a, %b, axis = 0 : tensor<4xi32>",
        ),
        ("sub(c, c)", "  %c = constant dense<[4, 5, 6, 7]> : tensor<4xi32>\n  %d = sub %c, %c : tensor<4xi32>"),
        (
            "broadcast of a computed scalar",
            "  %a = constant dense<3> : tensor<i32>\n  %b = sub %a, %a : tensor<i32>\n  %d = broadcast_in_dim %b, dims = [] : tensor<4xi32>",
        ),
    ];
    for (what, body) in cases {
        match lowered(&divided_by(body)) {
            Err(CompileError::TrappingDivision { reason, .. }) => {
                assert!(reason.contains("divisor is 0"), "{what}: {reason}")
            }
            other => panic!("{what}: expected TrappingDivision, got {other:?}"),
        }
    }
    // The same spellings without a zero lower.
    let safe = "  %z = constant dense<[0.5, 1.0, 2.0, 3.0]> : tensor<4xf32>\n  %o = constant dense<1.0> : tensor<f32>\n  %ob = broadcast_in_dim %o, dims = [] : tensor<4xf32>\n  %s = add %z, %ob : tensor<4xf32>\n  %d = convert %s : tensor<4xi32>";
    lowered(&divided_by(safe)).unwrap();
    let safe = "  %z = constant dense<7> : tensor<i32>\n  %d = broadcast_in_dim %z, dims = [] : tensor<4xi32>";
    lowered(&divided_by(safe)).unwrap();
}

/// The signed minimum over −1 by value too: a broadcast minimum over a
/// computed −1.
#[test]
fn signed_minimum_over_a_computed_minus_one_is_refused() {
    let text = "graph() {\n  %m = constant dense<-2147483648> : tensor<i32>\n  %a = broadcast_in_dim %m, dims = [] : tensor<4xi32>\n  %z = constant dense<0> : tensor<4xi32>\n  %o = constant dense<1> : tensor<4xi32>\n  %d = sub %z, %o : tensor<4xi32>\n  %q = div %a, %d : tensor<4xi32>\n  return %q\n}\n";
    match lowered(text) {
        Err(CompileError::TrappingDivision { reason, .. }) => assert!(reason.contains("/ -1 overflows"), "{reason}"),
        other => panic!("expected TrappingDivision, got {other:?}"),
    }
}
