//! Tensor parallelism finds the Megatron Linear pairs of every zoo model by
//! their Hugging Face names (`shard::megatron_pairs`): each block's
//! attention and feed-forward, never an embedding, norm or head.

#![allow(clippy::unwrap_used)] // Test helpers may unwrap (the workspace denies it in library code).

use kiln::models::bert::{Bert, BertConfig, BertFlavor};
use kiln::models::gpt2::{Gpt2, Gpt2Config};
use kiln::models::llama::{Llama, LlamaConfig};
use kiln::models::t5::{FeedForward, T5Config, T5};
use kiln::models::Spelling;
use kiln::nn::ParamStore;

fn pairs(build: impl FnOnce(&mut ParamStore)) -> (Vec<String>, Vec<String>) {
    let mut ps = ParamStore::new(0);
    build(&mut ps);
    kiln::shard::megatron_pairs(&ps)
}

/// (column, row) counts and one example of each.
fn check(name: &str, (c, r): (Vec<String>, Vec<String>), counts: (usize, usize), column: &str, row: &str) {
    assert_eq!((c.len(), r.len()), counts, "{name}: {c:?} {r:?}");
    assert!(c.iter().any(|x| x == column), "{name}: {c:?}");
    assert!(r.iter().any(|x| x == row), "{name}: {r:?}");
    for n in c.iter().chain(&r) {
        assert!(!n.contains("embed") && !n.contains("norm") && !n.contains("head"), "{name}: {n}");
    }
}

#[test]
fn every_zoo_model_has_its_megatron_pairs() {
    let b = Spelling::Builtin;
    // Two layers each: attention and feed-forward pairs per layer.
    let p = pairs(|ps| drop(Gpt2::new(ps, Gpt2Config::tiny(), b).unwrap()));
    check("gpt2", p, (4, 4), "transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj");
    let p = pairs(|ps| drop(Llama::new(ps, LlamaConfig::tiny(), b).unwrap()));
    check("llama", p, (10, 4), "model.layers.1.self_attn.k_proj", "model.layers.0.mlp.down_proj");
    let p = pairs(|ps| drop(Bert::new(ps, BertConfig::tiny(), b).unwrap()));
    check("bert", p, (8, 4), "bert.encoder.layer.0.attention.self.value", "bert.encoder.layer.1.output.dense");
    let distil = BertConfig { type_vocab: 0, flavor: BertFlavor::DistilBert, pooler: false, ..BertConfig::tiny() };
    let p = pairs(|ps| drop(Bert::new(ps, distil, b).unwrap()));
    check(
        "distilbert",
        p,
        (8, 4),
        "distilbert.transformer.layer.0.ffn.lin1",
        "distilbert.transformer.layer.0.attention.out_lin",
    );
    // T5: encoder self-attention and FFN, decoder self-, cross-attention and FFN.
    let relu = T5Config { feed_forward: FeedForward::Relu, ..T5Config::tiny() };
    let p = pairs(|ps| drop(T5::new(ps, relu, b).unwrap()));
    check(
        "t5",
        p,
        (2 * 4 + 2 * 7, 10),
        "decoder.block.1.layer.1.EncDecAttention.v",
        "encoder.block.0.layer.1.DenseReluDense.wo",
    );
    let gated = T5Config { feed_forward: FeedForward::GatedGelu, ..T5Config::tiny() };
    let p = pairs(|ps| drop(T5::new(ps, gated, b).unwrap()));
    check(
        "t5 gated",
        p,
        (2 * 5 + 2 * 8, 10),
        "decoder.block.0.layer.2.DenseReluDense.wi_1",
        "decoder.block.0.layer.2.DenseReluDense.wo",
    );
}
