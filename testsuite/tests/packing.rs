//! Packed decoder rows (`kiln::models::Packing`): a row holding several
//! documents computes, for each, the logits that document gives alone —
//! attention stays within a document and positions restart at each — for
//! GPT-2 (learned positions) and a grouped-query Llama (rotary), in both
//! spellings.

#![allow(clippy::unwrap_used)] // Test helpers may unwrap (the workspace denies it in library code).

use kiln::models::gpt2::{Gpt2, Gpt2Config};
use kiln::models::llama::{Llama, LlamaConfig};
use kiln::models::{Packing, Spelling};
use kiln::nn::ParamStore;
use kiln::Tensor;

/// f32 logits of one document alone and inside a packed row agree to this.
const TOLERANCE: f32 = 2e-5;

fn ids(tokens: &[i32]) -> Tensor {
    Tensor::from_vec(tokens.to_vec(), [1, tokens.len()]).unwrap()
}

#[test]
fn a_packed_row_computes_each_document_alone() {
    let docs: [&[i32]; 3] = [&[5, 17, 2], &[40, 11, 8, 3], &[9, 30]];
    let row: Vec<i32> = docs.concat();
    let mut ends = vec![false; row.len()];
    let mut at = 0;
    for d in docs {
        at += d.len();
        ends[at - 1] = true;
    }
    let packing = Packing::from_ends(&ends, 1, row.len()).unwrap();
    for spelling in Spelling::ALL {
        let mut ps = ParamStore::new(21);
        let g = Gpt2::new(&mut ps, Gpt2Config::tiny(), spelling).unwrap();
        let mut ps = ParamStore::new(22);
        let l = Llama::new(&mut ps, LlamaConfig::tiny(), spelling).unwrap();
        type Logits<'a> = Box<dyn Fn(&Tensor, Option<&Packing>) -> Vec<f32> + 'a>;
        let models: [(&str, usize, Logits); 2] = [
            ("gpt2", g.cfg.vocab, Box::new(|x, p| g.logits_packed(x, p).unwrap().to_vec::<f32>().unwrap())),
            ("llama", l.cfg.vocab, Box::new(|x, p| l.logits_packed(x, p).unwrap().to_vec::<f32>().unwrap())),
        ];
        for (name, vocab, logits) in &models {
            let packed = logits(&ids(&row), Some(&packing));
            let unpacked = logits(&ids(&row), None);
            let mut at = 0;
            let mut moved = 0.0f32;
            for d in docs {
                let alone = logits(&ids(d), None);
                let inside = &packed[at * vocab..(at + d.len()) * vocab];
                let diff = alone.iter().zip(inside).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                assert!(diff <= TOLERANCE, "{name} {spelling:?}: a document alone and packed differ by {diff}");
                let plain = &unpacked[at * vocab..(at + d.len()) * vocab];
                moved = moved.max(alone.iter().zip(plain).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max));
                at += d.len();
            }
            // Without the packing, the later documents see the earlier ones.
            assert!(moved > 1e-3, "{name} {spelling:?}: the packing changed nothing ({moved})");
        }
    }
}
