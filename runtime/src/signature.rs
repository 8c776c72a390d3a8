//! The type signature of a StableHLO program's `@main` function.
//!
//! The runtime checks arguments against it before calling the plugin, so a
//! wrong dtype or shape is a typed error naming the argument instead of an
//! XLA status string. Only static shapes are accepted (kiln never emits `?`).
//!
//! Display is the MLIR function type, `(tensor<4x3xf32>, tensor<f32>) -> (tensor<4xf32>)`,
//! and [`Signature::parse_function_type`] reads it back (used by serialized executables).

use std::fmt;

use crate::element_type::{ArgType, ElementType};
use crate::error::{Result, RuntimeError};

impl ArgType {
    /// Parses `tensor<4x3xf32>` / `tensor<f32>` (an encoding after `,` is ignored).
    pub fn parse(text: &str) -> Result<Self> {
        let text = text.trim();
        let inner = text
            .strip_prefix("tensor<")
            .and_then(|rest| rest.strip_suffix('>'))
            .ok_or_else(|| sig_err(format!("`{text}` is not a ranked tensor type")))?;
        let inner = inner.split(',').next().unwrap_or(inner).trim();
        let mut parts: Vec<&str> = inner.split('x').collect();
        let elem = parts.pop().unwrap_or_default();
        let ty = ElementType::from_mlir_name(elem)
            .ok_or_else(|| sig_err(format!("unsupported element type `{elem}` in `{text}`")))?;
        let dims = parts
            .iter()
            .map(|d| {
                d.parse::<usize>().map_err(|_| sig_err(format!("dimension `{d}` in `{text}` is not a static size")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ArgType { ty, dims })
    }
}

/// Argument and result types of `@main`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Signature {
    pub inputs: Vec<ArgType>,
    pub outputs: Vec<ArgType>,
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |ts: &[ArgType]| ts.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
        write!(f, "({}) -> ({})", list(&self.inputs), list(&self.outputs))
    }
}

fn sig_err(message: String) -> RuntimeError {
    RuntimeError::Signature { message }
}

/// Splits `text` at top-level commas (outside `<>`, `()`, `[]`, `{}` and strings).
fn split_top_level(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut in_string, mut start) = (0i32, false, 0);
    for (i, c) in text.char_indices() {
        match c {
            '"' => in_string = !in_string,
            _ if in_string => {}
            '<' | '(' | '[' | '{' => depth += 1,
            '>' | ')' | ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    let last = &text[start..];
    if !last.trim().is_empty() || !parts.is_empty() {
        parts.push(last);
    }
    parts
}

/// Returns the text inside the bracket that opens at `text[0]` and the rest after it.
fn bracketed(text: &str, open: char, close: char) -> Option<(&str, &str)> {
    let mut chars = text.char_indices();
    if chars.next()?.1 != open {
        return None;
    }
    let (mut depth, mut in_string) = (1i32, false);
    for (i, c) in chars {
        match c {
            '"' => in_string = !in_string,
            _ if in_string => {}
            c if c == open => depth += 1,
            c if c == close => {
                depth -= 1;
                if depth == 0 {
                    return Some((&text[1..i], &text[i + 1..]));
                }
            }
            _ => {}
        }
    }
    None
}

/// The type of one entry of an argument/result list, dropping `%name:` and `{attrs}`.
fn entry_type(entry: &str) -> Result<ArgType> {
    let entry = entry.trim();
    let entry = match entry.strip_prefix('%') {
        Some(rest) => rest.split_once(':').map(|(_, t)| t).unwrap_or(rest),
        None => entry,
    };
    let entry = entry.trim();
    let end = entry.find('{').or_else(|| entry.find(" loc(")).unwrap_or(entry.len());
    ArgType::parse(&entry[..end])
}

fn parse_list(list: &str) -> Result<Vec<ArgType>> {
    split_top_level(list).into_iter().map(entry_type).collect()
}

/// Parses the result part after `->`: `(t1, t2)`, `t`, or nothing.
fn parse_results(rest: &str) -> Result<Vec<ArgType>> {
    let rest = rest.trim_start();
    let Some(rest) = rest.strip_prefix("->") else {
        return Ok(Vec::new());
    };
    let rest = rest.trim_start();
    if rest.starts_with('(') {
        let (inner, _) =
            bracketed(rest, '(', ')').ok_or_else(|| sig_err("unbalanced parentheses in the result list".into()))?;
        return parse_list(inner);
    }
    let (ty, _) = bracketed(rest.strip_prefix("tensor").unwrap_or(""), '<', '>')
        .ok_or_else(|| sig_err(format!("cannot read the result type at `{}`", head(rest))))?;
    Ok(vec![ArgType::parse(&format!("tensor<{ty}>"))?])
}

fn head(text: &str) -> &str {
    let end = text.char_indices().nth(40).map(|(i, _)| i).unwrap_or(text.len());
    &text[..end]
}

impl Signature {
    /// Reads the signature of `func.func ... @main(...)` from StableHLO text.
    pub fn from_stablehlo(text: &str) -> Result<Self> {
        let start = text.find("@main(").ok_or_else(|| sig_err("no `@main(` function in the program".into()))?;
        let after = &text[start + "@main".len()..];
        let (args, rest) = bracketed(after, '(', ')')
            .ok_or_else(|| sig_err("unbalanced parentheses in the @main argument list".into()))?;
        Ok(Signature { inputs: parse_list(args)?, outputs: parse_results(rest)? })
    }

    /// Parses the Display form, `(types) -> (types)`.
    pub fn parse_function_type(text: &str) -> Result<Self> {
        let text = text.trim();
        let (args, rest) =
            bracketed(text, '(', ')').ok_or_else(|| sig_err(format!("`{}` is not a function type", head(text))))?;
        Ok(Signature { inputs: parse_list(args)?, outputs: parse_results(rest)? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_main_with_attributes_and_result_list() {
        let text = r#"module @m { func.func public @main(%arg0: tensor<4x3xf32> {tf.aliasing_output = 0 : i32}, %b: tensor<f32>, %c: tensor<2xi1>) -> (tensor<4xbf16> {jax.result_info = "a, b"}, tensor<ui8>) { return } }"#;
        let sig = Signature::from_stablehlo(text).unwrap();
        assert_eq!(sig.to_string(), "(tensor<4x3xf32>, tensor<f32>, tensor<2xi1>) -> (tensor<4xbf16>, tensor<ui8>)");
        assert_eq!(Signature::parse_function_type(&sig.to_string()).unwrap(), sig);
    }

    #[test]
    fn parses_single_result_and_no_args() {
        let sig = Signature::from_stablehlo("func.func @main() -> tensor<2x2xi64> {").unwrap();
        assert_eq!(sig.to_string(), "() -> (tensor<2x2xi64>)");
    }

    #[test]
    fn rejects_dynamic_and_unknown() {
        assert!(Signature::from_stablehlo("func.func @main(%a: tensor<?xf32>) -> tensor<f32>").is_err());
        assert!(Signature::from_stablehlo("func.func @main(%a: tensor<2xc64>)").is_err());
        assert!(Signature::from_stablehlo("func.func @other()").is_err());
    }
}
