//! The loop kernels against the host: each kernel run on the host as the
//! device computes it, against the reference interpreter and f64, on fresh
//! random inputs; and what the finder takes and leaves.

use super::*;
/// Rounds an f32 to `dtype` and back (the identity for f32).
fn round(x: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        DType::F16 => half::f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// `tanh` as the kernel computes it (f32, `ttir.rs` writes the same steps):
/// an odd polynomial below 0.0625, `(1 - e) / (1 + e)` with `e = exp(-2|z|)`
/// above, the sign put back.
fn tanh(z: f32) -> f32 {
    let a = z.abs();
    if a < TANH_SMALL {
        let z2 = z * z;
        z * (1.0 + z2 * (TANH_C3 + z2 * TANH_C5))
    } else {
        let e = (-2.0 * a).exp();
        let q = (1.0 - e) / (1.0 + e);
        if z < 0.0 {
            -q
        } else {
            q
        }
    }
}

impl Kernel {
    /// Runs the kernel on the host, as the device computes it (but for the
    /// last bits of `exp` and division): the stored values (row-major, f32
    /// holding each dtype's values) and the column sums of every tile of rows.
    /// `inputs` are the operands' values, in order.
    pub(crate) fn evaluate(&self, inputs: &[Vec<f32>]) -> (Vec<Vec<f32>>, Vec<f32>) {
        let (rows, cols) = (self.rows, self.cols);
        let mut stores = vec![vec![0.0; rows * cols]; self.stores.len()];
        let mut partial = vec![0.0f32; self.partial_rows() * cols];
        let mut vals = vec![0.0f32; self.body.len()];
        let (bm, pr) = (self.block.0, self.program_rows());
        for p in 0..self.partial_rows() {
            for c in 0..cols {
                // The tile's accumulator: one f32 a tile row, summed over the
                // chunks, then over the tile's rows.
                let mut acc = vec![0.0f32; bm];
                for r in p * pr..(p + 1) * pr {
                    for (i, s) in self.body.iter().enumerate() {
                        let x = match s.inst {
                            Inst::Load(k) => match self.inputs[k].space {
                                Space::Full => inputs[k][r * cols + c],
                                Space::Row => inputs[k][c],
                                Space::Scalar => inputs[k][0],
                            },
                            Inst::Const(bits) => f64::from_bits(bits) as f32,
                            Inst::Convert(a) => vals[a],
                            Inst::Unary(op, a) => match op {
                                UnaryOp::Neg => -vals[a],
                                UnaryOp::Exp => vals[a].exp(),
                                UnaryOp::Tanh => tanh(vals[a]),
                                _ => unreachable!("not a kernel op"),
                            },
                            Inst::Binary(op, a, b) => match op {
                                BinaryOp::Add => vals[a] + vals[b],
                                BinaryOp::Sub => vals[a] - vals[b],
                                BinaryOp::Mul => vals[a] * vals[b],
                                BinaryOp::Div => vals[a] / vals[b],
                                _ => unreachable!("not a kernel op"),
                            },
                        };
                        vals[i] = match s.inst {
                            Inst::Convert(_) => round(x, s.dtype),
                            _ => x,
                        };
                    }
                    for (k, &(s, _)) in self.stores.iter().enumerate() {
                        stores[k][r * cols + c] = round(vals[s], self.body[s].dtype);
                    }
                    acc[r % bm] += vals[self.sum.1];
                }
                partial[p * cols + c] = pairwise(&acc);
            }
        }
        (stores, partial)
    }
}

/// A sum in the order of a tree reduction over halves, as Triton's reduce
/// over a power-of-two axis adds (up to its lanes' order).
fn pairwise(x: &[f32]) -> f32 {
    if x.len() == 1 {
        x[0]
    } else {
        let h = x.len() / 2;
        pairwise(&x[..h]) + pairwise(&x[h..])
    }
}

use crate::ir::{DotDims, Literal, Shape, TensorType};
use crate::lower::live::live_nodes;

type R<T> = Result<T, crate::CompileError>;

/// SplitMix64, seeded from the clock: fresh inputs every run (the seed
/// is in every failure message).
struct Rng(u64);
impl Rng {
    fn fresh() -> Rng {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos());
        Rng(t as u64)
    }
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [-a, a], rounded to `dtype`.
    fn values(&mut self, n: usize, a: f64, dtype: DType) -> Vec<f64> {
        (0..n).map(|_| f64::from(round(((2.0 * self.next() - 1.0) * a) as f32, dtype))).collect()
    }
}

