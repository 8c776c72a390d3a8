//! The cost model on programs written in kiln's text form: FLOPs and bytes by
//! hand for each case (the arithmetic is in the comments), the per-op
//! breakdown, dead code left out, and the roofline on the built-in targets.

use kiln_compiler::cost::{estimate, estimate_seconds, graph_cost, graph_flops, node_cost, PeakClass, Totals};
use kiln_compiler::ir::NodeId;
use kiln_compiler::target::Target;
use kiln_compiler::text::parse;

/// Parses `src` and checks the whole-graph totals against `expect`.
fn check(src: &str, expect: Totals) {
    let g = parse(src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let cost = graph_cost(&g);
    assert_eq!(cost.total, expect, "\n{src}\n{cost}");
    assert_eq!(graph_flops(&g), expect.flops as f64);
    // The breakdown partitions the total.
    let summed = cost.by_op.values().fold(Totals::default(), |mut acc, t| {
        acc.nodes += t.nodes;
        acc.flops += t.flops;
        acc.transcendentals += t.transcendentals;
        acc.bytes_read += t.bytes_read;
        acc.bytes_written += t.bytes_written;
        acc.collective_bytes += t.collective_bytes;
        acc
    });
    assert_eq!(summed, cost.total);
}

const MATMUL: &str = "
graph(%x: tensor<8x4xf32>, %w: tensor<4x3xf32>) {
  %y = dot_general %x, %w, batch = [] x [], contract = [1] x [0] : tensor<8x3xf32>
  return %y
}";

#[test]
fn matmul() {
    // 2 * M 8 * N 3 * K 4; reads (32 + 12) f32, writes 24 f32.
    check(MATMUL, Totals { nodes: 3, flops: 192, bytes_read: 176, bytes_written: 96, ..Totals::default() });
}

#[test]
fn batched_dot_general() {
    // 2 * batch 2 * M 8 * N 3 * K 4; reads (64 + 24) f32, writes 48 f32.
    check(
        "graph(%a: tensor<2x8x4xf32>, %b: tensor<2x4x3xf32>) {
           %c = dot_general %a, %b, batch = [0] x [0], contract = [2] x [1] : tensor<2x8x3xf32>
           return %c
         }",
        Totals { nodes: 3, flops: 384, bytes_read: 352, bytes_written: 192, ..Totals::default() },
    );
}

#[test]
fn dot_general_with_two_contracting_dims_and_a_batch_dim_not_leading() {
    // lhs dims: 0 (3) contracted, 1 (2) batch, 2 (5) free, 3 (7) contracted;
    // rhs dims: 0 (2) batch, 1 (7) and 2 (3) contracted, 3 (6) free.
    // 2 * batch 2 * M 5 * N 6 * K (3 * 7) = 2520; bf16 reads (210 + 252) * 2,
    // writes 60 * 2.
    check(
        "graph(%a: tensor<3x2x5x7xbf16>, %b: tensor<2x7x3x6xbf16>) {
           %c = dot_general %a, %b, batch = [1] x [0], contract = [0, 3] x [2, 1] : tensor<2x5x6xbf16>
           return %c
         }",
        Totals { nodes: 3, flops: 2520, bytes_read: 924, bytes_written: 120, ..Totals::default() },
    );
}

const MLP: &str = "
graph(%x: tensor<8x4xf32>, %w1: tensor<4x16xf32>, %b1: tensor<16xf32>, %w2: tensor<16x3xf32>) {
  %h = dot_general %x, %w1, batch = [] x [], contract = [1] x [0] : tensor<8x16xf32>
  %bb = broadcast_in_dim %b1, dims = [1] : tensor<8x16xf32>
  %a = add %h, %bb : tensor<8x16xf32>
  %zero = constant dense<0.0> : tensor<f32>
  %zb = broadcast_in_dim %zero, dims = [] : tensor<8x16xf32>
  %r = max %a, %zb : tensor<8x16xf32>
  %y = dot_general %r, %w2, batch = [] x [], contract = [1] x [0] : tensor<8x3xf32>
  return %y
}";

