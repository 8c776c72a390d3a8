//! Rewriting by equality saturation (egg).
//!
//! The graph becomes an e-graph of [`TensorLang`] nodes whose e-class analysis
//! carries each class's output types (inferred from operand types alone, by
//! [`crate::ir::infer::infer_types`]) and, for small constants, the literal.
//! Rules (data, one topic a file under `rules/`) add equalities; the runner
//! applies them under explicit limits with a backoff scheduler; extraction
//! picks, per class, the node of least cost under the cost model and rebuilds a
//! `Graph`.
//!
//! Invariants and guarantees:
//! - Every rule is an identity of the op semantics as the reference interpreter
//!   and XLA define them, bit for bit (float reassociation is never used: no
//!   associativity or commutativity rules).
//! - A union of classes with different types, or a rule that builds an
//!   ill-typed node, is a bug in the rule: the runner returns
//!   [`CompileError::Rewrite`] naming it, and never a wrong graph.
//! - A runner that hits a limit (nodes, iterations, time) stops there and the
//!   best graph found so far is extracted; the report says why it stopped.
//! - Parameters keep their indices; outputs and aliases keep their positions.
//! - Deterministic: classes are visited in id order and ties in extraction are
//!   broken by class and node order, so equal graphs rewrite to equal graphs
//!   (the compile cache keys on the result).

mod analysis;
mod extract;
mod lang;
pub mod rules;

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

pub use analysis::{ClassData, TypeAnalysis};
pub use lang::{enode, holed, needs_token, to_op, TensorLang};
pub use rules::{Rhs, Rule, GRAPH_RULE_SETS, RULE_SETS};

use crate::ir::Graph;
use crate::CompileError;

/// The e-graph kiln rewrites in.
pub type EGraph = egg::EGraph<TensorLang, TypeAnalysis>;

/// Limits and rule selection of one rewrite run.
#[derive(Clone, Debug, PartialEq)]
pub struct RewriteOptions {
    /// Stop when the e-graph holds more e-nodes than this.
    pub node_limit: usize,
    /// Stop after this many iterations (search all rules, apply, rebuild).
    pub iteration_limit: usize,
    /// Stop when this much time has passed (checked between rules).
    pub time_limit_ms: u64,
    /// A rule with more matches than this in one iteration is banned for a
    /// while (backoff); both double each time it is banned again.
    pub match_limit: usize,
    pub ban_length_iterations: usize,
    /// Rule sets to use, by name (see [`RULE_SETS`]); all when `None`.
    pub rule_sets: Option<Vec<String>>,
}

impl Default for RewriteOptions {
    fn default() -> RewriteOptions {
        RewriteOptions {
            node_limit: 400_000,
            iteration_limit: 12,
            time_limit_ms: 1_500,
            match_limit: 20_000,
            ban_length_iterations: 2,
            rule_sets: None,
        }
    }
}

/// Why the runner stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// No rule changed the e-graph: every equality the rules know is in it.
    Saturated,
    IterationLimit {
        iterations: usize,
    },
    NodeLimit {
        nodes: usize,
    },
    TimeLimit {
        ms: u64,
    },
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StopReason::Saturated => write!(f, "saturated"),
            StopReason::IterationLimit { iterations } => write!(f, "iteration limit ({iterations})"),
            StopReason::NodeLimit { nodes } => write!(f, "node limit ({nodes} e-nodes)"),
            StopReason::TimeLimit { ms } => write!(f, "time limit ({ms} ms)"),
        }
    }
}

/// What a rewrite run did.
#[derive(Clone, Debug, PartialEq)]
pub struct RewriteReport {
    /// Unions each rule made that changed the e-graph, by rule name.
    pub rules_fired: BTreeMap<&'static str, usize>,
    pub stop_reason: StopReason,
    pub iterations: usize,
    pub egraph_nodes: usize,
    pub egraph_classes: usize,
    pub time: Duration,
}

/// The rewritten graph and the report.
#[derive(Clone, Debug)]
pub struct Rewritten {
    pub graph: Graph,
    pub report: RewriteReport,
}

/// Rewrites `g` with the selected rule sets and extracts the cheapest
/// equivalent graph. The `matmul` set's graph rule (merging products of one
/// operand, [`rules::matmul::merge_matmuls`]) is not an e-graph rule: the
/// pipeline runs it as its own pass, `merge_matmuls`, after this one.
pub fn rewrite(g: &Graph, opts: &RewriteOptions) -> Result<Rewritten, CompileError> {
    let rules = rules::select(opts.rule_sets.as_deref())?;
    rewrite_with(g, opts, &rules)
}

