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