#[test]
fn mlp_forward() {
    // FLOPs: dots 2*8*16*4 = 1024 and 2*8*3*16 = 768, add and max 128 each.
    // Bytes read: dot 128+256, broadcast 64, add 512+512, broadcast of the
    // scalar 4, max 512+512, dot 512+192 = 3204.
    // Bytes written: five [8, 16] f32 results of 512 (dot, two broadcasts,
    // add, max) and the [8, 3] one of 96 = 2656. The constant costs nothing.
    check(MLP, Totals { nodes: 11, flops: 2048, bytes_read: 3204, bytes_written: 2656, ..Totals::default() });
    let g = parse(MLP).unwrap();
    let by_op = graph_cost(&g).by_op;
    assert_eq!(
        by_op["dot_general"],
        Totals { nodes: 2, flops: 1792, bytes_read: 384 + 704, bytes_written: 512 + 96, ..Totals::default() }
    );
    assert_eq!(
        by_op["broadcast_in_dim"],
        Totals { nodes: 2, bytes_read: 68, bytes_written: 1024, ..Totals::default() }
    );
    assert_eq!(by_op["constant"], Totals { nodes: 1, ..Totals::default() });
    assert_eq!(by_op["parameter"], Totals { nodes: 4, ..Totals::default() });
    assert_eq!(
        by_op.keys().copied().collect::<Vec<_>>(),
        ["add", "broadcast_in_dim", "constant", "dot_general", "max", "parameter"]
    );
}

const SOFTMAX: &str = "
graph(%x: tensor<2x5xf32>) {
  %m = reduce max %x, axes = [1] : tensor<2xf32>
  %mb = broadcast_in_dim %m, dims = [0] : tensor<2x5xf32>
  %d = sub %x, %mb : tensor<2x5xf32>
  %e = exp %d : tensor<2x5xf32>
  %s = reduce sum %e, axes = [1] : tensor<2xf32>
  %sb = broadcast_in_dim %s, dims = [0] : tensor<2x5xf32>
  %y = div %e, %sb : tensor<2x5xf32>
  return %y
}";

#[test]
fn softmax() {
    // FLOPs: two reductions over 10 inputs, sub, exp and div over 10 outputs;
    // exp's 10 are transcendental.
    // Read: 40 + 8 + 80 + 40 + 40 + 8 + 80 = 296;
    // written: 8 + 40 + 40 + 40 + 8 + 40 + 40 = 216.
    check(
        SOFTMAX,
        Totals { nodes: 8, flops: 50, transcendentals: 10, bytes_read: 296, bytes_written: 216, ..Totals::default() },
    );
    insta::assert_snapshot!(graph_cost(&parse(SOFTMAX).unwrap()).to_string(), @r"
    op                      nodes          flops     bytes_read  bytes_written     collective
    broadcast_in_dim            2              0             16             80              0
    div                         1             10             80             40              0
    exp                         1             10             40             40              0
    parameter                   1              0              0              0              0
    reduce                      2             20             80             16              0
    sub                         1             10             80             40              0
    total                       8             50            296            216              0
    ");
}

#[test]
fn dead_code_is_not_counted() {
    // The 512x512 product and its exp reach no output: the totals are the
    // matmul's, and the unused parameter is not a live node either.
    check(
        "graph(%x: tensor<8x4xf32>, %w: tensor<4x3xf32>, %big: tensor<512x512xf32>) {
           %dead = dot_general %big, %big, batch = [] x [], contract = [1] x [0] : tensor<512x512xf32>
           %dead_exp = exp %dead : tensor<512x512xf32>
           %y = dot_general %x, %w, batch = [] x [], contract = [1] x [0] : tensor<8x3xf32>
           return %y
         }",
        Totals { nodes: 3, flops: 192, bytes_read: 176, bytes_written: 96, ..Totals::default() },
    );
}

