//! Bad input to `nn::attention` is refused when it is recorded, with a typed
//! error naming the op, the layer (inside a module) and both shapes: a mask
//! or bias that does not broadcast to the scores, key/value heads that do not
//! divide the query heads, a key padding mask of the wrong batch.

use kiln::nn::{self, AttentionOptions, Module};
use kiln::{DType, FrontendError, Tensor};

fn qkv(hq: usize, hkv: usize) -> kiln::Result<(Tensor, Tensor, Tensor)> {
    let x = |h: usize, s: usize| Tensor::randn(DType::F32, [2, h, s, 8]);
    Ok((x(hq, 5)?, x(hkv, 7)?, x(hkv, 7)?))
}

#[test]
fn a_mask_or_bias_that_does_not_fit_the_scores_names_both_shapes() -> kiln::Result<()> {
    let (q, k, v) = qkv(4, 4)?;
    let mask = Tensor::ones(DType::F32, [2, 1, 5, 6])?.gt(&Tensor::zeros(DType::F32, [])?)?;
    let err = nn::attention(&q, &k, &v, AttentionOptions { mask: Some(&mask), ..Default::default() }).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, FrontendError::AttentionOperand { what: "mask", .. }), "{err:?}");
    assert!(text.contains("attention: mask tensor<2x1x5x6xi1>") && text.contains("[2, 4, 5, 7]"), "{text}");
    let bias = Tensor::zeros(DType::F32, [4, 5, 7])?;
    let err = nn::attention(&q, &k, &v, AttentionOptions { bias: Some(&bias), ..Default::default() }).unwrap_err();
    assert!(matches!(err, FrontendError::AttentionOperand { what: "bias", .. }), "{err:?}");
    assert!(err.to_string().contains("tensor<4x5x7xf32>"), "{err}");
    let float_mask = Tensor::zeros(DType::F32, [2, 1, 1, 7])?;
    let err =
        nn::attention(&q, &k, &v, AttentionOptions { mask: Some(&float_mask), ..Default::default() }).unwrap_err();
    assert!(err.to_string().contains("must be a pred"), "{err}");
    Ok(())
}

#[test]
fn heads_that_do_not_divide_and_a_padding_mask_of_another_batch_are_refused() -> kiln::Result<()> {
    let (q, k, v) = qkv(6, 4)?;
    let err = nn::attention(&q, &k, &v, AttentionOptions::default()).unwrap_err();
    assert!(matches!(err, FrontendError::AttentionShapes { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("4 key/value heads do not divide 6 query heads"), "{text}");
    assert!(text.contains("q tensor<2x6x5x8xf32>") && text.contains("k tensor<2x4x7x8xf32>"), "{text}");

    let (q, k, v) = qkv(4, 2)?;
    let pad = Tensor::ones(DType::I32, [3, 7])?;
    let opts = AttentionOptions { key_padding_mask: Some(&pad), ..Default::default() };
    let err = nn::attention(&q, &k, &v, opts).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("key_padding_mask tensor<3x7xi32> must be [batch, kv_seq] = [2, 7]"), "{text}");
    // Causal with more keys than queries.
    let err = nn::attention(&q, &k, &v, AttentionOptions { causal: true, ..Default::default() }).unwrap_err();
    assert!(err.to_string().contains("as many queries (5) as keys (7)"), "{err}");
    Ok(())
}

/// Inside a module the error names the layer too.
struct Layer;

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> kiln::Result<Tensor> {
        nn::scoped(
            || self.describe(),
            || {
                let k = Tensor::randn(DType::F32, [2, 3, 5, 8])?;
                nn::attention(x, &k, &k, AttentionOptions::default())
            },
        )
    }
    fn describe(&self) -> String {
        "MyAttention(4 heads)".into()
    }
}

#[test]
fn the_layer_is_named() -> kiln::Result<()> {
    let err = Layer.forward(&Tensor::randn(DType::F32, [2, 4, 5, 8])?).unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("MyAttention(4 heads): attention: 3 key/value heads do not divide 4 query heads"),
        "{text}"
    );
    Ok(())
}
