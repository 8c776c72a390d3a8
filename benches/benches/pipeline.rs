//! The optimizer pipeline's time on real step graphs (it runs on every cache
//! miss): the gpt2-small and tiny GPT train steps and the Fashion-MNIST MLP
//! train step, saved with `KILN_SAVE_GRAPHS` (data/). Target (issue 10): the
//! whole pipeline on the gpt2-small train-step graph in at most 2 s on the
//! 2-core development machine.

use std::io::Read as _;

use criterion::{criterion_group, criterion_main, Criterion};
use kiln_compiler::ir::Graph;
use kiln_compiler::pipeline::{run, PipelineOptions};

fn load(name: &str) -> Graph {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data").join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let text = if name.ends_with(".gz") {
        let mut s = String::new();
        flate2::read::GzDecoder::new(&bytes[..]).read_to_string(&mut s).expect("gzip text");
        s
    } else {
        String::from_utf8(bytes).expect("utf-8")
    };
    kiln_compiler::text::parse(&text).expect("a saved step graph")
}

fn bench(c: &mut Criterion) {
    // What a cache miss runs: pruning, the default passes, the verifier after each.
    let opts = PipelineOptions::default();
    let mut group = c.benchmark_group("pipeline");
    group.sample_size(10);
    for (name, file) in [
        ("gpt2_small_train_step", "gpt2-small-train-step.kiln.gz"),
        ("gpt_tiny_train_step", "gpt-tiny-train-step.kiln.gz"),
        ("mlp_train_step", "mlp-train-step.kiln"),
    ] {
        let g = load(file);
        group.bench_function(name, |b| b.iter(|| run(&g, &opts, &mut |_, _| {}).expect("pipeline")));
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