#[test]
fn data_movement_moves_bytes_and_no_flops() {
    // Bytes (read, written), f32 [4, 6] = 96 bytes:
    // transpose (96, 96); reshape and the barrier (0, 0), bitcast and pass-through;
    // strided slice of 2x2 (16, 16); dynamic_slice 2x3 plus two i32 starts
    // (24 + 8, 24); dynamic_update_slice in place (24 + 8, 24); concatenate
    // (192, 192); pad 4x6 -> 6x6 with a scalar (96 + 4, 144); gather of 5 rows
    // by 5 i32 indices (120 + 20, 120); iota (0, 12); its broadcast (12, 24).
    // Read 96+16+32+32+192+100+140+12 = 620, written 96+16+24+24+192+144+120+12+24 = 652.
    check(
        "graph(%x: tensor<4x6xf32>, %i: tensor<i32>, %idx: tensor<5xi32>, %u: tensor<2x3xf32>) {
           %t = transpose %x, perm = [1, 0] : tensor<6x4xf32>
           %r = reshape %x : tensor<24xf32>
           %s = slice %x, start = [0, 0], limit = [4, 6], stride = [2, 3] : tensor<2x2xf32>
           %d = dynamic_slice %x, %i, %i : tensor<2x3xf32>
           %w = dynamic_update_slice %x, %u, %i, %i : tensor<4x6xf32>
           %c = concatenate %x, %x, axis = 0 : tensor<8x6xf32>
           %z = constant dense<0.0> : tensor<f32>
           %p = pad %x, %z, low = [1, 0], high = [1, 0], interior = [0, 0] : tensor<6x6xf32>
           %g = gather %x, %idx, axis = 0 : tensor<5x6xf32>
           %io = iota axis = 0 : tensor<3xi32>
           %b = broadcast_in_dim %io, dims = [0] : tensor<3x2xi32>
           %ob:2 = optimization_barrier %t, %r : (tensor<6x4xf32>, tensor<24xf32>)
           return %ob#0, %ob#1, %s, %d, %w, %c, %p, %g, %b
         }",
        Totals { nodes: 16, flops: 0, bytes_read: 620, bytes_written: 652, ..Totals::default() },
    );
}

#[test]
fn other_elementwise_ops_count_one_flop_per_output_element() {
    // compare (4 flops; reads 32, writes 4 pred bytes); select with a scalar
    // pred (4; 1 + 32, 16); clamp with scalar bounds (4; 4 + 16 + 4, 16);
    // convert to bf16 (4; 16, 8); tanh and pow (4 each, transcendental; 16
    // and 32 read, 16 written each).
    check(
        "graph(%x: tensor<4xf32>, %p: tensor<i1>, %lo: tensor<f32>) {
           %c = compare LT %x, %x : tensor<4xi1>
           %s = select %p, %x, %x : tensor<4xf32>
           %k = clamp %lo, %s, %lo : tensor<4xf32>
           %v = convert %k : tensor<4xbf16>
           %e = tanh %x : tensor<4xf32>
           %q = pow %x, %x : tensor<4xf32>
           return %c, %v, %e, %q
         }",
        Totals { nodes: 9, flops: 24, transcendentals: 8, bytes_read: 153, bytes_written: 76, ..Totals::default() },
    );
}

#[test]
fn scatter_rng_and_collectives() {
    // scatter_add of 5 rows of 6 f32: 30 adds; reads updates 120, the rows
    // they land on 120 and indices 20; writes the rows, 120.
    // rng_bit_generator: 4 generated words; reads the u64[2] state (16),
    // writes the new state (16) and the bits (16).
    // all_reduce of [4, 6] f32: no flops; reads 96, writes 96, sends 96.
    check(
        "graph(%x: tensor<4x6xf32>, %idx: tensor<5xi32>, %u: tensor<5x6xf32>, %st: tensor<2xui64>) {
           %s = scatter_add %x, %idx, %u, axis = 0 : tensor<4x6xf32>
           %rng:2 = rng_bit_generator THREE_FRY %st : (tensor<2xui64>, tensor<4xui32>)
           %ar = all_reduce sum %x : tensor<4x6xf32>
           return %s, %rng#1, %ar
         }",
        Totals {
            nodes: 7,
            flops: 34,
            transcendentals: 0,
            bytes_read: 260 + 16 + 96,
            bytes_written: 120 + 32 + 96,
            collective_bytes: 96,
        },
    );
}