fn splat(g: &mut Graph, v: f64, shape: &[usize]) -> R<ValueId> {
    let c = g.value(Op::Constant { literal: Literal::scalar(DType::BF16, v) })?;
    g.value(Op::BroadcastInDim { input: c, shape: Shape::new(shape), dims: vec![] })
}

fn bin(g: &mut Graph, op: BinaryOp, a: ValueId, b: ValueId) -> R<ValueId> {
    g.value(Op::Binary { op, lhs: a, rhs: b })
}

/// GELU's constants as kiln's bf16 graphs hold them.
const A: f64 = 0.044677734;
const C: f64 = 0.796875;
const A3: f64 = 0.134033203125;

/// One chain of a recomputed GELU from `h` and the f32 bias `b` (each
/// read through a barrier, as remat reads its leaves): x, 0.5 x and tanh.
fn chain(g: &mut Graph, h: ValueId, b: ValueId, guard: Option<ValueId>, shape: &[usize]) -> R<[ValueId; 3]> {
    let ins = match guard {
        Some(dg) => vec![b, h, dg],
        None => vec![b, h],
    };
    let bar = g.add(Op::OptimizationBarrier { inputs: ins })?;
    let (b, h) = (ValueId::new(bar, 0), ValueId::new(bar, 1));
    let b = if guard.is_some() {
        // The remat guard: select(x == x or x != x, b, 0) on one element of dg.
        let dg = ValueId::new(bar, 2);
        let one = g.value(Op::Slice {
            input: dg,
            start: vec![0; shape.len()],
            limit: vec![1; shape.len()],
            stride: vec![1; shape.len()],
        })?;
        let s = g.value(Op::Reshape { input: one, shape: Shape::new([]) })?;
        let eq = g.value(Op::Compare { dir: CompareDir::Eq, lhs: s, rhs: s })?;
        let ne = g.value(Op::Compare { dir: CompareDir::Ne, lhs: s, rhs: s })?;
        let p = bin(g, BinaryOp::Or, eq, ne)?;
        let z = g.value(Op::Constant { literal: Literal::scalar(DType::F32, 0.0) })?;
        let z = g.value(Op::BroadcastInDim { input: z, shape: Shape::new([shape[2]]), dims: vec![] })?;
        g.value(Op::Select { pred: p, on_true: b, on_false: z })?
    } else {
        b
    };
    let b16 = g.value(Op::Convert { input: b, to: DType::BF16 })?;
    let bb = g.value(Op::BroadcastInDim { input: b16, shape: Shape::new(shape), dims: vec![2] })?;
    let x = bin(g, BinaryOp::Add, h, bb)?;
    let (a, c, half) = (splat(g, A, shape)?, splat(g, C, shape)?, splat(g, 0.5, shape)?);
    let x2 = bin(g, BinaryOp::Mul, x, x)?;
    let x3 = bin(g, BinaryOp::Mul, x2, x)?;
    let ax3 = bin(g, BinaryOp::Mul, x3, a)?;
    let inner = bin(g, BinaryOp::Add, x, ax3)?;
    let z = bin(g, BinaryOp::Mul, inner, c)?;
    let hx = bin(g, BinaryOp::Mul, x, half)?;
    let t = g.value(Op::Unary { op: UnaryOp::Tanh, input: z })?;
    Ok([x, hx, t])
}

