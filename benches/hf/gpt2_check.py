"""GPT-2 numerics against Hugging Face `transformers` (CPU torch is enough).

make DIR:   saves a tiny random GPT2LMHeadModel as `save_pretrained` writes it
            (DIR/gpt2-tiny/) and its logits on fixed token ids
            (DIR/gpt2-tiny-expected.safetensors: input_ids i32 [2, 8], logits
            f32 [2, 8, vocab]) -- the fixture kiln's tests load.
check DIR:  loads DIR/model (a directory kiln's `hf::save_gpt2` wrote) with
            GPT2LMHeadModel.from_pretrained and compares its logits with the
            ones kiln computed (DIR/expected.safetensors); prints the largest
            absolute difference and exits 1 above the tolerance.

Rerun: python3 benches/hf/gpt2_check.py make OUT; python3 ... check DIR.
"""
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel

TOLERANCE = 1e-4


def make(out):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).eval()
    # Biases and norms away from their init, so a swapped tensor shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(f"{out}/gpt2-tiny", safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=g)
    with torch.no_grad():
        logits = model(ids).logits.float()
    save_file({"input_ids": ids.to(torch.int32).contiguous(), "logits": logits.contiguous()},
              f"{out}/gpt2-tiny-expected.safetensors")
    print(f"made {out}/gpt2-tiny: logits {tuple(logits.shape)}")


def check(d):
    model = GPT2LMHeadModel.from_pretrained(f"{d}/model").eval()
    expected = load_file(f"{d}/expected.safetensors")
    ids = expected["input_ids"].to(torch.int64)
    with torch.no_grad():
        logits = model(ids).logits.float()
    diff = (logits - expected["logits"]).abs().max().item()
    print(f"transformers loaded kiln's {d}/model: max |logits - kiln's| = {diff:.3e} (tolerance {TOLERANCE:g})")
    sys.exit(0 if diff <= TOLERANCE else 1)


if __name__ == "__main__":
    {"make": make, "check": check}[sys.argv[1]](sys.argv[2])