#[test]
fn peak_class_follows_the_dot_dtype() {
    let dot = |dtype: &str| {
        format!(
            "graph(%a: tensor<2x2x{dtype}>) {{
               %c = dot_general %a, %a, batch = [] x [], contract = [1] x [0] : tensor<2x2x{dtype}>
               %e = add %c, %c : tensor<2x2x{dtype}>
               return %e
             }}"
        )
    };
    for (dtype, class) in [
        ("bf16", PeakClass::Bf16Matmul),
        ("f16", PeakClass::Bf16Matmul),
        ("f32", PeakClass::Tf32Matmul),
        ("f64", PeakClass::Vector),
        ("i32", PeakClass::Vector),
    ] {
        let g = parse(&dot(dtype)).unwrap();
        assert_eq!(node_cost(&g, NodeId::from_index(1)).peak, class, "{dtype}");
        assert_eq!(node_cost(&g, NodeId::from_index(2)).peak, PeakClass::Vector, "{dtype}");
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs())
}

#[test]
fn a_large_bf16_matmul_is_compute_bound() {
    let g = parse(
        "graph(%a: tensor<4096x4096xbf16>, %b: tensor<4096x4096xbf16>) {
           %c = dot_general %a, %b, batch = [] x [], contract = [1] x [0] : tensor<4096x4096xbf16>
           return %c
         }",
    )
    .unwrap();
    let flops = 2.0 * 4096f64.powi(3);
    assert_eq!(graph_flops(&g), flops);
    // 137 GFLOP at 989 TFLOP/s is 139 us; its 96 MiB at 3.35 TB/s only 30 us.
    let e = estimate(&g, &Target::H100_SXM);
    assert!(close(e.seconds, flops / 989e12), "{e:?}");
    assert!(close(e.compute_bound_seconds, e.seconds) && e.memory_bound_seconds == 0.0, "{e:?}");
    assert!(close(estimate_seconds(&g, &Target::H100_SXM_MEASURED), flops / 798e12));
    assert!(close(estimate_seconds(&g, &Target::H200_SXM), flops / 989e12));
}

#[test]
fn an_f32_matmul_runs_at_the_tf32_peak() {
    let g = parse(
        "graph(%a: tensor<4096x4096xf32>, %b: tensor<4096x4096xf32>) {
           %c = dot_general %a, %b, batch = [] x [], contract = [1] x [0] : tensor<4096x4096xf32>
           return %c
         }",
    )
    .unwrap();
    assert!(close(estimate_seconds(&g, &Target::H100_SXM), 2.0 * 4096f64.powi(3) / 494e12));
}

#[test]
fn elementwise_is_memory_bound_and_faster_on_the_h200() {
    let g = parse(
        "graph(%a: tensor<1048576xf32>, %b: tensor<1048576xf32>) {
           %c = add %a, %b : tensor<1048576xf32>
           return %c
         }",
    )
    .unwrap();
    let bytes = 3.0 * 4.0 * 1048576.0;
    let h100 = estimate(&g, &Target::H100_SXM);
    assert!(close(h100.seconds, bytes / 3.35e12) && close(h100.memory_bound_seconds, h100.seconds), "{h100:?}");
    assert!(close(estimate_seconds(&g, &Target::H200_SXM), bytes / 4.8e12));
}

#[test]
fn all_reduce_is_bound_by_the_interconnect() {
    let g = parse(
        "graph(%a: tensor<1048576xf32>) {
           %s = all_reduce sum %a : tensor<1048576xf32>
           return %s
         }",
    )
    .unwrap();
    let e = estimate(&g, &Target::H100_SXM);
    assert!(
        close(e.collective_bound_seconds, 4.0 * 1048576.0 / 450e9) && close(e.seconds, e.collective_bound_seconds),
        "{e:?}"
    );
}

#[test]
fn the_estimate_sums_each_node_at_its_own_bound() {
    // The MLP's dots take their tf32 compute time or their bytes' time,
    // whichever is longer, the elementwise nodes their bytes' time.
    let g = parse(MLP).unwrap();
    let t = Target::H100_SXM;
    let by_node: f64 = g
        .nodes()
        .map(|(id, _)| {
            let c = node_cost(&g, id);
            (c.flops as f64 / t.peak_flops_per_s(c.peak)).max(c.bytes() as f64 / t.mem_bytes_per_s)
        })
        .sum();
    let e = estimate(&g, &t);
    assert!(close(e.seconds, by_node), "{e:?} vs {by_node}");
    assert!(close(e.seconds, e.compute_bound_seconds + e.memory_bound_seconds));
    assert!(e.memory_bound_seconds > 0.0 && e.collective_bound_seconds == 0.0);
}