/// The 50% plan's GELU backward in kiln's form (as in gpt2-small's
/// planned step): GELU's output from one chain for the weight gradient,
/// dh from a second chain behind a guarded barrier that reads the first's
/// `0.5 x`, and the bias gradient as the f32 sum of dh over the tokens.
/// Outputs: g, dh, db.
fn planned(shape: &[usize]) -> R<Graph> {
    let mut g = Graph::new();
    let h = g.parameter(TensorType::new(DType::BF16, shape.to_vec()));
    let b = g.parameter(TensorType::new(DType::F32, vec![shape[2]]));
    let dg = g.parameter(TensorType::new(DType::BF16, shape.to_vec()));
    let one = splat(&mut g, 1.0, shape)?;
    let [_, hx1, t1] = chain(&mut g, h, b, None, shape)?;
    let opt = bin(&mut g, BinaryOp::Add, t1, one)?;
    let gelu = bin(&mut g, BinaryOp::Mul, hx1, opt)?;
    let [x2, _, t2] = chain(&mut g, h, b, Some(dg), shape)?;
    let (half, c, a3) = (splat(&mut g, 0.5, shape)?, splat(&mut g, C, shape)?, splat(&mut g, A3, shape)?);
    // dh = dg (0.5 (1 + t) + 0.5 x (1 - t²) c (1 + 3a x²))
    let opt2 = bin(&mut g, BinaryOp::Add, t2, one)?;
    let p1 = bin(&mut g, BinaryOp::Mul, opt2, half)?;
    let tt = bin(&mut g, BinaryOp::Mul, t2, t2)?;
    let sech = bin(&mut g, BinaryOp::Sub, one, tt)?;
    let xx = bin(&mut g, BinaryOp::Mul, x2, x2)?;
    let q = bin(&mut g, BinaryOp::Mul, xx, a3)?;
    let q = bin(&mut g, BinaryOp::Add, one, q)?;
    let p2 = bin(&mut g, BinaryOp::Mul, hx1, sech)?;
    let p2 = bin(&mut g, BinaryOp::Mul, p2, c)?;
    let p2 = bin(&mut g, BinaryOp::Mul, p2, q)?;
    let d = bin(&mut g, BinaryOp::Add, p1, p2)?;
    let dh = bin(&mut g, BinaryOp::Mul, dg, d)?;
    let dh32 = g.value(Op::Convert { input: dh, to: DType::F32 })?;
    let db = g.value(Op::Reduce { op: ReduceOp::Sum, input: dh32, axes: vec![0, 1] })?;
    g.set_outputs(vec![gelu, dh, db])?;
    Ok(g)
}

/// The kernels of `g`, small regions included.
fn kernels(g: &Graph) -> Vec<Kernel> {
    find_with(g, &live_nodes(g), 0)
}

/// GELU and its derivative in f64, with the graph's constants.
fn gelu_f64(x: f64) -> (f64, f64) {
    let t = (C * (x + A * x * x * x)).tanh();
    (0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * C * (1.0 + A3 * x * x))
}

#[test]
fn the_planned_gelu_backward_becomes_one_kernel_with_one_chain() -> R<()> {
    let shape = [2, 8, 64];
    let g = planned(&shape)?;
    let ks = kernels(&g);
    assert_eq!(ks.len(), 1, "{ks:?}");
    let k = &ks[0];
    assert_eq!((k.rows, k.cols, k.block, k.chunks), (16, 64, (8, 64), 1));
    // h and b are read once each, through either barrier, and dg once.
    let spaces: Vec<(Space, DType)> = k.inputs.iter().map(|i| (i.space, i.dtype)).collect();
    assert_eq!(spaces, [(Space::Full, DType::BF16), (Space::Row, DType::F32), (Space::Full, DType::BF16)]);
    // The two chains are one: one tanh.
    let tanhs = k.body.iter().filter(|s| matches!(s.inst, Inst::Unary(UnaryOp::Tanh, _))).count();
    assert_eq!(tanhs, 1);
    // It writes GELU's output and dh; the reduce is the sum.
    let outs = g.outputs();
    let stored: Vec<ValueId> = k.stores.iter().flat_map(|(_, v)| v.clone()).collect();
    assert_eq!(stored, vec![outs[0], outs[1]]);
    assert_eq!(k.sum.0, outs[2].node);
    Ok(())
}

