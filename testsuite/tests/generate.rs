//! Generation with a key/value cache (`kiln::models::generate`): greedy
//! decoding gives the argmax of a full forward at every step, for GPT-2, a
//! grouped-query Llama and `kiln train gpt`'s character GPT; two programs serve every prompt length and count
//! of new tokens; top-k and top-p keep only the tokens they should; bad
//! settings are refused naming them.

#![allow(clippy::unwrap_used)] // Test helpers may unwrap (the workspace denies it in library code).

use kiln::models::generate::{generate, Decoder, Sampling};
use kiln::models::gpt::{Gpt, GptConfig};
use kiln::models::gpt2::{Gpt2, Gpt2Config};
use kiln::models::llama::{Llama, LlamaConfig};
use kiln::models::Spelling;
use kiln::nn::ParamStore;
use kiln::Tensor;

fn gpt2(seed: u64) -> Gpt2 {
    let mut ps = ParamStore::new(seed);
    Gpt2::new(&mut ps, Gpt2Config { max_positions: 24, ..Gpt2Config::tiny() }, Spelling::Builtin).unwrap()
}

fn llama(seed: u64) -> Llama {
    let mut ps = ParamStore::new(seed);
    Llama::new(&mut ps, LlamaConfig { tie_embeddings: false, ..LlamaConfig::tiny() }, Spelling::Builtin).unwrap()
}

fn char_gpt(seed: u64) -> Gpt {
    let mut ps = ParamStore::new(seed);
    Gpt::new(&mut ps, &GptConfig { seq: 24, ..GptConfig::tiny(48) }).unwrap()
}

/// The full forward's logits of the last position of `seq`, sorted
/// descending by value: (token, logit).
fn ranked(model: Decoder<'_>, seq: &[u32]) -> Vec<(u32, f32)> {
    let ids = Tensor::from_vec(seq.iter().map(|&t| t as i32).collect::<Vec<_>>(), [1, seq.len()]).unwrap();
    let logits = model.logits(&ids).unwrap().to_vec::<f32>().unwrap();
    let v = model.vocab();
    let last = &logits[(seq.len() - 1) * v..seq.len() * v];
    let mut r: Vec<(u32, f32)> = last.iter().enumerate().map(|(i, &x)| (i as u32, x)).collect();
    r.sort_by(|a, b| b.1.total_cmp(&a.1));
    r
}

#[test]
fn greedy_decoding_is_the_argmax_of_a_full_forward() {
    let (g, l, c) = (gpt2(3), llama(4), char_gpt(6));
    for (name, model) in [("gpt2", Decoder::Gpt2(&g)), ("llama", Decoder::Llama(&l)), ("gpt", Decoder::Gpt(&c))] {
        let prompt = [5u32, 17, 2, 40, 11];
        let out = generate(model, &prompt, 10, 20, &Sampling::GREEDY, None).unwrap();
        assert_eq!(out.tokens.len(), 10);
        let mut seq = prompt.to_vec();
        for (i, &t) in out.tokens.iter().enumerate() {
            let r = ranked(model, &seq);
            // A near-tie between the top two could flip on rounding; there is none here.
            assert!(r[0].1 - r[1].1 > 1e-4, "{name} step {i}: a tie {r:?}");
            assert_eq!(t, r[0].0, "{name} step {i}: the cache's token is not the full forward's argmax");
            seq.push(t);
        }
    }
}

#[test]
fn two_programs_serve_every_prompt_length_and_count() {
    let model = gpt2(5);
    let first = generate(Decoder::Gpt2(&model), &[1, 2, 3], 4, 20, &Sampling::GREEDY, None).unwrap();
    assert!(first.programs <= 2, "the prompt and the decode step: {} programs", first.programs);
    let again = generate(Decoder::Gpt2(&model), &[9, 8, 7, 6, 5, 4, 3], 12, 20, &Sampling::GREEDY, None).unwrap();
    assert_eq!(again.programs, 0, "another prompt length and count compiled again");
    assert_eq!(again.tokens.len(), 12);
    // A stop token ends it early (and is the last token).
    let stop = again.tokens[3];
    let stopped =
        generate(Decoder::Gpt2(&model), &[9, 8, 7, 6, 5, 4, 3], 12, 20, &Sampling::GREEDY, Some(stop)).unwrap();
    let at = again.tokens.iter().position(|&t| t == stop).unwrap();
    assert_eq!(stopped.tokens, again.tokens[..=at]);
}

#[test]
fn top_k_and_top_p_keep_only_their_tokens() {
    let model = llama(6);
    let d = Decoder::Llama(&model);
    let prompt = [3u32, 30, 7];
    let greedy = generate(d, &prompt, 6, 16, &Sampling::GREEDY, None).unwrap().tokens;
    // top-k 1 and a nucleus below the top token's probability are greedy.
    for s in [
        Sampling { temperature: 1.0, top_k: Some(1), top_p: None },
        Sampling { temperature: 1.0, top_k: None, top_p: Some(1e-6) },
    ] {
        assert_eq!(generate(d, &prompt, 6, 16, &s, None).unwrap().tokens, greedy, "{s:?}");
    }
    // top-k 3 at a high temperature: every token among the full forward's top 3.
    let s = Sampling { temperature: 5.0, top_k: Some(3), top_p: None };
    let out = generate(d, &prompt, 12, 16, &s, None).unwrap().tokens;
    let mut seq = prompt.to_vec();
    let mut outside_top1 = 0;
    for &t in &out {
        let r = ranked(d, &seq);
        assert!(r[..3].iter().any(|&(k, _)| k == t), "token {t} not in the top 3 {:?}", &r[..3]);
        outside_top1 += usize::from(t != r[0].0);
        seq.push(t);
    }
    // At temperature 5 the three are near-uniform: not every draw is the top one.
    assert!(outside_top1 > 0, "12 draws at temperature 5 all took the argmax: {out:?}");
}

#[test]
fn bad_settings_are_refused_naming_them() {
    let model = gpt2(7);
    let d = Decoder::Gpt2(&model);
    let err = |s: Sampling, prompt: &[u32], new: usize, ctx: usize| {
        generate(d, prompt, new, ctx, &s, None).unwrap_err().to_string()
    };
    let t = |top_p| Sampling { temperature: 1.0, top_k: None, top_p: Some(top_p) };
    assert!(err(t(0.0), &[1], 2, 8).contains("top_p"));
    assert!(err(t(1.5), &[1], 2, 8).contains("top_p"));
    assert!(err(Sampling { temperature: -1.0, ..Sampling::GREEDY }, &[1], 2, 8).contains("temperature"));
    assert!(err(Sampling { top_k: Some(0), ..Sampling::GREEDY }, &[1], 2, 8).contains("top_k"));
    assert!(err(Sampling::GREEDY, &[], 2, 8).contains("empty prompt"));
    assert!(err(Sampling::GREEDY, &[1; 7], 2, 8).contains("more than the context of 8"));
    assert!(err(Sampling::GREEDY, &[1], 2, 64).contains("more than the model's 24 positions"));
    assert!(err(Sampling::GREEDY, &[1, 999], 2, 8).contains("outside the model's vocabulary"));
}