/// Rewrites `g` with the given rules (`opts.rule_sets` is ignored): the
/// runner itself, for tests and for callers with rules of their own.
pub fn rewrite_with(g: &Graph, opts: &RewriteOptions, rules: &[Rule]) -> Result<Rewritten, CompileError> {
    let started = Instant::now();
    let extract::Encoded { egraph: mut eg, roots, places } = extract::to_egraph(g)?;
    let mut fired: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut banned_until = vec![0usize; rules.len()];
    let mut times_banned = vec![0u32; rules.len()];
    let mut stop = StopReason::IterationLimit { iterations: opts.iteration_limit };
    let mut iterations = 0;
    'outer: for iter in 0..opts.iteration_limit {
        iterations = iter + 1;
        let mut changed = false;
        let mut any_banned = false;
        // Classes in id order: the search order, and so the result, is deterministic.
        let mut classes: Vec<egg::Id> = eg.classes().map(|c| c.id).collect();
        classes.sort();
        for (ri, rule) in rules.iter().enumerate() {
            if started.elapsed() > Duration::from_millis(opts.time_limit_ms) {
                stop = StopReason::TimeLimit { ms: opts.time_limit_ms };
                break 'outer;
            }
            if banned_until[ri] > iter {
                any_banned = true;
                continue;
            }
            let mut matches: Vec<(egg::Id, Rhs)> = Vec::new();
            for &c in &classes {
                for n in &eg[c].nodes {
                    if let TensorLang::Op { op, children, .. } = n {
                        for rhs in (rule.find)(&eg, op, children) {
                            matches.push((c, rhs));
                        }
                    }
                }
            }
            let limit = opts.match_limit.saturating_mul(1 << times_banned[ri].min(16));
            if matches.len() > limit {
                banned_until[ri] = iter + (opts.ban_length_iterations << times_banned[ri].min(16));
                times_banned[ri] += 1;
                any_banned = true;
                continue;
            }
            let mut rule_changed = false;
            for (c, rhs) in matches {
                let new = rules::add_rhs(&mut eg, &rhs)
                    .map_err(|reason| CompileError::Rewrite { rule: rule.name, reason })?;
                if eg.union(c, new) {
                    *fired.entry(rule.name).or_insert(0) += 1;
                    rule_changed = true;
                }
                if let Some(reason) = eg.analysis.errors.first() {
                    return Err(CompileError::Rewrite { rule: rule.name, reason: reason.clone() });
                }
            }
            if rule_changed {
                // The next rule searches a canonical e-graph.
                eg.rebuild();
                classes = eg.classes().map(|c| c.id).collect();
                classes.sort();
                changed = true;
            }
        }
        eg.rebuild();
        if let Some(reason) = eg.analysis.errors.first() {
            return Err(CompileError::Rewrite { rule: "rebuild", reason: reason.clone() });
        }
        if eg.total_number_of_nodes() > opts.node_limit {
            stop = StopReason::NodeLimit { nodes: eg.total_number_of_nodes() };
            break;
        }
        if !changed && !any_banned {
            stop = StopReason::Saturated;
            break;
        }
    }
    let graph = extract::from_egraph(&eg, g, &roots, &places)?;
    let report = RewriteReport {
        rules_fired: fired,
        stop_reason: stop,
        iterations,
        egraph_nodes: eg.total_number_of_nodes(),
        egraph_classes: eg.number_of_classes(),
        time: started.elapsed(),
    };
    Ok(Rewritten { graph, report })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, Literal, Op, Shape, TensorType, UnaryOp};

    /// `tanh(transpose(transpose(x)))` over a [2, 3] parameter, with a `* 1`.
    fn sample() -> Graph {
        let mut g = Graph::new();
        let x = g.parameter(TensorType::new(DType::F32, [2, 3]));
        let t1 = g.value(Op::Transpose { input: x, perm: vec![1, 0] }).unwrap();
        let t2 = g.value(Op::Transpose { input: t1, perm: vec![1, 0] }).unwrap();
        let one =
            g.value(Op::Constant { literal: Literal::from_f64s(DType::F32, [2, 3], &[1.0; 6]).unwrap() }).unwrap();
        let m = g.value(Op::Binary { op: crate::ir::BinaryOp::Mul, lhs: t2, rhs: one }).unwrap();
        let y = g.value(Op::Unary { op: UnaryOp::Tanh, input: m }).unwrap();
        g.set_outputs(vec![y]).unwrap();
        g
    }

    fn reshape_to_wrong_type(eg: &EGraph, op: &Op, kids: &[egg::Id]) -> Vec<Rhs> {
        // A broken rule: claims tanh(x) equals reshape(x) to another shape.
        match op {
            Op::Unary { op: UnaryOp::Tanh, .. } => match eg[kids[0]].data.ty() {
                Some(t) => vec![Rhs::node(
                    Op::Reshape { input: rules::hole(), shape: Shape::new([t.shape.num_elements()]) },
                    vec![Rhs::Class(kids[0])],
                )],
                None => vec![],
            },
            _ => vec![],
        }
    }

    #[test]
    fn a_rule_that_breaks_types_is_an_error_naming_it() {
        let bad = Rule { name: "bad-reshape", algebra: "tanh(x) = reshape(x)", find: reshape_to_wrong_type };
        match rewrite_with(&sample(), &RewriteOptions::default(), &[bad]) {
            Err(CompileError::Rewrite { rule, reason }) => {
                assert_eq!(rule, "bad-reshape");
                assert!(reason.contains("tensor<6xf32>") && reason.contains("tensor<2x3xf32>"), "{reason}");
            }
            other => panic!("expected a rewrite error, got {other:?}"),
        }
    }

    #[test]
    fn saturates_and_reports_rules_fired() {
        let out = rewrite(&sample(), &RewriteOptions::default()).unwrap();
        assert_eq!(out.report.stop_reason, StopReason::Saturated);
        // Fires on t2 = T(T(x)), and again on t1 = T(x) once x's class holds T(t1).
        assert!(out.report.rules_fired.get("transpose-transpose").is_some_and(|&n| n >= 1));
        assert_eq!(out.report.rules_fired.get("mul-one"), Some(&1));
        // x, tanh: the transposes and the multiply are gone.
        assert_eq!(out.graph.len(), 2, "{}", crate::text::print(&out.graph));
        crate::verify(&out.graph).unwrap();
    }

    #[test]
    fn limits_stop_the_runner_with_the_best_graph_so_far() {
        let g = sample();
        let inputs = [Literal::from_f64s(DType::F32, [2, 3], &[0.5, -1.0, 2.0, 0.25, -0.75, 3.0]).unwrap()];
        let want = crate::interpret(&g, &inputs).unwrap();
        let cases = [
            (RewriteOptions { iteration_limit: 1, ..RewriteOptions::default() }, "iteration limit (1)"),
            (RewriteOptions { node_limit: 1, ..RewriteOptions::default() }, "node limit"),
            (RewriteOptions { time_limit_ms: 0, ..RewriteOptions::default() }, "time limit (0 ms)"),
        ];
        for (opts, reason) in cases {
            let out = rewrite(&g, &opts).unwrap();
            assert!(out.report.stop_reason.to_string().starts_with(reason), "{}", out.report.stop_reason);
            crate::verify(&out.graph).unwrap();
            assert_eq!(crate::interpret(&out.graph, &inputs).unwrap(), want);
            assert!(out.graph.len() <= g.len());
        }
    }

    #[test]
    fn backoff_bans_a_rule_with_too_many_matches_and_does_not_call_that_saturation() {
        let opts = RewriteOptions { match_limit: 0, iteration_limit: 3, ..RewriteOptions::default() };
        let out = rewrite(&sample(), &opts).unwrap();
        // Every rule with a match is banned, so nothing fires and the runner
        // cannot claim saturation.
        assert!(out.report.rules_fired.is_empty(), "{:?}", out.report.rules_fired);
        assert_eq!(out.report.stop_reason, StopReason::IterationLimit { iterations: 3 });
    }

    #[test]
    fn unknown_rule_sets_are_a_typed_error() {
        let opts = RewriteOptions { rule_sets: Some(vec!["nope".into()]), ..RewriteOptions::default() };
        assert!(matches!(rewrite(&sample(), &opts), Err(CompileError::UnknownPass { .. })));
    }
}