#[test]
fn the_kernel_computes_gelu_its_backward_and_the_bias_gradient() -> R<()> {
    let shape = [2, 8, 64];
    let g = planned(&shape)?;
    let k = &kernels(&g)[0];
    let mut rng = Rng::fresh();
    let seed = rng.0;
    let n = 2 * 8 * 64;
    let h = rng.values(n, 3.0, DType::BF16);
    let b = rng.values(64, 1.0, DType::F32);
    let dg = rng.values(n, 1.0, DType::BF16);
    let as_f32 = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    let (stores, sums) = k.evaluate(&[as_f32(&h), as_f32(&b), as_f32(&dg)]);
    let reference = crate::interpret(
        &g,
        &[
            Literal::from_f64s(DType::BF16, Shape::new(shape), &h)?,
            Literal::from_f64s(DType::F32, Shape::new([64]), &b)?,
            Literal::from_f64s(DType::BF16, Shape::new(shape), &dg)?,
        ],
    )?;
    // The exact values, in f64, from the same bf16 inputs and bias.
    let mut exact = [vec![0.0; n], vec![0.0; n], vec![0.0; 64]];
    for i in 0..n {
        let x = h[i] + f64::from(round(b[i % 64] as f32, DType::BF16));
        let (gx, dx) = gelu_f64(x);
        exact[0][i] = gx;
        exact[1][i] = dg[i] * dx;
        exact[2][i % 64] += dg[i] * dx;
    }
    let db: Vec<f64> =
        (0..64).map(|c| (0..k.partial_rows()).map(|r| f64::from(sums[r * 64 + c])).sum::<f64>()).collect();
    let got = [
        stores[0].iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
        stores[1].iter().map(|&v| f64::from(v)).collect(),
        db,
    ];
    for (j, name) in ["gelu", "dh", "db"].into_iter().enumerate() {
        let scale = exact[j].iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let err = |v: &[f64]| v.iter().zip(&exact[j]).fold(0.0f64, |m, (a, e)| m.max((a - e).abs())) / scale;
        let (kernel, interp) = (err(&got[j]), err(&reference[j].to_f64s()));
        // The kernel rounds only what it stores, so it is at least as
        // close as the op-by-op bf16 interpreter (and within bf16's
        // precision of the exact values).
        assert!(
            kernel <= interp * 1.01 + 1e-6,
            "{name}: kernel {kernel:e} against the interpreter's {interp:e} (seed {seed})"
        );
        assert!(kernel < 1.0 / 128.0, "{name}: kernel {kernel:e} (seed {seed})");
    }
    Ok(())
}

#[test]
fn the_kernels_tanh_is_within_5e7_of_the_exact_one() {
    let mut rng = Rng::fresh();
    let seed = rng.0;
    for _ in 0..200_000 {
        let z = ((2.0 * rng.next() - 1.0) * 12.0) as f32;
        let exact = f64::from(z).tanh();
        let err = (f64::from(tanh(z)) - exact).abs() / exact.abs().max(f64::MIN_POSITIVE);
        assert!(err < 5e-7 || z == 0.0, "tanh({z}) = {} against {exact} (seed {seed})", tanh(z));
    }
    assert!(tanh(f32::NAN).is_nan());
    assert_eq!((tanh(f32::INFINITY), tanh(f32::NEG_INFINITY)), (1.0, -1.0));
    assert_eq!(tanh(-0.0).to_bits(), (-0.0f32).to_bits());
}

