//! The target preparation ([`kiln_compiler::lower::prepare`]) and what the
//! printer writes for partitioned modules: the target passes report, verify
//! and show their graphs, printing a prepared graph is the lowering, and
//! `whole` is a sharding constraint only where the module is partitioned.

// Test helpers may unwrap (the workspace denies it in library code).
#![allow(clippy::unwrap_used)]

use kiln_compiler::ir::{AttentionAttrs, DType, Graph, Literal, Op, TensorType, UnaryOp, ValueId};
use kiln_compiler::lower::{self, prepare, TARGET_PASSES};
use kiln_compiler::{LowerOptions, LowerTarget};

type Result<T> = std::result::Result<T, kiln_compiler::CompileError>;

/// Causal attention and its gradient on fresh bf16 operands.
fn attention() -> Result<Graph> {
    let mut g = Graph::new();
    let ty = TensorType::new(DType::BF16, [2, 3, 16, 8]);
    let [q, k, v, dout] = [0; 4].map(|_| g.parameter(ty.clone()));
    let attrs = AttentionAttrs::new(1.0 / 8f64.sqrt(), true);
    let a = g.add(Op::Attention { q, k, v, bias: vec![], mask: None, attrs })?;
    let (out, stats) = (ValueId::new(a, 0), ValueId::new(a, 1));
    let gr = g.add(Op::AttentionGrad { q, k, v, bias: vec![], mask: None, out, stats, dout, attrs })?;
    g.set_outputs(vec![out, ValueId::new(gr, 0), ValueId::new(gr, 1), ValueId::new(gr, 2)])?;
    Ok(g)
}

/// On the CPU the attention composites expand into plain ops in
/// `expand_composites`, which the observer sees and the stats count; the
/// printed module is `lower()`'s, byte for byte, on both targets.
#[test]
fn target_passes_report_and_show_what_they_did() -> Result<()> {
    let g = attention()?;
    for target in [LowerTarget::Cpu, LowerTarget::Cuda] {
        let opts = LowerOptions { target, ..LowerOptions::default() };
        let mut seen = Vec::new();
        let p = prepare(&g, &opts, true, &mut |name, graph| seen.push((name.to_string(), graph.len())))?;
        let names: Vec<&str> = p.stats.iter().map(|s| s.name).collect();
        assert_eq!(names, TARGET_PASSES);
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(seen[0], ("expand_composites".to_string(), p.graph.len()));
        let composites = p.graph.nodes().filter(|(_, n)| n.op.props().composite).count();
        match target {
            LowerTarget::Cpu => {
                assert_eq!(p.stats[0].changed, 2, "{:?}", p.stats[0]);
                assert_eq!(composites, 0);
                assert!(p.graph.len() > g.len());
            }
            LowerTarget::Cuda => assert_eq!(p.stats[0].changed, 0, "{:?}", p.stats[0]),
        }
        assert_eq!(lower::print(&p)?, lower::lower(&g, &opts)?);
    }
    Ok(())
}

/// Options no module can be written for are refused before any pass.
#[test]
fn bad_options_are_refused_before_the_passes_run() -> Result<()> {
    let g = attention()?;
    let mut ran = false;
    let err = prepare(&g, &LowerOptions { num_replicas: 0, ..LowerOptions::default() }, true, &mut |_, _| ran = true)
        .unwrap_err();
    assert!(err.to_string().contains("num_replicas must be at least 1"), "{err}");
    assert!(!ran);
    Ok(())
}

/// `whole`: a replicated sharding constraint in a partitioned module, on
/// either target, and nothing in a module without shardings; the identity on
/// values, and its text form round-trips.
#[test]
fn whole_is_a_replicated_constraint_only_where_the_module_is_partitioned() -> Result<()> {
    let mut g = Graph::new();
    let w = g.parameter(TensorType::new(DType::F32, [8, 4]));
    let x = g.value(Op::Whole { input: w })?;
    let y = g.value(Op::Unary { op: UnaryOp::Exp, input: x })?;
    g.set_outputs(vec![y])?;
    let shardings = kiln_compiler::ModuleShardings {
        num_partitions: 2,
        params: vec!["{devices=[2,1]<=[2]}".into()],
        outputs: vec!["{replicated}".into()],
        attention: None,
    };
    for target in [LowerTarget::Cpu, LowerTarget::Cuda] {
        let split =
            lower::lower(&g, &LowerOptions { target, shardings: Some(shardings.clone()), ..LowerOptions::default() })?;
        assert_eq!(split.matches("@Sharding").count(), 1, "{split}");
        assert!(
            split.contains(
                "stablehlo.custom_call @Sharding(%arg0) {mhlo.sharding = \"{replicated}\"} : (tensor<8x4xf32>) -> tensor<8x4xf32>"
            ),
            "{split}"
        );
        let single = lower::lower(&g, &LowerOptions { target, ..LowerOptions::default() })?;
        assert!(!single.contains("custom_call") && single.contains("stablehlo.exponential %arg0"), "{single}");
    }
    let text = kiln_compiler::text::print(&g);
    assert!(text.contains("whole %"), "{text}");
    assert_eq!(kiln_compiler::text::print(&kiln_compiler::text::parse(&text)?), text);
    let v: Vec<f64> = (0..32).map(|i| (i as f64 * 0.37).sin()).collect();
    let lit = Literal::from_f64s(DType::F32, [8, 4], &v)?;
    let want: Vec<f64> = v.iter().map(|x| (*x as f32).exp() as f64).collect();
    let got = kiln_compiler::interpret(&g, &[lit])?[0].to_f64s();
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "{a} vs {b}");
    }
    Ok(())
}
