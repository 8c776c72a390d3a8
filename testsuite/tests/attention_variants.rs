//! The attention composite's general form: bias terms, a pred mask (either
//! sense), grouped and tiled key/value heads, a transposed k, cross-attention.
//! For each variant: the reference interpreter (written from the definition)
//! against the plain expansion on the interpreter (f64, 1e-10) and through
//! the XLA CPU plugin (f32, 1e-4); the reference gradients against central
//! finite differences of the reference forward (f64, 1e-6 relative to
//! max(1, |g|)); and the CUDA lowering's form: which cuDNN call, whether the
//! bias gradient comes from cuDNN or the attention stays plain, and why.
//! With `PJRT_DEVICE=CUDA`, cuDNN against the plain lowering on the device.
//! Fresh random inputs each run (seed printed on failure).

use kiln::compiler::composite;
use kiln::compiler::ir::{AttentionAttrs, DType, Graph, KvHeads, Literal, Op, TensorType, ValueId};
use kiln::compiler::{interpret, lower, LowerOptions, LowerTarget};
use kiln::runtime::{Client, ClientOptions, CompileOptions, ExecArg, PjrtDevice};

mod common;
use common::Rng;

fn seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(11, |d| d.as_nanos() as u64)
}

/// One attention's sizes and attributes.
#[derive(Clone, Debug)]
struct Variant {
    name: &'static str,
    /// b, hq, hkv, t, s, d
    dims: [usize; 6],
    causal: bool,
    kv_heads: KvHeads,
    k_transposed: bool,
    /// Shapes of the bias terms, `[b|1, h|1, t|1, s|1]`.
    bias: Vec<[usize; 4]>,
    /// The mask's shape and the value that keeps a score.
    mask: Option<([usize; 4], bool)>,
}

fn variants() -> Vec<Variant> {
    let v = |name, dims, causal| Variant {
        name,
        dims,
        causal,
        kv_heads: KvHeads::Grouped,
        k_transposed: false,
        bias: vec![],
        mask: None,
    };
    vec![
        Variant { ..v("grouped-query, causal", [2, 4, 2, 6, 6, 8], true) },
        Variant { kv_heads: KvHeads::Tiled, ..v("tiled heads", [1, 6, 2, 5, 5, 4], false) },
        Variant { k_transposed: true, ..v("transposed k, multi-query", [2, 3, 1, 4, 4, 8], true) },
        Variant { bias: vec![[1, 3, 5, 7]], ..v("relative bias, cross-attention", [2, 3, 3, 5, 7, 4], false) },
        Variant { mask: Some(([2, 1, 1, 6], true)), ..v("key padding mask", [2, 2, 2, 4, 6, 8], false) },
        Variant { mask: Some(([1, 1, 5, 5], false)), ..v("mask that drops where true", [1, 2, 2, 5, 5, 4], false) },
        Variant {
            bias: vec![[1, 4, 6, 6], [2, 1, 1, 6]],
            mask: Some(([2, 1, 1, 6], true)),
            ..v("two terms, a mask, causal, grouped", [2, 4, 2, 6, 6, 8], true)
        },
    ]
}

/// Parameters q, k, v, the bias terms, the mask and dout; outputs out, stats,
/// dq, dk, dv and each bias term's gradient.
fn graph(dtype: DType, x: &Variant, scale: f64) -> Graph {
    let [b, hq, hkv, t, s, d] = x.dims;
    let mut g = Graph::new();
    let q = g.parameter(TensorType::new(dtype, vec![b, hq, t, d]));
    let kshape = if x.k_transposed { vec![b, hkv, d, s] } else { vec![b, hkv, s, d] };
    let k = g.parameter(TensorType::new(dtype, kshape));
    let v = g.parameter(TensorType::new(dtype, vec![b, hkv, s, d]));
    // f64 operands take f64 terms, so the f64 checks are f64 throughout.
    let bias_dtype = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
    let bias: Vec<ValueId> = x.bias.iter().map(|sh| g.parameter(TensorType::new(bias_dtype, sh.to_vec()))).collect();
    let mask = x.mask.map(|(sh, _)| g.parameter(TensorType::new(DType::Pred, sh.to_vec())));
    let dout = g.parameter(TensorType::new(dtype, vec![b, hq, t, d]));
    let mut attrs = AttentionAttrs::new(scale, x.causal);
    attrs.kv_heads = x.kv_heads;
    attrs.k_transposed = x.k_transposed;
    if let Some((_, keep)) = x.mask {
        attrs = attrs.with_mask(-1e9, keep);
    }
    let a = g.add(Op::Attention { q, k, v, bias: bias.clone(), mask, attrs }).unwrap();
    let (out, stats) = (ValueId::new(a, 0), ValueId::new(a, 1));
    let gr = g.add(Op::AttentionGrad { q, k, v, bias: bias.clone(), mask, out, stats, dout, attrs }).unwrap();
    let mut outs = vec![out, stats];
    outs.extend((0..3 + bias.len()).map(|i| ValueId::new(gr, i as u32)));
    g.set_outputs(outs).unwrap();
    g
}