/// The unplanned step: GELU's forward output feeds the next GEMM, whose
/// gradient comes back into the backward. Taking the forward's `tanh`
/// with the backward would make a cycle, and without it the body has no
/// transcendental: XLA keeps it.
#[test]
fn no_kernel_where_it_would_make_a_cycle_or_has_no_transcendental() -> R<()> {
    let shape = [2, 8, 64];
    let mut g = Graph::new();
    let h = g.parameter(TensorType::new(DType::BF16, shape.to_vec()));
    let b = g.parameter(TensorType::new(DType::F32, vec![64]));
    let w = g.parameter(TensorType::new(DType::BF16, vec![64, 64]));
    let one = splat(&mut g, 1.0, &shape)?;
    let b16 = g.value(Op::Convert { input: b, to: DType::BF16 })?;
    let bb = g.value(Op::BroadcastInDim { input: b16, shape: Shape::new(shape), dims: vec![2] })?;
    let x = bin(&mut g, BinaryOp::Add, h, bb)?;
    let t = g.value(Op::Unary { op: UnaryOp::Tanh, input: x })?;
    let opt = bin(&mut g, BinaryOp::Add, t, one)?;
    let y = bin(&mut g, BinaryOp::Mul, x, opt)?;
    let mm = DotDims { lhs_batch: vec![], rhs_batch: vec![], lhs_contract: vec![2], rhs_contract: vec![0] };
    let dg = g.value(Op::DotGeneral { lhs: y, rhs: w, dims: mm })?;
    let tt = bin(&mut g, BinaryOp::Mul, t, t)?;
    let sech = bin(&mut g, BinaryOp::Sub, one, tt)?;
    let dh = bin(&mut g, BinaryOp::Mul, dg, sech)?;
    let dh32 = g.value(Op::Convert { input: dh, to: DType::F32 })?;
    let db = g.value(Op::Reduce { op: ReduceOp::Sum, input: dh32, axes: vec![0, 1] })?;
    g.set_outputs(vec![dh, db])?;
    assert!(kernels(&g).is_empty());

    // A sum of plain products: nothing XLA runs slowly.
    let mut g = Graph::new();
    let a = g.parameter(TensorType::new(DType::BF16, shape.to_vec()));
    let c = g.parameter(TensorType::new(DType::BF16, shape.to_vec()));
    let p = bin(&mut g, BinaryOp::Mul, a, c)?;
    let p32 = g.value(Op::Convert { input: p, to: DType::F32 })?;
    let s = g.value(Op::Reduce { op: ReduceOp::Sum, input: p32, axes: vec![0, 1] })?;
    g.set_outputs(vec![p, s])?;
    assert!(kernels(&g).is_empty());
    Ok(())
}

#[test]
fn no_kernel_for_shapes_the_tiles_do_not_divide_or_sums_over_other_axes() -> R<()> {
    // 60 columns: no tile width divides them; 3 x 5 rows: no tile height.
    for shape in [[2, 8, 60], [3, 5, 64]] {
        assert!(kernels(&planned(&shape)?).is_empty(), "{shape:?}");
    }
    // A sum over the tokens of one batch row only is not a column sum.
    let mut g = planned(&[2, 8, 64])?;
    let outs = g.outputs().to_vec();
    let Op::Reduce { input, .. } = g.node(outs[2].node).op.clone() else { unreachable!() };
    let other = g.value(Op::Reduce { op: ReduceOp::Sum, input, axes: vec![1] })?;
    g.set_outputs(vec![outs[0], outs[1], other])?;
    assert!(kernels(&g).is_empty());
    Ok(())
}

