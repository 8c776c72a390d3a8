//! The attention composite: the composite op on the reference interpreter
//! (written from its definition) against its plain expansion (the lowering
//! every non-CUDA target uses), on the interpreter and through the XLA CPU
//! plugin; and, with `PJRT_DEVICE=CUDA`, cuDNN's fused kernels against the plain
//! lowering on the device. Fresh random inputs each run (seeded from the clock,
//! printed on failure).
//!
//! Tolerances, relative to max(1, |reference|): f64 1e-10, f32 1e-4 (XLA's
//! exp/log approximations and a different summation order over up to 64 keys),
//! bf16 0.05 (bf16 has 8 significant bits and the expansion rounds the
//! probabilities to bf16 before `p · v`; cuDNN keeps them in f32).

use kiln::compiler::composite;
use kiln::compiler::ir::{AttentionAttrs, DType, Graph, Literal, Op, TensorType, ValueId};
use kiln::compiler::{interpret, lower, LowerOptions, LowerTarget};
use kiln::runtime::{Client, ClientOptions, CompileOptions, ExecArg, PjrtDevice};

mod common;
use common::Rng;

fn seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64)
}

/// Parameters q, k, v, dout `[b, h, t, d]`; outputs out, stats, dq, dk, dv.
fn attention_graph(dtype: DType, dims: [usize; 4], attrs: AttentionAttrs) -> Graph {
    let mut g = Graph::new();
    let ty = TensorType::new(dtype, dims.to_vec());
    let [q, k, v, dout] = [0; 4].map(|_| g.parameter(ty.clone()));
    let a = g.add(Op::Attention { q, k, v, bias: vec![], mask: None, attrs }).unwrap();
    let (out, stats) = (ValueId::new(a, 0), ValueId::new(a, 1));
    let gr = g.add(Op::AttentionGrad { q, k, v, bias: vec![], mask: None, out, stats, dout, attrs }).unwrap();
    g.set_outputs(vec![out, stats, ValueId::new(gr, 0), ValueId::new(gr, 1), ValueId::new(gr, 2)]).unwrap();
    g
}

fn inputs(g: &Graph, rng: &mut Rng) -> Vec<Literal> {
    g.param_types()
        .iter()
        .map(|t| {
            let v: Vec<f64> = (0..t.shape.num_elements()).map(|_| rng.normal()).collect();
            Literal::from_f64s(t.dtype, t.shape.clone(), &v).unwrap()
        })
        .collect()
}

fn max_rel_err(a: &Literal, b: &Literal) -> f64 {
    assert_eq!(a.ty(), b.ty());
    a.to_f64s().iter().zip(b.to_f64s()).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f64::max)
}

const NAMES: [&str; 5] = ["out", "stats", "dq", "dk", "dv"];

fn assert_all_close(what: &str, got: &[Literal], want: &[Literal], tol: f64, seed: u64) {
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let e = max_rel_err(a, b);
        eprintln!("{what}: {} max relative error {e:.3e}", NAMES[i]);
        assert!(e <= tol, "{what}: {} differs by {e} > {tol} (seed {seed})", NAMES[i]);
    }
}

fn run(c: &Client, g: &Graph, target: LowerTarget, inputs: &[Literal]) -> Vec<Literal> {
    let text = lower(g, &LowerOptions { target, ..LowerOptions::default() }).unwrap();
    let exe = c.compile(&text, &CompileOptions::default()).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let dev = &c.devices()[0];
    let bufs: Vec<_> = inputs
        .iter()
        .map(|l| c.buffer_from_bytes(l.bytes(), kiln::element_type(l.ty().dtype), l.ty().shape.dims(), dev).unwrap())
        .collect();
    let args: Vec<ExecArg> = bufs.iter().map(ExecArg::Borrowed).collect();
    exe.execute(&args)
        .unwrap()
        .iter()
        .zip(g.output_types())
        .map(|(b, ty)| Literal::from_bytes(ty, b.to_host_bytes().unwrap()).unwrap())
        .collect()
}

