//! Fuzzing of the graph text form, the one input of the compiler a user
//! writes by hand (`kiln compile`, `kiln profile`). A proptest-driven corpus
//! run: valid seed graphs covering the ops with size attributes, mutated by
//! token edits (hostile integers in dims and attributes, swapped op names and
//! dtypes), line edits (dropped, duplicated, swapped) and byte edits. Each
//! input goes through what the CLI does before the plugin: parse, verify,
//! optimize, lower. Every stage must return a value or a typed error: no
//! panic, no abort (allocation included), no hang. Bounded to a fixed number
//! of cases (a few seconds in release); `--nocapture` prints the counts.

use kiln_compiler::lower::{lower, LowerOptions};
use kiln_compiler::text::parse;
use kiln_compiler::{pipeline, verify};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

const SEEDS: &[&str] = &[
    "graph(%x: tensor<4x3xf32>, %b: tensor<3xf32>) {\n  %bb = broadcast_in_dim %b, dims = [1] : tensor<4x3xf32>\n  %s = add %x, %bb : tensor<4x3xf32>\n  %r = reduce sum %s, axes = [1] : tensor<4xf32>\n  %t = tanh %r : tensor<4xf32>\n  return %t\n}\n",
    "graph(%x: tensor<4xf32>) {\n  %v = constant dense<0.0> : tensor<f32>\n  %p = pad %x, %v, low = [1], high = [2], interior = [1] : tensor<10xf32>\n  %s = slice %p, start = [1], limit = [9], stride = [2] : tensor<4xf32>\n  return %s\n}\n",
    "graph(%a: tensor<2x3xi32>, %b: tensor<2x3xi32>) {\n  %c = concatenate %a, %b, axis = 0 : tensor<4x3xi32>\n  %k = constant dense<3> : tensor<4x3xi32>\n  %d = div %c, %k : tensor<4x3xi32>\n  %e = rem %c, %k : tensor<4x3xi32>\n  %f = add %d, %e : tensor<4x3xi32>\n  %r = reshape %f : tensor<12xi32>\n  return %r\n}\n",
    "graph(%x: tensor<2x3xf32>, %w: tensor<3x5xf32>) {\n  %y = dot_general %x, %w, batch = [] x [], contract = [1] x [0] : tensor<2x5xf32>\n  %c = constant dense<[1.0, 2.0, 3.0, 4.0, 5.0]> : tensor<5xf32>\n  %cb = broadcast_in_dim %c, dims = [1] : tensor<2x5xf32>\n  %z = mul %y, %cb : tensor<2x5xf32>\n  %m = reduce max %z, axes = [0, 1] : tensor<f32>\n  return %z, %m\n}\n",
    "graph(%x: tensor<8xf32>) {\n  %i = iota axis = 0 : tensor<8xi32>\n  %f = convert %i : tensor<8xf32>\n  %s = sub %x, %f : tensor<8xf32>\n  %e = exp %s : tensor<8xf32>\n  return %e\n}\n",
];

/// Integers a hostile user writes.
const NUMBERS: &[&str] = &[
    "0",
    "1",
    "-1",
    "2",
    "99999999999",
    "4294967295",
    "4294967296",
    "2147483648",
    "-2147483648",
    "9223372036854775807",
    "-9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "1e308",
    "nan",
];
const WORDS: &[&str] = &[
    "f32",
    "i32",
    "ui32",
    "i8",
    "ui8",
    "i64",
    "pred",
    "bf16",
    "f16",
    "add",
    "div",
    "rem",
    "pad",
    "slice",
    "reshape",
    "concatenate",
    "broadcast_in_dim",
    "dot_general",
    "reduce",
    "iota",
    "constant",
    "tensor<>",
    "tensor<0xf32>",
    "%x",
    "%0",
    "[",
    "]",
    ",",
    "x",
    "{",
    "}",
    "return",
    ":",
    "=",
];