/// Every SSA value of `@main` is defined before it is used (the Triton
/// module inside the call's `ir` string aside).
fn assert_defined_before_use(text: &str) {
    let mut defined: std::collections::HashSet<String> = std::collections::HashSet::new();
    let name =
        |s: &str| -> String { s.chars().take_while(|c| c.is_ascii_alphanumeric() || "_%#".contains(*c)).collect() };
    for line in text.lines() {
        let line = match (line.find("ir = \""), line.find("\", name = ")) {
            (Some(a), Some(b)) => format!("{}{}", &line[..a], &line[b..]),
            _ => line.to_string(),
        };
        let line = line.trim();
        let (lhs, rhs) = match line.split_once(" = ") {
            Some((l, r)) if l.starts_with('%') => (Some(l), r),
            _ => (None, line),
        };
        if line.starts_with("func.func") {
            for (i, _) in line.match_indices("%arg") {
                defined.insert(name(&line[i..]));
            }
            continue;
        }
        for (i, _) in rhs.match_indices('%') {
            let used = name(&rhs[i..]);
            let base = used.split('#').next().unwrap_or_default().to_string();
            assert!(defined.contains(&used) || defined.contains(&base), "`{used}` used before it is defined: {line}");
        }
        if let Some(l) = lhs {
            let base = l.split(':').next().unwrap_or_default().to_string();
            defined.insert(base);
        }
    }
}

#[test]
fn the_cuda_lowering_calls_the_kernel_and_every_other_target_does_not() -> R<()> {
    use crate::lower::{lower, LowerOptions};
    use crate::target::LowerTarget;
    // A region this small is left to XLA (`MIN_ELEMENTS`).
    let small = lower(&planned(&[2, 8, 64])?, &LowerOptions { target: LowerTarget::Cuda, ..LowerOptions::default() })?;
    assert!(!small.contains("triton"));
    let g = planned(&[8, 512, 1024])?;
    let cuda = lower(&g, &LowerOptions { target: LowerTarget::Cuda, ..LowerOptions::default() })?;
    assert_eq!(cuda.matches("@__gpu$xla.gpu.triton").count(), 1);
    assert_defined_before_use(&cuda);
    insta::assert_snapshot!("loop_kernel_planned_gelu_cuda", cuda);
    for opts in [
        LowerOptions::default(),
        LowerOptions { target: LowerTarget::Cuda, loop_kernels: false, ..LowerOptions::default() },
    ] {
        let text = lower(&g, &opts)?;
        assert!(!text.contains("triton"), "{opts:?}");
        assert_defined_before_use(&text);
    }
    Ok(())
}

/// Two kernels that each read, through a GEMM, what the other writes: no
/// cycle among the nodes, one between the two calls. The later one gives
/// way.
#[test]
fn of_two_kernels_that_wait_for_each_other_the_later_one_is_not_called() -> R<()> {
    use crate::lower::{lower, LowerOptions};
    use crate::target::LowerTarget;
    let shape = [8, 512, 1024];
    let mut g = Graph::new();
    let a = g.parameter(TensorType::new(DType::BF16, shape.to_vec()));
    let c = g.parameter(TensorType::new(DType::BF16, shape.to_vec()));
    let w = g.parameter(TensorType::new(DType::BF16, vec![1024, 1024]));
    let mm = DotDims { lhs_batch: vec![], rhs_batch: vec![], lhs_contract: vec![2], rhs_contract: vec![0] };
    let t1 = g.value(Op::Unary { op: UnaryOp::Tanh, input: a })?;
    let d1 = g.value(Op::DotGeneral { lhs: t1, rhs: w, dims: mm.clone() })?;
    let t2 = g.value(Op::Unary { op: UnaryOp::Tanh, input: c })?;
    let d2 = g.value(Op::DotGeneral { lhs: t2, rhs: w, dims: mm })?;
    let mut outs = Vec::new();
    for (t, d) in [(t1, d2), (t2, d1)] {
        let y = bin(&mut g, BinaryOp::Mul, t, d)?;
        let y32 = g.value(Op::Convert { input: y, to: DType::F32 })?;
        outs.push(g.value(Op::Reduce { op: ReduceOp::Sum, input: y32, axes: vec![0, 1] })?);
    }
    g.set_outputs(outs)?;
    assert_eq!(kernels(&g).len(), 2);
    let cuda = lower(&g, &LowerOptions { target: LowerTarget::Cuda, ..LowerOptions::default() })?;
    assert_eq!(cuda.matches("@__gpu$xla.gpu.triton").count(), 1);
    assert_defined_before_use(&cuda);
    Ok(())
}