const CASES: [(bool, [usize; 4]); 3] = [(true, [2, 3, 7, 8]), (false, [1, 2, 5, 16]), (true, [1, 1, 64, 32])];

#[test]
fn composite_matches_its_expansion_on_the_interpreter() {
    let s = seed();
    let mut rng = Rng::new(s);
    for dtype in [DType::F64, DType::F32] {
        for (causal, dims) in CASES {
            let scale = 0.3 + rng.uniform();
            let g = attention_graph(dtype, dims, AttentionAttrs::new(scale, causal));
            let x = inputs(&g, &mut rng);
            let plain = composite::expand(&g, LowerTarget::Cpu).unwrap();
            assert!(plain.nodes().all(|(_, n)| !matches!(n.op, Op::Attention { .. } | Op::AttentionGrad { .. })));
            let tol = if dtype == DType::F64 { 1e-10 } else { 1e-4 };
            let what = format!("{dtype} causal={causal} {dims:?}");
            assert_all_close(&what, &interpret(&plain, &x).unwrap(), &interpret(&g, &x).unwrap(), tol, s);
        }
    }
}

#[test]
fn composite_runs_through_the_xla_cpu_plugin() {
    let s = seed();
    let mut rng = Rng::new(s);
    let c = Client::new(&ClientOptions::default()).unwrap();
    // With PJRT_DEVICE=CUDA this runs on the GPU, whose f32 dots use TF32
    // (10-bit mantissa).
    let f32_tol = if c.platform_name() == "cpu" { 1e-4 } else { 5e-3 };
    for (dtype, tol) in [(DType::F32, f32_tol), (DType::BF16, 0.05)] {
        for (causal, dims) in CASES {
            let g = attention_graph(dtype, dims, AttentionAttrs::new(1.0 / (dims[3] as f64).sqrt(), causal));
            let x = inputs(&g, &mut rng);
            let what = format!("xla cpu {dtype} causal={causal} {dims:?}");
            assert_all_close(&what, &run(&c, &g, LowerTarget::Cpu, &x), &interpret(&g, &x).unwrap(), tol, s);
        }
    }
}

/// On CPU: the CUDA lowering holds the two custom calls and the CPU lowering
/// none. With `PJRT_DEVICE=CUDA`: cuDNN's outputs and gradients equal the plain
/// lowering's on the device (bf16, gpt2-small's head size).
#[test]
fn cudnn_lowering_matches_the_plain_lowering() {
    let g = attention_graph(DType::BF16, [2, 4, 128, 64], AttentionAttrs::new(0.125, true));
    let fused = lower(&g, &LowerOptions { target: LowerTarget::Cuda, ..LowerOptions::default() }).unwrap();
    let plain = lower(&g, &LowerOptions::default()).unwrap();
    assert!(fused.contains("@__cudnn$fmhaSoftmax(") && fused.contains("@__cudnn$fmhaSoftmaxBackward("));
    assert!(!plain.contains("custom_call"));
    if PjrtDevice::from_env().unwrap() != PjrtDevice::Cuda {
        return;
    }
    let s = seed();
    let c = Client::new(&ClientOptions::default()).unwrap();
    for (causal, dims) in [(true, [2, 4, 128, 64]), (false, [2, 12, 256, 64]), (true, [1, 2, 512, 128])] {
        let g = attention_graph(DType::BF16, dims, AttentionAttrs::new(1.0 / (dims[3] as f64).sqrt(), causal));
        let x = inputs(&g, &mut Rng::new(s ^ dims[2] as u64));
        let (f, p) = (run(&c, &g, LowerTarget::Cuda, &x), run(&c, &g, LowerTarget::Cpu, &x));
        assert_all_close(&format!("cuda: cudnn vs plain causal={causal} {dims:?}"), &f, &p, 0.05, s);
        assert_all_close(
            &format!("cuda: cudnn vs interpreter causal={causal} {dims:?}"),
            &f,
            &interpret(&g, &x).unwrap(),
            0.05,
            s,
        );
    }
}