/// Fresh inputs for `g`; a mask keeps (holds `keep` at) about three scores in
/// four and the first of every row, so no row is wholly masked.
fn inputs(g: &Graph, keep: bool, rng: &mut Rng) -> Vec<Literal> {
    g.param_types()
        .iter()
        .map(|t| {
            let n = t.shape.num_elements();
            let row = t.shape.dims().last().copied().unwrap_or(1);
            let v: Vec<f64> = if t.dtype == DType::Pred {
                (0..n).map(|i| f64::from(u8::from((i % row == 0 || rng.uniform() < 0.75) == keep))).collect()
            } else {
                (0..n).map(|_| rng.normal()).collect()
            };
            Literal::from_f64s(t.dtype, t.shape.clone(), &v).unwrap()
        })
        .collect()
}

fn keep(x: &Variant) -> bool {
    x.mask.is_none_or(|(_, keep)| keep)
}

fn max_rel_err(a: &Literal, b: &Literal) -> f64 {
    assert_eq!(a.ty(), b.ty());
    a.to_f64s().iter().zip(b.to_f64s()).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f64::max)
}

fn close(what: &str, got: &[Literal], want: &[Literal], tol: f64, seed: u64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let e = max_rel_err(a, b);
        assert!(e <= tol, "{what}: output {i} differs by {e:.3e} > {tol} (seed {seed})");
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

#[test]
fn every_variant_matches_its_expansion_on_the_interpreter_and_xla() {
    let s = seed();
    let mut rng = Rng::new(s);
    let c = Client::new(&ClientOptions::default()).unwrap();
    let f32_tol = if c.platform_name() == "cpu" { 1e-4 } else { 5e-3 };
    for x in variants() {
        let scale = 0.2 + rng.uniform();
        let g = graph(DType::F64, &x, scale);
        let input = inputs(&g, keep(&x), &mut rng);
        let plain = composite::expand(&g, LowerTarget::Cpu).unwrap();
        assert!(plain.nodes().all(|(_, n)| !composite::is_composite(&n.op)), "{}: expanded", x.name);
        close(
            &format!("{} f64 expansion", x.name),
            &interpret(&plain, &input).unwrap(),
            &interpret(&g, &input).unwrap(),
            1e-10,
            s,
        );

        let g = graph(DType::F32, &x, scale);
        let input = inputs(&g, keep(&x), &mut rng);
        let want = interpret(&g, &input).unwrap();
        close(&format!("{} f32 through XLA", x.name), &run(&c, &g, LowerTarget::Cpu, &input), &want, f32_tol, s);
    }
}

/// `Σ out · w` of the forward alone, for finite differences.
fn forward_loss(g: &Graph, input: &[Literal], w: &[f64]) -> f64 {
    interpret(g, input).unwrap()[0].to_f64s().iter().zip(w).map(|(o, w)| o * w).sum()
}

#[test]
fn reference_gradients_match_finite_differences() {
    let s = seed();
    let mut rng = Rng::new(s ^ 0x5eed);
    for x in variants() {
        let g = graph(DType::F64, &x, 0.4);
        let input = inputs(&g, keep(&x), &mut rng);
        let dout_at = g.param_types().len() - 1;
        let w = input[dout_at].to_f64s();
        let analytic = interpret(&g, &input).unwrap();
        // Operands with gradients: q, k, v, then the bias terms (outputs 2..).
        let positions: Vec<usize> = (0..3 + x.bias.len()).collect();
        for (i, &p) in positions.iter().enumerate() {
            let param = p;
            let n = input[param].ty().shape.num_elements();
            for _ in 0..4 {
                let at = (rng.uniform() * n as f64) as usize;
                let h = 1e-5;
                let mut plus = input.clone();
                let mut minus = input.clone();
                let mut vals = input[param].to_f64s();
                vals[at] += h;
                plus[param] = Literal::from_f64s(DType::F64, input[param].ty().shape.clone(), &vals).unwrap();
                vals[at] -= 2.0 * h;
                minus[param] = Literal::from_f64s(DType::F64, input[param].ty().shape.clone(), &vals).unwrap();
                let numeric = (forward_loss(&g, &plus, &w) - forward_loss(&g, &minus, &w)) / (2.0 * h);
                let got = analytic[2 + i].to_f64s()[at];
                let err = (got - numeric).abs() / numeric.abs().max(1.0);
                assert!(
                    err < 1e-6,
                    "{}: d{} [{at}] = {got}, finite difference {numeric} (seed {s})",
                    x.name,
                    ["q", "k", "v", "bias0", "bias1"][i]
                );
            }
        }
    }
}

/// Each composite's CUDA decision: fused, or the reason it is not.
fn decision(g: &Graph) -> Vec<Result<(), String>> {
    composite::decisions(g, LowerTarget::Cuda).into_iter().map(|d| d.fused).collect()
}

#[test]
fn the_cuda_form_of_each_variant_names_its_call_or_its_reason() {
    for x in variants() {
        let mut g = graph(DType::BF16, &x, 0.25);
        // Only dq, dk, dv read: no bias gradient wanted.
        let outs: Vec<ValueId> = g.outputs()[..5].to_vec();
        g.set_outputs(outs).unwrap();
        let text = lower(&g, &LowerOptions { target: LowerTarget::Cuda, ..LowerOptions::default() }).unwrap();
        let biased = !x.bias.is_empty() || x.mask.is_some();
        let (fwd, bwd) = if biased {
            ("@__cudnn$fmhaScaleBiasSoftmax(", "@__cudnn$fmhaScaleBiasSoftmaxBackward(")
        } else {
            ("@__cudnn$fmhaSoftmax(", "@__cudnn$fmhaSoftmaxBackward(")
        };
        let odd = biased && (x.dims[3] % 2 != 0 || x.dims[4] % 2 != 0);
        let head_ok = x.dims[5] % 8 == 0;
        if odd || !head_ok {
            assert!(!text.contains("custom_call @__cudnn"), "{}: fused though not fusable", x.name);
            assert!(decision(&g).iter().all(Result::is_err), "{}", x.name);
            continue;
        }
        assert!(text.contains(fwd) && text.contains(bwd), "{}: no {fwd} / {bwd} in\n{text}", x.name);
        assert!(decision(&g).iter().all(Result::is_ok), "{}: {:?}", x.name, decision(&g));
    }
}

#[test]
fn a_bias_gradient_cudnn_cannot_give_keeps_the_attention_plain() {
    // A [1, h, t, s] bias with no mask: cuDNN exports its gradient.
    let x = variants().into_iter().find(|v| v.name.starts_with("relative bias")).unwrap();
    let x = Variant { dims: [2, 4, 4, 8, 8, 8], bias: vec![[1, 4, 8, 8]], ..x };
    let g = graph(DType::BF16, &x, 0.25);
    assert!(decision(&g).iter().all(Result::is_ok), "{:?}", decision(&g));
    let text = lower(&g, &LowerOptions { target: LowerTarget::Cuda, ..LowerOptions::default() }).unwrap();
    assert!(text.contains("@__cudnn$fmhaScaleBiasSoftmaxBackward("));
    // With a key padding mask beside it the bias cuDNN reads has a batch:
    // no gradient from cuDNN, so the backward stays plain, with the reason.
    let x = Variant { mask: Some(([2, 1, 1, 8], true)), ..x };
    let g = graph(DType::BF16, &x, 0.25);
    let reasons = decision(&g);
    assert!(reasons[0].is_ok(), "the forward is fused: {reasons:?}");
    let why = reasons[1].as_ref().expect_err("the backward stays plain");
    assert!(why.contains("bias gradient") && why.contains("[2, 4, 8, 8]"), "{why}");
}

/// With `PJRT_DEVICE=CUDA`: each fusable variant's cuDNN outputs and
/// gradients equal the plain lowering's on the device (bf16).
#[test]
fn cudnn_matches_the_plain_lowering_on_the_device() {
    if PjrtDevice::from_env().unwrap() != PjrtDevice::Cuda {
        return;
    }
    let s = seed();
    let c = Client::new(&ClientOptions::default()).unwrap();
    let sizes = [
        ("grouped 12/4 causal", [2, 12, 4, 128, 128, 64], vec![], None, true),
        ("key padding", [2, 12, 12, 128, 128, 64], vec![], Some(([2, 1, 1, 128], true)), false),
        ("relative bias with gradient", [2, 8, 8, 64, 64, 64], vec![[1, 8, 64, 64]], None, true),
        ("cross attention", [2, 8, 8, 64, 128, 64], vec![], Some(([2, 1, 1, 128], true)), false),
    ];
    for (name, dims, bias, mask, causal) in sizes {
        let x = Variant { name, dims, causal, kv_heads: KvHeads::Grouped, k_transposed: false, bias, mask };
        let g = graph(DType::BF16, &x, 1.0 / 8.0);
        let input = inputs(&g, true, &mut Rng::new(s ^ dims[3] as u64));
        let (f, p) = (run(&c, &g, LowerTarget::Cuda, &input), run(&c, &g, LowerTarget::Cpu, &input));
        close(&format!("cuda: cudnn vs plain, {name}"), &f, &p, 0.05, s);
    }
}
