//! Runs kiln's optimizer pipeline on saved step graphs and prints, per graph,
//! nodes and cost-model FLOPs/bytes before and after, the pipeline's time, each
//! pass's stats and the rules fired.
//!
//! `cargo run --release -p kiln-benches --example pipeline_stats -- FILE.kiln...`

use std::time::Instant;

use kiln_compiler::cost::graph_cost;
use kiln_compiler::fusion::plan_fusion;
use kiln_compiler::pipeline::{run, PipelineOptions};
use kiln_compiler::text::parse;

fn main() {
    for path in std::env::args().skip(1) {
        let source = std::fs::read_to_string(&path).expect("read the graph file");
        let g = parse(&source).expect("parse the graph");
        let before = graph_cost(&g).total;
        let opts = PipelineOptions { prune_params: false, verify: true, ..PipelineOptions::default() };
        let t = Instant::now();
        let out = run(&g, &opts, &mut |_, _| {}).expect("pipeline");
        let with_verify = t.elapsed();
        let opts = PipelineOptions { verify: false, ..opts };
        let t = Instant::now();
        let out2 = run(&g, &opts, &mut |_, _| {}).expect("pipeline");
        let took = t.elapsed();
        assert_eq!(kiln_compiler::text::print(&out.graph), kiln_compiler::text::print(&out2.graph), "deterministic");
        let after = graph_cost(&out.graph).total;
        let unfused = plan_fusion(&g);
        let fused = plan_fusion(&out.graph);
        println!("{path}");
        println!("  nodes {} -> {} (live {} -> {})", g.len(), out.graph.len(), before.nodes, after.nodes);
        println!("  flops {} -> {}", before.flops, after.flops);
        println!(
            "  bytes (unfused) {} -> {}",
            before.bytes_read + before.bytes_written,
            after.bytes_read + after.bytes_written
        );
        println!(
            "  fusion: {} -> {} groups, bytes to memory {} -> {}",
            unfused.num_groups(),
            fused.num_groups(),
            unfused.bytes_to_memory(),
            fused.bytes_to_memory()
        );
        println!(
            "  pipeline {:.1} ms ({:.1} ms with the verifier after each pass)",
            took.as_secs_f64() * 1e3,
            with_verify.as_secs_f64() * 1e3
        );
        for p in &out.stats.passes {
            println!(
                "    {:<13} {:>6} -> {:>6} nodes {:>8.1} ms changed {} stop {:?}",
                p.name,
                p.nodes_in,
                p.nodes_out,
                p.time.as_secs_f64() * 1e3,
                p.changed,
                p.stop_reason()
            );
            for (r, n) in &p.rules_fired() {
                println!("      {r}: {n}");
            }
        }
    }
}
