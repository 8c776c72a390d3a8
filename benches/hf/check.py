"""kiln's Hugging Face models against `transformers` itself (CPU torch is enough).

make DIR [NAME...]:
            for each architecture (or those named), saves a tiny random model as `save_pretrained`
            writes it (DIR/<name>/) and its logits on fixed inputs
            (DIR/<name>-expected.safetensors: the inputs as i32 tensors named
            as the model's forward names them, and `logits` f32) -- the
            fixtures kiln's tests load (`testsuite/tests/hf_models.rs`).
check DIR:  for each DIR/<name>/model that kiln wrote (`hf_export` example),
            loads it with the architecture's `from_pretrained` and compares its
            logits with kiln's (DIR/<name>/expected.safetensors); prints the
            largest absolute difference of each and exits 1 if one is above
            the tolerance or a directory did not load.

Rerun: python3 benches/hf/check.py make OUT; python3 benches/hf/check.py check DIR.
"""
import os
import sys

import torch
from safetensors.torch import load_file, save_file
import transformers as tf

TOLERANCE = 1e-4


def gpt2():
    cfg = tf.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return tf.GPT2LMHeadModel(cfg), ["input_ids"]


def bert():
    cfg = tf.BertConfig(vocab_size=89, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=16, type_vocab_size=2)
    return tf.BertForMaskedLM(cfg), ["input_ids", "attention_mask", "token_type_ids"]


def roberta():
    cfg = tf.RobertaConfig(vocab_size=83, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=18, type_vocab_size=1,
                           pad_token_id=1)
    return tf.RobertaForMaskedLM(cfg), ["input_ids", "attention_mask"]


def distilbert():
    cfg = tf.DistilBertConfig(vocab_size=89, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                              max_position_embeddings=16, dropout=0.0, attention_dropout=0.0)
    return tf.DistilBertForMaskedLM(cfg), ["input_ids", "attention_mask"]


def bert_cls():
    cfg = tf.BertConfig(vocab_size=89, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=16, type_vocab_size=2,
                        id2label={0: "negative", 1: "neutral", 2: "positive"})
    return tf.BertForSequenceClassification(cfg), ["input_ids", "attention_mask", "token_type_ids"]


def roberta_cls():
    cfg = tf.RobertaConfig(vocab_size=83, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=18, type_vocab_size=1,
                           pad_token_id=1, num_labels=2)
    return tf.RobertaForSequenceClassification(cfg), ["input_ids", "attention_mask"]


def distilbert_cls():
    cfg = tf.DistilBertConfig(vocab_size=89, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                              max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                              seq_classif_dropout=0.0, id2label={0: "spam", 1: "ham", 2: "other", 3: "more"})
    return tf.DistilBertForSequenceClassification(cfg), ["input_ids", "attention_mask"]


def xlm_roberta():
    cfg = tf.XLMRobertaConfig(vocab_size=91, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=18, type_vocab_size=1,
                              pad_token_id=1)
    return tf.XLMRobertaForMaskedLM(cfg), ["input_ids", "attention_mask"]