/// `layers` attention layers, each reading the previous one's output as its
/// queries, keys and values, then their gradients in reverse (the cotangent
/// of each layer's input is `dq + dk + dv`); parameters x `[b, h, t, d]` and
/// the last output's cotangent; outputs the last output and x's cotangent.
fn stack_graph(dims: [usize; 4], layers: usize) -> Graph {
    let mut g = Graph::new();
    let ty = TensorType::new(DType::F32, dims.to_vec());
    let x = g.parameter(ty.clone());
    let attrs = AttentionAttrs::new(1.0 / (dims[3] as f64).sqrt(), true);
    let mut saved = Vec::new();
    let mut h = x;
    for _ in 0..layers {
        let a = g.add(Op::Attention { q: h, k: h, v: h, bias: vec![], mask: None, attrs }).unwrap();
        saved.push((h, ValueId::new(a, 0), ValueId::new(a, 1)));
        h = ValueId::new(a, 0);
    }
    let mut d = g.parameter(ty);
    for &(x, out, stats) in saved.iter().rev() {
        let gr = g
            .add(Op::AttentionGrad { q: x, k: x, v: x, bias: vec![], mask: None, out, stats, dout: d, attrs })
            .unwrap();
        let add = kiln::compiler::ir::BinaryOp::Add;
        let s = g.value(Op::Binary { op: add, lhs: ValueId::new(gr, 0), rhs: ValueId::new(gr, 1) }).unwrap();
        d = g.value(Op::Binary { op: add, lhs: s, rhs: ValueId::new(gr, 2) }).unwrap();
    }
    g.set_outputs(vec![h, d]).unwrap();
    g
}

/// XLA's CPU pipeline drops optimization barriers before its CSE, which
/// merged the backward's recomputed scores `q·kᵀ` with the forward's and kept
/// every layer's scores from the forward to its backward. The CPU expansion
/// reads q through a runtime guard on the cotangent (`kiln::compiler`'s
/// fence): the same values bit for bit on the interpreter, and XLA's temp no
/// longer grows with depth, where the unguarded expansion (the CUDA target's,
/// which keeps barriers) holds one more layer of scores per layer.
#[test]
fn the_cpu_backward_recomputes_the_scores_under_xla() {
    let dims = [1, 4, 256, 16];
    let scores = (dims[0] * dims[1] * dims[2] * dims[2] * 4) as i64;
    let c = Client::new(&ClientOptions::default()).unwrap();
    let temp = |g: &Graph| {
        let text = lower(g, &LowerOptions::default()).unwrap();
        c.compile(&text, &CompileOptions::default()).unwrap().compiled_memory_stats().unwrap().temp_size_in_bytes
    };
    let mut temps = Vec::new();
    for layers in [2, 6] {
        let g = stack_graph(dims, layers);
        let guarded = composite::expand(&g, LowerTarget::Cpu).unwrap();
        let unguarded = composite::expand(&g, LowerTarget::Cuda).unwrap();
        let x = inputs(&g, &mut Rng::new(seed()));
        let (a, b) = (interpret(&guarded, &x).unwrap(), interpret(&unguarded, &x).unwrap());
        assert!(a.iter().zip(&b).all(|(a, b)| a.bytes() == b.bytes()), "the guard changed a value");
        if c.platform_name() != "cpu" {
            return;
        }
        let (with, without) = (temp(&guarded), temp(&unguarded));
        eprintln!("{layers} layers, scores {scores} B each: XLA CPU temp {with} B guarded, {without} B unguarded");
        temps.push((with, without));
    }
    let [(with2, without2), (with6, without6)] = temps[..] else { unreachable!() };
    assert!(with6 < with2 + scores, "guarded: {with2} B at 2 layers, {with6} B at 6 (scores {scores} B)");
    assert!(
        without6 >= without2 + 3 * scores,
        "unguarded: {without2} B at 2 layers, {without6} B at 6; if XLA keeps the recomputation now, the guard is not needed"
    );
}