/// A stored value the kernel computes once a row (a bias converted to
/// bf16, which something outside also reads) is stored as a full tile.
#[test]
fn a_value_computed_once_a_row_is_stored_as_a_full_tile() -> R<()> {
    let shape = [2, 8, 64];
    let mut g = Graph::new();
    let a = g.parameter(TensorType::new(DType::BF16, shape.to_vec()));
    let b = g.parameter(TensorType::new(DType::F32, vec![64]));
    let bb = g.value(Op::BroadcastInDim { input: b, shape: Shape::new(shape), dims: vec![2] })?;
    let cb = g.value(Op::Convert { input: bb, to: DType::BF16 })?;
    let t = g.value(Op::Unary { op: UnaryOp::Tanh, input: a })?;
    let y = bin(&mut g, BinaryOp::Mul, t, cb)?;
    let y32 = g.value(Op::Convert { input: y, to: DType::F32 })?;
    let s = g.value(Op::Reduce { op: ReduceOp::Sum, input: y32, axes: vec![0, 1] })?;
    g.set_outputs(vec![cb, s])?;
    let k = &kernels(&g)[0];
    assert_eq!(k.stores.len(), 1);
    assert_eq!(k.body[k.stores[0].0].space, Space::Row);
    let ir = crate::lower::ttir::module(k);
    let store =
        ir.lines().find(|l| l.trim_start().starts_with("tt.store %") && l.contains("x64x!tt.ptr<bf16>")).unwrap();
    let value = store.split(", ").nth(1).and_then(|v| v.split(' ').next()).unwrap();
    let def = ir.lines().find(|l| l.trim_start().starts_with(&format!("{value} = "))).unwrap();
    assert!(def.contains(&format!("tensor<{}x64xbf16>", k.block.0)), "{def}");
    // On the host: every row of the stored tile is the rounded bias.
    let mut rng = Rng::fresh();
    let av: Vec<f32> = rng.values(2 * 8 * 64, 2.0, DType::BF16).iter().map(|&v| v as f32).collect();
    let bv: Vec<f32> = rng.values(64, 2.0, DType::F32).iter().map(|&v| v as f32).collect();
    let operands: Vec<Vec<f32>> = k.inputs.iter().map(|i| if i.value == a { av.clone() } else { bv.clone() }).collect();
    let (stores, _) = k.evaluate(&operands);
    for (i, v) in stores[0].iter().enumerate() {
        assert_eq!(*v, round(bv[i % 64], DType::BF16));
    }
    Ok(())
}

#[test]
fn a_program_takes_fewer_tiles_where_there_are_few_rows() {
    // gpt2-small's MLP: 32 tiles a program, 768 programs (as measured).
    assert_eq!(tiling(8192, 3072), Some((128, 32)));
    // A quarter of the rows: 8 tiles a program keeps 768 programs.
    assert_eq!(tiling(2048, 3072), Some((128, 8)));
    // Too few rows for 512 programs at any count: one tile a program.
    assert_eq!(tiling(512, 256), Some((128, 1)));
    assert_eq!(tiling(64, 96), Some((32, 1)));
    // No tile fits 15 rows or 60 columns.
    assert_eq!(tiling(15, 64), None);
    assert_eq!(tiling(16, 60), None);
}