#[derive(Clone, Debug)]
enum Edit {
    /// Replace the `k`-th run of digits with a hostile number.
    Number {
        k: usize,
        with: usize,
    },
    /// Replace the `k`-th word with another keyword or token.
    Word {
        k: usize,
        with: usize,
    },
    DropLine(usize),
    DupLine(usize),
    SwapLines(usize, usize),
    Byte {
        at: usize,
        byte: u8,
    },
    Truncate(usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        8 => (any::<usize>(), 0..NUMBERS.len()).prop_map(|(k, with)| Edit::Number { k, with }),
        2 => (any::<usize>(), 0..WORDS.len()).prop_map(|(k, with)| Edit::Word { k, with }),
        1 => any::<usize>().prop_map(Edit::DropLine),
        1 => any::<usize>().prop_map(Edit::DupLine),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Edit::SwapLines(a, b)),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Edit::Byte { at, byte }),
        1 => any::<usize>().prop_map(Edit::Truncate),
    ]
}

/// Byte ranges of maximal runs where `f` holds.
fn runs(s: &str, f: impl Fn(char) -> bool) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in s.char_indices().chain([(s.len(), ' ')]) {
        match (start, f(c) && i < s.len()) {
            (None, true) => start = Some(i),
            (Some(st), false) => {
                out.push((st, i));
                start = None;
            }
            _ => {}
        }
    }
    out
}

fn apply(mut s: String, edits: &[Edit]) -> String {
    for e in edits {
        match e {
            Edit::Number { k, with } => {
                let r = runs(&s, |c| c.is_ascii_digit());
                if !r.is_empty() {
                    let (a, b) = r[k % r.len()];
                    s.replace_range(a..b, NUMBERS[*with]);
                }
            }
            Edit::Word { k, with } => {
                let r = runs(&s, |c| c.is_ascii_alphanumeric() || c == '_');
                if !r.is_empty() {
                    let (a, b) = r[k % r.len()];
                    s.replace_range(a..b, WORDS[*with]);
                }
            }
            Edit::DropLine(i) | Edit::DupLine(i) | Edit::SwapLines(i, _) => {
                let mut lines: Vec<String> = s.lines().map(String::from).collect();
                if !lines.is_empty() {
                    let n = lines.len();
                    match e {
                        Edit::DropLine(_) => {
                            lines.remove(i % n);
                        }
                        Edit::DupLine(_) => {
                            let l = lines[i % n].clone();
                            lines.insert(i % n, l);
                        }
                        Edit::SwapLines(_, j) => lines.swap(i % n, j % n),
                        _ => {}
                    }
                }
                s = lines.join("\n");
            }
            Edit::Byte { at, byte } => {
                let mut b = s.into_bytes();
                if !b.is_empty() {
                    let n = b.len();
                    b[at % n] = *byte;
                }
                s = String::from_utf8_lossy(&b).into_owned();
            }
            Edit::Truncate(at) => {
                let mut at = at % (s.len() + 1);
                while !s.is_char_boundary(at) {
                    at -= 1;
                }
                s.truncate(at);
            }
        }
    }
    s
}

/// What the CLI does before the plugin; `Some(stage)` of the furthest
/// stage reached.
fn pipeline_of(text: &str) -> &'static str {
    let Ok(g) = parse(text) else { return "parse error" };
    if verify(&g).is_err() {
        return "verify error";
    }
    let Ok((opt, _)) = pipeline::optimize(&g) else { return "optimize error" };
    match lower(&opt, &LowerOptions::default()) {
        Ok(_) => "lowered",
        Err(_) => "lower error",
    }
}

#[test]
fn the_text_form_never_panics_from_parse_to_lowering() {
    for s in SEEDS {
        assert_eq!(pipeline_of(s), "lowered", "a seed must lower:\n{s}");
    }
    let counts = std::cell::RefCell::new(std::collections::BTreeMap::<&str, u64>::new());
    let cases = 30_000;
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let strategy = (0..SEEDS.len(), proptest::collection::vec(edit(), 1..3));
    runner
        .run(&strategy, |(seed, edits)| {
            let text = apply(SEEDS[seed].to_string(), &edits);
            *counts.borrow_mut().entry(pipeline_of(&text)).or_default() += 1;
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let counts = counts.into_inner();
    println!("fuzz text form: {} executions, 0 panics; by stage reached: {counts:?}", counts.values().sum::<u64>());
    assert_eq!(counts.values().sum::<u64>(), u64::from(cases));
    assert!(counts.get("lowered").copied().unwrap_or(0) > 100, "mutations still reach the lowering: {counts:?}");
}