def llama():
    cfg = tf.LlamaConfig(vocab_size=79, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32,
                         rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    return tf.LlamaForCausalLM(cfg), ["input_ids"]


def t5():
    cfg = tf.T5Config(vocab_size=71, d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2,
                      num_decoder_layers=2, relative_attention_num_buckets=8,
                      relative_attention_max_distance=20, feed_forward_proj="relu",
                      tie_word_embeddings=True, dropout_rate=0.0)
    return tf.T5ForConditionalGeneration(cfg), ["input_ids", "attention_mask", "decoder_input_ids"]


def t5_gated():
    cfg = tf.T5Config(vocab_size=71, d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2,
                      num_decoder_layers=3, relative_attention_num_buckets=8,
                      relative_attention_max_distance=20, feed_forward_proj="gated-gelu",
                      tie_word_embeddings=False, dropout_rate=0.0)
    return tf.T5ForConditionalGeneration(cfg), ["input_ids", "attention_mask", "decoder_input_ids"]


MODELS = {"gpt2-tiny": gpt2, "bert-tiny": bert, "roberta-tiny": roberta, "llama-tiny": llama,
          "t5-tiny": t5, "t5-gated-tiny": t5_gated, "distilbert-tiny": distilbert, "bert-cls-tiny": bert_cls, "roberta-cls-tiny": roberta_cls,
          "distilbert-cls-tiny": distilbert_cls, "xlm-roberta-tiny": xlm_roberta,
          "llama-sharded-tiny": llama}

# Saved in shards of at most this (`model-0000i-of-0000n.safetensors` and
# `model.safetensors.index.json`, as transformers writes a large model).
SHARDED = {"llama-sharded-tiny": "40KB"}


def inputs(model, names, g):
    """Fixed inputs: two rows of 8 tokens; the second padded after 5 where the
    model takes a mask (with the pad token in the padded places)."""
    vocab = model.config.vocab_size
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    # Ids from 3 up: no special token (RoBERTa's pad is 1) among the real ones.
    ids = torch.randint(3, vocab, (2, 8), generator=g)
    out = {"input_ids": ids}
    if "attention_mask" in names:
        mask = torch.ones(2, 8, dtype=torch.int64)
        mask[1, 5:] = 0
        ids[1, 5:] = pad
        out["attention_mask"] = mask
    if "token_type_ids" in names:
        types = torch.zeros(2, 8, dtype=torch.int64)
        types[:, 4:] = 1
        out["token_type_ids"] = types
    if "decoder_input_ids" in names:
        dec = torch.randint(3, vocab, (2, 6), generator=g)
        dec[:, 0] = 0  # T5's decoder start token (its pad)
        out["decoder_input_ids"] = dec
    return out


def make(out, only=()):
    for name, build in MODELS.items():
        if only and name not in only:
            continue
        torch.manual_seed(0)
        model, names = build()
        model = model.eval()
        # Biases and norms away from their init, so a swapped tensor shows.
        with torch.no_grad():
            for _, p in model.named_parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn_like(p))
        if name in SHARDED:
            model.save_pretrained(f"{out}/{name}", max_shard_size=SHARDED[name])
        else:
            model.save_pretrained(f"{out}/{name}")
        x = inputs(model, names, torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = model(**x).logits.float()
        tensors = {k: v.to(torch.int32).contiguous() for k, v in x.items()}
        tensors["logits"] = logits.contiguous()
        save_file(tensors, f"{out}/{name}-expected.safetensors")
        print(f"made {out}/{name} ({type(model).__name__}): logits {tuple(logits.shape)}")


def check(d):
    worst, failed = 0.0, False
    for name in sorted(os.listdir(d)):
        model_dir = f"{d}/{name}/model"
        if not os.path.isdir(model_dir):
            continue
        try:
            model = tf.AutoModelForMaskedLM if name.startswith(("bert", "roberta", "distilbert", "xlm")) else None
            if "cls" in name:
                model = tf.AutoModelForSequenceClassification
            elif name.startswith("t5"):
                model = tf.AutoModelForSeq2SeqLM
            elif model is None:
                model = tf.AutoModelForCausalLM
            model = model.from_pretrained(model_dir).eval()
            expected = load_file(f"{d}/{name}/expected.safetensors")
            x = {k: v.to(torch.int64) for k, v in expected.items() if k != "logits"}
            with torch.no_grad():
                logits = model(**x).logits.float()
            diff = (logits - expected["logits"]).abs().max().item()
        except Exception as e:  # reported, and the check fails
            print(f"{name}: transformers did not load or run kiln's directory: {e}")
            failed = True
            continue
        print(f"{name}: transformers ({type(model).__name__}) on kiln's directory: "
              f"max |logits - kiln's| = {diff:.3e}")
        worst = max(worst, diff)
    print(f"worst {worst:.3e} (tolerance {TOLERANCE:g})")
    sys.exit(0 if worst <= TOLERANCE and not failed else 1)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3:])
    else:
        check(sys.argv[2])
